"""Batch reproduction: execute the notebooks of a profile with papermill, resumably, one live line each.

The profile (``papermill_runs/<profile>.yaml``, see :mod:`macroarch.repro.profiles`) is checked whole before
any kernel starts. papermill receives only ``profile``: the notebook fills its own sizes from the profile
(``notebook.resolve_parameters``), so a direct ``papermill ... -p profile ci`` runs exactly what the runner
runs (notebooks not converted to annotated parameters yet get their values from papermill).

Resume: a notebook is skipped when its stamp (written after a clean execution) records the same effective
parameters as a run would have now (``notebook.resolve``: profile values, defaults, ``compute_dtype: auto``
on this machine), the stamp is newer than the notebook and every file of the package, and every claim of the
notebook has a complete result that this execution wrote, with those parameters in its config, and the executed
notebook is whole and papermill recorded its execution as ending cleanly (a truncated one is run again). A
notebook executes into a ``.partial`` file that becomes ``<stem>.ipynb`` on success (``<stem>.failed.ipynb``
otherwise, where the partial file is a whole file; a half-written one is removed); a failure marks every claim
it did not finish as failed, Ctrl-C marks them interrupted, each with a fresh record of this execution (no
verdict, metrics or W&B id of an earlier run; ``previous`` points at that run), so no stale result passes as
the outcome of this run. One failing notebook does not stop the others. Each outcome is reported against the
notebook's time budget (``ok 4m12s of 6m``), with a warning when over it.

A write that fails (a full disk, a read-only folder) stops only what needs it: a notebook whose executed
notebook, result or stamp could not be written is a failed outcome whose error names the file (nothing
half-written is left), and the batch goes on to the next notebook (space may be freed, or the next one may
write less); ``timings.json`` that cannot be written is one warning line. Only when the profile's lock file
cannot be written, before anything runs, does the run stop, with one line naming it.

SIGTERM is Ctrl-C: while :func:`reproduce` runs it raises ``KeyboardInterrupt`` in the runner, which takes the
same path (every running notebook's claims marked interrupted, resumable); :class:`Interrupted` carries the
signal (``signum``), and ``macroarch reproduce`` exits 128 + it (130 for Ctrl-C, 143 for SIGTERM).

One run per profile at a time: :class:`ProfileLock` (``out/<profile>/.lock``, released by the OS when the
holder dies) refuses a second one with a message naming the holder.

Notebooks in parallel (``jobs``): each notebook runs in a worker process of its own, pinned
(``os.sched_setaffinity``, inherited by the kernel papermill starts) to cores no other notebook has, as many as
its ``threads`` parameter (``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS`` say the same); a notebook the profile
marks ``exclusive`` runs alone on all the cores. :class:`Schedule` starts them in a fixed order (the exclusive
ones first, while every core is free; then the rest in the profile's order), each as soon as its cores are
free: which notebook ran beside which depends only on how long each takes, and ``timings.json`` records it.
By default ``jobs`` is as many notebooks as fit on the cores side by side. Ctrl-C reaches the runner, which
interrupts every running worker (SIGTERM, which a worker takes as its Ctrl-C) and waits for each to mark its
claims interrupted and end its kernel.

``out/<profile>/timings.json`` (rewritten whenever a notebook starts or ends) says where the time went: each
notebook's wall time, start and end, cores, what overlapped it, its kernels' compile time where its results
record one (``compile``, from ``macroarch.mvas.compile_stats()``), and the machine.

A seed offset (``seed_offset``) adds to every notebook's ``seed`` parameter and keeps its results apart, in
``out/seed<K>/<profile>/``: the same tree under another root, so the paper and every other reader work on it
with ``MACROARCH_OUT`` pointed there, and the offset-0 results (the ones the paper is built from) are never
replaced by a rerun's.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import fcntl
import json
import logging
import os
import platform
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
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
from macroarch.repro.progress import Board, Progress, engine
from macroarch.repro.tracking import (
    COMPLETE,
    EVIDENCE_ENV,
    FAILED,
    INTERRUPTED,
    merge_wandb_status,
    notebook_problem,
    read_result,
    result_path,
    wandb_status_path,
    write_json_atomic,
)

WANDB_WAIT_S = 30.0  # after a notebook, how long the runner waits for its runs' W&B processes (in total)
STOP_WAIT_S = 90.0  # after Ctrl-C, how long a worker may take to mark its claims and end its kernel
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # set to the cores a notebook is pinned to


class ProfileBusy(ConfigError):
    """Another process is reproducing this profile."""


class Interrupted(Exception):
    """Ctrl-C or SIGTERM: the notebooks that were running and how long each had run; ``signum`` is the signal
    (``signal.SIGINT`` for Ctrl-C, ``signal.SIGTERM``)."""

    def __init__(self, message: str = "", signum: int = signal.SIGINT) -> None:
        super().__init__(message)
        self.signum = signum


@contextlib.contextmanager
def sigterm_as_ctrl_c():
    """While inside: SIGTERM raises ``KeyboardInterrupt`` (in the main thread, where Python runs signal handlers),
    so a ``kill`` or a service manager stopping the run takes Ctrl-C's path; what leaves as an interrupt leaves
    as :class:`Interrupted` with ``signum`` SIGTERM. Elsewhere than the main thread it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        received.append(signum)
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    except Interrupted as e:
        if received:
            e.signum = signal.SIGTERM
        raise
    except KeyboardInterrupt:
        if received:
            raise Interrupted("", signal.SIGTERM) from None
        raise
    finally:
        signal.signal(signal.SIGTERM, old)


@dataclass
class JobOutcome:
    job: NotebookJob
    status: str  # "ok", "skipped", "failed", "interrupted"
    seconds: float = 0.0
    error: str = ""
    grades: dict[str, str] = field(default_factory=dict)
    wandb_errors: dict[str, str] = field(default_factory=dict)
    started_at: float = 0.0  # time.time() when papermill started, and when it ended
    finished_at: float = 0.0
    cores: tuple[int, ...] = ()  # what the notebook was pinned to (empty: not pinned, run in this process)

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
        try:
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps({"pid": os.getpid(), "started": _now(),
                                     "command": " ".join(["macroarch", *sys.argv[1:]])}).encode())
        except OSError as e:  # a full disk: nothing else could be written either; the one line names the lock
            os.close(fd)
            raise OSError(e.errno, e.strerror, str(self.path)) from None
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
    notebook and the package code, is what every claim's result file holds, and left a whole executed notebook
    that papermill recorded as ending cleanly (:func:`~macroarch.repro.tracking.notebook_problem`: a truncated
    or unfinished one, whatever its stamp says, is no evidence, so the notebook runs again)."""
    root, out = root or project_root(), out or out_root()
    stamp = _stamp_path(profile, job.stem, out)
    executed = out / profile / f"{job.stem}.ipynb"
    if not stamp.is_file() or not executed.is_file() or notebook_problem(executed, complete=True):
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

#: how often a notebook's kernel is started when it dies before answering (jupyter_client picks free ports per
#: kernel, and two kernels launched at once can race for one: seen once in four full test runs on 2 cores)
KERNEL_START_ATTEMPTS = 2


def kernel_never_started(error: BaseException) -> bool:
    """Whether papermill's ``error`` says the kernel died before it replied to ``kernel_info``: no cell ran."""
    return isinstance(error, RuntimeError) and "before replying to kernel_info" in str(error)


def execute(job: NotebookJob, profile: str, root: Path | None = None, out: Path | None = None,
            progress: Progress | None = None) -> JobOutcome:
    """Execute one notebook with papermill; never raises for a failure inside the notebook, nor for a file it
    could not write (the executed notebook, a result, the stamp: a failed outcome whose error names the file).
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
    started_at = time.time()
    t0 = time.perf_counter()
    env_before = os.environ.get(EVIDENCE_ENV)
    os.environ[EVIDENCE_ENV] = os.pathsep.join(str(p) for p in (final, failed))  # the kernel inherits it
    try:
        with _quiet_papermill():
            for attempt in range(1, KERNEL_START_ATTEMPTS + 1):
                try:
                    papermill.execute_notebook(
                        str(job.path), str(partial), parameters=job.papermill_parameters(profile, root),
                        kernel_name="python3", cwd=str(root), progress_bar=False, log_output=False,
                        execution_timeout=job.timeout, report_mode=False, engine_name=engine(progress),
                        # ipykernel logs to the terminal (unencrypted loopback, the interrupt at shutdown): the
                        # line says it
                        extra_arguments=["--IPKernelApp.log_level=CRITICAL"],
                    )
                    break
                except RuntimeError as e:
                    if attempt == KERNEL_START_ATTEMPTS or not kernel_never_started(e):
                        raise
                    time.sleep(1.0)  # a kernel that died before it answered ran no cell: start it again
    except KeyboardInterrupt:
        seconds = time.perf_counter() - t0
        with _no_sigint():
            _keep_failed(partial, failed)
            _mark_unfinished(job, profile, out, started, INTERRUPTED, "interrupted (Ctrl-C)")
        raise Interrupted(f"{job.stem} stopped after {format_duration(seconds)}") from None
    except Exception as e:  # a failing notebook is an outcome, not a crash of the batch
        seconds = time.perf_counter() - t0
        _keep_failed(partial, failed)
        message = _failure_message(e, partial)
        unwritten = _mark_unfinished(job, profile, out, started, FAILED, message)
        outcome = JobOutcome(job, "failed", seconds, "; ".join([message, *unwritten]))
    else:
        seconds = time.perf_counter() - t0
        os.replace(partial, final)
        outcome = JobOutcome(job, "ok", seconds)
        incomplete = [c for c in job.claims if _status(c, profile, out) != COMPLETE]
        if incomplete:
            # The notebook ran to the end but left claims without a complete result: that is a failure.
            outcome.status = "failed"
            outcome.error = f"notebook finished without a complete result for {', '.join(incomplete)}"
            outcome.error = "; ".join([outcome.error,
                                       *_mark_unfinished(job, profile, out, started, FAILED, outcome.error)])
    finally:
        if env_before is None:
            os.environ.pop(EVIDENCE_ENV, None)
        else:
            os.environ[EVIDENCE_ENV] = env_before
    outcome.started_at, outcome.finished_at = started_at, started_at + seconds
    outcome.wandb_errors = _settle_wandb(job, profile, out, started)
    outcome.grades = _grades(job, profile, out)
    if outcome.status == "ok":
        try:
            write_json_atomic(stamp, {"notebook": job.stem, "parameters": _jsonable(params),
                                      "claims": list(job.claims), "seed_offset": job.seed_offset, "finished": _now(),
                                      "seconds": round(seconds, 2)})
        except OSError as e:  # the results are complete, but without its stamp the next run cannot resume it
            outcome.status = "failed"
            outcome.error = f"{_io_text(e)} (its results are complete; the next run executes it again)"
    return outcome


def _io_text(e: OSError) -> str:
    """``cannot write <file>: No space left on device``: a write's error, naming the file where it is known."""
    return f"cannot write {e.filename}: {e.strerror}" if e.filename else f"{type(e).__name__}: {e.strerror or e}"


_WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG)


def _failure_message(e: BaseException, partial: Path) -> str:
    """The one line of a failed execution. An ``OSError`` out of papermill itself (not a cell's error, which
    papermill raises as its own exception type) that names no file and is a write error (full disk, quota,
    read-only) is papermill writing the executed notebook: the line names that file."""
    if isinstance(e, OSError) and not e.filename and e.errno in _WRITE_ERRNOS:
        return f"cannot write the executed notebook {partial}: {e.strerror}"
    if isinstance(e, OSError) and e.filename:
        return _io_text(e)
    return _short_error(e)


def _keep_failed(partial: Path, failed: Path) -> None:
    """A failed execution's notebook becomes ``failed`` where papermill left a whole file; a half-written one (a
    full disk) is removed: nothing half-written may look like evidence."""
    if not partial.exists():
        return
    if notebook_problem(partial, complete=False) is None:
        with contextlib.suppress(OSError):
            os.replace(partial, failed)
            return
    with contextlib.suppress(OSError):
        partial.unlink()


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
            try:
                write_json_atomic(path, r)
            except OSError as e:  # the result stays as the kernel wrote it; W&B's outcome is the loss
                errors[claim] = f"its final state not recorded ({_io_text(e)})"
                continue
        if r["wandb"].get("error"):
            errors[claim] = r["wandb"]["error"]
    return errors


def _ran_since(r: dict, started: _dt.datetime) -> bool:
    """Whether result ``r`` was started by the execution that started at ``started`` (or later)."""
    try:
        return bool(r.get("started")) and _dt.datetime.fromisoformat(r["started"]) >= started.replace(microsecond=0)
    except (TypeError, ValueError):  # not a time: not this execution's
        return False


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
                     message: str) -> list[str]:
    """Mark every claim of ``job`` that this execution did not finish as ``status``; returns one line for each
    result that could not be written (a full disk), naming the file, and never raises for it.

    A result this execution wrote (started since ``started``) keeps what it measured. Any other (an earlier
    run's, or none, or an unreadable file) is replaced by a fresh record of this execution: ``started`` is this
    execution's, and nothing of the earlier run is carried as if this one had produced it (no verdict, metrics,
    figures or W&B run); ``previous`` says which run it was (started, finished, status, commit)."""
    unwritten = []
    for claim in job.claims:
        path = result_path(claim, profile, out)
        try:
            r = read_result(path)
        except (OSError, ValueError):
            r = None
        if r is not None and _ran_since(r, started) and r.get("status") in (COMPLETE, FAILED):
            continue
        if r is None or not _ran_since(r, started):
            previous = None if r is None else {k: r.get(k) for k in ("started", "finished", "status", "git_commit")}
            r = {"schema": 1, "claim": claim, "profile": profile, "notebook": job.stem,
                 "started": started.isoformat(timespec="seconds"), "finished": None, "config": {}, "metrics": {},
                 "series": {}, "figures": [], "verdict": None, "wandb": None, "previous": previous}
        r["status"] = status
        r["error"] = {"type": "NotebookInterrupted" if status == INTERRUPTED else "NotebookFailed",
                      "message": f"{job.stem}: {message}", "traceback": ""}
        r["finished"] = _now()
        try:
            write_json_atomic(path, r)
        except OSError as e:
            unwritten.append(f"{claim} not marked {status}: {_io_text(e)}")
    return unwritten


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
    """While an interrupt is being handled (claims marked, workers stopped), a second Ctrl-C or SIGTERM is
    ignored: it would leave the claims unmarked and the workers behind."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


# --- the schedule: which notebooks share the machine, on which cores ---------------------------------------

@dataclass(frozen=True)
class Task:
    """A notebook as the schedule sees it: the cores it computes on (its ``threads``), whether it runs alone."""

    stem: str
    threads: int = 1
    exclusive: bool = False


def usable_cores() -> tuple[int, ...]:
    """The cores this process may run on (``os.sched_getaffinity``: a container's or ``taskset``'s limit)."""
    return tuple(sorted(os.sched_getaffinity(0)))


def plan(tasks: Sequence[Task]) -> list[Task]:
    """The order notebooks start in: the exclusive ones first (each alone, while every core is free anyway:
    placed later, one would wait with cores idle for the longest running neighbour), then the rest, each group
    in the profile's order."""
    return [t for t in tasks if t.exclusive] + [t for t in tasks if not t.exclusive]


def default_jobs(tasks: Sequence[Task], cores: int) -> int:
    """How many of ``tasks`` can run side by side on ``cores`` cores, each on its own ``threads`` cores (the
    most that fit, counting the smallest first); 1 when only exclusive ones are left."""
    count = used = 0
    for need in sorted(min(t.threads, cores) for t in tasks if not t.exclusive):
        if used + need > cores:
            break
        used += need
        count += 1
    return max(1, count)


class Schedule:
    """Starts ``tasks`` strictly in the given order (:func:`plan`'s), each once ``jobs`` allows another and its
    cores are free: an exclusive task takes every core and waits for all others to end, a task needing more
    cores than there are gets all of them. The lowest-numbered free cores go first, so that a run is the same
    every time it is made with the same durations."""

    def __init__(self, tasks: Sequence[Task], cores: Sequence[int], jobs: int) -> None:
        if jobs < 1:
            raise ConfigError(f"--jobs must be at least 1, got {jobs}")
        if not cores:
            raise ConfigError("this process may run on no CPU core (os.sched_getaffinity is empty)")
        self.cores, self.jobs = tuple(sorted(cores)), jobs
        self._queue = list(tasks)
        self._free = list(self.cores)
        self._running: dict[str, tuple[Task, tuple[int, ...]]] = {}

    def need(self, task: Task) -> int:
        return len(self.cores) if task.exclusive else min(task.threads, len(self.cores))

    def start_next(self) -> tuple[Task, tuple[int, ...]] | None:
        """The next task and the cores it is pinned to, if it can start now (then it counts as running)."""
        if not self._queue:
            return None
        task = self._queue[0]
        alone = task.exclusive or any(t.exclusive for t, _ in self._running.values())
        if (alone and self._running) or len(self._running) >= self.jobs or len(self._free) < self.need(task):
            return None
        self._queue.pop(0)
        cores, self._free = tuple(self._free[:self.need(task)]), self._free[self.need(task):]
        self._running[task.stem] = (task, cores)
        return task, cores

    def finish(self, stem: str) -> None:
        _, cores = self._running.pop(stem)
        self._free = sorted(self._free + list(cores))

    @property
    def done(self) -> bool:
        return not self._queue and not self._running


def _task(job: NotebookJob, profile: str, root: Path) -> Task:
    return Task(job.stem, job.threads(profile, root), job.exclusive)


def results_root(seed_offset: int = 0, out: Path | None = None) -> Path:
    """Where a run with ``seed_offset`` keeps its results: ``out`` itself for 0, else ``out/seed<K>``, the same
    tree (``<profile>/<claim>/result.json``) under a root of its own."""
    out = out or out_root()
    return out if seed_offset == 0 else out / f"seed{seed_offset}"


# --- a notebook in a worker process, pinned ---------------------------------------------------------------

def _worker_main() -> None:
    """A worker: ``python -c 'from macroarch.repro.runner import _worker_main; _worker_main()' SPEC``. Pins itself
    (its kernel inherits the affinity), runs :func:`execute` and reports on the file descriptor the runner gave
    it, one JSON line per event. Ctrl-C is the runner's to decide: SIGINT is ignored and SIGTERM interrupts."""
    spec = json.loads(sys.argv[1])
    os.sched_setaffinity(0, spec["cores"])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    channel = os.fdopen(spec["fd"], "w", buffering=1)
    lock = threading.Lock()

    def send(event: str, **data: Any) -> None:
        with lock, contextlib.suppress(OSError, ValueError):  # the runner is gone: nobody to tell
            channel.write(json.dumps({"event": event, **data}) + "\n")

    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    profile, root, out = spec["profile"], Path(spec["root"]), Path(spec["out"])
    started, t0, job = _dt.datetime.now(_dt.UTC), time.perf_counter(), None
    try:
        job = load_job(profile, spec["stem"], root)
        if job is None:
            raise ConfigError(f"{spec['stem']} is not in papermill_runs/{profile}.yaml any more")
        job = job.with_seed_offset(spec["seed_offset"])
        o = execute(job, profile, root, out, progress=lambda done, total, _s: send("cells", done=done, total=total))
    except Interrupted as e:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM (the runner's and a group kill's) is moot
        send("interrupted", message=str(e))
        _quiet()
        return
    except KeyboardInterrupt:  # before papermill started, or after it ended: what it finished stays
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if job is not None:
            _mark_unfinished(job, profile, out, started, INTERRUPTED, "interrupted (Ctrl-C)")
        send("interrupted", message=f"{spec['stem']} stopped after {format_duration(time.perf_counter() - t0)}")
        _quiet()
        return
    except Exception as e:  # the runner's side of the worker failed (a full disk): an outcome, not a traceback
        message = _io_text(e) if isinstance(e, OSError) else _short_error(e)
        if job is not None:
            message = "; ".join([message, *_mark_unfinished(job, profile, out, started, FAILED, message)])
        seconds = time.perf_counter() - t0
        send("outcome", status="failed", seconds=seconds, error=message, grades={}, wandb_errors={},
             started_at=time.time() - seconds, finished_at=time.time())
        return
    send("outcome", status=o.status, seconds=o.seconds, error=o.error, grades=o.grades,
         wandb_errors=o.wandb_errors, started_at=o.started_at, finished_at=o.finished_at)


def _quiet() -> None:
    """After Ctrl-C the runner's one line says it all: nothing of the kernel's shutdown (asyncio's "Task exception
    was never retrieved" as the interpreter exits) may reach the terminal."""
    sys.stderr.flush()
    sys.stderr = open(os.devnull, "w")  # noqa: SIM115 (kept open until the interpreter exits)


def _watch_parent(ppid: int) -> None:
    """A worker whose runner died (killed without its process group) stops as if interrupted."""
    while os.getppid() == ppid:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)


@dataclass
class _Worker:
    job: NotebookJob
    cores: tuple[int, ...]
    proc: subprocess.Popen
    spawned: _dt.datetime
    spawned_at: float
    outcome: JobOutcome | None = None
    stopped: str = ""  # the worker's "stopped after" line, after an interrupt


def _spawn(job: NotebookJob, cores: tuple[int, ...], profile: str, root: Path, out: Path,
           events: queue.Queue) -> _Worker:
    read_fd, write_fd = os.pipe()
    spec = {"stem": job.stem, "profile": profile, "root": str(root), "out": str(out), "cores": list(cores),
            "seed_offset": job.seed_offset, "fd": write_fd}
    env = {**os.environ, **{v: str(len(cores)) for v in THREAD_VARIABLES}, "MACROARCH_OUT": str(out)}
    spawned = _dt.datetime.now(_dt.UTC)
    try:
        proc = subprocess.Popen([sys.executable, "-c", "from macroarch.repro.runner import _worker_main; "
                                 "_worker_main()", json.dumps(spec)], env=env, pass_fds=(write_fd,))
    finally:
        os.close(write_fd)
    worker = _Worker(job, cores, proc, spawned, time.time())
    threading.Thread(target=_read_events, args=(job.stem, read_fd, events), daemon=True).start()
    return worker


def _read_events(stem: str, fd: int, events: queue.Queue) -> None:
    with os.fdopen(fd, "r") as f:
        for line in f:
            with contextlib.suppress(ValueError):
                events.put((stem, json.loads(line)))
    events.put((stem, None))  # the worker ended


def _next_event(events: queue.Queue) -> tuple[str, dict | None]:
    while True:  # a short timeout: Ctrl-C reaches the main thread between waits
        with contextlib.suppress(queue.Empty):
            return events.get(timeout=0.5)


def _ended(w: _Worker, profile: str, out: Path) -> JobOutcome:
    """The outcome of a worker that has ended: what it reported, or a failure if it reported nothing."""
    rc = w.proc.wait()
    if w.outcome is not None:
        return w.outcome
    seconds = time.time() - w.spawned_at
    message = f"the runner's worker process ended with status {rc} before reporting"
    message = "; ".join([message, *_mark_unfinished(w.job, profile, out, w.spawned, FAILED, message)])
    return JobOutcome(w.job, "failed", seconds, message, grades=_grades(w.job, profile, out),
                      started_at=w.spawned_at, finished_at=time.time(), cores=w.cores)


def _outcome_of(w: _Worker, msg: dict) -> JobOutcome:
    return JobOutcome(w.job, msg["status"], msg["seconds"], msg["error"], msg["grades"], msg["wandb_errors"],
                      msg["started_at"], msg["finished_at"], w.cores)


# --- timings.json: where the run's time went ----------------------------------------------------------------

def machine() -> dict[str, Any]:
    """The machine of a run, for ``timings.json``: CPU model, cores, vector ISA, Python, torch."""
    import torch

    from macroarch.measure.machine import cpu_capability, cpu_model

    return {"cpu_model": cpu_model(), "cpu_count": os.cpu_count(), "usable_cores": list(usable_cores()),
            "cpu_capability": cpu_capability(), "python": platform.python_version(), "torch": torch.__version__}


def _compile_record(o: JobOutcome, profile: str, out: Path) -> dict[str, float] | None:
    """The compile time and kernels compiled in a notebook's kernel process, from the ``compile`` of the results
    this execution wrote (``macroarch.mvas.compile_stats()`` at each run's end: counts since the process started,
    so the largest is the notebook's); None where none records one."""
    started = _dt.datetime.fromtimestamp(o.started_at, _dt.UTC)
    found = []
    for claim in o.job.claims:
        with contextlib.suppress(OSError, ValueError):
            r = read_result(result_path(claim, profile, out))
            if _ran_since(r, started) and isinstance(r.get("compile"), dict):
                found.append(r["compile"])
    if not found:
        return None
    return {"compile_seconds": round(max(float(c.get("compile_seconds") or 0.0) for c in found), 3),
            "compiles": max(int(c.get("compiles") or 0) for c in found)}


class _Timings:
    """``out/<profile>/timings.json``, rewritten (atomically) whenever a notebook starts or ends."""

    def __init__(self, profile: str, out: Path, jobs: int, cores: Sequence[int], seed_offset: int) -> None:
        self.path = out / profile / "timings.json"
        try:
            earlier = json.loads(self.path.read_text()).get("notebooks") or {}
        except (OSError, ValueError, AttributeError):
            earlier = {}
        self.earlier = earlier if isinstance(earlier, dict) else {}
        self.profile, self.out, self.jobs, self.cores, self.seed_offset = profile, out, jobs, list(cores), seed_offset
        self.t0, self.started = time.time(), _now()
        self.machine = machine()
        self.entries: dict[str, dict[str, Any]] = {}
        self.unwritten = ""  # why the last write of timings.json failed ("" when it did not)

    def skipped(self, job: NotebookJob) -> None:
        entry: dict[str, Any] = {"status": "skipped", "claims": list(job.claims)}
        before = self.earlier.get(job.stem)
        if isinstance(before, dict):  # what it took when it last ran, so a resumed run still accounts for it
            before = before.get("earlier") if before.get("status") == "skipped" else before
        if isinstance(before, dict):
            entry["earlier"] = before
        self.entries[job.stem] = entry

    def running(self, w: _Worker, threads: int) -> None:
        self.entries[w.job.stem] = {"status": "running", "claims": list(w.job.claims), "cores": list(w.cores),
                                    "threads": threads, "exclusive": w.job.exclusive, "_start": w.spawned_at}
        self.write("running")

    def ended(self, o: JobOutcome) -> None:
        entry = self.entries.setdefault(o.job.stem, {"claims": list(o.job.claims), "cores": list(o.cores),
                                                     "exclusive": o.job.exclusive})
        entry.update(status=o.status, seconds=round(o.seconds, 2), budget_seconds=o.job.budget,
                     _start=o.started_at, _end=o.finished_at, compile=_compile_record(o, self.profile, self.out))

    def beside(self, stem: str) -> list[str]:
        """The notebooks whose time overlapped ``stem``'s in this run (running ones up to now)."""
        now = time.time()
        me = self.entries[stem]
        if "_start" not in me:
            return []
        a0, a1 = me["_start"], me.get("_end", now)
        return [other for other, e in self.entries.items()
                if other != stem and "_start" in e and e["_start"] < a1 and a0 < e.get("_end", now)]

    def write(self, status: str) -> dict[str, Any]:
        notebooks = {}
        for stem, e in self.entries.items():
            entry = {k: v for k, v in e.items() if not k.startswith("_")}
            if "_start" in e:
                entry["started"] = _iso(e["_start"])
                entry["finished"] = _iso(e["_end"]) if "_end" in e else None
                entry["start_s"] = round(e["_start"] - self.t0, 3)  # seconds since the run started
                entry["end_s"] = round(e["_end"] - self.t0, 3) if "_end" in e else None
                entry["beside"] = self.beside(stem)
            notebooks[stem] = entry
        ran = [e.get("compile") for e in notebooks.values() if e.get("status") not in ("skipped", "running")]
        recorded = [c for c in ran if c]
        data = {
            "schema": 1, "profile": self.profile, "seed_offset": self.seed_offset, "status": status,
            "started": self.started, "finished": None if status == "running" else _now(),
            "wall_seconds": round(time.time() - self.t0, 2), "jobs": self.jobs, "cores": self.cores,
            "machine": self.machine,
            "compile": {"compile_seconds": round(sum(c["compile_seconds"] for c in recorded), 3),
                        "compiles": sum(c["compiles"] for c in recorded), "notebooks_recorded": len(recorded),
                        "notebooks_without_record": len(ran) - len(recorded)} if recorded else None,
            "notebooks": notebooks,
        }
        try:
            write_json_atomic(self.path, data)
        except OSError as e:  # an account of the time, not an outcome: the notebooks go on without it
            self.unwritten = _io_text(e)
        else:
            self.unwritten = ""
        return data


def _iso(t: float) -> str:
    return _dt.datetime.fromtimestamp(t, _dt.UTC).isoformat(timespec="milliseconds")


def timings_summary(data: dict[str, Any], path: Path) -> str:
    """The summary's last line: wall time, jobs and cores, the machine, compile time where recorded."""
    m = data["machine"]
    cores = data["cores"]
    text = (f"wall {format_duration(data['wall_seconds'])} with --jobs {data['jobs']} on "
            f"{len(cores)} core{'s' if len(cores) != 1 else ''} of {m['cpu_model']} ({m['cpu_capability']}, "
            f"torch {m['torch']})")
    c = data.get("compile")
    if c:
        text += (f"; compiling {format_duration(c['compile_seconds'])} for {c['compiles']} kernel(s) in "
                 f"{c['notebooks_recorded']} notebook(s)")
        if c["notebooks_without_record"]:
            text += f" ({c['notebooks_without_record']} without a compile record)"
    elif any(e.get("status") not in ("skipped",) for e in data["notebooks"].values()):
        text += "; compile time not recorded (no result has 'compile')"
    return f"{text}; timings in {path}"


# --- a whole profile ----------------------------------------------------------------------------------------

def reproduce(profile: str = "cpu", *, only: str | None = None, force: bool = False, jobs: int | None = None,
              seed_offset: int = 0, root: Path | None = None, out: Path | None = None, echo: Callable[..., Any] = print,
              stream: Any = None) -> list[JobOutcome]:
    """Run a profile's notebooks (validated first, under the profile's lock), up to ``jobs`` at once (default:
    :func:`default_jobs`), a live line for each running one, then a summary table; returns the outcomes in the
    order of :func:`plan`. ``seed_offset`` (0 or more) adds to every ``seed`` parameter and keeps the results in
    :func:`results_root`. Raises :class:`ConfigError` for a bad profile, ``jobs`` or ``seed_offset``,
    :class:`ProfileBusy` if another run holds the profile, :class:`Interrupted` on Ctrl-C or SIGTERM (every
    running notebook's claims are marked interrupted and the next run resumes there; ``signum`` says which), an
    ``OSError`` naming the lock file if even that cannot be written. Other failed writes fail only the notebook
    that needed them (see the module docstring)."""
    if isinstance(seed_offset, bool) or not isinstance(seed_offset, int) or seed_offset < 0:
        raise ConfigError(f"--seed-offset must be a whole number, 0 or more; got {seed_offset!r}")
    root = root or project_root()
    out = results_root(seed_offset, out)
    jobs_list = [j.with_seed_offset(seed_offset) for j in select(load_profile(profile, root), only)]
    tasks = {j.stem: _task(j, profile, root) for j in jobs_list}
    cores = usable_cores()
    if jobs is None:
        jobs = default_jobs(list(tasks.values()), len(cores))
    elif jobs < 1:
        raise ConfigError(f"--jobs must be at least 1, got {jobs}")
    elif jobs > len(cores):
        raise ConfigError(f"--jobs {jobs}: this process may run on {len(cores)} core(s) (os.sched_getaffinity) and "
                          f"each notebook is pinned to cores of its own; use --jobs {len(cores)} or fewer")
    order = plan([tasks[j.stem] for j in jobs_list])
    by_stem = {j.stem: j for j in jobs_list}
    planned = [by_stem[t.stem] for t in order]
    stream = stream if stream is not None else sys.stdout
    width = max(len(j.stem) for j in planned)
    heads = {j.stem: f"[{i}/{len(planned)}] {j.stem:<{width}} ({', '.join(j.claims) or 'no claims'})"
             for i, j in enumerate(planned, 1)}
    with sigterm_as_ctrl_c(), ProfileLock(profile, out):
        if seed_offset:
            echo(f"seed offset {seed_offset}: results in {out / profile}", flush=True)
            for j in planned:
                if not j.has_seed(profile, root):
                    echo(f"  note: {j.stem} has no 'seed' parameter; it runs with its own seeds", flush=True)
        timings = _Timings(profile, out, jobs, cores, seed_offset)
        outcomes: dict[str, JobOutcome] = {}
        todo = []
        for job in planned:
            if not force and is_fresh(job, profile, root, out):
                outcomes[job.stem] = JobOutcome(job, "skipped", grades=_grades(job, profile, out))
                timings.skipped(job)
                echo(f"{heads[job.stem]} skipped: up to date ({_grade_text(outcomes[job.stem])})", flush=True)
            else:
                todo.append(job)
        with Board(stream, echo) as board:
            _run(todo, tasks, profile, root, out, Schedule([tasks[j.stem] for j in todo], cores, jobs), heads,
                 board, timings, outcomes)
        data = timings.write("complete")
        ordered = [outcomes[j.stem] for j in planned]
        echo(summary_table(ordered, profile), flush=True)
        echo(timings_summary(data, timings.path), flush=True)
        if timings.unwritten:
            echo(f"warning: timings not recorded: {timings.unwritten}", flush=True)
    return ordered


def _run(todo: Sequence[NotebookJob], tasks: dict[str, Task], profile: str, root: Path, out: Path,
         schedule: Schedule, heads: dict[str, str], board: Board, timings: _Timings,
         outcomes: dict[str, JobOutcome]) -> None:
    by_stem = {j.stem: j for j in todo}
    running: dict[str, _Worker] = {}
    events: queue.Queue = queue.Queue()
    stopping = False

    def ended(w: _Worker) -> None:
        o = _ended(w, profile, out)
        outcomes[w.job.stem] = o
        del running[w.job.stem]
        schedule.finish(w.job.stem)
        board.remove(w.job.stem)
        timings.ended(o)
        timings.write("running")
        if o.status == "interrupted" and stopping:
            return  # Ctrl-C: the one line of the interrupt says it
        board.print(f"{heads[o.job.stem]} {outcome_text(o)}")
        if o.over_budget:
            board.print(f"  warning: {o.job.stem} took {format_duration(o.seconds)}, over its budget of "
                        f"{format_duration(o.job.budget)} in papermill_runs/{profile}.yaml: this machine is slower "
                        f"than the profile expects (see the machine in its result.json config)")

    try:
        while not schedule.done:
            while (started := schedule.start_next()) is not None:
                task, cores = started
                w = running[task.stem] = _spawn(by_stem[task.stem], cores, profile, root, out, events)
                board.add(task.stem, heads[task.stem], f"core{'s' if len(cores) > 1 else ''} "
                          f"{','.join(map(str, cores))}")
                timings.running(w, task.threads)
            stem, msg = _next_event(events)
            w = running[stem]
            if msg is None:
                ended(w)
            elif msg["event"] == "cells":
                board.update(stem, msg["done"], msg["total"])
            elif msg["event"] == "outcome":
                w.outcome = _outcome_of(w, msg)
            elif msg["event"] == "interrupted":  # stopped from outside (the runner alone would have said so)
                w.stopped = msg["message"]
                w.outcome = JobOutcome(w.job, "interrupted", time.time() - w.spawned_at, msg["message"],
                                       grades=_grades(w.job, profile, out), started_at=w.spawned_at,
                                       finished_at=time.time(), cores=w.cores)
    except KeyboardInterrupt:
        stopping = True
        with _no_sigint():
            stopped = _stop_all(running, events, profile, out, ended)
            timings.write("interrupted")
        raise Interrupted(", ".join(stopped)) from None
    except Exception:  # the runner's own fault: no worker is left behind it
        stopping = True
        with _no_sigint():
            _stop_all(running, events, profile, out, ended)
        raise


def _stop_all(running: dict[str, _Worker], events: queue.Queue, profile: str, out: Path,
              ended: Callable[[_Worker], None]) -> list[str]:
    """Interrupt every running worker and wait for each to end (killed after :data:`STOP_WAIT_S`); returns each
    interrupted notebook's "stopped after" line, in the order they started."""
    workers = list(running.values())
    for w in workers:
        with contextlib.suppress(ProcessLookupError):
            w.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_WAIT_S
    while running and time.monotonic() < deadline:
        with contextlib.suppress(queue.Empty):
            stem, msg = events.get(timeout=0.5)
            w = running.get(stem)
            if w is None:
                continue
            if msg is None:
                if w.outcome is None:  # ended without a word: its claims are marked here
                    _interrupted_here(w, profile, out)
                ended(w)
            elif msg["event"] == "outcome":
                w.outcome = _outcome_of(w, msg)
            elif msg["event"] == "interrupted":
                w.stopped = msg["message"]
                w.outcome = JobOutcome(w.job, "interrupted", time.time() - w.spawned_at, msg["message"],
                                       started_at=w.spawned_at, finished_at=time.time(), cores=w.cores)
    for w in list(running.values()):  # did not end in time: killed, its claims marked here
        w.proc.kill()
        _interrupted_here(w, profile, out)
        ended(w)
    return [w.stopped for w in workers if w.stopped]


def _interrupted_here(w: _Worker, profile: str, out: Path) -> None:
    w.stopped = f"{w.job.stem} stopped after {format_duration(time.time() - w.spawned_at)}"
    _mark_unfinished(w.job, profile, out, w.spawned, INTERRUPTED, "interrupted (Ctrl-C)")
    w.outcome = JobOutcome(w.job, "interrupted", time.time() - w.spawned_at, w.stopped,
                           started_at=w.spawned_at, finished_at=time.time(), cores=w.cores)


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
__all__ = ["NotebookJob", "JobOutcome", "ProfileBusy", "ProfileLock", "Interrupted", "Task", "Schedule", "load_profile",
           "load_job", "select", "is_fresh", "execute", "reproduce", "plan", "default_jobs", "usable_cores",
           "results_root", "machine", "summary_table", "timings_summary", "outcome_text", "parse_duration",
           "format_duration"]
