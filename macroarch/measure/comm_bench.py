"""Measurements for the post's communication advice (claim C9): bucket sizes, windows, and what a dead rank does.

:func:`compare_bucketing` launches gloo ranks that train the same GPT-2-style decoder (same initial weights,
each rank its own batches) under several gradient-synchronisation set-ups, given as dicts:

- ``{"kind": "local"}``: no communication (the compute-only floor);
- ``{"kind": "ddp", "bucket_mb": None | x}``: ``DistributedDataParallel`` (None: its defaults, 25 MiB buckets
  with a 1 MiB first bucket);
- ``{"kind": "bucketer", "bucket_mb": x, "window_ms": None | w}``: :class:`GradientBucketer`.

A step is forward, backward and gradient synchronisation (``wait()``); the optimizer step, the same for every
set-up, is left out so all set-ups see the same weights. Set-ups run in turn for ``rounds`` rounds (a fresh
copy of the model each time), so drifting load from elsewhere hits them alike; times are per micro-step,
the slower rank's median. The first step's synchronised gradients are compared with an explicit average
(``all_reduce`` of every gradient, divided by the world size) of the same batches.

:func:`dead_rank` shows what happens when a rank dies (``"exit"``) or stops communicating (``"stall"``)
while the others train: with the bucketer's per-collective timeout, or with a plain blocking
``all_reduce`` that only the process group's own timeout ends.
"""

from __future__ import annotations

import copy
import datetime
import os
import statistics
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

import torch

from macroarch._compat.distributed import default_store
from macroarch.comm.bucketer import GradientBucketer, ddp_bucket_bytes, ddp_with_buckets
from macroarch.comm.launch import launch
from macroarch.comm.layout import MiB
from macroarch.measure.workload import Workload, flat_grads, lm_loss, timed


def label(setup: Mapping[str, Any]) -> str:
    """``"DDP 25 MiB (default)"``, ``"bucketer 8 MiB"``, ``"bucketer 8 MiB, 200 ms window"``, ``"no communication"``."""
    if setup["kind"] == "local":
        return "no communication"
    mb = setup.get("bucket_mb")
    if setup["kind"] == "ddp":
        return "DDP 25 MiB (default)" if mb is None else f"DDP {mb:g} MiB"
    window = setup.get("window_ms")
    return f"bucketer {mb:g} MiB" + ("" if window is None else f", {window:g} ms window")


def compare_bucketing(workload: Workload, setups: Sequence[Mapping[str, Any]], *, steps: int = 4, warmup: int = 1,
                      rounds: int = 2, world_size: int = 2, threads: int = 1, timeout: float = 600.0,
                      collective_timeout: float = 120.0) -> list[dict[str, Any]]:
    """One row per set-up: step times, collectives per micro-step, bucket sizes, gradient error (module doc)."""
    outcomes = launch("macroarch.measure.comm_bench:_bucketing_worker", world_size, threads=threads, timeout=timeout,
                      pg_timeout=collective_timeout,
                      kwargs={"workload": asdict(workload), "setups": [dict(s) for s in setups], "steps": steps,
                              "warmup": warmup, "rounds": rounds, "collective_timeout": collective_timeout})
    rows = []
    for i, setup in enumerate(setups):
        per_rank = [o.result[i] for o in outcomes]
        rows.append({**per_rank[0], "label": label(setup), "setup": dict(setup),
                     "step_s": max(statistics.median(r["times"]) for r in per_rank),
                     "max_grad_error": max(r["max_grad_error"] for r in per_rank)})
    return rows


def _bucketing_worker(workload: dict, setups: list[dict], steps: int, warmup: int, rounds: int,
                      collective_timeout: float) -> list[dict[str, Any]]:
    import torch.distributed as dist

    w = Workload(**workload)
    rank = dist.get_rank()
    initial = w.model()
    batches = w.batches(rank, warmup + steps)
    reference = _reference_average(initial, batches[0])
    rows = [{"times": [], "collectives_per_step": 0.0, "bucket_bytes": [], "window_steps": [],
             "max_grad_error": 0.0} for _ in setups]  # times: the mean micro-step of each round
    for round_ in range(rounds):
        for setup, row in zip(setups, rows):
            model = copy.deepcopy(initial)
            step, stats = _setup(model, setup, collective_timeout)
            dist.barrier()
            # Warm-up, then the timed micro-steps: at least `steps`, and, with a window, up to a reduction,
            # so that every timed window is whole.
            # A window set-up's first two windows are one micro-step each (no micro-step time known yet).
            skip = max(warmup, 2) if setup.get("window_ms") is not None else warmup
            i = timed_steps = collectives_before = 0
            elapsed_total = 0.0
            while i < skip or timed_steps < steps or (not stats.synced() and timed_steps < 20 * steps):
                ids = batches[i % len(batches)]
                elapsed = timed(lambda ids=ids, step=step: step(ids))
                if round_ == 0 and i == 0 and setup["kind"] != "local":
                    error = (flat_grads(_params(model)) - reference).abs().max().item()
                    row["max_grad_error"] = max(row["max_grad_error"], error)
                model.zero_grad(set_to_none=True)
                i += 1
                if i == skip:
                    collectives_before = stats.collectives()
                elif i > skip:
                    elapsed_total += elapsed
                    timed_steps += 1
            row["times"].append(elapsed_total / timed_steps)
            row["collectives_per_step"] = (stats.collectives() - collectives_before) / timed_steps
            row.update(stats.layout())
            if setup["kind"] == "ddp":  # one all-reduce per bucket and backward, counted after DDP's rebuild
                row["collectives_per_step"] = float(len(row["bucket_bytes"]))
    return rows


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    return [p for p in inner.parameters() if p.requires_grad]


def _reference_average(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The independent answer: every gradient all-reduced on its own and divided by the world size."""
    import torch.distributed as dist

    reference = copy.deepcopy(model)
    lm_loss(reference, ids).backward()
    for p in reference.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    return flat_grads(list(reference.parameters()))


class _Counters:
    """What a set-up reports: collectives so far, whether the last micro-step synchronised, its layout."""

    def __init__(self, collectives=lambda: 0, synced=lambda: True, layout=dict) -> None:
        self.collectives, self.synced, self.layout = collectives, synced, layout


def _setup(model: torch.nn.Module, setup: dict, collective_timeout: float):
    """``(step, counters)``: a function running one micro-step on a batch, and the set-up's :class:`_Counters`."""
    kind = setup["kind"]
    if kind == "local":
        return (lambda ids: lm_loss(model, ids).backward()), _Counters()
    if kind == "ddp":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a non-multiple of 8 warns; here it is asked for on purpose
            ddp = (torch.nn.parallel.DistributedDataParallel(model) if setup.get("bucket_mb") is None
                   else ddp_with_buckets(model, setup["bucket_mb"]))
        return (lambda ids: lm_loss(ddp, ids).backward()), _Counters(
            layout=lambda: {"bucket_bytes": ddp_bucket_bytes(ddp)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bucketer = GradientBucketer(model, bucket_mb=setup["bucket_mb"], window_ms=setup.get("window_ms"),
                                    timeout=collective_timeout)
    synced = [True]

    def bucketer_step(ids: torch.Tensor) -> None:
        lm_loss(model, ids).backward()
        synced[0] = bucketer.wait()

    return bucketer_step, _Counters(collectives=lambda: bucketer.collectives, synced=lambda: synced[0],
                                    layout=lambda: {"bucket_bytes": bucketer.bucket_bytes,
                                                    "window_steps": list(bucketer.window_history)})


def all_reduce_times(sizes_mb: Sequence[float], *, repeats: int = 5, world_size: int = 2, threads: int = 1,
                     timeout: float = 300.0) -> list[float]:
    """Seconds of one fp32 ``all_reduce`` of each size (MiB): the slower rank's fastest of ``repeats``.

    Buffers of 8k MiB beside 8k +- 1 MiB show whether sizes on the post's 8 MB grid are faster per byte.
    """
    outcomes = launch("macroarch.measure.comm_bench:_all_reduce_worker", world_size, threads=threads, timeout=timeout,
                      kwargs={"sizes_mb": list(sizes_mb), "repeats": repeats})
    return [max(o.result[i] for o in outcomes) for i in range(len(sizes_mb))]


def _all_reduce_worker(sizes_mb: list[float], repeats: int) -> list[float]:
    import torch.distributed as dist

    seconds = []
    for mb in sizes_mb:
        buffer = torch.ones(int(mb * MiB) // 4)
        dist.all_reduce(buffer)  # warm-up
        times = []
        for _ in range(repeats):
            dist.barrier()
            times.append(timed(lambda buffer=buffer: dist.all_reduce(buffer)))
        seconds.append(min(times))  # load from elsewhere only ever adds time
    return seconds


# ----------------------------------------------------------------------------------------- failures
def dead_rank(workload: Workload, *, mode: str, after_steps: int = 2, collective_timeout: float = 5.0,
              blocking: bool = False, pg_timeout: float = 30.0, env: Mapping[str, str] | None = None,
              threads: int = 1, timeout: float = 120.0) -> dict[str, Any]:
    """Two ranks train (``workload.mlp()``); after ``after_steps`` steps rank 1 exits (``mode="exit"``) or goes
    silent (``"stall"``).

    Rank 0 goes on synchronising, with the bucketer (``blocking=False``: each collective has
    ``collective_timeout``) or with a plain blocking ``all_reduce`` per gradient (``blocking=True``: only
    the process group's ``pg_timeout`` can end it). Returns what rank 0 saw: the error type and message, and
    the seconds from the failing step's start to the error (None if it never failed).
    """
    if mode not in ("exit", "stall"):
        raise ValueError(f"mode={mode!r} must be 'exit' or 'stall'")
    outcomes = launch("macroarch.measure.comm_bench:_dead_rank_worker", 2, threads=threads, timeout=timeout,
                      pg_timeout=pg_timeout, env=env, check=False,
                      kwargs={"workload": asdict(workload), "mode": mode, "after_steps": after_steps,
                              "collective_timeout": collective_timeout, "blocking": blocking,
                              "stall_s": pg_timeout + collective_timeout + 10})
    survivor = outcomes[0]
    if survivor.result is None:
        raise RuntimeError(f"rank 0 left no result (exit code {survivor.returncode}):\n{survivor.log}")
    return {**survivor.result, "rank1_exit_code": outcomes[1].returncode}


def _dead_rank_worker(workload: dict, mode: str, after_steps: int, collective_timeout: float, blocking: bool,
                      stall_s: float) -> dict[str, Any] | None:
    import torch.distributed as dist

    w = Workload(**workload)
    rank = dist.get_rank()
    store = default_store()
    model = w.mlp()
    bucketer = None if blocking else GradientBucketer(model, bucket_mb=8, timeout=collective_timeout)
    for step, x in enumerate(w.mlp_batches(rank, after_steps + 1)):
        if rank == 1 and step == after_steps:
            if mode == "exit":
                os._exit(1)  # a crash: no clean-up, sockets closed by the OS
            # Alive, holding its connections, joining no collective until rank 0 has seen what it sees.
            store.wait(["survivor_done"], datetime.timedelta(seconds=stall_s))
            return {"stalled": True}
        start = time.perf_counter()
        try:
            model(x).square().mean().backward()
            if blocking:
                for p in model.parameters():
                    dist.all_reduce(p.grad)
            else:
                bucketer.wait()
        except Exception as exc:
            store.set("survivor_done", "1")
            return {"steps_done": step, "error_type": type(exc).__name__, "error": str(exc)[:1500],
                    "seconds_to_error": time.perf_counter() - start,
                    "env_TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"),
                    "backend": dist.get_backend()}
        model.zero_grad(set_to_none=True)
    store.set("survivor_done", "1")
    return {"steps_done": after_steps + 1, "error_type": None, "error": None, "seconds_to_error": None}


def bucket_summary(rows: Sequence[Mapping[str, Any]]) -> str:
    """A plain-text table of :func:`compare_bucketing` rows."""
    lines = [f"{'set-up':<34}{'ms/step':>9}{'coll./step':>11}  {'buckets (MiB)':<32}{'max |g - avg|':>13}"]
    for r in rows:
        sizes = r["bucket_bytes"]
        shown = ", ".join(f"{s / MiB:.2f}" for s in sizes[:4]) + (", ..." if len(sizes) > 4 else "")
        lines.append(f"{r['label']:<34}{r['step_s'] * 1e3:>9.1f}{r['collectives_per_step']:>11.2f}  {shown:<32}"
                     f"{r['max_grad_error']:>13.2e}")
    return "\n".join(lines)
