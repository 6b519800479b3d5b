"""Notebook 07's experiments (claim C9, post section 4.2): gradient buckets on the 8 MB grid, 200 ms all-reduce
windows, and what a failed peer does (the post's ``NCCL_ASYNC_ERROR_HANDLING=0``).

Everything runs on gloo ranks on loopback launched with torchrun's environment (``macroarch.comm.launch``). The
two graded ratios are timed in ABBA blocks inside one launch, so drift and load from elsewhere cancel within a
block and the spread over blocks is the interval (``measure.stats.ratio_from_blocks``):

- :func:`abba`: ``ddp8_vs_ddp_default`` = DDP 25 MiB (its default) micro-step time / DDP 8 MiB micro-step time,
  like for like (only the bucket size differs), graded; beside it, reported but not graded, our 8 MiB bucketer
  against both (``bucket_speedup_vs_ddp`` = DDP 25 MiB / bucketer 8 MiB, ``bucket8_vs_ddp8``), which mixes the
  implementation into the bucket size. One block runs DDP 25, bucketer 8, DDP 8, then the same in reverse, so
  every pair is ABBA-ordered; each side is the mean of ``abba_steps`` micro-steps (forward, backward, gradient
  sync) of models kept across blocks. Graded too: ``aligned_throughput_ratio`` = all-reduce seconds per byte of
  buffers beside the grid (``s - 1`` and ``s + 1`` MiB) / on it (``s`` MiB), one grid size per block,
  ``off, on, on, off``;
- :func:`bucketing`: the descriptive sweep, a micro-step of the same decoder under no communication, DDP (25 MiB
  and 8 MiB buckets), the bucketer at each bucket size and with each window, set-ups in turn for ``rounds`` rounds
  (``measure.comm_bench.compare_bucketing``); the synchronised gradients against an explicit average;
- :func:`windows`: collectives per micro-step and throughput with ``window_ms``;
- :func:`failures`: a rank that exits or stalls, with the bucketer's timeout and with a blocking all-reduce that
  only the process group's timeout ends. ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` is NCCL-only: set, it changes
  nothing on gloo, which the result shows.

Nothing here computes in a 16-bit dtype: the gradients are fp32, as DDP's buckets are.
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from macroarch.comm import MiB
from macroarch.comm.bucketer import GradientBucketer, ddp_with_buckets
from macroarch.comm.launch import launch
from macroarch.experiments.settings import Settings
from macroarch.measure.comm_bench import bucket_summary, compare_bucketing, dead_rank
from macroarch.measure.machine import describe, machine_info
from macroarch.measure.stats import Estimate, Repeated, ratio_from_blocks
from macroarch.measure.workload import Workload, lm_loss, timed

BUCKET = 8
"""The post's bucket multiple, MiB."""
DDP_DEFAULT, BUCKETER, DDP8 = "DDP 25 MiB (default)", f"bucketer {BUCKET} MiB", f"DDP {BUCKET} MiB"
ABBA_SETUPS: dict[str, dict[str, Any]] = {
    DDP_DEFAULT: {"kind": "ddp", "bucket_mb": None},
    BUCKETER: {"kind": "bucketer", "bucket_mb": BUCKET},
    DDP8: {"kind": "ddp", "bucket_mb": BUCKET},
}
"""The set-ups timed in ABBA blocks, in block order (the second half of a block runs them reversed)."""
BLOCKING = "rank stalls, blocking all-reduce, TORCH_NCCL_ASYNC_ERROR_HANDLING=0"
SCENARIOS: dict[str, dict[str, Any]] = {
    "rank exits, bucketer": dict(mode="exit"),
    "rank stalls, bucketer": dict(mode="stall"),
    BLOCKING: dict(mode="stall", blocking=True, env={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}),
}


@dataclass(frozen=True)
class BucketingSettings(Settings):
    """Notebook 07's settings: its parameters cell, less ``profile`` (``BucketingSettings.from_params(params)``)."""

    d_model: int
    """GPT-2-style decoder width."""
    n_layers: int
    """Decoder layers."""
    n_heads: int
    """Attention heads; must divide ``d_model``."""
    seq_len: int
    """Tokens per row."""
    bucket_sizes_mb: tuple[float, ...]
    """Bucketer sizes of the descriptive sweep, MiB; those that are not multiples of 8 are the contrast. Must
    include 8 (the graded one)."""
    windows_ms: tuple[float, ...]
    """Window lengths, ms: the post's 200 ms, and one of several micro-steps here."""
    grid_sizes_mb: tuple[float, ...]
    """Buffer sizes on the 8 MiB grid; each is timed against ``s - 1`` and ``s + 1`` MiB (off the grid)."""
    alignment_repeats: int
    """All-reduces per buffer and side of a grid block (their median counts)."""
    alignment_blocks: int
    """ABBA blocks of the grid comparison (graded ``aligned_throughput_ratio``); grid sizes take turns."""
    abba_blocks: int
    """ABBA blocks of DDP 25 MiB / bucketer 8 MiB / DDP 8 MiB (graded ``ddp8_vs_ddp_default``)."""
    abba_steps: int
    """Timed micro-steps per set-up and half-block (their mean is the side's time)."""
    steps: int
    """Timed micro-steps per set-up and round of the sweep (windows: until a window closes)."""
    rounds: int
    """Sweep set-ups take turns this many times (the figure's error bars span the rounds)."""
    collective_timeout_s: float
    """The bucketer's timeout per collective, seconds."""
    pg_timeout_s: float
    """The process group's timeout, seconds: all a blocking all-reduce has."""
    threads: int
    """Torch threads per rank."""
    seed: int = 0
    """Initial weights (the same on every rank) and each rank's batches."""
    batch_size: int = 2
    """Rows per rank and micro-step."""
    warmup: int = 1
    """Untimed micro-steps per set-up and round of the sweep, and before the first ABBA block."""
    world_size: int = 2
    """Gloo ranks on loopback."""

    def __post_init__(self) -> None:
        self._positive("d_model", "n_layers", "n_heads", "seq_len", "alignment_repeats", "alignment_blocks",
                       "abba_blocks", "abba_steps", "steps", "rounds", "collective_timeout_s", "pg_timeout_s",
                       "threads", "batch_size")
        self._non_negative("warmup")
        self._non_empty("bucket_sizes_mb", "windows_ms", "grid_sizes_mb")
        if self.d_model % self.n_heads:
            self._fail("n_heads", f"a divisor of d_model {self.d_model}")
        if BUCKET not in self.bucket_sizes_mb:
            self._fail("bucket_sizes_mb", f"a list holding {BUCKET} (the graded bucket size)")
        if any(not x > 0 for x in (*self.bucket_sizes_mb, *self.windows_ms)):
            self._fail("bucket_sizes_mb", "positive sizes (as windows_ms)")
        if any(not (s > 1 and s % BUCKET == 0) for s in self.grid_sizes_mb):
            self._fail("grid_sizes_mb", f"multiples of {BUCKET} MiB (each is compared with s - 1 and s + 1)")
        if self.abba_blocks < 2 or self.alignment_blocks < 2:
            self._fail("abba_blocks" if self.abba_blocks < 2 else "alignment_blocks",
                       "at least 2 (an interval needs two blocks)")
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 2:
            self._fail("world_size", "an int >= 2 (a collective needs two ranks)")


def workload(settings: BucketingSettings) -> Workload:
    """The decoder and micro-batch every rank trains (threads of this process set to ``threads``)."""
    torch.set_num_threads(settings.threads)
    return Workload(d_model=settings.d_model, n_layers=settings.n_layers, n_heads=settings.n_heads,
                    seq_len=settings.seq_len, batch_size=settings.batch_size, seed=settings.seed)


def describe_workload(work: Workload, world_size: int) -> str:
    n = sum(p.numel() for p in work.model().parameters())
    return (f"{n / 1e6:.1f}M parameters: {4 * n / MiB:.1f} MiB of fp32 gradients per rank, {work.tokens} tokens per "
            f"rank and micro-step, {world_size} gloo ranks")


def window_label(window_ms: float) -> str:
    return f"bucketer {BUCKET} MiB, {window_ms:g} ms window"


# ----------------------------------------------------------------------------------------- ABBA blocks (graded)
@dataclass
class Abba:
    """Per-block times of the ABBA launch: micro-step seconds per set-up, and all-reduce seconds per MiB on and
    beside the grid (each block's slower rank)."""

    step_s: dict[str, list[float]]
    """Set-up label -> the mean micro-step of each block (both halves)."""
    grid_mb: list[float]
    """The grid size of each grid block."""
    on_s_per_mib: list[float]
    off_s_per_mib: list[float]
    """Seconds per MiB of the ``s`` MiB buffer, and of ``s - 1`` and ``s + 1`` MiB together, per block."""

    def ratio(self, a: str, b: str) -> Estimate:
        """How many times faster set-up ``b`` is than ``a`` (``time_a / time_b`` per block)."""
        return ratio_from_blocks(self.step_s[a], self.step_s[b])

    @property
    def aligned(self) -> Estimate:
        """All-reduce throughput per byte on the grid / beside it (> 1: the grid is faster)."""
        return ratio_from_blocks(self.off_s_per_mib, self.on_s_per_mib)

    def estimates(self) -> dict[str, Estimate]:
        """The graded ``ddp8_vs_ddp_default`` (like for like) and ``aligned_throughput_ratio``, and beside them,
        not graded, our bucketer against DDP (``bucket_speedup_vs_ddp``, ``bucket8_vs_ddp8``)."""
        return {"ddp8_vs_ddp_default": self.ratio(DDP_DEFAULT, DDP8),
                "aligned_throughput_ratio": self.aligned,
                "bucket_speedup_vs_ddp": self.ratio(DDP_DEFAULT, BUCKETER),
                "bucket8_vs_ddp8": self.ratio(DDP8, BUCKETER)}

    def repeated(self) -> dict[str, Repeated]:
        """The graded estimates' raw blocks, for ``claims.regrade_leaving_out`` (two groups: speed and grid blocks)."""
        return {"ddp8_vs_ddp_default": Repeated(ratio_from_blocks, (self.step_s[DDP_DEFAULT], self.step_s[DDP8]),
                                                group="speed blocks"),
                "aligned_throughput_ratio": Repeated(ratio_from_blocks, (self.off_s_per_mib, self.on_s_per_mib),
                                                     group="grid blocks")}

    @classmethod
    def from_tables(cls, tables: Mapping[str, Mapping[str, Any]]) -> Abba:
        """The blocks back from a result's ``tables`` (``speed_blocks``, ``grid_blocks`` as ``run.table`` stored
        them: ``{"columns": [...], "rows": [[...], ...]}``), e.g. to regrade with each block left out."""
        def columns(name: str) -> dict[str, list]:
            t = tables[name]
            return {c: [row[i] for row in t["rows"]] for i, c in enumerate(t["columns"])}

        speed, grid = columns("speed_blocks"), columns("grid_blocks")
        return cls({name: [ms / 1e3 for ms in speed[f"{name} ms"]] for name in ABBA_SETUPS}, grid["grid MiB"],
                   grid["on s/MiB"], grid["off s/MiB"])

    def speed_rows(self) -> list[dict[str, float]]:
        return [{"block": i, **{f"{name} ms": t[i] * 1e3 for name, t in self.step_s.items()}}
                for i in range(len(next(iter(self.step_s.values()))))]

    def grid_rows(self) -> list[dict[str, float]]:
        return [{"block": i, "grid MiB": s, "on s/MiB": on, "off s/MiB": off}
                for i, (s, on, off) in enumerate(zip(self.grid_mb, self.on_s_per_mib, self.off_s_per_mib))]

    def throughput_by_size(self) -> dict[str, dict[float, list[float]]]:
        """GB/s per block of each grid size, on the grid and beside it (the mean of ``s - 1`` and ``s + 1``)."""
        out: dict[str, dict[float, list[float]]] = {"on": {}, "off": {}}
        for s, on, off in zip(self.grid_mb, self.on_s_per_mib, self.off_s_per_mib):
            out["on"].setdefault(s, []).append(MiB / on / 1e9)
            out["off"].setdefault(s, []).append(MiB / off / 1e9)
        return out

    def text(self) -> str:
        e = self.estimates()
        n_speed, n_grid = len(self.step_s[BUCKETER]), len(self.grid_mb)
        med = {name: statistics.median(t) * 1e3 for name, t in self.step_s.items()}
        return "\n".join([
            f"{n_speed} ABBA blocks, median micro-step: " + ", ".join(f"{k} {v:.1f} ms" for k, v in med.items()),
            f"DDP 25 MiB / DDP 8 MiB (graded):      {e['ddp8_vs_ddp_default'].describe()}",
            f"DDP 25 MiB / bucketer 8 MiB (not graded): {e['bucket_speedup_vs_ddp'].describe()}",
            f"DDP 8 MiB / bucketer 8 MiB (not graded):  {e['bucket8_vs_ddp8'].describe()}",
            f"{n_grid} grid blocks over {sorted(set(self.grid_mb))} MiB: per-byte throughput on the grid / beside it "
            f"(s -+ 1 MiB, graded): {e['aligned_throughput_ratio'].describe()}"])


def abba(work: Workload, settings: BucketingSettings, run: Any = None) -> Abba:
    """The graded ratios from ABBA blocks in one launch (module docstring); per-block rows to ``run``'s tables."""
    p = settings
    outcomes = launch(f"{__name__}:_abba_worker", p.world_size, threads=p.threads, timeout=1800.0,
                      pg_timeout=max(p.collective_timeout_s, 60.0),
                      kwargs={"workload": asdict(work), "blocks": p.abba_blocks, "steps": p.abba_steps,
                              "warmup": max(p.warmup, 2), "grid_sizes_mb": list(p.grid_sizes_mb),
                              "repeats": p.alignment_repeats, "grid_blocks": p.alignment_blocks})
    results = [o.result for o in outcomes]

    def slower(key: str, sub: str | None = None) -> list[float]:
        rows = [r[key] if sub is None else r[key][sub] for r in results]
        return [max(xs) for xs in zip(*rows)]

    a = Abba({name: slower("step_s", name) for name in ABBA_SETUPS}, results[0]["grid_mb"], slower("on"),
             slower("off"))
    if run is not None:
        run.table("speed_blocks", a.speed_rows())
        run.table("grid_blocks", a.grid_rows())
    return a


def _abba_worker(workload: dict, blocks: int, steps: int, warmup: int, grid_sizes_mb: list[float], repeats: int,
                 grid_blocks: int) -> dict[str, Any]:
    import torch.distributed as dist

    w = Workload(**workload)
    initial = w.model()
    batches = w.batches(dist.get_rank(), steps)
    step = {name: _micro_step(copy.deepcopy(initial), setup) for name, setup in ABBA_SETUPS.items()}
    for name in ABBA_SETUPS:  # DDP rebuilds its buckets after the first backward; lazy allocations
        for i in range(warmup):
            step[name](batches[i % steps])
    names = list(ABBA_SETUPS)
    step_s: dict[str, list[float]] = {name: [] for name in names}
    for block in range(blocks):
        total = dict.fromkeys(names, 0.0)
        for name in block_order(names, block):
            dist.barrier()
            total[name] += sum(step[name](ids) for ids in batches)
        for name in names:
            step_s[name].append(total[name] / (2 * steps))
    del step
    # One buffer per size (zeros: a sum of zeros stays finite however often it is reduced).
    buffers = {mb: torch.zeros(int(mb * MiB) // 4) for s in grid_sizes_mb for mb in (s - 1, s, s + 1)}
    for buffer in buffers.values():
        dist.all_reduce(buffer)

    def per_mib(mb: float) -> float:
        times = []
        for _ in range(repeats):
            dist.barrier()
            times.append(timed(lambda: dist.all_reduce(buffers[mb])))
        return statistics.median(times) / mb

    grid_mb, on, off = [], [], []
    for block in range(grid_blocks):
        s, order = grid_block(grid_sizes_mb, block)
        t = [per_mib(mb) for mb in order]
        grid_mb.append(s)
        on.append((t[1] + t[2]) / 2)
        off.append((t[0] + t[3]) / 2)
    return {"step_s": step_s, "grid_mb": grid_mb, "on": on, "off": off}


def block_order(names: Sequence[str], block: int) -> list[str]:
    """The set-ups of speed block ``block``: ``A B C C B A``, mirrored (``C B A A B C``) on odd blocks, so that
    every pair runs in ABBA order and a drift that is linear in time cancels for each pair."""
    half = list(names) if block % 2 == 0 else list(names)[::-1]
    return half + half[::-1]


def grid_block(grid_sizes_mb: Sequence[float], block: int) -> tuple[float, list[float]]:
    """``(s, order)`` of grid block ``block``: ``s - 1, s, s, s + 1`` MiB, mirrored on odd blocks; each grid size
    takes two blocks in a row (both orders) before the next."""
    s = grid_sizes_mb[(block // 2) % len(grid_sizes_mb)]
    return s, ([s - 1, s, s, s + 1] if block % 2 == 0 else [s + 1, s, s, s - 1])


def _micro_step(model: torch.nn.Module, setup: Mapping[str, Any]):
    """A function timing one micro-step (forward, backward, gradient sync) of ``model`` under ``setup`` on a batch;
    it leaves no gradients behind, so every micro-step sees the same weights."""
    if setup["kind"] == "ddp":
        net = (torch.nn.parallel.DistributedDataParallel(model) if setup["bucket_mb"] is None
               else ddp_with_buckets(model, setup["bucket_mb"]))
        sync = None
    else:
        net, bucketer = model, GradientBucketer(model, bucket_mb=setup["bucket_mb"])
        sync = bucketer.wait

    def run(ids: torch.Tensor) -> float:
        def once() -> None:
            lm_loss(net, ids).backward()
            if sync is not None:
                sync()

        seconds = timed(once)
        model.zero_grad(set_to_none=True)
        return seconds

    return run


# ----------------------------------------------------------------------------------------- the sweep (described)
@dataclass
class Bucketing:
    """:func:`compare_bucketing` rows by label: the descriptive sweep (the graded ratios are :class:`Abba`'s)."""

    rows: list[dict[str, Any]]
    bucket_sizes_mb: list[float]
    n_params: int

    @property
    def by(self) -> dict[str, dict[str, Any]]:
        return {r["label"]: r for r in self.rows}

    @property
    def bucketer(self) -> dict[float, float]:
        """Micro-step seconds of the bucketer at each size (no window): the median over rounds."""
        return {mb: self.by[f"bucketer {mb:g} MiB"]["step_s"] for mb in self.bucket_sizes_mb}

    def step_s(self, label: str) -> float:
        return self.by[label]["step_s"]

    def spread_s(self, label: str) -> tuple[float, float]:
        """The fastest and slowest round's micro-step of ``label`` (rank 0's rounds)."""
        times = [*(self.by[label].get("times") or []), self.step_s(label)]  # the slower rank's median within
        return min(times), max(times)

    def metrics(self) -> dict[str, float]:
        """Sweep numbers (prefixed ``sweep_`` where an ABBA estimate has the same meaning): single medians over
        ``rounds``, described, not graded."""
        b, local = self.bucketer, self.step_s("no communication")
        ddp_default, ddp8 = self.step_s(DDP_DEFAULT), self.step_s(DDP8)
        errors = [r["max_grad_error"] for r in self.rows if r["setup"]["kind"] != "local"]
        return dict(sweep_ddp_over_bucketer8=ddp_default / b[BUCKET], sweep_ddp8_over_bucketer8=ddp8 / b[BUCKET],
                    ddp_default_step_ms=ddp_default * 1e3, ddp8_step_ms=ddp8 * 1e3, local_step_ms=local * 1e3,
                    sync_overhead_ddp_default=ddp_default / local - 1, sync_overhead_bucketer8=b[BUCKET] / local - 1,
                    max_grad_error_vs_average=max(errors), n_params=self.n_params,
                    **{f"bucketer_{mb:g}mb_step_ms".replace(".", "_"): s * 1e3 for mb, s in b.items()})

    def text(self) -> str:
        m = self.metrics()
        return "\n".join([
            bucket_summary(self.rows),
            f"sweep (median of rounds, not graded): DDP 25 MiB / bucketer 8 MiB {m['sweep_ddp_over_bucketer8']:.3f}x, "
            f"DDP 8 MiB / bucketer 8 MiB {m['sweep_ddp8_over_bucketer8']:.3f}x",
            f"sync overhead over compute alone: DDP {m['sync_overhead_ddp_default']:.1%}, bucketer 8 MiB "
            f"{m['sync_overhead_bucketer8']:.1%}; largest gradient difference from the explicit average: "
            f"{m['max_grad_error_vs_average']:.2e}"])


def setups(bucket_sizes_mb: Sequence[float], windows_ms: Sequence[float]) -> list[dict[str, Any]]:
    """No communication, DDP (default and 8 MiB buckets), the bucketer at each size, and with each window."""
    return ([{"kind": "local"}, dict(ABBA_SETUPS[DDP_DEFAULT]), dict(ABBA_SETUPS[DDP8])]
            + [{"kind": "bucketer", "bucket_mb": mb} for mb in bucket_sizes_mb]
            + [{"kind": "bucketer", "bucket_mb": BUCKET, "window_ms": w} for w in windows_ms])


def bucketing(work: Workload, settings: BucketingSettings, run: Any = None) -> Bucketing:
    """Every set-up from the same weights on the same batches, in turns for ``rounds`` rounds; step time is the
    slower rank's mean micro-step, median over rounds. Per set-up numbers logged to ``run``."""
    p = settings
    rows = compare_bucketing(work, setups(p.bucket_sizes_mb, p.windows_ms), steps=p.steps,
                             warmup=p.warmup, rounds=p.rounds, world_size=p.world_size, threads=p.threads,
                             collective_timeout=max(p.collective_timeout_s, 60.0))
    if run is not None:
        for i, r in enumerate(rows):
            run.log(step=i, step_ms=r["step_s"] * 1e3, collectives_per_step=r["collectives_per_step"],
                    max_grad_error=r["max_grad_error"])
    return Bucketing(rows, list(p.bucket_sizes_mb), sum(t.numel() for t in work.model().parameters()))


def windows(b: Bucketing, windows_ms: Sequence[float]) -> tuple[dict[str, float], str]:
    """Per window: k (micro-steps of the last window), collectives per micro-step, throughput against no window;
    the metrics and a text."""
    base, m, lines = b.by[BUCKETER], {}, []
    for w in windows_ms:
        r = b.by[window_label(w)]
        ks = r["window_steps"]
        k = ks[-1] if ks else 1
        lines.append(f"{w:g} ms window: k = {k} micro-steps per window (windows {ks}); collectives per micro-step "
                     f"{r['collectives_per_step']:.2f} vs {base['collectives_per_step']:.2f}; micro-step "
                     f"{r['step_s'] * 1e3:.1f} ms vs {base['step_s'] * 1e3:.1f} ms "
                     f"({base['step_s'] / r['step_s']:.2f}x throughput)")
        m.update({f"window_{w:g}ms_k": k, f"window_{w:g}ms_collectives_per_step": r["collectives_per_step"],
                  f"window_{w:g}ms_throughput_gain": base["step_s"] / r["step_s"]})
        m.setdefault("window_first_k", k)
    return m, "\n".join(lines)


def failures(work: Workload, settings: BucketingSettings) -> dict[str, dict[str, Any]]:
    """What rank 0 saw in each of :data:`SCENARIOS` (rank 1 fails after one step)."""
    p = settings
    return {name: dead_rank(work, after_steps=1, collective_timeout=p.collective_timeout_s,
                            pg_timeout=p.pg_timeout_s, threads=p.threads,
                            timeout=p.pg_timeout_s + p.collective_timeout_s + 120, **kw)
            for name, kw in SCENARIOS.items()}


def failure_metrics(failed: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    return dict(dead_rank_error_s=failed["rank exits, bucketer"]["seconds_to_error"],
                stalled_rank_error_s=failed["rank stalls, bucketer"]["seconds_to_error"],
                stalled_blocking_error_s=failed[BLOCKING]["seconds_to_error"],
                failures_raised=sum(f["error_type"] is not None for f in failed.values()))


def failure_text(failed: Mapping[str, Mapping[str, Any]]) -> str:
    return "\n".join(
        f"{name}: rank 0 raised {f['error_type']} after {f['seconds_to_error']:.2f} s (backend {f['backend']}, "
        f"TORCH_NCCL_ASYNC_ERROR_HANDLING={f['env_TORCH_NCCL_ASYNC_ERROR_HANDLING']})\n    {f['error'][:240]}"
        for name, f in failed.items())


# ----------------------------------------------------------------------------------------- figure
_TARGET = dict(color="C3", ls="--", lw=1)
_BAND = dict(color="0.85", zorder=0)


def _interval_bar(ax, x: float, e: Estimate, color: str, label: str | None = None) -> None:
    ax.errorbar([x], [e.value], yerr=[[e.value - e.low], [e.high - e.value]], fmt="D", color=color, ms=7,
                capsize=5, lw=2, zorder=3, label=label)


def _below(ax, ncol: int = 1, pad: float = 0.22) -> None:
    """The axes' legend under its x label: it covers nothing."""
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -pad), ncol=ncol)


def plot(a: Abba, b: Bucketing, failed: Mapping[str, Mapping[str, Any]], settings: BucketingSettings,
         targets: Sequence[Any]) -> Figure:
    """Top: the graded ratios with their 90% intervals and per-block values (the speed ratio like for like, our
    bucketer beside it, not graded; all-reduce on and beside the 8 MiB grid); middle: all-reduce throughput by
    size and the bucket-size sweep (range over rounds); bottom: windows and a failed peer. ``targets``: C9's
    registry targets (``get_claim("C9").targets``), drawn where they apply."""
    p, est = settings, a.estimates()
    targets = {t.metric: t for t in targets}
    fig, axes = plt.subplots(3, 2, figsize=(8, 13))
    # (0, 0) speed ratios: the graded like-for-like ratio first
    ax = axes[0, 0]
    pairs = [("ddp8_vs_ddp_default", DDP_DEFAULT, DDP8, "DDP 25 MiB\n/ DDP 8 MiB\n(graded)"),
             ("bucket_speedup_vs_ddp", DDP_DEFAULT, BUCKETER, "DDP 25 MiB\n/ bucketer\n8 MiB"),
             ("bucket8_vs_ddp8", DDP8, BUCKETER, "DDP 8 MiB\n/ bucketer\n8 MiB")]
    rng = np.random.default_rng(0)
    for i, (key, slow, fast, _) in enumerate(pairs):
        per_block = np.array(a.step_s[slow]) / np.array(a.step_s[fast])
        ax.plot(i + rng.uniform(-0.15, 0.15, per_block.size), per_block, ".", color="0.55", ms=4,
                label="one ABBA block" if i == 0 else None)
        label = {0: "graded: geometric mean, 90% interval", 1: "not graded: the same"}.get(i)
        _interval_bar(ax, i, est[key], "C3" if i == 0 else "C0", label=label)
    t = targets["ddp8_vs_ddp_default"]
    ax.axhspan(*t.no_effect, **_BAND, label=f"no-effect band {t.band_text()}")
    ax.axhline(t.lo, **_TARGET, label=f"post: 8 MiB no slower (>= {t.lo:g}x)")
    ax.set_xticks(range(len(pairs)), [label for *_, label in pairs], fontsize=8)
    ax.set(xlabel="set-ups compared (time of first / time of second)", ylabel="speed ratio (x)",
           title=f"micro-step speed, {len(a.step_s[BUCKETER])} ABBA blocks\nx {p.abba_steps} micro-step(s)")
    _below(ax, pad=0.3)
    # (0, 1) grid blocks
    ax = axes[0, 1]
    per_block = np.array(a.off_s_per_mib) / np.array(a.on_s_per_mib)
    sizes = sorted(set(a.grid_mb))
    for j, s in enumerate(sizes):
        idx = [i for i, g in enumerate(a.grid_mb) if g == s]
        ax.plot(idx, per_block[idx], "o", ms=4, color=f"C{j + 4}", label=f"{s:g} vs {s - 1:g} / {s + 1:g} MiB")
    e, t = est["aligned_throughput_ratio"], targets["aligned_throughput_ratio"]
    ax.axhspan(*t.no_effect, **_BAND, label=f"no-effect band {t.band_text()}")
    ax.axhline(t.lo, **_TARGET, label=f"post: >= {t.lo:g}x on the grid")
    ax.axhline(e.value, color="k", lw=1.5, label=f"graded: geometric mean {e.value:.3f}x")
    ax.axhspan(e.low, e.high, color="C3", alpha=0.2, label=f"90% interval [{e.low:.3f}, {e.high:.3f}]")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="grid block (off, on, on, off)", ylabel="per-byte throughput ratio (x)",
           title=f"all-reduce on vs beside the 8 MiB grid\n{len(a.grid_mb)} blocks (graded)")
    _below(ax, ncol=2)
    # (1, 0) throughput by size
    ax = axes[1, 0]
    thr = a.throughput_by_size()
    for side, color, dx in (("on", "C3", -0.12), ("off", "C0", 0.12)):
        x = np.arange(len(sizes)) + dx
        med = [np.median(thr[side][s]) for s in sizes]
        lo = [np.percentile(thr[side][s], 25) for s in sizes]
        hi = [np.percentile(thr[side][s], 75) for s in sizes]
        ax.errorbar(x, med, yerr=[np.subtract(med, lo), np.subtract(hi, med)], fmt="o", color=color, capsize=4,
                    label="s MiB (on the grid)" if side == "on" else "s - 1 and s + 1 MiB (beside it)")
    ax.set_xticks(range(len(sizes)), [f"{s:g}" for s in sizes])
    ax.set(xlabel="grid size s (MiB)", ylabel="all-reduce GB/s", ylim=(0, None),
           title="all-reduce throughput by size\n(median, interquartile range over blocks)")
    _below(ax)
    # (1, 1) sweep, evenly spaced sizes (no overlapping tick labels), range over rounds
    ax = axes[1, 1]
    bsizes = sorted(b.bucket_sizes_mb)
    x = np.arange(len(bsizes))
    mid = [b.bucketer[s] * 1e3 for s in bsizes]
    spread = [b.spread_s(f"bucketer {s:g} MiB") for s in bsizes]
    ax.errorbar(x, mid, yerr=[[m - lo * 1e3 for m, (lo, _) in zip(mid, spread)],
                              [hi * 1e3 - m for m, (_, hi) in zip(mid, spread)]],
                fmt="o-", capsize=4, color="C0", label="bucketer (median, range over rounds)")
    off = [i for i, s in enumerate(bsizes) if s % BUCKET]
    ax.plot(x[off], [mid[i] for i in off], "x", color="C3", ms=10, label="not a multiple of 8 MiB")
    for label, color, ls in ((DDP_DEFAULT, "C1", "--"), (DDP8, "C2", "--"), ("no communication", "k", ":")):
        ax.axhline(b.step_s(label) * 1e3, color=color, ls=ls, label=label)
    ax.set_xticks(x, [f"{s:g}" for s in bsizes])
    ax.set(xlabel="bucket size (MiB)", ylabel="ms per micro-step", ylim=(0, None),
           title=f"bucket-size sweep (not graded), {p.rounds} round(s)\n{b.n_params / 1e6:.1f}M params, "
                 f"{p.world_size} gloo ranks")
    _below(ax)
    # (2, 0) windows
    ax = axes[2, 0]
    labels = [BUCKETER] + [window_label(w) for w in p.windows_ms]
    ax.bar(range(len(labels)), [b.by[x]["collectives_per_step"] for x in labels], color="C0",
           label="collectives / micro-step (left)")
    ax2 = ax.twinx()
    ax2.plot(range(len(labels)), [b.by[x]["step_s"] * 1e3 for x in labels], "ko-", label="ms / micro-step (right)")
    ax.set_xticks(range(len(labels)), ["no window"] + [f"{w:g} ms" for w in p.windows_ms])
    ax.set(xlabel="window", ylabel="collectives per micro-step", title="windows: fewer collectives,\nlarger batch")
    ax2.set(ylabel="ms per micro-step", ylim=(0, None))
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22))
    # (2, 1) failures
    ax = axes[2, 1]
    names = list(failed)
    ax.barh(range(len(names)), [failed[n]["seconds_to_error"] for n in names], color=["C3", "C1", "C7"])
    ax.axvline(p.collective_timeout_s, color="C1", ls="--", lw=1,
               label=f"bucketer timeout {p.collective_timeout_s:g} s")
    ax.axvline(p.pg_timeout_s, color="C7", ls="--", lw=1, label=f"process-group timeout {p.pg_timeout_s:g} s")
    ax.set_yticks(range(len(names)), [_scenario_label(n) for n in names], fontsize=8)
    ax.set(xlabel="seconds until rank 0 raises", ylabel="rank 1 fails after one step",
           title="a failed peer on gloo\n(NCCL: not testable here)")
    _below(ax)
    fig.tight_layout()
    return fig


def _scenario_label(name: str) -> str:
    """A failure scenario's name on three short lines (the environment variable is long)."""
    return name.replace(", TORCH_NCCL_ASYNC_ERROR_HANDLING=0", ",\nERROR_HANDLING=0").replace(", ", ",\n", 1)


# ----------------------------------------------------------------------------------------- verdict
def verdict_texts(a: Abba, b: Bucketing, metrics: Mapping[str, float], settings: BucketingSettings,
                  tokens: int) -> dict[str, str]:
    """``scale``, ``measured_text`` and ``note`` for ``get_claim("C9").grade``."""
    p, m, e = settings, metrics, a.estimates()
    last = f"{p.windows_ms[-1]:g}"
    no_window = b.by[BUCKETER]
    thr = a.throughput_by_size()
    fastest = max(((s, side) for side in thr for s in thr[side]), key=lambda k: np.median(thr[k[1]][k[0]]))
    scale = (f"{b.n_params / 1e6:.1f}M-param GPT-2-style decoder, fp32 gradients, {tokens} tokens/rank, "
             f"{p.world_size} gloo ranks on loopback; {len(a.step_s[BUCKETER])} ABBA blocks x {p.abba_steps} "
             f"micro-steps per set-up, {len(a.grid_mb)} grid blocks x {p.alignment_repeats} all-reduces per buffer, "
             f"in one launch; {describe(machine_info())}")
    measured = (f"micro-step speed, like for like, DDP 25 MiB / DDP 8 MiB (graded) "
                f"{e['ddp8_vs_ddp_default'].describe()}; all-reduce per byte on the 8 MiB grid / beside it (graded) "
                f"{e['aligned_throughput_ratio'].describe()}; our bucketer (not graded: it mixes the implementation "
                f"into the bucket size): DDP 25 MiB / bucketer 8 MiB {e['bucket_speedup_vs_ddp'].describe()}, "
                f"DDP 8 MiB / bucketer 8 MiB {e['bucket8_vs_ddp8'].describe()}")
    side = "on the grid" if fastest[1] == "on" else "beside it"
    note = (f"gradients equal the explicit average (max difference {m['max_grad_error_vs_average']:.1e}); the "
            f"fastest buffer per byte was the one {side} at grid size {fastest[0]:g} MiB (median over blocks); "
            f"a {p.windows_ms[0]:g} ms window here is k = {int(m['window_first_k'])} micro-step(s) of "
            f"{no_window['step_s'] * 1e3:.0f} ms; a {last} ms window cuts collectives per micro-step "
            f"{no_window['collectives_per_step']:.1f} -> {m[f'window_{last}ms_collectives_per_step']:.2f} "
            f"({m[f'window_{last}ms_throughput_gain']:.2f}x throughput) by growing the effective batch "
            f"{int(m[f'window_{last}ms_k'])}x. Error handling: on gloo a dead rank raised in "
            f"{m['dead_rank_error_s']:.2f} s, a stalled one after the bucketer's {p.collective_timeout_s:g} s "
            f"timeout ({m['stalled_rank_error_s']:.1f} s), a blocking all-reduce only after the process group's "
            f"{p.pg_timeout_s:g} s ({m['stalled_blocking_error_s']:.1f} s); TORCH_NCCL_ASYNC_ERROR_HANDLING is read "
            "by NCCL only and did nothing here. Setting it to 0 disables the watchdog's abort (default 3), which "
            "turns such failures into hangs: not testable here (needs >= 2 GPUs), and not advisable")
    return {"scale": scale, "measured_text": measured, "note": note}
