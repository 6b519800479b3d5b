"""Run tracking: one measured claim = one ``result.json`` and one W&B run carrying the same numbers.

``start_run`` is the only way a notebook records what it measured::

    run = start_run("C4", profile, params)   # params: the notebook's parameters, whole
    run.log(step=i, loss=...)                # series: name -> [{step, value}]
    run.summary(total_bytes=...)             # scalar metrics
    run.estimate(quality_gap=paired_difference(base, tech))  # a graded number with its interval (measure.stats)
    run.table("sweep", rows)                 # a list of dicts (one per row): sweeps, grids
    run.figure("bytes_by_category", fig)
    run.verdict(get_claim("C4").grade(run.measurements, scale=...))
    run.finish()                             # or use the run as a context manager

Guarantees, because the paper trusts these files:

- ``papermill_runs/out/<profile>/<claim>/result.json`` is only ever replaced whole (temporary file in the
  same folder, fsync, ``os.replace``; mode 0644). It says ``"status": "running"`` from the moment the run
  starts, with the measuring process's ``pid``, ``host`` and ``process_identity`` (boot and start time, so a
  reader can tell a run in progress from one that was killed, even where the pid went to another process),
  ``"complete"`` only after a verdict was recorded and the run ended cleanly, ``"failed"`` (with the error)
  if it raised or ended without a verdict, ``"interrupted"`` if it was stopped
  (a ``KeyboardInterrupt``: JupyterLab's stop button, the runner's Ctrl-C).
- :func:`read_result` refuses a file whose top-level keys have other types than :data:`RESULT_TYPES` says
  (one line naming the file and the key), so no reader trips over ``"verdict": "yes"``.
- ``result["verdict"]["estimates"]`` records, for every number the verdict was graded on, its value, interval,
  n, method, confidence and kind (measured, modelled, looked up), its grade and the n that would decide it;
  ``result["estimates"]`` holds what :meth:`Run.estimate` recorded. Files written before these existed lack
  them and stay readable.
- W&B is best effort and isolated: the run's W&B side lives in a process of its own
  (:mod:`macroarch.repro.wandb_sidecar`, which says why), so a dead ``wandb-core``, a bad key, no network or
  a full disk can neither fail nor slow the measurement; what went wrong is recorded under
  ``result["wandb"]["error"]``. Offline unless the user configured it (``WANDB_API_KEY`` or ``WANDB_MODE``).

The W&B run: config = the parameters plus claim, profile, git commit and machine; ``group`` = profile,
``job_type`` = notebook; metric names grouped by claim and kind (see the sidecar); the verdict as a one-row
table and its graded numbers as a bar chart ``<claim>/graded`` (value, interval, n, kind and grade per number);
series as line charts against ``step``; system metrics of the measuring process and its console output; at the
end an ``evidence`` artifact (``result.json``, figures and, under the runner, the executed notebook).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno as _errno
import json
import math
import os
import random
import socket
import string
import subprocess
import sys
import tempfile
import traceback
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from macroarch.paths import check_profile, out_root, project_root, wandb_root
from macroarch.repro.claims import CLAIMS, Verdict, get_claim

SCHEMA_VERSION = 1
RUNNING, COMPLETE, FAILED, INTERRUPTED = "running", "complete", "failed", "interrupted"

#: set by the runner for the kernels it starts: where the executed notebook will be once papermill is done
EVIDENCE_ENV = "MACROARCH_EVIDENCE"


def wandb_wait_s() -> float:
    """Seconds a finishing run waits for its W&B process outside the runner (the runner waits itself)."""
    return float(os.environ.get("MACROARCH_WANDB_WAIT", 10))


class ResultFileError(ValueError):
    """A result file that exists but is not a result: the message names the file and what is wrong."""


def result_path(claim: str, profile: str, root: Path | None = None) -> Path:
    return (root or out_root()) / profile / claim / "result.json"


def write_json_atomic(path: Path, data: Any, *, allow_nan: bool = False) -> None:
    """Replace ``path`` with ``data`` as JSON in one step: readers see the old file or the new, never half.
    The file is world-readable (0644), like any output a user may want to share or serve. NaN and inf are refused
    unless ``allow_nan`` (a benchmark's diverged variant is a result; a claim's metric is not).

    A write that fails (a full disk, a read-only folder) removes its temporary ``.partial`` file, leaves the old
    ``path`` as it was and raises an ``OSError`` whose ``filename`` is ``path`` (``str(e)`` names it: a bare
    ``No space left on device`` would not say what could not be written)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    except OSError as e:
        raise _naming(e, path) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, sort_keys=False, default=_json_default, allow_nan=allow_nan)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise _naming(e, path) from None
        raise


def _naming(e: OSError, path: Path) -> OSError:
    """``e`` with ``path`` as its filename (the same subclass: a full disk stays an ``OSError`` with ENOSPC)."""
    if e.filename is not None and e.errno is not None:
        return e
    return OSError(e.errno, e.strerror or str(e), str(path)) if e.errno is not None else \
        OSError(_errno.EIO, str(e) or type(e).__name__, str(path))


GRADED_COLUMNS = ("number", "value", "low", "high", "n", "kind", "grade")
"""The columns of each run's W&B chart ``<claim>/graded``: one row per graded number of its verdict."""

#: the top-level keys of a result file and the JSON types each may hold (None: null). A key may be absent (files
#: written before it existed stay readable); present with another type, the file is not a result.
RESULT_TYPES: dict[str, tuple[type, ...]] = {
    "status": (str,), "claim": (str,), "profile": (str,), "notebook": (str, type(None)),
    "started": (str, type(None)), "finished": (str, type(None)), "pid": (int, type(None)),
    "host": (str, type(None)), "process_identity": (str, type(None)), "git_commit": (str, type(None)),
    "config": (dict,), "metrics": (dict,), "series": (dict,), "tables": (dict,), "figures": (list,),
    "estimates": (dict,), "verdict": (dict, type(None)), "error": (dict, type(None)),
    "wandb": (dict, type(None)), "compile": (dict, type(None)), "previous": (dict, type(None)),
    "stability": (dict, type(None)), "figure_problems": (dict,), "figure_captions": (dict,),
}
_JSON_NAMES = {str: "a string", int: "a whole number", dict: "an object", list: "a list", type(None): "null",
               float: "a number", bool: "a boolean"}


def read_result(path: Path) -> dict:
    """A result file as a dict; :class:`ResultFileError` (one line, naming the file and what is wrong) if it is
    not one: not JSON, not an object, no ``status``, or a top-level key of another type than
    :data:`RESULT_TYPES` allows (``"verdict": "yes"``, ``"metrics": [1, 2]``), or a verdict without a ``grade``
    string. Only the top level is checked: what every reader indexes without looking (``r["verdict"]["grade"]``,
    ``dict(r["metrics"])``); the values inside are the notebook's."""
    try:
        with Path(path).open(encoding="utf-8") as f:
            data = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ResultFileError(f"{path}: malformed result file ({e})") from None
    if not isinstance(data, dict):
        raise ResultFileError(f"{path}: malformed result file (a JSON {type(data).__name__}, not an object)")
    if "status" not in data or data["status"] is None:
        raise ResultFileError(f"{path}: malformed result file (no 'status')")
    for key, types in RESULT_TYPES.items():
        if key in data and not _is(data[key], types):
            want = " or ".join(_JSON_NAMES[t] for t in types)
            raise ResultFileError(f"{path}: malformed result file ('{key}' is {_json_name(data[key])}, "
                                  f"expected {want})")
    if "figures" in data and not all(isinstance(n, str) for n in data["figures"]):
        raise ResultFileError(f"{path}: malformed result file ('figures' must be a list of names)")
    verdict = data.get("verdict")
    if isinstance(verdict, dict) and verdict and not isinstance(verdict.get("grade"), str):
        raise ResultFileError(f"{path}: malformed result file ('verdict' has no 'grade' string)")
    return data


def _is(value: Any, types: tuple[type, ...]) -> bool:
    return not isinstance(value, bool) and isinstance(value, types)  # JSON true is no pid


def _json_name(value: Any) -> str:
    return f"{_JSON_NAMES.get(type(value), type(value).__name__)} ({json.dumps(value)[:40]})"


def notebook_problem(path: Path, *, complete: bool = True) -> str | None:
    """What keeps an executed notebook from being evidence, in a few words, or None if nothing does. It must be a
    whole file (a JSON object: a truncated write is not one; a failed or partial notebook needs no more); with
    ``complete`` also a notebook (a ``cells`` list) whose execution papermill recorded as ending cleanly
    (``metadata.papermill`` with an ``end_time`` and no ``exception``), or an interactive run's recording
    (``metadata.macroarch``, :mod:`macroarch.repro.interactive`) whose last cell did not raise: what a notebook
    that passes as a run's clean outcome must be. Only the file is read, no kernel."""
    try:
        with Path(path).open(encoding="utf-8") as f:
            nb = json.load(f)
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return f"cannot read: {e.strerror}"
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"not a whole notebook: {e}"
    if not isinstance(nb, dict):
        return f"not a notebook (a JSON {type(nb).__name__})"
    if not complete:
        return None
    if not isinstance(nb.get("cells"), list):
        return "not a notebook (no list of cells)"
    meta = nb.get("metadata") if isinstance(nb.get("metadata"), dict) else {}
    own = meta.get("macroarch")
    if isinstance(own, dict) and own.get("interactive"):  # an interactive run's (macroarch.repro.interactive)
        if own.get("exception"):
            return "its last cell raised"
        return None if own.get("end_time") else "no end time recorded"
    pm = meta.get("papermill")
    if not isinstance(pm, dict):
        return "no papermill record of its execution"
    if pm.get("exception"):
        return "papermill recorded an exception"
    if not pm.get("end_time"):
        return "papermill recorded no end time: the execution did not finish"
    return None


def process_identity(pid: int) -> str | None:
    """What tells process ``pid`` from a later process that got the same pid: the boot it runs in and its start
    time (``/proc/sys/kernel/random/boot_id`` and field 22 of ``/proc/<pid>/stat``, clock ticks after boot), as
    ``"<boot id>/<start>"``. None where there is no such ``/proc`` (not Linux) or the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except (OSError, ValueError):
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # the name in parentheses may hold spaces: fields 3.. follow it
    if len(fields) < 20:
        return None
    return f"{boot}/{fields[19]}"  # field 22, counted from 1, is the 20th after the name


def run_is_alive(result: Mapping[str, Any]) -> bool:
    """Whether the process that wrote a ``running`` result is still running (on this host): its pid exists and,
    where the result recorded the process's identity (:func:`process_identity`), it is still that process, not
    an unrelated one that reused the pid. A result written before the identity was recorded (or where ``/proc``
    cannot tell) is judged by the pid alone, as before."""
    pid, host = result.get("pid"), result.get("host")
    if not isinstance(pid, int) or host != socket.gethostname():
        return host is not None and host != socket.gethostname()  # another host: assume it is
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    recorded = result.get("process_identity")
    if isinstance(recorded, str):
        now = process_identity(pid)
        if now is not None and now != recorded:
            return False  # the pid is alive, but it is another process now
    return True


def git_commit(root: Path | None = None) -> str | None:
    """The checkout's HEAD, with ``+dirty`` if tracked files differ from it; ``None`` outside git.
    ``paper/`` is output, not code: a rebuilt paper does not make the next run dirty. ``git status`` may run the
    notebooks' clean filter (nbstripout, a Python process per notebook whose index entry is stale: every one, in
    a fresh clone, until an index refresh), so it gets a minute; ``make`` refreshes the index once it installs
    the filter."""
    root = root or project_root()
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)paper"], cwd=root, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty.strip() else "")


def _json_default(obj: Any) -> Any:
    # numpy and torch scalars, paths and tuples appear in configs and metrics; keep them readable.
    if hasattr(obj, "item") and callable(obj.item):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def _number(name: str, value: Any) -> float | int:
    """Metrics are numbers; NaN and inf are refused here, where the notebook can still see which one."""
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"metric {name!r} must be a number, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"metric {name!r} is not finite: {value}")
    return value


def wandb_mode() -> str:
    """``offline`` unless the user set ``WANDB_MODE`` or gave an API key (then ``online``)."""
    if mode := os.environ.get("WANDB_MODE"):
        return mode
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


def _run_id() -> str:
    return "".join(random.SystemRandom().choices(string.ascii_lowercase + string.digits, k=8))


class Run:
    """What ``start_run`` returns. ``summary``, ``table``, ``figure`` and ``verdict`` write the result file
    through (``log`` is written with them and at the end), so a long run's progress is visible on disk."""

    def __init__(self, claim: str, profile: str, config: Mapping[str, Any], path: Path) -> None:
        self.claim, self.profile, self.path = claim, profile, path
        self.dir = path.parent
        self._data: dict[str, Any] = {
            "schema": SCHEMA_VERSION,
            "claim": claim,
            "profile": profile,
            "notebook": CLAIMS[claim].notebook,
            "status": RUNNING,
            "started": _now(),
            "finished": None,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "process_identity": process_identity(os.getpid()),
            "git_commit": git_commit(),
            "config": json.loads(json.dumps(dict(config), default=_json_default)),
            "metrics": {},
            "series": {},
            "tables": {},
            "figures": [],
            "estimates": {},
            "verdict": None,
            "error": None,
            "wandb": {"mode": None, "id": None, "dir": None, "state": None, "error": None, "artifact": None},
        }
        self._sidecar = None
        self._verdict_set = False

    # --- what notebooks call -------------------------------------------------------------------------

    def log(self, step: int, **metrics: Any) -> None:
        """Append ``metrics`` at ``step`` to their series."""
        step = int(step)
        row = {k: _number(k, v) for k, v in metrics.items()}
        for k, v in row.items():
            self._data["series"].setdefault(k, []).append({"step": step, "value": v})
        self._send("log", row={**{f"{self.claim}/series/{k}": v for k, v in row.items()}, "step": step})

    def summary(self, **metrics: Any) -> None:
        """Record scalar metrics (a later value for the same name replaces the earlier one)."""
        from macroarch.repro.wandb_sidecar import metric_key

        row = {k: _number(k, v) for k, v in metrics.items()}
        self._data["metrics"].update(row)
        self._send("summary", values={metric_key(self.claim, k): v for k, v in row.items()})
        self._flush()

    @property
    def metrics(self) -> dict[str, float]:
        return dict(self._data["metrics"])

    def estimate(self, **estimates: Any) -> None:
        """Record graded numbers with their intervals: each an :class:`~macroarch.measure.stats.Estimate` (or its
        dict). Its value goes into ``metrics`` under the same name (so tables, W&B and old readers see a number);
        the whole estimate into ``result["estimates"]``."""
        from macroarch.measure.stats import as_estimate

        ests = {k: as_estimate(e) for k, e in estimates.items()}
        self._data.setdefault("estimates", {}).update({k: e.to_dict() for k, e in ests.items()})
        self.summary(**{k: e.value for k, e in ests.items()})

    def leave_one_out(self, repeated: Mapping[str, Any]) -> Any:
        """Regrade this claim with each seed (each timing block) left out in turn, and record the outcome with the
        raw data it was computed from (``result["stability"]``: the grade, every left-out repetition that changes
        it, each metric's :class:`~macroarch.measure.stats.Repeated` as a dict, and the other numbers as they were
        recorded), so the paper marks a grade that rests on one repetition as unstable and a reader can regrade.
        Call it after every graded number is recorded, before :meth:`verdict`; returns the
        :class:`~macroarch.repro.claims.Stability`."""
        from macroarch.repro.claims import regrade_leaving_out

        fixed = {k: v for k, v in self.measurements.items() if k not in repeated}
        stability = regrade_leaving_out(self.claim, repeated, fixed=fixed)
        record = {**stability.to_dict(), "repeated": {k: r.to_dict() for k, r in repeated.items()}, "fixed": fixed}
        self._data["stability"] = json.loads(json.dumps(record, default=_json_default))
        self._send("summary", values={"stability": self._data["stability"], "leave_one_out": stability.text()})
        self._flush()
        return stability

    @property
    def measurements(self) -> dict[str, Any]:
        """What a claim is graded on: ``metrics``, with each recorded estimate (as its dict) in place of its value:
        ``get_claim(cid).grade(run.measurements, ...)``."""
        return {**self._data["metrics"], **self._data.get("estimates", {})}

    def table(self, name: str, rows: Sequence[Mapping[str, Any]] | Any) -> None:
        """Record a table (a sweep, a grid): ``rows`` is a list of dicts with the same keys, or a DataFrame."""
        _check_name("table", name)
        if hasattr(rows, "to_dict"):  # a pandas DataFrame
            rows = rows.to_dict("records")
        rows = [dict(r) for r in rows]
        columns = list(dict.fromkeys(k for r in rows for k in r))
        cells = json.loads(json.dumps([[r.get(c) for c in columns] for r in rows], default=_json_default))
        self._data["tables"][name] = {"columns": columns, "rows": cells}
        self._send("table", key=f"{self.claim}/tables/{name}", columns=columns, rows=cells)
        self._flush()

    def figure(self, name: str, fig: Any, *, dpi: int = 150) -> Path:
        """Save a matplotlib figure as ``<claim dir>/<name>.png`` (atomically) and log it to W&B.

        Its layout is checked as the report will show it (:func:`macroarch.repro.figures.figure_problems`: text
        size at the report's width, overlaps, unlabelled axes, legends over data); problems are recorded under
        ``figure_problems`` in the result file and warned about, never raised: a figure is evidence, not a verdict.
        """
        _check_name("figure", name)
        from macroarch.repro.figures import figure_problems

        problems = figure_problems(fig)
        found = self._data.setdefault("figure_problems", {})
        found.pop(name, None)
        if problems:
            found[name] = problems
            warnings.warn(f"{self.claim} figure {name!r}: " + "; ".join(problems), stacklevel=2)
        from macroarch.repro.report.captions import describe_figure

        caption = describe_figure(fig)  # the report's caption: what the figure's titles, axes and legend say
        captions = self._data.setdefault("figure_captions", {})
        captions.pop(name, None)
        if caption:
            captions[name] = caption
        path = self.dir / f"{name}.png"
        tmp = self.dir / f".{name}.png.partial"
        try:
            fig.savefig(tmp, dpi=dpi, bbox_inches="tight", format="png")
            os.replace(tmp, path)
        except OSError as e:  # a full disk: no half-written figure is left, and the error names the file
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise _naming(e, path) from None
        if name not in self._data["figures"]:
            self._data["figures"].append(name)
        self._send("image", key=f"{self.claim}/figures/{name}", path=str(path))
        self._flush()
        return path

    def verdict(self, verdict: Verdict | None = None, **fields: Any) -> Verdict:
        """Record the graded verdict: a :class:`Verdict` (from ``Claim.grade``) or its fields."""
        if verdict is None:
            verdict = Verdict(**fields)
        elif fields:
            raise TypeError("pass a Verdict or its fields, not both")
        v = verdict.to_dict()
        self._data["verdict"] = v
        self._verdict_set = True
        self._send("summary", values={"verdict": v})
        # a table cell holds text: the per-number estimates go in as one JSON string
        cells = {**v, "estimates": json.dumps(v.get("estimates") or {}, sort_keys=True)}
        self._send("table", key=f"{self.claim}/verdict", columns=list(cells), rows=[list(cells.values())])
        if v.get("estimates"):  # the graded numbers as a bar chart, their intervals, n and grades beside
            rows = [[name, e.get("value"), e.get("low"), e.get("high"), e.get("n"), e.get("kind"), e.get("grade")]
                    for name, e in v["estimates"].items()]
            self._send("bar", key=f"{self.claim}/graded", columns=list(GRADED_COLUMNS), rows=rows,
                       label="number", value="value", title=f"{self.claim}: the graded numbers ({v['grade']})")
        self._flush()
        return verdict

    def finish(self, error: BaseException | None = None) -> None:
        """Close the run: ``complete`` if a verdict was recorded and no ``error``, ``failed`` otherwise."""
        if self.finished:
            return
        self._finish(error)

    @property
    def finished(self) -> bool:
        return self._data["status"] != RUNNING

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.finish(exc)
        return False

    # --- lifecycle -----------------------------------------------------------------------------------

    def _start(self) -> None:
        for old in self.dir.glob("*.png"):  # figures of an earlier run must not pass as this run's
            old.unlink()
        self._flush()
        self._start_wandb()
        self._flush()

    def _finish(self, error: BaseException | None) -> None:
        if error is None and not self._verdict_set:
            error = RuntimeError(f"run {self.claim}/{self.profile} ended without a verdict")
        self._data["finished"] = _now()
        # what this kernel process spent compiling MVAS kernels (cumulative: the runner takes the largest over a
        # notebook's claims); read only where mvas is already imported, so a run without MVAS pays nothing
        mvas = sys.modules.get("macroarch.mvas")
        self._data["compile"] = dict(mvas.compile_stats()) if mvas is not None else None
        if error is None:
            self._data["status"] = COMPLETE
        else:  # a KeyboardInterrupt is the stop button, or the runner's Ctrl-C: not a failure of the claim
            self._data["status"] = INTERRUPTED if isinstance(error, KeyboardInterrupt) else FAILED
            tb = "".join(traceback.format_exception(type(error), error, error.__traceback__))
            self._data["error"] = {"type": type(error).__name__, "message": str(error), "traceback": tb[-4000:]}
        _ACTIVE.discard(self)
        self._flush()  # the measurement is on disk before anything waits on W&B
        from macroarch.repro.interactive import recorder

        if (rec := recorder()) is not None:  # JupyterLab: this kernel's executed notebook, rewritten after each cell
            rec.target(self.path.parent.parent / f"{self._data['notebook']}.ipynb")
        if self._sidecar is None:
            return
        summary = {"status": self._data["status"], "finished": self._data["finished"]}
        if error is not None:
            summary["error"] = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
        evidence = {"result.json": str(self.path), **{f"{n}.png": str(self.dir / f"{n}.png")
                                                      for n in self._data["figures"]}}
        linger = [p for p in os.environ.get(EVIDENCE_ENV, "").split(os.pathsep) if p]
        self._sidecar.finish(exit_code=0 if error is None else 1, summary=summary, evidence=evidence,
                             linger=linger, profile=self.profile)
        if not linger:  # under the runner, the runner waits for W&B once the executed notebook exists
            wait = wandb_wait_s()
            self.merge_wandb_status(self._sidecar.wait(wait), waited=wait)
            self._flush()

    def merge_wandb_status(self, status: Mapping[str, Any], waited: float) -> None:
        merge_wandb_status(self._data, status, waited)
        if self._sidecar is not None and self._sidecar.error and not self._data["wandb"]["error"]:
            self._data["wandb"]["error"] = self._sidecar.error

    def _watch_ipython(self) -> None:
        """In IPython, a cell that raises while this run is open finishes it as failed (and closes W&B)."""
        try:
            from IPython import get_ipython
        except ImportError:
            return
        shell = get_ipython()
        if shell is None:
            return

        def _after_cell(result) -> None:
            if self.finished:
                shell.events.unregister("post_run_cell", _after_cell)
            elif result.error_in_exec is not None or result.error_before_exec is not None:
                self.finish(result.error_in_exec or result.error_before_exec)
                shell.events.unregister("post_run_cell", _after_cell)

        shell.events.register("post_run_cell", _after_cell)

    def _start_wandb(self) -> None:
        from macroarch.repro.wandb_sidecar import Sidecar, read_status

        mode = wandb_mode()
        self._data["wandb"].update(mode=mode)
        if mode == "disabled":
            return
        wdir = wandb_root()
        init = dict(
            project=os.environ.get("WANDB_PROJECT", "macroarch"),
            entity=os.environ.get("WANDB_ENTITY") or None,
            id=_run_id(),
            name=f"{self.claim}-{self.profile}",
            group=self.profile,
            job_type=self._data["notebook"],
            tags=[self.claim, self.profile],
            config={**self._data["config"], "claim": self.claim, "profile": self.profile,
                    "git_commit": self._data["git_commit"]},
            dir=str(wdir),
            mode=mode,
        )
        # after the kernel ends, how long to wait for papermill's last write of the executed notebook
        linger = float(os.environ.get("MACROARCH_WANDB_LINGER", 60)) if os.environ.get(EVIDENCE_ENV) else 0.0
        try:
            wdir.mkdir(parents=True, exist_ok=True)
            self._sidecar = Sidecar(wandb_status_path(self.path), init, linger_s=linger)
        except Exception as e:  # could not even start the process: the run goes on without W&B
            self._data["wandb"]["error"] = f"W&B process did not start: {type(e).__name__}: {e}"
            warnings.warn(self._data["wandb"]["error"], stacklevel=3)
            return
        self._data["wandb"].update(id=init["id"], state=read_status(self._sidecar.status_path).get("state"))
        self._send("summary", values={"status": RUNNING, "started": self._data["started"]})
        _ACTIVE.add(self)
        _install_console_tee()

    def _send(self, op: str, **payload: Any) -> None:
        if self._sidecar is not None and not self.finished:
            self._sidecar.send(op, **payload)

    def _flush(self) -> None:
        write_json_atomic(self.path, self._data)


def wandb_status_path(result: Path) -> Path:
    """Where a run's W&B process reports its state: beside ``result.json``."""
    return Path(result).parent / "wandb.json"


def merge_wandb_status(result: dict, status: Mapping[str, Any], waited: float) -> None:
    """Copy a W&B process's final status into a result's ``wandb`` section (a W&B failure is recorded there,
    never in the result's own status)."""
    w = result.setdefault("wandb", {})
    for key in ("id", "dir", "artifact"):
        if status.get(key):
            w[key] = status[key]
    state = status.get("state")
    w["state"] = state
    if status.get("error"):
        w["error"] = status["error"]
    elif state not in ("finished", "failed") and w.get("mode") not in (None, "disabled"):
        w["error"] = f"W&B not finished after {waited:.0f}s (state {state or 'unknown'}); left to finish alone"


# --- console: what the notebook prints also reaches its W&B runs ------------------------------------------

_ACTIVE: set[Run] = set()


class _Tee:
    """Stands in for ``sys.stdout`` / ``sys.stderr``: writes go where they went, and to each open run's W&B
    process (a queue put: it never blocks the notebook)."""

    def __init__(self, stream: Any, name: str) -> None:
        self._stream, self._name = stream, name

    def write(self, text: str) -> int:
        n = self._stream.write(text)
        for run in list(_ACTIVE):
            with contextlib.suppress(Exception):
                run._send("console", stream=self._name, text=text)
        return n

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._stream, attr)


def _install_console_tee() -> None:
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _Tee):
            setattr(sys, name, _Tee(stream, name))


def _check_name(what: str, name: str) -> None:
    if not name or any(c in name for c in "/\\ ") or name.startswith("."):
        raise ValueError(f"{what} name must be a plain file stem, got {name!r}")


def start_run(claim: str, profile: str, config: Mapping[str, Any] | None = None) -> Run:
    """Open a tracked run of ``claim`` under ``profile``; see the module docstring for its guarantees.

    Use it as a context manager, or (across notebook cells) keep the returned run and call
    :meth:`Run.finish` at the end: inside IPython a cell that raises finishes the run as failed.
    """
    get_claim(claim)
    check_profile(profile)
    from macroarch.measure.machine import machine_info  # torch: imported when a run starts, not by the CLI

    config = dict(config or {})
    # Every run names the hardware it measured on: speed ratios and compute dtypes depend on it.
    config.setdefault("machine", machine_info(str(config.get("device", "cpu"))))
    run = Run(claim, profile, config, result_path(claim, profile))
    run._start()
    run._watch_ipython()
    from macroarch.repro.interactive import recorder

    recorder()  # in JupyterLab, this kernel records what it executes from here on (the run's evidence)
    return run


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
