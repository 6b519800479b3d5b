"""Run a function on N local processes exactly as torchrun starts them, under a timeout that nothing outlives.

torchrun's contract with a worker is its environment: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` and ``TORCHELASTIC_USE_AGENT_STORE=True``
(its agent hosts the rendezvous ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT`` and every rank connects to it as a
client). :func:`launch` sets the same variables and hosts the store itself, on a port the OS picks, so two
launches running at once never race for a port. Each rank runs ``python -m macroarch.comm._rank <spec>``:
it sets its torch threads (and ``OMP_NUM_THREADS``), calls ``init_process_group`` through ``env://`` with a
timeout, runs ``module:function(**kwargs)`` and writes the returned JSON-able value to a file that the parent
reads back. A worker can equally be started by torchrun itself; only the result file is this module's.

Every launch has a wall-clock ``timeout``: past it, each rank's process group (its own session) is killed
and :class:`LaunchError` says which ranks had not finished. Collectives inside the workers carry their own
(shorter) timeouts, so a dead or stalled peer surfaces as an error, not as a hang.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_LOG_TAIL = 4000


class LaunchError(RuntimeError):
    """A launch that timed out, or in which a rank failed (with each failed rank's log tail)."""


@dataclass(frozen=True)
class RankOutcome:
    """What one rank left: its exit code, its returned value (None if it returned none) and its log tail."""

    rank: int
    returncode: int | None
    result: Any
    log: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def launch(
    target: str,
    world_size: int = 2,
    *,
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = 120.0,
    pg_timeout: float = 60.0,
    threads: int = 1,
    env: Mapping[str, str] | None = None,
    check: bool = True,
) -> list[RankOutcome]:
    """Run ``target`` (``"package.module:function"``) on ``world_size`` gloo ranks; one outcome per rank.

    Args:
        target: an importable function; it is called as ``function(**kwargs)`` on every rank after
            ``init_process_group("gloo")`` and must return something ``json.dumps`` accepts (or None).
        world_size: number of processes, >= 1.
        kwargs: JSON-able keyword arguments for ``target``.
        timeout: seconds for the whole launch; past it every rank is killed and ``LaunchError`` raised.
        pg_timeout: the process group's timeout in seconds (collectives without their own timeout).
        threads: torch intra-op threads per rank (and ``OMP_NUM_THREADS``).
        env: extra environment variables for the ranks.
        check: raise ``LaunchError`` if a rank exits non-zero; with False the outcomes say it instead.
    """
    import torch.distributed as dist

    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be an int >= 1")
    if ":" not in target:
        raise ValueError(f"target={target!r} must read 'package.module:function'")
    if not timeout > 0 or not pg_timeout > 0:
        raise ValueError(f"timeout={timeout!r} and pg_timeout={pg_timeout!r} must be positive seconds")
    # The rendezvous store, hosted here as torchrun's agent hosts it: port 0 lets the OS pick a free one.
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=timeout),
                          wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="macroarch-launch-") as tmp:
        tmp = Path(tmp)
        spec = tmp / "spec.json"
        spec.write_text(json.dumps({"target": target, "kwargs": dict(kwargs or {}), "threads": threads,
                                    "pg_timeout": pg_timeout, "out": str(tmp)}))
        procs, logs = [], []
        for rank in range(world_size):
            rank_env = {**os.environ, **(env or {}), "RANK": str(rank), "LOCAL_RANK": str(rank),
                        "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0",
                        "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True",
                        "OMP_NUM_THREADS": str(threads)}
            log = (tmp / f"rank{rank}.log").open("w")
            logs.append(log)
            procs.append(subprocess.Popen([sys.executable, "-m", "macroarch.comm._rank", str(spec)], env=rank_env,
                                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + timeout
        try:
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            hung = [rank for rank, p in enumerate(procs) if p.poll() is None]
            for p in procs:
                _kill(p)
            for log in logs:
                log.close()
        outcomes = [_outcome(tmp, rank, p.returncode) for rank, p in enumerate(procs)]
    del store
    if hung:
        raise LaunchError(f"{target} on {world_size} ranks ran past its {timeout:g} s timeout; ranks {hung} were "
                          f"killed.\n" + _describe(o for o in outcomes if o.rank in hung))
    if check and not all(o.ok for o in outcomes):
        raise LaunchError(f"{target} failed on ranks {[o.rank for o in outcomes if not o.ok]}:\n"
                          + _describe(o for o in outcomes if not o.ok))
    return outcomes


def _kill(proc: subprocess.Popen) -> None:
    """Kill a rank we started, and whatever it started (its own session), if it is still running."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _outcome(tmp: Path, rank: int, returncode: int | None) -> RankOutcome:
    result_file = tmp / f"rank{rank}.json"
    result = json.loads(result_file.read_text()) if result_file.is_file() else None
    log = (tmp / f"rank{rank}.log").read_text(errors="replace")
    return RankOutcome(rank=rank, returncode=returncode, result=result, log=log[-_LOG_TAIL:])


def _describe(outcomes: Any) -> str:
    return "\n".join(f"--- rank {o.rank} (exit code {o.returncode}) ---\n{o.log.strip()}" for o in outcomes)
