"""Measurements for the ZeRO-3 model (claim C5): collectives timed on a real process group, and a real FSDP2 step.

:func:`measure_zero3` launches ``world_size`` gloo ranks (``macroarch.comm.launch``) that

1. time ``all_gather_single`` and ``reduce_scatter_single`` (the collectives FSDP2 issues) and
   ``all_reduce`` over a range of sizes: the data that :func:`macroarch.measure.zero3.fit_alpha_beta` turns into
   this machine's latency ``alpha`` and bandwidth ``B``;
2. time one training step (forward + backward) of a GPT-2-style decoder with one ``fully_shard`` unit per
   block and the root (``torch.distributed.fsdp.fully_shard``, FSDP2), and the same step of an unsharded
   copy (pure compute), alternating the two; and count the collectives FSDP2 issues in one step and their
   bytes, by wrapping ``torch.distributed.all_gather_single`` / ``reduce_scatter_single``, through which
   FSDP2 calls them.

The parent gets, per operation and size, the slowest rank's time (each rank's fastest of ``repeats``: on a
shared machine, load from elsewhere only ever adds time; a collective ends when its last rank does), and the
ranks' median step times. ``compare_fsdp`` sets the model's prediction beside them.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from typing import Any

import torch

from macroarch.comm.launch import launch
from macroarch.measure.workload import Workload, lm_loss, timed

OPS = ("all_gather", "reduce_scatter", "all_reduce")


def measure_zero3(workload: Workload, *, sizes: Sequence[int], repeats: int = 5, steps: int = 3,
                  world_size: int = 2, threads: int = 1, timeout: float = 300.0, then: str | None = None,
                  then_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run the measurements on ``world_size`` ranks (module docstring); ``sizes`` are gathered bytes.

    ``then`` (``"module:function"``) runs on the same ranks afterwards, as ``function(workload=..., **then_kwargs)``
    (a further measurement without a second launch); its results, in rank order, come back as ``"then"``."""
    outcomes = launch("macroarch.measure.calibrate:_zero3_worker", world_size, threads=threads, timeout=timeout,
                      pg_timeout=min(timeout, 120.0),
                      kwargs={"workload": asdict(workload), "sizes": list(sizes), "repeats": repeats, "steps": steps,
                              "then": then, "then_kwargs": then_kwargs or {}})
    results = [o.result for o in outcomes]
    first = results[0]
    return {
        "world_size": world_size,
        "sizes": first["sizes"],
        "seconds": {op: [max(r["seconds"][op][i] for r in results) for i in range(len(first["sizes"]))]
                    for op in OPS},
        "compute_s": statistics.median(r["compute_s"] for r in results),
        "fsdp_step_s": statistics.median(r["fsdp_step_s"] for r in results),
        "fsdp_collectives": first["fsdp_collectives"],
        "fsdp_gather_bytes": first["fsdp_gather_bytes"],
        "fsdp_scatter_bytes": first["fsdp_scatter_bytes"],
        "n_params": first["n_params"],
    } | ({"then": [r["then"] for r in results]} if then else {})


def _zero3_worker(workload: dict, sizes: list[int], repeats: int, steps: int, then: str | None = None,
                  then_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    import importlib

    import torch.distributed as dist

    world = dist.get_world_size()
    seconds = {op: [] for op in OPS}
    for size in sizes:
        numel = max(world, size // 4 // world * world)  # fp32, divisible by the world size
        full, shard = torch.ones(numel), torch.ones(numel // world)
        calls = {"all_gather": lambda full=full, shard=shard: dist.all_gather_single(full, shard),
                 "reduce_scatter": lambda full=full, shard=shard: dist.reduce_scatter_single(shard, full),
                 "all_reduce": lambda full=full: dist.all_reduce(full)}
        for op in OPS:
            calls[op]()  # warm-up: connections, buffers
            times = []
            for _ in range(repeats):
                dist.barrier()
                times.append(timed(calls[op]))
            seconds[op].append(min(times))  # load from elsewhere only ever adds time

    w = Workload(**workload)
    plain = w.model()
    sharded = copy.deepcopy(plain)
    _fully_shard_blocks(sharded)
    batches = w.batches(dist.get_rank(), steps + 1)
    compute, fsdp = [], []
    for i, ids in enumerate(batches):  # alternate, so that load from elsewhere hits both alike
        t_plain = timed(lambda ids=ids: lm_loss(plain, ids).backward())
        plain.zero_grad(set_to_none=True)
        dist.barrier()
        with _counting() as counts:
            t_fsdp = timed(lambda ids=ids: lm_loss(sharded, ids).backward())
        sharded.zero_grad(set_to_none=True)
        if i:  # the first step pays for lazy initialisation
            compute.append(t_plain)
            fsdp.append(t_fsdp)
    out = {"sizes": [max(world, s // 4 // world * world) * 4 for s in sizes], "seconds": seconds,
           "compute_s": statistics.median(compute), "fsdp_step_s": statistics.median(fsdp),
           "fsdp_collectives": counts["all_gather"] + counts["reduce_scatter"] + counts["all_reduce"],
           "fsdp_gather_bytes": counts["all_gather_bytes"], "fsdp_scatter_bytes": counts["reduce_scatter_bytes"],
           "n_params": sum(p.numel() for p in plain.parameters())}
    if then:
        module, function = then.split(":")
        out["then"] = getattr(importlib.import_module(module), function)(workload=workload, **(then_kwargs or {}))
    return out


def _fully_shard_blocks(model: torch.nn.Module) -> None:
    """One FSDP2 unit per transformer block, then the root (embeddings, final norm, head)."""
    from torch.distributed.fsdp import fully_shard

    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)


@contextlib.contextmanager
def _counting() -> Iterator[dict[str, int]]:
    """Count the collectives FSDP2 issues (it calls them through the ``torch.distributed`` module)."""
    import torch.distributed as dist

    counts = dict.fromkeys(("all_gather", "reduce_scatter", "all_reduce", "all_gather_bytes",
                            "reduce_scatter_bytes"), 0)
    originals = {"all_gather_single": dist.all_gather_single, "reduce_scatter_single": dist.reduce_scatter_single,
                 "all_reduce": dist.all_reduce}

    def all_gather_single(output, input, *args, **kwargs):
        counts["all_gather"] += 1
        counts["all_gather_bytes"] += output.numel() * output.element_size()
        return originals["all_gather_single"](output, input, *args, **kwargs)

    def reduce_scatter_single(output, input, *args, **kwargs):
        counts["reduce_scatter"] += 1
        counts["reduce_scatter_bytes"] += input.numel() * input.element_size()
        return originals["reduce_scatter_single"](output, input, *args, **kwargs)

    def all_reduce(tensor, *args, **kwargs):
        counts["all_reduce"] += 1
        return originals["all_reduce"](tensor, *args, **kwargs)

    dist.all_gather_single, dist.reduce_scatter_single, dist.all_reduce = (all_gather_single, reduce_scatter_single,
                                                                           all_reduce)
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
