"""Run tracking: one measured claim = one ``result.json`` and one W&B run carrying the same numbers.

``start_run`` is the only way a notebook records what it measured::

    with start_run("C4", profile, config) as run:
        run.log(step=i, loss=...)          # series: name -> [{step, value}]
        run.summary(total_bytes=...)       # scalar metrics
        run.figure("bytes_by_category", fig)
        run.verdict(get_claim("C4").grade(metrics, scale=...))

or, across notebook cells, ``run = start_run(...)`` ... ``run.finish()``.

Guarantees, because the paper trusts these files:

- ``papermill_runs/out/<profile>/<claim>/result.json`` is only ever replaced whole (write to a temporary
  file in the same folder, fsync, ``os.replace``). It says ``"status": "running"`` from the moment the
  run starts, ``"complete"`` only after a verdict was recorded and the block exited cleanly, and
  ``"failed"`` (with the error) if the block raised or ended without a verdict. A killed process leaves
  ``running``: never a result that looks complete.
- W&B is best effort. Offline unless the user configured it (``WANDB_API_KEY`` or ``WANDB_MODE``); any
  W&B error is recorded under ``result["wandb"]["error"]`` and the run carries on without it.

The W&B run gets: config (plus claim, profile, git commit), each ``log`` call as a history row with an
explicit ``step`` key (series restart their steps, so W&B's own ``_step`` cannot be the series axis),
under ``series/<name>``, metrics, verdict and status in the summary, and figures as ``wandb.Image`` under
``figures/<name>``.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import math
import os
import subprocess
import tempfile
import traceback
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from macroarch.paths import check_profile, out_root, project_root, wandb_root
from macroarch.repro.claims import Verdict, get_claim

SCHEMA_VERSION = 1
RUNNING, COMPLETE, FAILED = "running", "complete", "failed"


def result_path(claim: str, profile: str, root: Path | None = None) -> Path:
    return (root or out_root()) / profile / claim / "result.json"


def write_json_atomic(path: Path, data: Any) -> None:
    """Replace ``path`` with ``data`` as JSON in one step: readers see the old file or the new, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, sort_keys=False, default=_json_default, allow_nan=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def read_result(path: Path) -> dict:
    with Path(path).open(encoding="utf-8") as f:
        return json.load(f)


def git_commit(root: Path | None = None) -> str | None:
    """The checkout's HEAD, with ``+dirty`` if tracked files differ from it; ``None`` outside git."""
    root = root or project_root()
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


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


class Run:
    """What ``start_run`` returns. ``summary``, ``figure`` and ``verdict`` write the result file through
    (``log`` is written with them and at the end), so a long run's progress is visible on disk."""

    def __init__(self, claim: str, profile: str, config: Mapping[str, Any], path: Path) -> None:
        self.claim, self.profile, self.path = claim, profile, path
        self.dir = path.parent
        now = _now()
        self._data: dict[str, Any] = {
            "schema": SCHEMA_VERSION,
            "claim": claim,
            "profile": profile,
            "status": RUNNING,
            "started": now,
            "finished": None,
            "git_commit": git_commit(),
            "config": json.loads(json.dumps(dict(config), default=_json_default)),
            "metrics": {},
            "series": {},
            "figures": [],
            "verdict": None,
            "error": None,
            "wandb": {"mode": None, "id": None, "dir": None, "error": None},
        }
        self._wandb = None
        self._verdict_set = False

    # --- what notebooks call -------------------------------------------------------------------------

    def log(self, step: int, **metrics: Any) -> None:
        """Append ``metrics`` at ``step`` to their series."""
        step = int(step)
        row = {k: _number(k, v) for k, v in metrics.items()}
        for k, v in row.items():
            self._data["series"].setdefault(k, []).append({"step": step, "value": v})
        self._wandb_call("log", lambda w: w.log({**{f"series/{k}": v for k, v in row.items()}, "step": step}))

    def summary(self, **metrics: Any) -> None:
        """Record scalar metrics (a later value for the same name replaces the earlier one)."""
        row = {k: _number(k, v) for k, v in metrics.items()}
        self._data["metrics"].update(row)
        self._wandb_call("summary", lambda w: w.summary.update(row))
        self._flush()

    @property
    def metrics(self) -> dict[str, float]:
        return dict(self._data["metrics"])

    def figure(self, name: str, fig: Any, *, dpi: int = 150) -> Path:
        """Save a matplotlib figure as ``<claim dir>/<name>.png`` (atomically) and log it to W&B."""
        if not name or any(c in name for c in "/\\ ") or name.startswith("."):
            raise ValueError(f"figure name must be a plain file stem, got {name!r}")
        path = self.dir / f"{name}.png"
        tmp = self.dir / f".{name}.png.partial"
        fig.savefig(tmp, dpi=dpi, bbox_inches="tight", format="png")
        os.replace(tmp, path)
        if name not in self._data["figures"]:
            self._data["figures"].append(name)

        def _log(w):
            import wandb

            w.log({f"figures/{name}": wandb.Image(str(path))})

        self._wandb_call("figure", _log)
        self._flush()
        return path

    def verdict(self, verdict: Verdict | None = None, **fields: Any) -> Verdict:
        """Record the graded verdict: a :class:`Verdict` (from ``Claim.grade``) or its fields."""
        if verdict is None:
            verdict = Verdict(**fields)
        elif fields:
            raise TypeError("pass a Verdict or its fields, not both")
        self._data["verdict"] = verdict.to_dict()
        self._verdict_set = True
        self._wandb_call("verdict", lambda w: w.summary.update({"verdict": verdict.to_dict()}))
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
        if error is None:
            self._data["status"] = COMPLETE
        else:
            self._data["status"] = FAILED
            tb = "".join(traceback.format_exception(type(error), error, error.__traceback__))
            self._data["error"] = {"type": type(error).__name__, "message": str(error), "traceback": tb[-4000:]}
        self._wandb_call("status", lambda w: w.summary.update({"status": self._data["status"]}))
        if self._wandb is not None:
            with contextlib.suppress(Exception):
                self._wandb.finish(exit_code=0 if error is None else 1)
                # finish() returns before wandb-core has written the tail of the .wandb file; teardown
                # waits for it, so a reader (``macroarch runs``, the paper) never sees a truncated run.
                import wandb

                wandb.teardown()
            self._wandb = None
        self._flush()

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
        mode = wandb_mode()
        self._data["wandb"]["mode"] = mode
        if mode == "disabled":
            return
        try:
            import wandb

            wdir = wandb_root()
            wdir.mkdir(parents=True, exist_ok=True)
            self._wandb = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "macroarch"),
                entity=os.environ.get("WANDB_ENTITY") or None,
                name=f"{self.claim}-{self.profile}",
                group=self.profile,
                job_type=self.claim,
                tags=[self.claim, self.profile],
                config={**self._data["config"], "claim": self.claim, "profile": self.profile,
                        "git_commit": self._data["git_commit"]},
                dir=str(wdir),
                mode=mode,
                reinit="create_new",
                settings=wandb.Settings(console="off", x_disable_stats=True, silent=True, disable_code=True,
                                        disable_job_creation=True),
            )
            self._wandb.define_metric("series/*", step_metric="step")
            self._data["wandb"].update(id=self._wandb.id, dir=str(Path(self._wandb.dir).parent))
        except Exception as e:  # W&B is best effort: the measurement goes on without it
            self._wandb_failed("init", e)

    def _wandb_call(self, what: str, fn) -> None:
        if self._wandb is None:
            return
        try:
            fn(self._wandb)
        except Exception as e:
            self._wandb_failed(what, e)

    def _wandb_failed(self, what: str, e: Exception) -> None:
        msg = f"wandb {what} failed: {type(e).__name__}: {e}"
        warnings.warn(msg + " (the run continues without W&B)", stacklevel=3)
        self._data["wandb"]["error"] = msg
        if self._wandb is not None:
            with contextlib.suppress(Exception):
                self._wandb.finish(exit_code=1)
        self._wandb = None

    def _flush(self) -> None:
        write_json_atomic(self.path, self._data)


def start_run(claim: str, profile: str, config: Mapping[str, Any] | None = None) -> Run:
    """Open a tracked run of ``claim`` under ``profile``; see the module docstring for its guarantees.

    Use it as a context manager, or (across notebook cells) keep the returned run and call
    :meth:`Run.finish` at the end: inside IPython a cell that raises finishes the run as failed.
    """
    get_claim(claim)
    check_profile(profile)
    from macroarch.experiments.hardware import machine_info  # torch: imported when a run starts, not by the CLI

    config = dict(config or {})
    # Every run names the hardware it measured on: speed ratios and compute dtypes depend on it.
    config.setdefault("machine", machine_info(str(config.get("device", "cpu"))))
    run = Run(claim, profile, config, result_path(claim, profile))
    run._start()
    run._watch_ipython()
    return run


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
