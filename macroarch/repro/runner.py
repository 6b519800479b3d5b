"""Batch reproduction: execute the notebooks of a profile with papermill, resumably, one live line each.

``papermill_runs/<profile>.yaml`` lists the notebooks and the values of their per-profile parameters::

    description: what this profile is for
    budget: 10m                           # optional: the time budget of a notebook without its own
    notebooks:
      - notebook: 02_memory_wall          # notebooks/02_memory_wall.ipynb
        parameters: {measured_layers: 2}  # each a parameter of its `parameters` cell, of the declared type
        timeout: 600                      # optional: seconds per cell
        budget: 6m                        # optional: how long the notebook should take here (90s, 6m, 1h)

Everything is checked before any kernel starts: a bad profile, notebook, claim id, parameter name, a value of
the wrong type (against the annotation in the notebook's ``parameters`` cell) or a ``None`` parameter the
profile leaves without a value raises :class:`ConfigError`, with nothing written. papermill receives only
``profile``: the notebook fills its own sizes from this file (``notebook.resolve_parameters``), so a direct
``papermill ... -p profile ci`` runs exactly what the runner runs. (Notebooks whose parameters cell is not
annotated yet get their profile values from papermill and a name check only.)

Resume: a notebook is skipped when its stamp (written after a clean execution) records the same effective
parameters as a run would have now (``notebook.resolve``: profile values, defaults, ``compute_dtype: auto``
on this machine), the stamp is newer than the notebook and every file of the package, and every claim of the
notebook has a complete result that this execution wrote, with those parameters in its config. A notebook
executes into a ``.partial`` file that becomes ``<stem>.ipynb`` on success (``<stem>.failed.ipynb``
otherwise); a failure marks every claim it did not finish as failed, Ctrl-C marks them interrupted, so no
stale result passes as the outcome of this run. One failing notebook does not stop the others.

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
import re
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from macroarch._table import format_table
from macroarch.config import ConfigError, check_keys, load_yaml
from macroarch.paths import check_profile, out_root, project_root
from macroarch.repro import notebook as nbparams
from macroarch.repro.claims import CLAIMS, parse_claim_ids
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

_PROFILE_KEYS = ("description", "notebooks", "budget")
_ENTRY_KEYS = ("notebook", "parameters", "timeout", "budget")
WANDB_WAIT_S = 30.0  # after a notebook, how long the runner waits for its runs' W&B processes (in total)


class ProfileBusy(ConfigError):
    """Another process is reproducing this profile."""


class Interrupted(Exception):
    """Ctrl-C: the notebook that was running and how long it had run."""


@dataclass(frozen=True)
class NotebookJob:
    """One notebook of a profile, validated."""

    stem: str
    path: Path
    claims: tuple[str, ...]
    parameters: dict[str, Any]  # what the profile file gives (for old-form notebooks: what papermill injects)
    timeout: int | None = None
    budget: float | None = None  # seconds
    annotated: bool = True  # the parameters cell is `name: type = default  # help` (resolves its own sizes)

    def papermill_parameters(self, profile: str) -> dict[str, Any]:
        return {"profile": profile} if self.annotated else {**self.parameters, "profile": profile}

    def effective_parameters(self, profile: str, root: Path | None = None) -> dict[str, Any]:
        """The parameters a run of this notebook would have now (what its result.json config records)."""
        if not self.annotated:
            return {**self.parameters, "profile": profile}
        return nbparams.resolve(self.stem, {"profile": profile}, root)


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


def profile_file(profile: str, root: Path | None = None) -> Path:
    return (root or project_root()) / "papermill_runs" / f"{profile}.yaml"


_DURATION = re.compile(r"^(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")


def parse_duration(value: Any, where: str) -> float:
    """``90``, ``"90s"``, ``"6m"``, ``"1h30m"`` -> seconds."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    m = _DURATION.match(str(value).strip()) if isinstance(value, str) else None
    if not m or not any(m.groups()):
        raise ConfigError(f"{where}: budget must be seconds or a duration like 90s, 6m, 1h30m; got {value!r}")
    h, mi, s = (int(g or 0) for g in m.groups())
    return float(h * 3600 + mi * 60 + s)


def format_duration(seconds: float) -> str:
    """``252`` -> ``4m12s``; ``360`` -> ``6m``; ``42.3`` -> ``42s``."""
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    if h:
        return f"{h}h{m:02d}m"
    if m:
        return f"{m}m{s:02d}s" if s else f"{m}m"
    return f"{s}s"


def load_profile(profile: str, root: Path | None = None) -> list[NotebookJob]:
    """Read and validate ``papermill_runs/<profile>.yaml`` against the notebooks and the registry."""
    check_profile(profile)
    root = root or project_root()
    path = profile_file(profile, root)
    try:
        data = load_yaml(path)
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}") from None
    check_keys(data or {}, _PROFILE_KEYS, str(path), required=("notebooks",))
    entries = data["notebooks"]
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{path}: 'notebooks' must be a non-empty list")
    default_budget = parse_duration(data["budget"], f"{path}: budget") if data.get("budget") is not None else None
    jobs, seen = [], set()
    for i, entry in enumerate(entries):
        where = f"{path}: notebooks[{i}]"
        check_keys(entry, _ENTRY_KEYS, where, required=("notebook",))
        stem = str(entry["notebook"]).removesuffix(".ipynb")
        nb = root / "notebooks" / f"{stem}.ipynb"
        if not nb.is_file():
            raise ConfigError(f"{where}: unknown notebook {stem!r} (no notebooks/{stem}.ipynb)")
        if stem in seen:
            raise ConfigError(f"{where}: notebook {stem!r} is listed twice")
        seen.add(stem)
        where = f"{path.name}: {stem}"
        params = entry.get("parameters") or {}
        if not isinstance(params, dict):
            raise ConfigError(f"{where}: 'parameters' must be a mapping, got {type(params).__name__}")
        if "profile" in params:
            raise ConfigError(f"{where}: 'profile' is set by the runner, not by the profile file")
        annotated = _check_parameters(nb, profile, params, where)
        timeout = entry.get("timeout")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int) or timeout <= 0):
            raise ConfigError(f"{where}: timeout must be a positive whole number of seconds, got {timeout!r}")
        budget = parse_duration(entry["budget"], where) if entry.get("budget") is not None else default_budget
        claims = tuple(c.id for c in CLAIMS.values() if c.notebook == stem)
        jobs.append(NotebookJob(stem=stem, path=nb, claims=claims, parameters=params, timeout=timeout,
                                budget=budget, annotated=annotated))
    return jobs


def _check_parameters(nb: Path, profile: str, params: dict[str, Any], where: str) -> bool:
    """Check a profile's values against the notebook's parameters cell; returns whether it is annotated."""
    source = nbparams.parameters_cell(nb)
    if not nbparams.is_annotated(source):  # an old-form cell: names only
        import papermill

        declared = papermill.inspect_notebook(str(nb))
        if "profile" not in declared:
            raise ConfigError(f"{nb.name}: its parameters cell must define 'profile'")
        _check_names(params, declared, where)
        return False
    spec = nbparams.parse_parameters(source, where=nb.name)
    _check_names(params, spec, where)
    for name, value in params.items():
        spec[name].check(value, where)
    missing = [n for n, p in spec.items() if p.default is None and params.get(n) is None]
    if missing:
        raise ConfigError(f"{where}: parameter {missing[0]!r} is None in the notebook and {profile}.yaml gives "
                          f"no value for it")
    return True


def _check_names(params: dict[str, Any], declared: Any, where: str) -> None:
    unknown = [k for k in params if k not in declared]
    if unknown:
        raise ConfigError(f"{where}: unknown parameter {unknown[0]!r}; the notebook's parameters are: "
                          f"{', '.join(declared)}")


def select(jobs: Sequence[NotebookJob], only: str | None) -> list[NotebookJob]:
    """Keep the notebooks that measure any claim of ``only`` (``"C4,C7"``); all when ``only`` is None."""
    if not only:
        return list(jobs)
    wanted = set(parse_claim_ids(only))
    picked = [j for j in jobs if wanted & set(j.claims)]
    missing = wanted - {c for j in picked for c in j.claims}
    if missing:
        raise ConfigError(f"claim(s) {', '.join(sorted(missing))} have no notebook in this profile")
    return picked


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

Progress = Callable[[int, int, float], None]  # (code cells done, code cells in all, seconds elapsed)


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
                report_mode=False, engine_name=_engine(progress),
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


_ENGINE = "macroarch-progress"
_progress_callback: Progress | None = None


def _engine(progress: Progress | None) -> str:
    """A papermill engine that reports code cells done to ``progress`` (registered once)."""
    global _progress_callback
    from papermill.engines import NBClientEngine, papermill_engines

    _progress_callback = progress
    if _ENGINE not in papermill_engines._engines:

        class _ProgressEngine(NBClientEngine):
            @classmethod
            def execute_managed_notebook(cls, nb_man, kernel_name, **kwargs):
                total = sum(c.cell_type == "code" for c in nb_man.nb.cells)
                t0 = time.perf_counter()
                done = [0]
                complete = nb_man.cell_complete

                def cell_complete(cell, cell_index=None, **kw):
                    complete(cell, cell_index=cell_index, **kw)
                    if cell.cell_type == "code":
                        done[0] += 1
                    if _progress_callback is not None:
                        _progress_callback(done[0], total, time.perf_counter() - t0)

                nb_man.cell_complete = cell_complete
                if _progress_callback is not None:
                    _progress_callback(0, total, 0.0)
                return super().execute_managed_notebook(nb_man, kernel_name, **kwargs)

        papermill_engines.register(_ENGINE, _ProgressEngine)
    return _ENGINE


# --- the batch --------------------------------------------------------------------------------------------

class _LiveLine:
    """``[1/8] 01_gradient_explosion (C2, C3, R1)  cell 12/31  1m05s`` rewritten in place on a terminal; on
    anything else (a log file, a pipe) a line every few minutes."""

    def __init__(self, head: str, stream: Any, every_s: float = 300.0) -> None:
        self.head, self.stream = head, stream
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.cells = (0, 0)
        self.t0 = time.perf_counter()
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, daemon=True)

    def __enter__(self) -> _LiveLine:
        self._thread.start()
        return self

    def update(self, done: int, total: int, _elapsed: float) -> None:
        self.cells = (done, total)
        if self.tty:
            self._draw()

    def text(self) -> str:
        done, total = self.cells
        cells = f"cell {min(done + 1, total)}/{total}" if total else "starting"
        return f"{self.head}  {cells}, {format_duration(time.perf_counter() - self.t0)}"

    def _draw(self) -> None:
        with contextlib.suppress(Exception):
            self.stream.write("\r\x1b[2K" + self.text())
            self.stream.flush()

    def _tick(self) -> None:
        last = time.perf_counter()
        while not self._stop.wait(1.0):
            if self.tty:
                self._draw()
            elif time.perf_counter() - last >= self.every_s:
                last = time.perf_counter()
                with contextlib.suppress(Exception):
                    self.stream.write(f"  ... {self.text()}\n")
                    self.stream.flush()

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        if self.tty:
            with contextlib.suppress(Exception):
                self.stream.write("\r\x1b[2K")
                self.stream.flush()


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
            with _LiveLine(head, stream) as line:
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


__all__ = ["NotebookJob", "JobOutcome", "ProfileBusy", "ProfileLock", "Interrupted", "load_profile", "select",
           "is_fresh", "execute", "reproduce", "summary_table", "outcome_text", "parse_duration", "format_duration"]
