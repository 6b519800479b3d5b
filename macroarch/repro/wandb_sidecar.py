"""W&B in a process of its own: a run's W&B failures can never reach the notebook that measures.

Why a second process
--------------------
``wandb.init`` in the notebook's kernel installs an import hook (``wandb.sdk.lib.import_hooks``: a finder
at the front of ``sys.meta_path`` that reports imported ML libraries as telemetry) and talks to the
``wandb-core`` service through a socket. When that service dies mid-run, ``finish()`` fails before it
removes the hook, and every later ``import transformers`` in the kernel raises ``ConnectionResetError``:
a W&B fault fails the experiment. Console capture (wandb wraps ``sys.stdout.write``) has the same failure
mode, and an unreachable server blocks ``wandb.init`` for its 90 s ``init_timeout``. Tearing the hook down
after the fact would fix one symptom of wandb 0.31's internals; instead the kernel never imports wandb.

How it works
------------
``tracking.start_run`` starts ``python -m macroarch.repro.wandb_sidecar STATUS`` and sends it JSON lines
(``init``, ``log``, ``summary``, ``image``, ``table``, ``console``, ``finish``) through a pipe, from a
background thread: a notebook call only appends to a queue, so a slow or hung W&B never blocks it. The
sidecar owns the W&B run: system metrics are sampled for the kernel's pid, the kernel's console (tee'd by
``tracking``) is written to the sidecar's stdout, which wandb captures. At ``finish`` it logs the run's
evidence as an artifact (``result.json``, the figures and, under the runner, the executed notebook, which
exists only once papermill has written it after the kernel ended: the sidecar waits for it), then finishes.

The sidecar reports its state in ``STATUS`` (``<claim dir>/wandb.json``, replaced whole): ``starting``,
``running``, ``finished`` or ``failed`` with the error. Any exception in a W&B call ends W&B for that run
(recorded there); the measurement goes on without it. A watchdog ends the sidecar if W&B hangs.

Names in W&B (result.json keeps the plain names; :func:`metric_key` / :func:`plain_name` map between them):
metrics ``<claim>/<kind>/<name>`` (kind from the name: bytes, speed, quality, gradients, value), series
``<claim>/series/<name>`` against ``step``, figures ``<claim>/figures/<name>``, tables
``<claim>/tables/<name>``, the verdict as the one-row table ``<claim>/verdict`` and as the summary's
``verdict`` mapping; ``status`` and ``error`` in the summary.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

STARTING, RUNNING, FINISHED, FAILED = "starting", "running", "finished", "failed"
FINAL_STATES = (FINISHED, FAILED)

METRIC_KINDS = ("bytes", "speed", "quality", "gradients", "value")
_KIND_WORDS = {
    "bytes": {"bytes", "byte", "gb", "tb", "mb", "mib", "gib", "memory", "mem"},
    "speed": {"speed", "speedup", "seconds", "s", "ms", "us", "time", "throughput", "tflops", "latency"},
    "quality": {"loss", "accuracy", "acc", "gap", "perplexity", "ppl", "quality"},
    "gradients": {"grad", "grads", "gradient", "gradients", "variance", "norm", "gain", "clipped", "clip",
                  "rate", "lr"},
}
ARTIFACT_TYPE = "evidence"


def metric_kind(name: str) -> str:
    """The panel a metric belongs to in W&B, from the words of its name (``peak_bytes`` -> ``bytes``)."""
    words = set(name.lower().split("_"))
    for kind in METRIC_KINDS[:-1]:
        if words & _KIND_WORDS[kind]:
            return kind
    return "value"


def metric_key(claim: str, name: str) -> str:
    """``C4``, ``post_accounting_bytes`` -> ``C4/bytes/post_accounting_bytes``."""
    return f"{claim}/{metric_kind(name)}/{name}"


def plain_name(claim: str, key: str) -> str | None:
    """The result.json name of a W&B metric key of ``claim``; ``None`` for any other key."""
    parts = key.split("/", 2)
    if len(parts) == 3 and parts[0] == claim and parts[1] in METRIC_KINDS:
        return parts[2]
    return None


def artifact_name(claim: str, profile: str) -> str:
    return f"evidence-{claim}-{profile}"


def read_status(path: Path) -> dict[str, Any]:
    """The sidecar's last reported state (``{}`` when it has written none yet)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def wait_status(path: Path, timeout: float) -> dict[str, Any]:
    """Poll ``path`` until the sidecar reports a final state or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        status = read_status(path)
        if status.get("state") in FINAL_STATES or time.monotonic() >= deadline:
            return status
        time.sleep(0.05)


# --- the kernel's side --------------------------------------------------------------------------------

class Sidecar:
    """The kernel's handle on one run's W&B process. ``send`` never blocks and never raises."""

    def __init__(self, status_path: Path, init: Mapping[str, Any], *, linger_s: float = 0.0) -> None:
        self.status_path = Path(status_path)
        self.error: str | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        with contextlib.suppress(FileNotFoundError):
            self.status_path.unlink()
        log = (self.status_path.parent / ".wandb-sidecar.log").open("wb")
        try:
            # A session of its own: Ctrl-C in the terminal stops the runner, not the run's W&B bookkeeping.
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "macroarch.repro.wandb_sidecar", str(self.status_path)],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True,
                env={**os.environ, "WANDB_SILENT": "true"})
        finally:
            log.close()
        self.send("init", init=dict(init), watch_pid=os.getpid(), linger_s=linger_s)
        self._writer = threading.Thread(target=self._write, name="wandb-sidecar-writer", daemon=True)
        self._writer.start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def send(self, op: str, **payload: Any) -> None:
        if not self._closed:
            self._queue.put({"op": op, **payload})

    def _write(self) -> None:
        pipe = self._proc.stdin
        try:
            while True:
                msg = self._queue.get()
                if msg is None:
                    break
                pipe.write(json.dumps(msg, default=_plain).encode() + b"\n")
                pipe.flush()
        except Exception as e:  # the sidecar died: its status file says why; stop feeding it
            self.error = f"W&B process gone: {type(e).__name__}: {e}"
        finally:
            with contextlib.suppress(Exception):
                pipe.close()

    def finish(self, **payload: Any) -> None:
        """Send ``finish`` and close the pipe; the sidecar completes on its own."""
        if self._closed:
            return
        self.send("finish", **payload)
        self._closed = True
        self._queue.put(None)

    def wait(self, timeout: float) -> dict[str, Any]:
        """The sidecar's status once final, or as it stands after ``timeout`` seconds."""
        status = wait_status(self.status_path, timeout)
        if status.get("state") not in FINAL_STATES and self._proc.poll() is not None:
            status = {**status, "state": FAILED,
                      "error": status.get("error") or f"W&B process exited with status {self._proc.returncode}"}
        return status


def _plain(obj: Any) -> Any:
    if hasattr(obj, "item") and callable(obj.item):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    return str(obj)


# --- the sidecar process --------------------------------------------------------------------------------

_HANG_S = 60.0  # a W&B call that takes longer than this after the run ended is a hang: give up


class _Worker:
    def __init__(self, status_path: Path) -> None:
        self.status_path = status_path
        self.status: dict[str, Any] = {"state": STARTING, "pid": os.getpid(), "mode": None, "id": None,
                                       "dir": None, "error": None, "artifact": None}
        self.run = None
        self.claim = ""
        self.watch_pid = 0
        self.linger_s = 0.0
        self.started = time.time()
        self.deadline: float | None = None
        self._report()

    def _report(self, **changes: Any) -> None:
        self.status.update(changes)
        tmp = self.status_path.with_name(f".{self.status_path.name}.{os.getpid()}.partial")
        with contextlib.suppress(OSError):
            tmp.write_text(json.dumps(self.status, indent=2) + "\n", encoding="utf-8")
            os.chmod(tmp, 0o644)
            os.replace(tmp, self.status_path)

    def _watchdog(self) -> None:
        while True:
            time.sleep(0.5)
            if self.deadline is not None and time.monotonic() > self.deadline:
                self._report(state=FAILED, error=self.status.get("error") or "W&B did not finish in time (hung)")
                os._exit(1)

    def serve(self, stream) -> None:
        threading.Thread(target=self._watchdog, daemon=True).start()
        finished = False
        for line in stream:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            op = msg.pop("op", "")
            if self.status["state"] == FAILED:
                continue  # W&B is gone for this run; drain the pipe so the kernel never blocks
            try:
                if op == "finish":
                    finished = True
                    self._finish(**msg)
                    return
                getattr(self, f"_op_{op}")(**msg)
            except Exception as e:
                self._fail(op, e)
        if not finished and self.status["state"] != FAILED:  # the kernel died without finishing the run
            self.deadline = time.monotonic() + _HANG_S
            try:
                self._finish_wandb(exit_code=1, summary={"status": "interrupted"})
                self._report(state=FINISHED, error="the measuring process ended without finishing the run")
            except Exception as e:
                self._fail("finish", e)

    def _fail(self, op: str, e: BaseException) -> None:
        first = (str(e).strip().splitlines() or [""])[0]
        self._report(state=FAILED, error=f"wandb {op} failed: {type(e).__name__}: {first}".strip())
        # Leave wandb-core to notice that its client is gone; never wait on a broken service here.
        self.run = None

    # --- operations ---

    def _op_init(self, init: dict, watch_pid: int, linger_s: float) -> None:
        import wandb

        self.claim, self.watch_pid, self.linger_s = init.get("config", {}).get("claim", ""), watch_pid, linger_s
        mode = init.pop("mode")
        self._report(mode=mode, id=init.get("id"))
        settings = wandb.Settings(silent=True, console="wrap_raw", x_stats_pid=watch_pid, disable_code=True,
                                  disable_job_creation=True, init_timeout=float(os.environ.get(
                                      "MACROARCH_WANDB_INIT_TIMEOUT", 15)))
        self.run = wandb.init(mode=mode, reinit="create_new", settings=settings, **init)
        self.run.define_metric(f"{self.claim}/series/*", step_metric="step")
        self._report(state=RUNNING, id=self.run.id, dir=str(Path(self.run.dir).parent))

    def _op_log(self, row: dict) -> None:
        self.run.log(row)

    def _op_summary(self, values: dict) -> None:
        self.run.summary.update(values)

    def _op_image(self, key: str, path: str) -> None:
        import wandb

        self.run.log({key: wandb.Image(path)})

    def _op_table(self, key: str, columns: list, rows: list) -> None:
        import wandb

        self.run.log({key: wandb.Table(columns=columns, data=rows)})

    def _op_bar(self, key: str, columns: list, rows: list, label: str, value: str, title: str) -> None:
        import wandb

        self.run.log({key: wandb.plot.bar(wandb.Table(columns=columns, data=rows), label, value, title=title)})

    def _op_console(self, stream: str, text: str) -> None:
        (sys.stderr if stream == "stderr" else sys.stdout).write(text)

    def _finish(self, exit_code: int, summary: dict, evidence: dict, linger: list[str], profile: str) -> None:
        self.deadline = time.monotonic() + self.linger_s + _HANG_S
        if self.run is None:
            return
        self.run.summary.update(summary)
        notebook = self._await_notebook(linger)
        files = dict(evidence)
        if notebook is not None:
            files[notebook.name] = str(notebook)
        self._log_evidence(files, profile, summary)
        self._finish_wandb(exit_code=exit_code, summary={})
        self._report(state=FINISHED, artifact=artifact_name(self.claim, profile),
                     evidence=sorted(files), notebook=notebook.name if notebook else None)

    def _await_notebook(self, candidates: list[str]) -> Path | None:
        """Under the runner, the executed notebook appears once the kernel has ended (a notebook measures other
        claims after this one, maybe for minutes): wait while the kernel lives, then ``linger_s`` at most."""
        if not candidates:
            return None
        gone_since = None
        while True:
            for c in map(Path, candidates):
                with contextlib.suppress(OSError):
                    if c.stat().st_mtime >= self.started - 1:
                        time.sleep(0.2)  # let a rename in progress settle
                        return c
            if _alive(self.watch_pid):
                self.deadline = time.monotonic() + self.linger_s + _HANG_S  # waiting is not hanging
            else:
                gone_since = gone_since or time.monotonic()
                if time.monotonic() - gone_since >= self.linger_s:
                    return None
            time.sleep(0.2)

    def _log_evidence(self, files: dict[str, str], profile: str, summary: dict) -> None:
        """Copy the evidence into the run's folder (so the offline run holds it) and log it as an artifact."""
        import wandb

        folder = Path(self.run.dir).parent / "evidence"
        folder.mkdir(exist_ok=True)
        art = wandb.Artifact(artifact_name(self.claim, profile), type=ARTIFACT_TYPE,
                             description=f"what produced the {self.claim} run: executed notebook, result.json, "
                                         "figures",
                             metadata={"claim": self.claim, "profile": profile, "status": summary.get("status"),
                                       "git_commit": self.run.config.get("git_commit")})
        for name, src in sorted(files.items()):
            dst = folder / name
            with contextlib.suppress(OSError):
                shutil.copyfile(src, dst)
                art.add_file(str(dst), name=name, policy="immutable")
        self.run.log_artifact(art)

    def _finish_wandb(self, exit_code: int, summary: dict) -> None:
        import wandb

        if self.run is None:
            return
        if summary:
            self.run.summary.update(summary)
        self.run.finish(exit_code=exit_code)
        # finish() returns before wandb-core has written the tail of the log; teardown waits for it.
        wandb.teardown()
        self.run = None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    worker = _Worker(Path(argv[0]))
    worker.serve(sys.stdin.buffer)
    return 0 if worker.status["state"] == FINISHED else 1


if __name__ == "__main__":
    sys.exit(main())
