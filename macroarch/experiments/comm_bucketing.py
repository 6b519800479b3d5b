"""Notebook 07's experiments (claim C9, post section 4.2): gradient buckets on the 8 MB grid, 200 ms all-reduce
windows, and what a failed peer does (the post's ``NCCL_ASYNC_ERROR_HANDLING=0``).

The measurements are ``macroarch.measure.comm_bench``'s, on gloo ranks on loopback launched with torchrun's
environment; this module chooses the set-ups, reads the numbers the grading rule needs, and draws them:

- :func:`bucketing`: a micro-step (forward, backward, gradient sync) of the same GPT-2-style decoder under no
  communication, DDP (its default 25 MiB buckets and 8 MiB ones), ``GradientBucketer`` at each bucket size and
  with each window; the graded ``bucket_speedup_vs_ddp`` = DDP-default time / 8 MiB-bucketer time, and the
  synchronised gradients against an explicit average;
- :func:`alignment`: one all-reduce per buffer size on and beside the 8 MiB grid (bucket counts do not change),
  the graded ``aligned_throughput_ratio``;
- :func:`windows`: collectives per micro-step and throughput with ``window_ms``;
- :func:`failures`: a rank that exits or stalls, with the bucketer's timeout and with a blocking all-reduce that
  only the process group's timeout ends. ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` is NCCL-only: set, it changes
  nothing on gloo, which the result shows.

Nothing here computes in a 16-bit dtype: the gradients are fp32, as DDP's buckets are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.figure import Figure

from macroarch.comm import MiB
from macroarch.experiments.hardware import describe, machine_info
from macroarch.experiments.settings import Settings
from macroarch.measure.comm_bench import all_reduce_times, bucket_summary, compare_bucketing, dead_rank
from macroarch.measure.workload import Workload

BUCKET = 8
"""The post's bucket multiple, MiB."""
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
    """Bucketer sizes, MiB; those that are not multiples of 8 are the contrast. Must include 8 (the graded one)."""
    windows_ms: tuple[float, ...]
    """Window lengths, ms: the post's 200 ms, and one of several micro-steps here."""
    alignment_sizes_mb: tuple[float, ...]
    """One all-reduce each: buffers on and off the 8 MiB grid."""
    alignment_repeats: int
    """All-reduces per size (the fastest counts)."""
    steps: int
    """Timed micro-steps per set-up and round (windows: until a window closes)."""
    rounds: int
    """Set-ups take turns this many times, so that load from elsewhere hits them alike."""
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
    """Untimed micro-steps per set-up and round."""
    world_size: int = 2
    """Gloo ranks on loopback."""

    def __post_init__(self) -> None:
        self._positive("d_model", "n_layers", "n_heads", "seq_len", "alignment_repeats", "steps", "rounds",
                       "collective_timeout_s", "pg_timeout_s", "threads", "batch_size")
        self._non_negative("warmup")
        self._non_empty("bucket_sizes_mb", "windows_ms", "alignment_sizes_mb")
        if self.d_model % self.n_heads:
            self._fail("n_heads", f"a divisor of d_model {self.d_model}")
        if BUCKET not in self.bucket_sizes_mb:
            self._fail("bucket_sizes_mb", f"a list holding {BUCKET} (the graded bucket size)")
        if any(not x > 0 for x in (*self.bucket_sizes_mb, *self.windows_ms, *self.alignment_sizes_mb)):
            self._fail("bucket_sizes_mb", "positive sizes (as windows_ms and alignment_sizes_mb)")
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


@dataclass
class Bucketing:
    """:func:`compare_bucketing` rows by label, and the times the verdict reads."""

    rows: list[dict[str, Any]]
    bucket_sizes_mb: list[float]
    n_params: int

    @property
    def by(self) -> dict[str, dict[str, Any]]:
        return {r["label"]: r for r in self.rows}

    @property
    def bucketer(self) -> dict[float, float]:
        """Micro-step seconds of the bucketer at each size (no window)."""
        return {mb: self.by[f"bucketer {mb:g} MiB"]["step_s"] for mb in self.bucket_sizes_mb}

    def step_s(self, label: str) -> float:
        return self.by[label]["step_s"]

    @property
    def best_multiple(self) -> float:
        bucketer = self.bucketer
        return min((mb for mb in self.bucket_sizes_mb if mb % BUCKET == 0), key=bucketer.get)

    def metrics(self) -> dict[str, float]:
        b, local = self.bucketer, self.step_s("no communication")
        ddp_default, ddp8 = self.step_s("DDP 25 MiB (default)"), self.step_s(f"DDP {BUCKET} MiB")
        errors = [r["max_grad_error"] for r in self.rows if r["setup"]["kind"] != "local"]
        m = dict(bucket_speedup_vs_ddp=ddp_default / b[BUCKET], bucket8_vs_ddp8=ddp8 / b[BUCKET],
                 best_multiple_of_8_mb=self.best_multiple,
                 best_multiple_of_8_speedup_vs_ddp=ddp_default / b[self.best_multiple],
                 ddp_default_step_ms=ddp_default * 1e3, ddp8_step_ms=ddp8 * 1e3, local_step_ms=local * 1e3,
                 sync_overhead_ddp_default=ddp_default / local - 1, sync_overhead_bucketer8=b[BUCKET] / local - 1,
                 max_grad_error_vs_average=max(errors), n_params=self.n_params,
                 **{f"bucketer_{mb:g}mb_step_ms".replace(".", "_"): s * 1e3 for mb, s in b.items()})
        if 24 in b and 25 in b:  # the same size class, one a multiple of 8 and one not
            m["non_multiple_25_vs_24"] = b[25] / b[24]
        if {8, 12, 16} <= set(b):
            m["non_multiple_12_vs_8_16"] = b[12] / ((b[8] + b[16]) / 2)
        return m

    def text(self) -> str:
        m = self.metrics()
        lines = [bucket_summary(self.rows),
                 f"DDP (25 MiB default) / bucketer 8 MiB: {m['bucket_speedup_vs_ddp']:.3f}x; DDP 8 MiB / bucketer "
                 f"8 MiB: {m['bucket8_vs_ddp8']:.3f}x; best multiple of 8: {self.best_multiple:g} MiB "
                 f"({m['best_multiple_of_8_speedup_vs_ddp']:.3f}x)",
                 f"sync overhead over compute alone: DDP {m['sync_overhead_ddp_default']:.1%}, bucketer 8 MiB "
                 f"{m['sync_overhead_bucketer8']:.1%}; largest gradient difference from the explicit average: "
                 f"{m['max_grad_error_vs_average']:.2e}"]
        if "non_multiple_25_vs_24" in m:
            lines.append(f"not a multiple of 8: 25 MiB / 24 MiB = {m['non_multiple_25_vs_24']:.3f}x; 12 MiB / "
                         f"mean(8, 16 MiB) = {m.get('non_multiple_12_vs_8_16', float('nan')):.3f}x (1.0 = no effect)")
        return "\n".join(lines)


def setups(bucket_sizes_mb: Sequence[float], windows_ms: Sequence[float]) -> list[dict[str, Any]]:
    """No communication, DDP (default and 8 MiB buckets), the bucketer at each size, and with each window."""
    return ([{"kind": "local"}, {"kind": "ddp", "bucket_mb": None}, {"kind": "ddp", "bucket_mb": BUCKET}]
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


@dataclass
class Alignment:
    sizes_mb: list[float]
    seconds: list[float]

    @property
    def throughput(self) -> list[float]:
        """GB/s (buffer bytes / time) of each size."""
        return [mb * MiB / t / 1e9 for mb, t in zip(self.sizes_mb, self.seconds)]

    @property
    def ratio(self) -> float:
        """Mean throughput of the sizes on the 8 MiB grid / mean of the others."""
        on = [g for mb, g in zip(self.sizes_mb, self.throughput) if mb % BUCKET == 0]
        off = [g for mb, g in zip(self.sizes_mb, self.throughput) if mb % BUCKET]
        return float(np.mean(on) / np.mean(off))

    def text(self) -> str:
        return ("all-reduce GB/s by buffer size: "
                + ", ".join(f"{mb:g} MiB {g:.2f}" for mb, g in zip(self.sizes_mb, self.throughput))
                + f"\nmultiples of 8 MiB / other sizes: {self.ratio:.3f}x (1.0 = no effect)")


def alignment(settings: BucketingSettings, run: Any = None) -> Alignment:
    """One fp32 all-reduce of each ``alignment_sizes_mb`` buffer, the fastest of ``alignment_repeats``."""
    p = settings
    a = Alignment(list(p.alignment_sizes_mb), all_reduce_times(p.alignment_sizes_mb,
                                                                  repeats=p.alignment_repeats,
                                                                  world_size=p.world_size, threads=p.threads))
    if run is not None:
        for i, (mb, t, g) in enumerate(zip(a.sizes_mb, a.seconds, a.throughput)):
            run.log(step=i, alignment_mb=mb, alignment_ms=t * 1e3, alignment_GBps=g)
    return a


def windows(b: Bucketing, windows_ms: Sequence[float]) -> tuple[dict[str, float], str]:
    """Per window: k (micro-steps of the last window), collectives per micro-step, throughput against no window;
    the metrics and a text."""
    base, m, lines = b.by[f"bucketer {BUCKET} MiB"], {}, []
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


def plot(b: Bucketing, a: Alignment, failed: Mapping[str, Mapping[str, Any]], settings: BucketingSettings) -> Figure:
    """Step time by bucket size against DDP; windows; a failed peer; all-reduce throughput on and off the grid."""
    p = settings
    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    axes = axes.ravel()
    ax = axes[3]
    ax.plot(a.sizes_mb, a.throughput, "o-", color="C0")
    for mb, gbps in zip(a.sizes_mb, a.throughput):
        if mb % BUCKET == 0:
            ax.plot([mb], [gbps], "o", ms=10, mfc="none", color="C3")
    ax.set(xlabel="all-reduce buffer (MiB); circled: multiples of 8", ylabel="GB/s (buffer bytes / time)",
           title=f"one all-reduce per size: multiples of 8 / others = {a.ratio:.2f}x", ylim=(0, None))
    ax = axes[0]
    bucketer = b.bucketer
    sizes = sorted(bucketer)
    ax.semilogx(sizes, [bucketer[s] * 1e3 for s in sizes], "o-", label="GradientBucketer")
    for s in sizes:
        if s % BUCKET:
            ax.semilogx([s], [bucketer[s] * 1e3], "rx", ms=9)
    ax.axhline(b.step_s("DDP 25 MiB (default)") * 1e3, color="C1", ls="--", label="DDP 25 MiB (default)")
    ax.axhline(b.step_s(f"DDP {BUCKET} MiB") * 1e3, color="C2", ls="--", label="DDP 8 MiB")
    ax.axhline(b.step_s("no communication") * 1e3, color="k", ls=":", label="no communication")
    ax.set_xticks(sizes, [f"{s:g}" for s in sizes])
    ax.set(xlabel="bucket size (MiB); x = not a multiple of 8", ylabel="ms per micro-step",
           title=f"{b.n_params / 1e6:.1f}M params, {p.world_size} gloo ranks", ylim=(0, None))
    ax.legend(fontsize=7)
    ax = axes[1]
    labels = [f"bucketer {BUCKET} MiB"] + [window_label(w) for w in p.windows_ms]
    ax.bar(range(len(labels)), [b.by[x]["collectives_per_step"] for x in labels], color="C0",
           label="collectives / micro-step")
    ax2 = ax.twinx()
    ax2.plot(range(len(labels)), [b.by[x]["step_s"] * 1e3 for x in labels], "ko-", label="ms / micro-step")
    ax.set_xticks(range(len(labels)), ["no window"] + [f"{w:g} ms" for w in p.windows_ms])
    ax.set(ylabel="collectives per micro-step", title="windows: fewer collectives, larger effective batch")
    ax2.set(ylabel="ms per micro-step", ylim=(0, None))
    ax.legend(loc="upper right", fontsize=7)
    ax = axes[2]
    names = list(failed)
    ax.barh(range(len(names)), [failed[n]["seconds_to_error"] for n in names], color=["C3", "C1", "C7"])
    ax.axvline(p.collective_timeout_s, color="C1", ls="--", lw=1,
               label=f"bucketer timeout {p.collective_timeout_s:g} s")
    ax.axvline(p.pg_timeout_s, color="C7", ls="--", lw=1, label=f"process-group timeout {p.pg_timeout_s:g} s")
    ax.set_yticks(range(len(names)), [n.replace(", ", "\n", 1) for n in names], fontsize=7)
    ax.set(xlabel="seconds until rank 0 raises", title="a failed peer on gloo (NCCL: not testable here)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def verdict_texts(b: Bucketing, metrics: Mapping[str, float], settings: BucketingSettings,
                  tokens: int) -> dict[str, str]:
    """``scale``, ``measured_text`` and ``note`` for ``get_claim("C9").grade``."""
    p, m = settings, metrics
    last = f"{p.windows_ms[-1]:g}"
    no_window = b.by[f"bucketer {BUCKET} MiB"]
    scale = (f"{b.n_params / 1e6:.1f}M-param GPT-2-style decoder, fp32 gradients, {tokens} tokens/rank, "
             f"{p.world_size} gloo ranks on loopback, {p.rounds} rounds x {p.steps} micro-steps per set-up; "
             f"{describe(machine_info())}")
    measured = (f"DDP default / bucketer 8 MiB = {m['bucket_speedup_vs_ddp']:.3f}x (DDP 8 MiB / bucketer 8 MiB "
                f"{m['bucket8_vs_ddp8']:.3f}x, best multiple of 8: {m['best_multiple_of_8_mb']:g} MiB "
                f"{m['best_multiple_of_8_speedup_vs_ddp']:.3f}x; all fp32 on {machine_info()['cpu_capability']}); "
                f"all-reduce throughput on the 8 MiB grid / off it {m['aligned_throughput_ratio']:.3f}x")
    note = (f"gradients equal the explicit average (max difference {m['max_grad_error_vs_average']:.1e}); "
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
