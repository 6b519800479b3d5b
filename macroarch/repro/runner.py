"""Batch reproduction: execute the notebooks of a profile with papermill, resumably, one live line each.

The profile (``papermill_runs/<profile>.yaml``, see :mod:`macroarch.repro.profiles`) is checked whole before
any kernel starts. papermill receives only ``profile``: the notebook fills its own sizes from the profile
(``notebook.resolve_parameters``), so a direct ``papermill ... -p profile ci`` runs exactly what the runner
runs (notebooks not converted to annotated parameters yet get their values from papermill).

Resume: a notebook is skipped when its stamp (written after a clean execution) records the same effective
parameters as a run would have now (``notebook.resolve``: profile values, defaults, ``compute_dtype: auto``
on this machine), the stamp is newer than the notebook and every file of the package, and every claim of the
notebook has a complete result that this execution wrote, with those parameters in its config. A notebook
executes into a ``.partial`` file that becomes ``<stem>.ipynb`` on success (``<stem>.failed.ipynb``
otherwise); a failure marks every claim it did not finish as failed, Ctrl-C marks them interrupted, so no
stale result passes as the outcome of this run. One failing notebook does not stop the others. Each outcome
is reported against the notebook's time budget (``ok 4m12s of 6m``), with a warning when over it.

One run per profile at a time: :class:`ProfileLock` (``out/<profile>/.lock``, released by the OS when the
holder dies) refuses a second one with a message naming the holder.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from macroarch._table import format_table
from macroarch.config import ConfigError
from macroarch.paths import out_root, project_root
from macroarch.repro.profiles import (
    NotebookJob,
    format_duration,
    load_job,
    load_profile,
    parse_duration,
    select,
)
from macroarch.repro.progress import LiveLine, Progress, engine
from macroarch.repro.tracking import (
    COMPLETE,
    EVIDENCE_ENV,
    FAILED,
    INTERRUPTED,
    merge_wandb_status,
    read_result,
    result_path,
    wandb_status_path,
    write_json_atomic,
)

WANDB_WAIT_S = 30.0  # after a notebook, how long the runner waits for its runs' W&B processes (in total)


class ProfileBusy(ConfigError):
    """Another process is reproducing this profile."""


class Interrupted(Exception):
    """Ctrl-C: the notebook that was running and how long it had run."""


@dataclass
class JobOutcome:
    job: NotebookJob
    status: str  # "ok", "skipped", "failed", "interrupted"
    seconds: float = 0.0
    error: str = ""
    grades: dict[str, str] = field(default_factory=dict)
    wandb_errors: dict[str, str] = field(default_factory=dict)

    @property
    def over_budget(self) -> bool:
        return self.status == "ok" and self.job.budget is not None and self.seconds > self.job.budget


# --- one run per profile ------------------------------------------------------------------------------

class ProfileLock:
    """An exclusive lock on ``out/<profile>``: ``flock`` on ``.lock``, which says who holds it."""

    def __init__(self, profile: str, out: Path | None = None) -> None:
        self.path = (out or out_root()) / profile / ".lock"
        self.profile = profile
        self._fd: int | None = None

    def __enter__(self) -> ProfileLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise ProfileBusy(f"profile {self.profile} is already being reproduced by pid {holder.get('pid', '?')} "
                              f"(started {holder.get('started', '?')}: {holder.get('command', '?')}); wait for it "
                              f"to finish or stop it, then run this again") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "started": _now(),
                                 "command": " ".join(["macroarch", *sys.argv[1:]])}).encode())
        self._fd = fd
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing releases the flock
            self._fd = None


def _read_holder(fd: int) -> dict[str, Any]:
    with contextlib.suppress(OSError, ValueError):
        os.lseek(fd, 0, os.SEEK_SET)
        data = json.loads(os.read(fd, 4096) or b"{}")
        if isinstance(data, dict):
            return data
    return {}


# --- freshness --------------------------------------------------------------------------------------------

def _stamp_path(profile: str, stem: str, out: Path) -> Path:
    return out / profile / ".stamps" / f"{stem}.json"


def _newest_code_mtime() -> float:
    pkg = Path(__file__).resolve().parent.parent
    return max((p.stat().st_mtime for p in pkg.rglob("*.py")), default=0.0)


def is_fresh(job: NotebookJob, profile: str, root: Path | None = None, out: Path | None = None) -> bool:
    """Whether ``job``'s last clean execution ran with the parameters it would run with now, is newer than its
    notebook and the package code, and is what every claim's result file holds."""
    root, out = root or project_root(), out or out_root()
    stamp = _stamp_path(profile, job.stem, out)
    if not stamp.is_file() or not (out / profile / f"{job.stem}.ipynb").is_file():
        return False
    try:
        info = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return False
    params = _jsonable(job.effective_parameters(profile, root))
    if not isinstance(info, dict) or info.get("parameters") != params:
        return False
    t = stamp.stat().st_mtime
    if t <= job.path.stat().st_mtime or t <= _newest_code_mtime():
        return False
    for claim in job.claims:
        try:
            r = read_result(result_path(claim, profile, out))
        except (OSError, ValueError):
            return False
        config = r.get("config") or {}
        if r.get("status") != COMPLETE or (r.get("started") or "") > info.get("finished", ""):
            return False  # incomplete, or written by a run after this stamp (papermill by hand, say)
        if any(k in config and config[k] != v for k, v in params.items()):
            return False
    return True


def _jsonable(data: Any) -> Any:
    return json.loads(json.dumps(data, default=str))


# --- execution --------------------------------------------------------------------------------------------

def execute(job: NotebookJob, profile: str, root: Path | None = None, out: Path | None = None,
            progress: Progress | None = None) -> JobOutcome:
    """Execute one notebook with papermill; never raises for a failure inside the notebook.
    Raises :class:`Interrupted` on Ctrl-C, after marking the claims it interrupted."""
    import papermill

    root, out = root or project_root(), out or out_root()
    pdir = out / profile
    pdir.mkdir(parents=True, exist_ok=True)
    final, failed = pdir / f"{job.stem}.ipynb", pdir / f"{job.stem}.failed.ipynb"
    partial = pdir / f".{job.stem}.partial.ipynb"
    stamp = _stamp_path(profile, job.stem, out)
    for stale in (stamp, final, failed, partial):
        with contextlib.suppress(FileNotFoundError):
            stale.unlink()
    params = job.effective_parameters(profile, root)

    started = _dt.datetime.now(_dt.UTC)
    t0 = time.perf_counter()
    env_before = os.environ.get(EVIDENCE_ENV)
    os.environ[EVIDENCE_ENV] = os.pathsep.join(str(p) for p in (final, failed))  # the kernel inherits it
    try:
        with _quiet_papermill():
            papermill.execute_notebook(
                str(job.path), str(partial), parameters=job.papermill_parameters(profile), kernel_name="python3",
                cwd=str(root), progress_bar=False, log_output=False, execution_timeout=job.timeout,
                report_mode=False, engine_name=engine(progress),
                # ipykernel logs to the terminal (unencrypted loopback, the interrupt at shutdown): the line says it
                extra_arguments=["--IPKernelApp.log_level=CRITICAL"],
            )
    except KeyboardInterrupt:
        seconds = time.perf_counter() - t0
        with _no_sigint():
            if partial.exists():
                os.replace(partial, failed)
            _mark_unfinished(job, profile, out, started, INTERRUPTED, "interrupted (Ctrl-C)")
        raise Interrupted(f"{job.stem} stopped after {format_duration(seconds)}") from None
    except Exception as e:  # a failing notebook is an outcome, not a crash of the batch
        seconds = time.perf_counter() - t0
        if partial.exists():
            os.replace(partial, failed)
        message = _short_error(e)
        _mark_unfinished(job, profile, out, started, FAILED, message)
        outcome = JobOutcome(job, "failed", seconds, message)
    else:
        seconds = time.perf_counter() - t0
        os.replace(partial, final)
        outcome = JobOutcome(job, "ok", seconds)
        incomplete = [c for c in job.claims if _status(c, profile, out) != COMPLETE]
        if incomplete:
            # The notebook ran to the end but left claims without a complete result: that is a failure.
            outcome.status = "failed"
            outcome.error = f"notebook finished without a complete result for {', '.join(incomplete)}"
            _mark_unfinished(job, profile, out, started, FAILED, outcome.error)
    finally:
        if env_before is None:
            os.environ.pop(EVIDENCE_ENV, None)
        else:
            os.environ[EVIDENCE_ENV] = env_before
    outcome.wandb_errors = _settle_wandb(job, profile, out, started)
    outcome.grades = _grades(job, profile, out)
    if outcome.status == "ok":
        write_json_atomic(stamp, {"notebook": job.stem, "parameters": _jsonable(params), "claims": list(job.claims),
                                  "finished": _now(), "seconds": round(seconds, 2)})
    return outcome


def _settle_wandb(job: NotebookJob, profile: str, out: Path, started: _dt.datetime) -> dict[str, str]:
    """Wait (bounded) for the W&B processes of this execution's runs, record their outcome in the results."""
    from macroarch.repro.wandb_sidecar import wait_status

    deadline = time.monotonic() + WANDB_WAIT_S
    errors = {}
    for claim in job.claims:
        path = result_path(claim, profile, out)
        try:
            r = read_result(path)
        except (OSError, ValueError):
            continue
        w = r.get("wandb") or {}
        if not _ran_since(r, started) or w.get("mode") in (None, "disabled"):
            continue
        if w.get("state") not in ("finished", "failed"):
            status = wait_status(wandb_status_path(path), max(0.0, deadline - time.monotonic()))
            merge_wandb_status(r, status, WANDB_WAIT_S)
            write_json_atomic(path, r)
        if r["wandb"].get("error"):
            errors[claim] = r["wandb"]["error"]
    return errors


def _ran_since(r: dict, started: _dt.datetime) -> bool:
    return bool(r.get("started")) and _dt.datetime.fromisoformat(r["started"]) >= started.replace(microsecond=0)


def _status(claim: str, profile: str, out: Path) -> str | None:
    try:
        return read_result(result_path(claim, profile, out)).get("status")
    except (OSError, ValueError):
        return None


def _grades(job: NotebookJob, profile: str, out: Path) -> dict[str, str]:
    grades = {}
    for claim in job.claims:
        try:
            r = read_result(result_path(claim, profile, out))
        except (OSError, ValueError):
            continue
        if r.get("status") == COMPLETE and r.get("verdict"):
            grades[claim] = r["verdict"]["grade"]
        else:
            grades[claim] = r.get("status", "?")
    return grades


def _mark_unfinished(job: NotebookJob, profile: str, out: Path, started: _dt.datetime, status: str,
                     message: str) -> None:
    """Mark every claim of ``job`` that this execution did not finish as ``status`` (results stay readable)."""
    for claim in job.claims:
        path = result_path(claim, profile, out)
        try:
            r = read_result(path)
        except (OSError, ValueError):
            r = {"schema": 1, "claim": claim, "profile": profile, "notebook": job.stem, "config": {},
                 "metrics": {}, "series": {}, "figures": [], "verdict": None, "wandb": None}
        if _ran_since(r, started) and r.get("status") in (COMPLETE, FAILED):
            continue
        r["status"] = status
        r["error"] = {"type": "NotebookInterrupted" if status == INTERRUPTED else "NotebookFailed",
                      "message": f"{job.stem}: {message}", "traceback": ""}
        r["finished"] = _now()
        write_json_atomic(path, r)


def _short_error(e: BaseException) -> str:
    ename = getattr(e, "ename", None)
    evalue = getattr(e, "evalue", None)
    if ename:
        return f"{ename}: {(str(evalue).strip().splitlines() or [''])[0]}".strip()
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"


@contextlib.contextmanager
def _quiet_papermill():
    """papermill, nbclient and the kernel client log to the terminal; the runner's line says it all."""
    names = ("papermill", "nbclient", "traitlets", "asyncio", "jupyter_client")
    levels = {n: logging.getLogger(n).level for n in names}
    for n in names:
        logging.getLogger(n).setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for n, level in levels.items():
            logging.getLogger(n).setLevel(level)


@contextlib.contextmanager
def _no_sigint():
    import signal

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def reproduce(profile: str = "cpu", *, only: str | None = None, force: bool = False,
              root: Path | None = None, out: Path | None = None, echo=print, stream: Any = None) -> list[JobOutcome]:
    """Run a profile's notebooks (validated first, under the profile's lock), one live line each, then a
    summary table. Raises :class:`ProfileBusy` if another run holds the profile, :class:`Interrupted` on Ctrl-C
    (the interrupted notebook's claims are marked so and the next run resumes there)."""
    root, out = root or project_root(), out or out_root()
    jobs = select(load_profile(profile, root), only)
    stream = stream if stream is not None else sys.stdout
    outcomes: list[JobOutcome] = []
    width = max(len(j.stem) for j in jobs)
    with ProfileLock(profile, out):
        for i, job in enumerate(jobs, 1):
            head = f"[{i}/{len(jobs)}] {job.stem:<{width}} ({', '.join(job.claims) or 'no claims'})"
            if not force and is_fresh(job, profile, root, out):
                outcome = JobOutcome(job, "skipped", grades=_grades(job, profile, out))
                echo(f"{head} skipped: up to date ({_grade_text(outcome)})", flush=True)
                outcomes.append(outcome)
                continue
            with LiveLine(head, stream) as line:
                outcome = execute(job, profile, root, out, progress=line.update)
            echo(f"{head} {outcome_text(outcome)}", flush=True)
            if outcome.over_budget:
                echo(f"  warning: {job.stem} took {format_duration(outcome.seconds)}, over its budget of "
                     f"{format_duration(job.budget)} in papermill_runs/{profile}.yaml: this machine is slower than "
                     f"the profile expects (see the machine in its result.json config)", flush=True)
            outcomes.append(outcome)
        echo(summary_table(outcomes, profile), flush=True)
    return outcomes


def outcome_text(o: JobOutcome) -> str:
    """``ok 4m12s of 6m: C4 partially`` (``failed 12s: RuntimeError: ...``), with any W&B trouble."""
    took = format_duration(o.seconds) + (f" of {format_duration(o.job.budget)}" if o.job.budget else "")
    if o.over_budget:
        took += " (over budget)"
    text = f"{o.status} {took}: " + (_grade_text(o) if o.status == "ok" else o.error)
    if o.wandb_errors:
        first = next(iter(o.wandb_errors.values()))
        text += f"; W&B: {first} (results complete without it)"
    return text


def _grade_text(o: JobOutcome) -> str:
    return ", ".join(f"{c} {g}" for c, g in o.grades.items()) or "no results"


def summary_table(outcomes: Sequence[JobOutcome], profile: str) -> str:
    rows = [("notebook", "status", "time", "budget", "claims")]
    for o in outcomes:
        rows.append((o.job.stem, o.status + (" (over budget)" if o.over_budget else ""),
                     format_duration(o.seconds) if o.status != "skipped" else "-",
                     format_duration(o.job.budget) if o.job.budget else "-", _grade_text(o)))
    header = (f"\nprofile {profile}: {sum(o.status == 'ok' for o in outcomes)} ran, "
              f"{sum(o.status == 'skipped' for o in outcomes)} skipped, "
              f"{sum(o.status == 'failed' for o in outcomes)} failed")
    return header + "\n" + format_table(rows)


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


# the profile's names are re-exported: the runner is where callers look for them
__all__ = ["NotebookJob", "JobOutcome", "ProfileBusy", "ProfileLock", "Interrupted", "load_profile", "load_job",
           "select", "is_fresh", "execute", "reproduce", "summary_table", "outcome_text", "parse_duration",
           "format_duration"]
