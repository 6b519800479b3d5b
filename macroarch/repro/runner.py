"""Batch reproduction: execute the notebooks of a profile with papermill, resumably, one line each.

``papermill_runs/<profile>.yaml`` lists the notebooks and their parameters::

    description: what this profile is for
    notebooks:
      - notebook: 02_memory_wall          # notebooks/02_memory_wall.ipynb
        parameters: {batch_size: 1}       # keys must exist in the notebook's `parameters` cell
        timeout: 600                      # optional: seconds per cell

The runner injects ``profile``; the claims a notebook measures come from the registry (``claims.py``).
Everything is validated before anything runs: a bad profile, notebook, claim id or parameter key raises
:class:`ConfigError` with nothing written.

Resume: a notebook is skipped when its stamp (written after a clean execution) is newer than the
notebook and every file of the package, its parameters hash the same, and all its claims' results are
complete. A notebook executes into a ``.partial`` file that becomes ``<stem>.ipynb`` only on success
(``<stem>.failed.ipynb`` otherwise), and a failure marks every claim it did not finish as failed, so no
stale result passes as the outcome of this run. One failing notebook does not stop the others.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from macroarch.config import ConfigError, check_keys, load_yaml
from macroarch.paths import check_profile, out_root, project_root
from macroarch._table import format_table
from macroarch.repro.claims import CLAIMS, parse_claim_ids
from macroarch.repro.tracking import COMPLETE, FAILED, read_result, result_path, write_json_atomic

_PROFILE_KEYS = ("description", "notebooks")
_ENTRY_KEYS = ("notebook", "parameters", "timeout")


@dataclass(frozen=True)
class NotebookJob:
    """One notebook of a profile, validated."""

    stem: str
    path: Path
    claims: tuple[str, ...]
    parameters: dict[str, Any]
    timeout: int | None = None

    @property
    def params_hash(self) -> str:
        blob = json.dumps(self.parameters, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


@dataclass
class JobOutcome:
    job: NotebookJob
    status: str  # "ok", "skipped", "failed"
    seconds: float = 0.0
    error: str = ""
    grades: dict[str, str] = field(default_factory=dict)


def profile_file(profile: str, root: Path | None = None) -> Path:
    return (root or project_root()) / "papermill_runs" / f"{profile}.yaml"


def load_profile(profile: str, root: Path | None = None) -> list[NotebookJob]:
    """Read and validate ``papermill_runs/<profile>.yaml`` against the notebooks and the registry."""
    check_profile(profile)
    root = root or project_root()
    path = profile_file(profile, root)
    data = load_yaml(path)
    check_keys(data or {}, _PROFILE_KEYS, str(path), required=("notebooks",))
    entries = data["notebooks"]
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{path}: 'notebooks' must be a non-empty list")
    jobs, seen = [], set()
    for i, entry in enumerate(entries):
        where = f"{path}: notebooks[{i}]"
        check_keys(entry, _ENTRY_KEYS, where, required=("notebook",))
        stem = str(entry["notebook"]).removesuffix(".ipynb")
        nb = root / "notebooks" / f"{stem}.ipynb"
        if not nb.is_file():
            raise ConfigError(f"{where}: unknown notebook {stem!r} (no {nb.relative_to(root)})")
        if stem in seen:
            raise ConfigError(f"{where}: notebook {stem!r} is listed twice")
        seen.add(stem)
        params = entry.get("parameters") or {}
        if not isinstance(params, dict):
            raise ConfigError(f"{where}: 'parameters' must be a mapping, got {type(params).__name__}")
        params = {**params, "profile": profile}
        _check_parameters(nb, params, where)
        timeout = entry.get("timeout")
        if timeout is not None and (not isinstance(timeout, int) or timeout <= 0):
            raise ConfigError(f"{where}: timeout must be a positive number of seconds, got {timeout!r}")
        claims = tuple(c.id for c in CLAIMS.values() if c.notebook == stem)
        jobs.append(NotebookJob(stem=stem, path=nb, claims=claims, parameters=params, timeout=timeout))
    return jobs


def _check_parameters(nb: Path, params: dict[str, Any], where: str) -> None:
    import papermill

    declared = papermill.inspect_notebook(str(nb))
    if "profile" not in declared:
        raise ConfigError(f"{nb.name}: its parameters cell must define 'profile'")
    unknown = [k for k in params if k not in declared]
    if unknown:
        raise ConfigError(f"{where}: unknown parameter {unknown[0]!r} for notebook {nb.stem}; "
                          f"its parameters are: {', '.join(declared)}")


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


# --- freshness --------------------------------------------------------------------------------------------

def _stamp_path(profile: str, stem: str, out: Path) -> Path:
    return out / profile / ".stamps" / f"{stem}.json"


def _newest_code_mtime() -> float:
    pkg = Path(__file__).resolve().parent
    return max((p.stat().st_mtime for p in pkg.rglob("*.py")), default=0.0)


def is_fresh(job: NotebookJob, profile: str, root: Path | None = None, out: Path | None = None) -> bool:
    """Whether ``job``'s last clean execution is newer than its notebook, parameters and package code."""
    root, out = root or project_root(), out or out_root()
    stamp = _stamp_path(profile, job.stem, out)
    if not stamp.is_file() or not (out / profile / f"{job.stem}.ipynb").is_file():
        return False
    try:
        info = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return False
    if info.get("params_hash") != job.params_hash:
        return False
    t = stamp.stat().st_mtime
    if t <= job.path.stat().st_mtime or t <= _newest_code_mtime():
        return False
    for claim in job.claims:
        p = result_path(claim, profile, out)
        try:
            if read_result(p).get("status") != COMPLETE:
                return False
        except (OSError, ValueError):
            return False
    return True


# --- execution --------------------------------------------------------------------------------------------

def execute(job: NotebookJob, profile: str, root: Path | None = None, out: Path | None = None) -> JobOutcome:
    """Execute one notebook with papermill; never raises for a failure inside the notebook."""
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

    started = _dt.datetime.now(_dt.UTC)
    t0 = time.perf_counter()
    try:
        papermill.execute_notebook(
            str(job.path), str(partial), parameters=job.parameters, kernel_name="python3",
            cwd=str(root), progress_bar=False, log_output=False, execution_timeout=job.timeout,
            report_mode=False,
            # ipykernel warns on every start that loopback TCP is unencrypted; keep the progress lines clean
            extra_arguments=["--IPKernelApp.log_level=ERROR"],
        )
    except BaseException as e:  # a failing notebook is an outcome, not a crash of the batch
        seconds = time.perf_counter() - t0
        if partial.exists():
            os.replace(partial, failed)
        message = _short_error(e)
        _fail_unfinished_claims(job, profile, out, started, message)
        if isinstance(e, KeyboardInterrupt):
            raise
        return JobOutcome(job, "failed", seconds, message, _grades(job, profile, out))
    seconds = time.perf_counter() - t0
    os.replace(partial, final)
    outcome = JobOutcome(job, "ok", seconds, grades=_grades(job, profile, out))
    incomplete = [c for c in job.claims if _status(c, profile, out) != COMPLETE]
    if incomplete:
        # The notebook ran to the end but left claims without a complete result: that is a failure.
        message = f"notebook finished without a complete result for {', '.join(incomplete)}"
        _fail_unfinished_claims(job, profile, out, started, message)
        outcome.status, outcome.error = "failed", message
        return outcome
    write_json_atomic(stamp, {"notebook": job.stem, "params_hash": job.params_hash, "claims": list(job.claims),
                              "finished": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
                              "seconds": round(seconds, 2)})
    return outcome


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


def _fail_unfinished_claims(job: NotebookJob, profile: str, out: Path, started: _dt.datetime, message: str) -> None:
    """Mark every claim of ``job`` that this execution did not finish as failed (results stay readable)."""
    for claim in job.claims:
        path = result_path(claim, profile, out)
        try:
            r = read_result(path)
        except (OSError, ValueError):
            r = {"schema": 1, "claim": claim, "profile": profile, "config": {}, "metrics": {}, "series": {},
                 "figures": [], "verdict": None, "wandb": None}
        ran_now = r.get("started") and _dt.datetime.fromisoformat(r["started"]) >= started.replace(microsecond=0)
        if ran_now and r.get("status") in (COMPLETE, FAILED):
            continue
        r["status"] = FAILED
        r["error"] = {"type": "NotebookFailed", "message": f"{job.stem}: {message}", "traceback": ""}
        r["finished"] = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
        write_json_atomic(path, r)


def _short_error(e: BaseException) -> str:
    ename = getattr(e, "ename", None)
    evalue = getattr(e, "evalue", None)
    if ename:
        return f"{ename}: {evalue}".strip()
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"


def reproduce(profile: str = "cpu", *, only: str | None = None, force: bool = False,
              root: Path | None = None, out: Path | None = None, echo=print) -> list[JobOutcome]:
    """Run a profile's notebooks (validated first), one progress line each, then a summary table."""
    root, out = root or project_root(), out or out_root()
    jobs = select(load_profile(profile, root), only)
    outcomes = []
    width = max(len(j.stem) for j in jobs)
    for i, job in enumerate(jobs, 1):
        head = f"[{i}/{len(jobs)}] {job.stem:<{width}} ({', '.join(job.claims) or 'no claims'})"
        if not force and is_fresh(job, profile, root, out):
            outcome = JobOutcome(job, "skipped", grades=_grades(job, profile, out))
            echo(f"{head} skipped: up to date ({_grade_text(outcome)})", flush=True)
        else:
            echo(f"{head} ... ", end="", flush=True)  # the line is finished when the notebook is
            outcome = execute(job, profile, root, out)
            tail = _grade_text(outcome) if outcome.status == "ok" else outcome.error
            echo(f"{outcome.status} in {outcome.seconds:.1f}s: {tail}", flush=True)
        outcomes.append(outcome)
    echo(summary_table(outcomes, profile), flush=True)
    return outcomes


def _grade_text(o: JobOutcome) -> str:
    return ", ".join(f"{c} {g}" for c, g in o.grades.items()) or "no results"


def summary_table(outcomes: Sequence[JobOutcome], profile: str) -> str:
    rows = [("notebook", "status", "time", "claims")]
    for o in outcomes:
        rows.append((o.job.stem, o.status, f"{o.seconds:.1f}s" if o.status != "skipped" else "-", _grade_text(o)))
    header = (f"\nprofile {profile}: {sum(o.status == 'ok' for o in outcomes)} ran, "
              f"{sum(o.status == 'skipped' for o in outcomes)} skipped, "
              f"{sum(o.status == 'failed' for o in outcomes)} failed")
    return header + "\n" + format_table(rows)


__all__ = ["NotebookJob", "JobOutcome", "load_profile", "select", "is_fresh", "execute", "reproduce",
           "summary_table"]
