"""Notebook 03's experiment: under ZeRO-3, the share of a step spent in parameter sync (claim C5, section 2.2).

The post: "once communication latency exceeds 200 us, parameter synchronisation takes over 38% of each
training step". It names no model, cluster or batch; the setting here is GPT-3 175B (its section 2.2) on
8x A100 (section 4.2), with LLaMA-65B and a ~10B Llama beside it. The model is ``macroarch.measure.zero3``
(alpha-beta ring collectives, ``3 L + 2`` per step, Kaplan FLOPs over peak x MFU; serial and FSDP-overlapped).

- :func:`post_setting`: the share against latency per model, the share at 200 us, the latency where it
  reaches 38% (serial and overlapped), and the training state each GPU holds;
- :func:`sensitivity`: the share at 200 us over what the post leaves open, tokens per GPU and MFU;
- :func:`calibrate`: this machine's collectives timed on gloo ranks (``macroarch.measure.calibrate``) and the
  alpha-beta fit per collective; :func:`check_here`: the model with the fitted link and measured compute
  beside a real FSDP2 step on those ranks;
- packed weights (issue 18): on the same ranks (:func:`packed_ranks`, run after the calibration), the same
  GPT-2-style model trained a few steps under FSDP2 in bf16 and with its blocks' matmul weights as MVAS fp8 / fp4
  (``macroarch.mvas.interop.fsdp.fully_shard``, ``MVASAdamW``); the bytes each all-gather carried are counted at the
  collective (``macroarch.measure.fsdp_bytes.count_collectives``), with each rank's weight, gradient and optimizer
  bytes. :func:`packed_payload` turns them into bytes gathered per parameter of a block, and :func:`packed_shares`
  feeds that measured payload into the ZeRO-3 model of the post's setting: the sync share with packed weights.

What is graded: ``sync_share_at_200us``, the bf16 model's share for the graded model at 200 us, is a **model output**:
arithmetic on the parameters typed into the notebook (A100 peak, MFU, NVLink bandwidth; the gloo calibration does not
enter it). :func:`sync_share_estimate` records it as ``modelled`` with the model's validation error, from the one
place where the same model meets a measurement (:func:`check_here`: its sync time against a real FSDP2 step's), as
its interval; the registry grades it "not testable here" and names the measurement that would test it.

Deviations of the packed line: the payload per parameter is measured on the small model's blocks, whose biases
and norms stay bf16 (a larger share of a d=64 block than of a GPT-3 block, so the measured bytes per parameter
are if anything too high); the ZeRO-3 model applies it to every unit, the root (embeddings, 0.4% of GPT-3) too.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import NullLocator

from macroarch._table import format_table
from macroarch.experiments.settings import Settings
from macroarch.measure.calibrate import measure_zero3
from macroarch.measure.memory import format_bytes, parameter_count, training_state_bytes
from macroarch.measure.stats import MODELLED, Estimate
from macroarch.measure.workload import Workload, lm_loss
from macroarch.measure.zero3 import Cluster, StepTime, fit_alpha_beta, latency_for_share, zero3_step
from macroarch.models import ModelSpec, get_model_spec

POST_LATENCY = 200e-6
"""The latency of the claim, seconds per ring step."""
TOKEN_GRID = (512, 1024, 2048, 4096, 8192, 16384)
"""Tokens per GPU per step that the sensitivity sweeps."""
FITTED_OPS = ("all_gather", "reduce_scatter")
PLAIN = "bf16"
"""The format name of the dense baseline: FSDP2 with bf16 weights (``torch.distributed.fsdp.fully_shard``)."""
PACKED_RULE = "transformer.h.*.weight"
"""The weights packed: every block's matmul weights (the plan keeps norms and biases in bf16)."""


@dataclass(frozen=True)
class Zero3Settings(Settings):
    """Notebook 03's settings: its parameters cell, less ``profile`` (``Zero3Settings.from_params(params)``)."""

    sweep_points: int
    """Latencies in the sweep."""
    calibration_sizes_log2: tuple[int, int]
    """Gathered bytes ``2**a`` ... ``2**b`` timed on the gloo ranks, every power of 4."""
    calibration_repeats: int
    """Timings per size; each rank keeps its fastest."""
    fsdp_d_model: int
    """Width of the GPT-2-style model of the FSDP2 check."""
    fsdp_layers: int
    """Its layers (one FSDP unit each)."""
    fsdp_heads: int
    """Its attention heads; must divide ``fsdp_d_model``."""
    fsdp_seq_len: int
    """Tokens per sequence of the FSDP2 check."""
    fsdp_steps: int
    """FSDP2 steps timed."""
    threads: int
    """Torch threads per rank."""
    seed: int = 0
    """Weights and batches of the FSDP2 check."""
    model: str = "gpt3_175b"
    """The post's section-2.2 model; graded."""
    other_models: tuple[str, ...] = ("llama_65b", "llama_10b")
    """Shown beside it."""
    world_size_post: int = 8
    """GPUs of the post's setting (8x A100, section 4.2)."""
    micro_batch: int = 1
    """Sequences per GPU per step."""
    seq_len: int = 2048
    """Tokens per sequence."""
    a100_peak_tflops: float = 312.0
    """Dense bf16 tensor-core peak (A100 datasheet)."""
    mfu: float = 0.5
    """Model FLOPs utilisation (Megatron-LM on A100: ~52%)."""
    nvlink_GBps: float = 300.0
    """NVLink3 bandwidth each way per GPU."""
    bus_efficiency: float = 0.8
    """Share of it collectives reach."""
    param_bytes: int = 2
    """Bytes per gathered parameter (bf16)."""
    grad_bytes: int = 2
    """Bytes per reduce-scattered gradient element (bf16)."""
    share_target: float = 0.38
    """The post's share of the step."""
    latency_range_us: tuple[float, float] = (1.0, 1000.0)
    """Latencies swept, microseconds per ring step."""
    fsdp_batch: int = 2
    """Sequences per rank of the FSDP2 check."""
    world_size: int = 2
    """Gloo ranks on this machine."""
    packed_formats: tuple[str, ...] = ("bf16", "fp8", "fp4")
    """bf16 (the dense baseline, first), then MVAS formats of the blocks' matmul weights."""
    packed_block_size: int = 32
    """Elements per fp32 scale (a divisor of it where it does not cut every shard)."""
    packed_steps: int = 1
    """Training steps counted per format."""

    def __post_init__(self) -> None:
        self._positive("sweep_points", "calibration_repeats", "fsdp_d_model", "fsdp_layers", "fsdp_heads",
                       "fsdp_seq_len", "fsdp_steps", "threads", "world_size_post", "micro_batch", "seq_len",
                       "a100_peak_tflops", "mfu", "nvlink_GBps", "bus_efficiency", "param_bytes", "grad_bytes",
                       "share_target", "fsdp_batch", "world_size", "packed_block_size", "packed_steps")
        self._fraction("mfu", "bus_efficiency", "share_target")
        if self.fsdp_d_model % self.fsdp_heads:
            self._fail("fsdp_heads", f"a divisor of fsdp_d_model {self.fsdp_d_model}")
        if len(self.calibration_sizes_log2) != 2 or self.calibration_sizes_log2[0] > self.calibration_sizes_log2[1]:
            self._fail("calibration_sizes_log2", "[a, b] with a <= b")
        if len(self.latency_range_us) != 2 or not 0 < self.latency_range_us[0] < self.latency_range_us[1]:
            self._fail("latency_range_us", "[low, high] microseconds with 0 < low < high")
        if not self.packed_formats or self.packed_formats[0] != PLAIN:
            self._fail("packed_formats", f"a list starting with the dense baseline {PLAIN!r}")
        if self.world_size < 2:
            self._fail("world_size", "at least 2 (a collective needs two ranks)")

    @property
    def cluster(self) -> Cluster:
        return a100_cluster(self.world_size_post, self.nvlink_GBps, self.bus_efficiency, self.a100_peak_tflops,
                            self.mfu)

    @property
    def latencies(self) -> np.ndarray:
        return latency_grid(list(self.latency_range_us), self.sweep_points)

    @property
    def workload(self) -> Workload:
        """The GPT-2-style model and batch of the FSDP2 check."""
        return Workload(d_model=self.fsdp_d_model, n_layers=self.fsdp_layers, n_heads=self.fsdp_heads,
                        seq_len=self.fsdp_seq_len, batch_size=self.fsdp_batch, seed=self.seed)

    @property
    def packed(self) -> dict[str, Any]:
        """:func:`packed_ranks`' keyword arguments."""
        return dict(formats=list(self.packed_formats), block_size=self.packed_block_size, steps=self.packed_steps)


def latency_grid(range_us: list[float], points: int) -> np.ndarray:
    """``points`` latencies in seconds, log-spaced over ``range_us`` (microseconds)."""
    return np.logspace(np.log10(range_us[0] * 1e-6), np.log10(range_us[1] * 1e-6), points)


def a100_cluster(world_size: int, nvlink_GBps: float, bus_efficiency: float, peak_tflops: float,
                 mfu: float) -> Cluster:
    """``world_size`` A100 SXM on NVLink3 through NVSwitch, at the claim's 200 us latency."""
    return Cluster(f"{world_size}x A100 SXM, NVLink3 via NVSwitch", world_size, latency=POST_LATENCY,
                   bandwidth=nvlink_GBps * 1e9 * bus_efficiency, peak_flops=peak_tflops * 1e12, mfu=mfu)


def share_curve(spec: ModelSpec, cluster: Cluster, tokens: int, latencies: np.ndarray,
                **kw) -> tuple[np.ndarray, np.ndarray]:
    """Share of the step in parameter sync at each latency: ``(serial, overlapped)``."""
    steps = [zero3_step(spec, cluster.with_latency(a), tokens, **kw) for a in latencies]
    return np.array([s.share_serial for s in steps]), np.array([s.share_overlapped for s in steps])


@dataclass(frozen=True)
class ModelShare:
    spec: ModelSpec
    at_200us: StepTime
    serial: np.ndarray
    overlapped: np.ndarray
    crossing: tuple[float | None, float | None]
    """Latency (s) where the share reaches the target, serial and overlapped; None: never (below 10 s)."""
    state_per_gpu: float
    """bf16 mixed-precision training state (16 B/param) sharded over the ranks."""


@dataclass(frozen=True)
class PostSetting:
    cluster: Cluster
    tokens: int
    latencies: np.ndarray
    share_target: float
    graded: str
    """The model the claim is graded on; its metrics carry no prefix."""
    models: dict[str, ModelShare]

    def metrics(self) -> dict[str, float]:
        m: dict[str, float] = {}
        for name, s in self.models.items():
            key = "" if name == self.graded else f"{name}_"
            step = s.at_200us
            m |= {f"{key}sync_share_at_200us": step.share_serial,
                  f"{key}sync_share_at_200us_overlapped": step.share_overlapped,
                  f"{key}compute_s": step.compute, f"{key}sync_s_at_200us": step.comm,
                  f"{key}latency_part_s_at_200us": step.latency_part, f"{key}collectives_per_step": step.collectives,
                  f"{key}state_bytes_per_gpu": s.state_per_gpu}
            for suffix, latency in zip(("", "_overlapped"), s.crossing):
                if latency is not None:
                    m[f"{key}latency_at_38pct{suffix}_us"] = latency * 1e6
        return m

    def series(self) -> list[tuple[int, dict[str, float]]]:
        """``(index, values)`` rows for ``run.log``: the share curves against latency."""
        return [(i, {k: v for name, s in self.models.items() for k, v in (
            (f"{name}_latency_us", a * 1e6), (f"{name}_share", s.serial[i]),
            (f"{name}_share_overlapped", s.overlapped[i]))}) for i, a in enumerate(self.latencies)]

    def table(self) -> str:
        rows = [("model", "params", "state/GPU", "collectives", "compute s", "sync s @200us", "share @200us",
                 "overlapped", "38% reached at (serial / overlapped)")]
        for name, s in self.models.items():
            us = " / ".join("never" if c is None else f"{c * 1e6:.0f} us" for c in s.crossing)
            step = s.at_200us
            rows.append((name, f"{parameter_count(s.spec) / 1e9:.1f}B", format_bytes(s.state_per_gpu, "GB", 0),
                         step.collectives, f"{step.compute:.2f}", f"{step.comm:.2f}", f"{step.share_serial:.1%}",
                         f"{step.share_overlapped:.1%}", us))
        return (format_table(rows) + f"\n(state/GPU: bf16 mixed-precision training state, 16 B/param, sharded over "
                f"{self.cluster.world_size} GPUs; an A100 has 80 GB)")


def post_setting(models: list[str], cluster: Cluster, tokens: int, latencies: np.ndarray, share_target: float, *,
                 seq_len: int, param_bytes: int, grad_bytes: int) -> PostSetting:
    """Every model of ``models`` on ``cluster``; the first is the graded one."""
    kw = dict(seq_len=seq_len, param_bytes=param_bytes, grad_bytes=grad_bytes)
    shares = {}
    for name in models:
        spec = get_model_spec(name)
        shares[name] = ModelShare(
            spec, zero3_step(spec, cluster.with_latency(POST_LATENCY), tokens, **kw),
            *share_curve(spec, cluster, tokens, latencies, **kw),
            tuple(latency_for_share(spec, cluster, tokens, share_target, overlap=o, **kw) for o in (False, True)),
            training_state_bytes(spec, "bf16_mixed")["total"] / cluster.world_size)
    return PostSetting(cluster, tokens, latencies, share_target, models[0], shares)


@dataclass(frozen=True)
class Sensitivity:
    model: str
    tokens: tuple[int, ...]
    shares: dict[float, list[float]]
    """Serial share at 200 us per MFU, one per entry of ``tokens``."""

    def metrics(self) -> dict[str, float]:
        return {"sync_share_at_200us_max_over_sensitivity": max(max(s) for s in self.shares.values())}

    def text(self) -> str:
        return "\n".join(f"MFU {m:.2f}: share at 200 us for {list(self.tokens)} tokens/GPU: "
                         + ", ".join(f"{s:.1%}" for s in shares) for m, shares in self.shares.items())


def sensitivity(model: str, cluster: Cluster, *, seq_len: int, param_bytes: int, grad_bytes: int,
                tokens: tuple[int, ...] = TOKEN_GRID) -> Sensitivity:
    """The serial share at 200 us over tokens per GPU and MFU 0.3, the cluster's, 0.7."""
    spec = get_model_spec(model)
    base = cluster.with_latency(POST_LATENCY)
    return Sensitivity(model, tuple(tokens), {
        m: [zero3_step(spec, replace(base, mfu=m), t, seq_len=seq_len, param_bytes=param_bytes,
                       grad_bytes=grad_bytes).share_serial for t in tokens]
        for m in sorted({0.3, cluster.mfu, 0.7})})


@dataclass(frozen=True)
class Calibration:
    """Collectives timed on this machine's ranks (``measure_zero3``'s result) and one alpha-beta fit each."""

    measured: dict
    fits: dict[str, tuple[float, float]]
    """``(alpha seconds, bandwidth bytes/s)`` of all-gather and reduce-scatter."""

    @property
    def world_size(self) -> int:
        return self.measured["world_size"]

    def ring_seconds(self, op: str, nbytes):
        """The fitted ring time of ``op`` for ``nbytes`` (a number or an array)."""
        a, b = self.fits[op]
        n = self.world_size
        return (n - 1) * a + (n - 1) / n * nbytes / b

    def metrics(self) -> dict[str, float]:
        (alpha, bandwidth), (rs_alpha, rs_bandwidth) = self.fits["all_gather"], self.fits["reduce_scatter"]
        return dict(here_alpha_us=alpha * 1e6, here_bandwidth_GBps=bandwidth / 1e9, here_rs_alpha_us=rs_alpha * 1e6,
                    here_rs_bandwidth_GBps=rs_bandwidth / 1e9)

    def series(self) -> list[tuple[int, dict[str, float]]]:
        seconds = self.measured["seconds"]
        return [(i, {"calibration_bytes": s, "all_gather_s": seconds["all_gather"][i],
                     "reduce_scatter_s": seconds["reduce_scatter"][i], "all_reduce_s": seconds["all_reduce"][i]})
                for i, s in enumerate(self.measured["sizes"])]

    def table(self) -> str:
        seconds = self.measured["seconds"]
        rows = [("bytes", *(f"{op} ms" for op in seconds), "fit AG / RS ms")]
        for i, s in enumerate(self.measured["sizes"]):
            rows.append((s, *(f"{seconds[op][i] * 1e3:.3f}" for op in seconds),
                         " / ".join(f"{self.ring_seconds(op, s) * 1e3:.3f}" for op in FITTED_OPS)))
        fits = [f"fit {op}: alpha = {a * 1e6:.1f} us per ring step, B = {b / 1e9:.2f} GB/s each way"
                for op, (a, b) in self.fits.items()]
        return "\n".join([format_table(rows), *fits])


def calibrate(work: Workload, sizes_log2: list[int], repeats: int, steps: int, world_size: int,
              threads: int, packed: dict[str, Any] | None = None) -> Calibration:
    """Time the collectives at gathered sizes ``2**k`` for every other ``k`` of ``sizes_log2`` (both ends
    included), and ``steps`` FSDP2 steps of ``work``, on ``world_size`` gloo ranks; fit each collective.
    ``packed``: keyword arguments of :func:`packed_ranks` (formats, block_size, steps), run on the same ranks
    afterwards; their results are ``measured["then"]`` (:func:`packed_payload`)."""
    sizes = [2**k for k in range(sizes_log2[0], sizes_log2[1] + 1, 2)]
    extra = {} if packed is None else dict(then=f"{__name__}:packed_ranks", then_kwargs=packed)
    measured = measure_zero3(work, sizes=sizes, repeats=repeats, steps=steps, world_size=world_size, threads=threads,
                             **extra)
    # One alpha-beta fit per collective: gloo's reduce-scatter is not as fast as its all-gather.
    fits = {op: fit_alpha_beta(measured["sizes"], measured["seconds"][op], world_size) for op in FITTED_OPS}
    return Calibration(measured, fits)


@dataclass(frozen=True)
class HereCheck:
    """The ZeRO-3 model of this machine (fitted link, measured compute) beside the measured FSDP2 step."""

    cluster: Cluster
    tokens: int
    predicted: StepTime
    """The model's step at this machine's own latency."""
    step_s: float
    compute_s: float
    collectives: int
    n_params: int
    curve: tuple[np.ndarray, np.ndarray]
    at_200us: StepTime
    crossing: float | None

    @property
    def sync_measured(self) -> float:
        return self.step_s - self.compute_s

    def metrics(self) -> dict[str, float]:
        p = self.predicted
        m = dict(fsdp_step_s=self.step_s, fsdp_compute_s=self.compute_s, fsdp_sync_measured_s=self.sync_measured,
                 fsdp_sync_predicted_s=p.comm, fsdp_predicted_over_measured=p.comm / self.sync_measured,
                 fsdp_step_predicted_serial_s=p.serial, fsdp_step_predicted_overlapped_s=p.overlapped,
                 fsdp_collectives_measured=self.collectives, fsdp_collectives_predicted=p.collectives,
                 here_share_measured=self.sync_measured / self.step_s, here_share_model=p.share_serial,
                 here_sync_share_at_200us=self.at_200us.share_serial)
        return m | ({} if self.crossing is None else {"here_latency_at_38pct_us": self.crossing * 1e6})

    def text(self) -> str:
        p, n = self.predicted, self.cluster.world_size
        return (f"FSDP2 on {n} gloo ranks, {self.n_params / 1e6:.1f}M params (fp32), {self.tokens} tokens/rank:\n"
                f"  collectives per step: FSDP2 issued {self.collectives}, model {p.collectives}\n"
                f"  step: measured {self.step_s * 1e3:.1f} ms (compute alone {self.compute_s * 1e3:.1f} ms); "
                f"model {p.serial * 1e3:.1f} ms serial, {p.overlapped * 1e3:.1f} ms overlapped\n"
                f"  sync time: measured {self.sync_measured * 1e3:.1f} ms, model {p.comm * 1e3:.1f} ms "
                f"(ratio model / measured {p.comm / self.sync_measured:.2f})\n"
                f"  this machine: share {p.share_serial:.1%} at its own alpha, {self.at_200us.share_serial:.1%} at "
                f"200 us; measured share {self.sync_measured / self.step_s:.1%}")


def check_here(calib: Calibration, work: Workload, latencies: np.ndarray, share_target: float) -> HereCheck:
    """fp32 gathers and reduce-scatters (4 bytes), as the FSDP2 step ran."""
    (alpha, bandwidth), (rs_alpha, rs_bandwidth) = calib.fits["all_gather"], calib.fits["reduce_scatter"]
    n = calib.world_size
    here = Cluster(f"{n} gloo ranks on loopback (this machine)", n, latency=alpha, bandwidth=bandwidth,
                   peak_flops=1.0, scatter_latency=rs_alpha, scatter_bandwidth=rs_bandwidth)
    m = calib.measured
    kw = dict(seq_len=work.seq_len, param_bytes=4, grad_bytes=4, compute_seconds=m["compute_s"])
    small = work.spec()
    return HereCheck(here, work.tokens, zero3_step(small, here, work.tokens, **kw), m["fsdp_step_s"], m["compute_s"],
                     m["fsdp_collectives"], m["n_params"], share_curve(small, here, work.tokens, latencies, **kw),
                     zero3_step(small, here.with_latency(POST_LATENCY), work.tokens, **kw),
                     latency_for_share(small, here, work.tokens, share_target, **kw))


def validation_error(here: HereCheck) -> float:
    """The ZeRO-3 model's relative error where it meets a measurement: the factor by which its sync time misses
    the FSDP2 step's, less one (``max(r, 1 / r) - 1`` of ``r`` = modelled / measured), so that an underprediction
    by 2.6x is a 160% error, as an overprediction by 2.6x is."""
    r = here.predicted.comm / here.sync_measured
    if not r > 0:
        raise ValueError(f"the FSDP2 check measured no sync time (step {here.step_s} s, compute {here.compute_s} s)")
    return max(r, 1 / r) - 1


def sync_share_estimate(post: PostSetting, here: HereCheck) -> Estimate:
    """The graded ``sync_share_at_200us``: the graded model's serial share at 200 us, ``modelled``, with the model's
    validation error (:func:`validation_error`, a factor) as its interval: ``share / (1 + e)`` to ``share x (1 + e)``,
    capped at the whole step. A model output from typed-in constants; never a measurement."""
    share, e = post.models[post.graded].at_200us.share_serial, validation_error(here)
    return Estimate(share, share / (1 + e), min(1.0, share * (1 + e)), n=1, kind=MODELLED, unit="share of step",
                    method=f"alpha-beta ZeRO-3 model on the typed-in A100 setting, checked once against a real FSDP2 "
                           f"step here (sync time modelled / measured {here.predicted.comm / here.sync_measured:.2f}): "
                           f"validation error {e:.0%}, a factor of {1 + e:.2f} either way, capped at the whole step")


# ---------------------------------------------------------------------------------------------- packed weights
def shard_block_size(shapes: list[tuple[int, ...]], world_size: int, preferred: int) -> int:
    """The block size of the packed weights: the largest divisor of ``preferred`` that cuts each rank's dim-0
    shard of every weight of ``shapes`` into whole blocks (``preferred`` itself when it does). Even, so that fp4
    blocks are whole bytes; a ValueError if dim 0 does not split evenly or only odd blocks would."""
    if preferred < 2:
        raise ValueError(f"block size {preferred} must be >= 2")
    uneven = [s for s in shapes if s[0] % world_size]
    if uneven:
        raise ValueError(f"weights of shapes {uneven} do not split evenly on dim 0 over {world_size} ranks")
    block = math.gcd(preferred, *(math.prod(s) // world_size for s in shapes))
    if block < 2 or block % 2:
        raise ValueError(f"no even block size divides {preferred} and every rank's shard of {shapes}")
    return block


def packed_ranks(workload: dict, formats: list[str], block_size: int, steps: int, lr: float = 1e-3
                 ) -> dict[str, Any]:
    """On every rank (after the calibration, ``measure_zero3(then=...)``): for each of ``formats`` (``"bf16"``:
    dense, else an MVAS format for the blocks' matmul weights), the workload's model in bf16 under FSDP2, one unit
    per block and the root, trained ``steps`` steps (AdamW in bf16; ``MVASAdamW`` with fp8 moments on each
    rank's shard); the collectives counted, then each unit all-gathered once on its own (``unshard``)."""
    import torch.distributed as dist

    work = Workload(**workload)
    batches = work.batches(dist.get_rank(), steps)
    out: dict[str, Any] = {}
    with _eager_kernels():
        for fmt in formats:
            out[fmt] = _packed_format(work, batches, fmt, block_size, lr)
    return out


@contextlib.contextmanager
def _eager_kernels() -> Iterator[None]:
    """MVAS's kernels eager (``MACROARCH_COMPILE=0``): a few steps of a small model count bytes, not speed, and
    compiling them would cost each rank seconds."""
    from macroarch.mvas import COMPILE_ENV as ENV

    previous = os.environ.get(ENV)
    os.environ[ENV] = "0"
    try:
        yield
    finally:
        if previous is None:
            del os.environ[ENV]
        else:
            os.environ[ENV] = previous


def _packed_format(work: Workload, batches: list, fmt: str, block_size: int, lr: float) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from macroarch.measure.fsdp_bytes import count_collectives, rank_bytes
    from macroarch.mvas import MVASAdamW, apply, get_format, plan_from_rules
    from macroarch.mvas.interop import fsdp as mvas_fsdp

    model = work.model().to(torch.bfloat16)
    blocks = list(model.transformer.h)
    block = None
    if fmt != PLAIN:
        plan = plan_from_rules(model, [(PACKED_RULE, fmt)], block_size=block_size, min_numel=0)
        packed = get_format(fmt).name
        shapes = [tuple(model.get_parameter(t.name).shape) for t in plan.tensors if t.format == packed]
        block = shard_block_size(shapes, dist.get_world_size(), block_size)
        if block != block_size:
            plan = plan_from_rules(model, [(PACKED_RULE, fmt)], block_size=block, min_numel=0)
        apply(model, plan)
    shard = fully_shard if fmt == PLAIN else mvas_fsdp.fully_shard
    for unit in blocks:
        shard(unit)
    shard(model)
    optimizer = (torch.optim.AdamW(model.parameters(), lr=lr) if fmt == PLAIN else
                 MVASAdamW(model.parameters(), lr=lr, rounding="nearest", min_state_numel=0, seed=0,
                           compile=False))
    losses = []
    with count_collectives() as log:
        for ids in batches:
            optimizer.zero_grad(set_to_none=True)  # before, not after: the step's gradients are measured
            loss = lm_loss(model, ids)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    units = []
    for unit in (model, *blocks):
        with count_collectives() as one:
            unit.unshard()
        unit.reshard()
        units.append({"params": sum(p.numel() for p in unit.parameters()), "gather_bytes":
                      one.all_gather_output_bytes, "gathers": len(one.calls)})
    units[0]["params"] -= sum(u["params"] for u in units[1:])  # the root's own: not its blocks'
    steps = len(batches)
    result = {**rank_bytes(model, optimizer), "block_size": block, "requested_block_size": block_size,
              "losses": losses, "units": units,
              "params": sum(p.numel() for p in model.parameters()),
              "gather_bytes_per_step": log.all_gather_output_bytes / steps,
              "gather_sent_per_step": log.all_gather_bytes / steps,
              "reduce_scatter_bytes_per_step": log.reduce_scatter_bytes / steps,
              "gathers_per_step": sum(1 for name, *_ in log.calls if name.startswith("all_gather")) / steps}
    optimizer.zero_grad(set_to_none=True)
    return result


@dataclass(frozen=True)
class PackedPayload:
    """What the ranks measured per format (:func:`packed_ranks`; the largest over ranks where they differ)."""

    formats: tuple[str, ...]
    ranks: dict[str, dict[str, Any]]
    block_size: int
    """Elements per scale of the packed weights: the requested size, or its largest divisor that cuts every rank's
    shard into whole blocks (``shard_block_size``)."""
    requested_block_size: int
    world_size: int

    @property
    def block_text(self) -> str:
        if self.block_size == self.requested_block_size:
            return f"blocks of {self.block_size}"
        return (f"blocks of {self.block_size} (the requested {self.requested_block_size} does not cut every rank's "
                "shard into whole blocks)")

    def _units(self, fmt: str) -> list[dict]:
        return self.ranks[fmt]["units"]

    def bytes_per_param(self, fmt: str) -> float:
        """Bytes one all-gather of a block delivers per parameter of the block (every block's summed): the
        payload that the ZeRO-3 model's ``param_bytes`` stands for."""
        blocks = self._units(fmt)[1:]
        return sum(u["gather_bytes"] for u in blocks) / sum(u["params"] for u in blocks)

    def step_elements(self, fmt: str) -> int:
        """Parameters gathered in one step if the root is gathered once and each block twice (3 L + 2)."""
        root, *blocks = self._units(fmt)
        return root["params"] + 2 * sum(u["params"] for u in blocks)

    def step_bytes_per_param(self, fmt: str) -> float:
        """The whole step's all-gather bytes (counted during training) per parameter gathered."""
        return self.ranks[fmt]["gather_bytes_per_step"] / self.step_elements(fmt)

    def grad_bytes_per_param(self, fmt: str) -> float:
        """Bytes a rank hands to the reduce-scatters per step, per parameter (gradient element)."""
        return self.ranks[fmt]["reduce_scatter_bytes_per_step"] / self.ranks[fmt]["params"]

    def step_matches_units(self, fmt: str) -> bool:
        """Whether a training step gathered exactly the root once and each block twice, byte for byte."""
        root, *blocks = self._units(fmt)
        return self.ranks[fmt]["gather_bytes_per_step"] == root["gather_bytes"] + 2 * sum(
            u["gather_bytes"] for u in blocks)

    def metrics(self) -> dict[str, float]:
        m: dict[str, float] = {"packed_block_size": self.block_size}
        for fmt in self.formats:
            r = self.ranks[fmt]
            m |= {f"allgather_bytes_per_param_{fmt}": self.bytes_per_param(fmt),
                  f"allgather_step_bytes_per_param_{fmt}": self.step_bytes_per_param(fmt),
                  f"allgather_bytes_per_step_{fmt}": r["gather_bytes_per_step"],
                  f"reduce_scatter_bytes_per_param_{fmt}": self.grad_bytes_per_param(fmt),
                  f"rank_weight_bytes_{fmt}": r["weights"], f"rank_grad_bytes_{fmt}": r["grads"],
                  f"rank_optimizer_bytes_{fmt}": r["optimizer"], f"final_loss_{fmt}": r["losses"][-1]}
        return m

    def table(self) -> str:
        rows = [("format", "B/param gathered (block)", "(whole step)", "all-gather B/step", "RS B/param",
                 "weights/rank", "grads/rank", "optimizer/rank", "loss first -> last", "step = units")]
        for fmt in self.formats:
            r = self.ranks[fmt]
            rows.append((fmt, f"{self.bytes_per_param(fmt):.4f}", f"{self.step_bytes_per_param(fmt):.4f}",
                         f"{r['gather_bytes_per_step']:,.0f}", f"{self.grad_bytes_per_param(fmt):.3f}",
                         f"{r['weights']:,}", f"{r['grads']:,}", f"{r['optimizer']:,}",
                         f"{r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}", self.step_matches_units(fmt)))
        return (format_table(rows) + f"\n(counted at FSDP2's collectives on {self.world_size} gloo ranks, per rank; "
                f"bf16 compute; packed {self.block_text}, fp8/fp4 payload + fp32 scales, biases and norms "
                "bf16; optimizer: AdamW (bf16 state) vs MVASAdamW (fp8 moments))")


def packed_payload(calib: Calibration) -> PackedPayload:
    """The packed run of :func:`calibrate` (``packed=``): per format, the rank holding the most bytes."""
    ranks = calib.measured.get("then")
    if not ranks:
        raise ValueError("the calibration ran no packed measurement: pass packed=dict(formats=..., ...) to calibrate")
    formats = tuple(ranks[0])
    if formats[0] != PLAIN:
        raise ValueError(f"formats must start with the dense baseline {PLAIN!r}; got {list(formats)}")
    merged = {fmt: max((r[fmt] for r in ranks), key=lambda r: r["weights"] + r["optimizer"]) for fmt in formats}
    packed = [r[fmt] for r in ranks for fmt in formats[1:]]
    blocks = {r["block_size"] for r in packed}
    if len(blocks) > 1:
        raise ValueError(f"the packed formats were measured with different block sizes {sorted(blocks)}")
    requested = packed[0]["requested_block_size"] if packed else 0
    return PackedPayload(formats, merged, blocks.pop() if blocks else 0, requested, calib.world_size)


@dataclass(frozen=True)
class PackedShares:
    """The graded model's share of the step in parameter sync with the measured payload per format."""

    model: str
    formats: tuple[str, ...]
    bytes_per_param: dict[str, float]
    grad_bytes: dict[str, float]
    at_200us: dict[str, StepTime]
    curves: dict[str, tuple[np.ndarray, np.ndarray]]
    crossing: dict[str, float | None]
    latencies: np.ndarray
    share_target: float

    @staticmethod
    def prefix(fmt: str) -> str:
        return f"measured_{fmt}_" if fmt == PLAIN else f"packed_{fmt}_"

    def metrics(self) -> dict[str, float]:
        m: dict[str, float] = {}
        for fmt in self.formats:
            key, step = self.prefix(fmt), self.at_200us[fmt]
            m |= {f"{key}sync_share_at_200us": step.share_serial,
                  f"{key}sync_share_at_200us_overlapped": step.share_overlapped,
                  f"{key}sync_s_at_200us": step.comm,
                  f"{key}sync_time_over_{PLAIN}": step.comm / self.at_200us[PLAIN].comm}
            if self.crossing[fmt] is not None:
                m[f"{key}latency_at_38pct_us"] = self.crossing[fmt] * 1e6
        return m

    def series(self) -> list[tuple[int, dict[str, float]]]:
        return [(i, {f"{self.prefix(fmt)}share": self.curves[fmt][0][i] for fmt in self.formats}
                 | {f"{self.prefix(fmt)}share_overlapped": self.curves[fmt][1][i] for fmt in self.formats})
                for i in range(len(self.latencies))]

    def table(self) -> str:
        rows = [("weights gathered", "B/param (measured)", "RS B/param", "sync s @200us", "share @200us", "overlapped",
                 "38% reached at")]
        for fmt in self.formats:
            step, c = self.at_200us[fmt], self.crossing[fmt]
            rows.append((fmt, f"{self.bytes_per_param[fmt]:.4f}", f"{self.grad_bytes[fmt]:.3f}", f"{step.comm:.3f}",
                         f"{step.share_serial:.1%}", f"{step.share_overlapped:.1%}",
                         "never" if c is None else f"{c * 1e6:.0f} us"))
        return (format_table(rows) + f"\n({self.model}, the post's setting; bytes measured on the FSDP2 check's "
                "blocks)")


def packed_shares(post: PostSetting, payload: PackedPayload, *, seq_len: int) -> PackedShares:
    """The graded model of ``post`` with each format's measured bytes per gathered parameter and per reduce-scattered
    gradient element (:class:`PackedPayload`) in place of the typed ``param_bytes`` / ``grad_bytes``."""
    spec, cluster = post.models[post.graded].spec, post.cluster
    per = {fmt: dict(seq_len=seq_len, param_bytes=payload.bytes_per_param(fmt),
                     grad_bytes=payload.grad_bytes_per_param(fmt)) for fmt in payload.formats}
    return PackedShares(
        post.graded, payload.formats, {f: kw["param_bytes"] for f, kw in per.items()},
        {f: kw["grad_bytes"] for f, kw in per.items()},
        {f: zero3_step(spec, cluster.with_latency(POST_LATENCY), post.tokens, **kw) for f, kw in per.items()},
        {f: share_curve(spec, cluster, post.tokens, post.latencies, **kw) for f, kw in per.items()},
        {f: latency_for_share(spec, cluster, post.tokens, post.share_target, **kw) for f, kw in per.items()},
        post.latencies, post.share_target)


def _binary(n: float) -> str:
    """``4096`` -> ``4K``, ``2**24`` -> ``16M``: short labels for powers of two."""
    for unit, size in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= size:
            return f"{n / size:g}{unit}"
    return f"{n:g}"


def _legend_in_slot(fig: Figure, slot_ax, handles, labels, title: str) -> None:
    """Put a legend where ``slot_ax`` (an empty panel) was, as a figure legend, so the layout check sees it."""
    slot = slot_ax.get_position()
    fig.delaxes(slot_ax)
    fig.legend(handles, labels, fontsize=8, loc="center left", bbox_to_anchor=slot, title=title, title_fontsize=8)


def plot_packed(shares: PackedShares, payload: PackedPayload) -> Figure:
    """The post's setting with the all-gather payload measured per format, and the bytes each FSDP2 rank held."""
    fig, axes = plt.subplots(1, 2, figsize=(8, 4.6))
    ax, us = axes[0], shares.latencies * 1e6
    for fmt in shares.formats:
        serial, overlapped = shares.curves[fmt]
        line, = ax.semilogx(us, serial, lw=1.6, label=f"{fmt}: {shares.bytes_per_param[fmt]:.3f} B/param (serial)")
        ax.semilogx(us, overlapped, ls="--", lw=1.1, color=line.get_color(), label=f"{fmt} (overlapped)")
    ax.axhline(shares.share_target, color="r", lw=0.8, ls=":", label=f"{shares.share_target:.0%} (the post)")
    ax.axvline(POST_LATENCY * 1e6, color="r", lw=0.8, ls=":")
    ax.set(xlabel="latency alpha per ring step (us)", ylabel="share of step in parameter sync", ylim=(0, 1),
           title=f"{shares.model}, ZeRO-3 (modelled)\nwith the all-gather payload measured")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.24), ncol=1)
    ax = axes[1]
    kinds = (("weights", "weights"), ("grads", "gradients"), ("optimizer", "optimizer"),
             ("gather_bytes_per_step", "gathered\nper step"))
    x, width = np.arange(len(kinds)), 0.8 / len(payload.formats)
    for i, fmt in enumerate(payload.formats):
        ax.bar(x + i * width, [payload.ranks[fmt][k] / 1e6 for k, _ in kinds], width, label=fmt)
    ax.set_xticks(x + width * (len(payload.formats) - 1) / 2, [label for _, label in kinds])
    ax.set(xlabel="bytes each rank holds or gathers", ylabel="MB per rank",
           title=f"FSDP2 on {payload.world_size} gloo ranks\nbytes per rank (measured)")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.34), ncol=len(payload.formats))
    fig.tight_layout()
    return fig


def plot_sync_share(post: PostSetting, sens: Sensitivity, calib: Calibration, here: HereCheck) -> Figure:
    """The graded share against latency (modelled, with the model's error on the FSDP2 check as its band and
    error bar), its sensitivity to tokens and MFU, and the collectives timed here with the model fitted to them."""
    fig, axes = plt.subplots(2, 2, figsize=(8, 7.6))
    us, cluster = post.latencies * 1e6, post.cluster
    ax = axes[0, 0]
    err = validation_error(here)
    for name, s in post.models.items():
        line, = ax.semilogx(us, s.serial, lw=1.6, label=f"{name} (serial)")
        ax.semilogx(us, s.overlapped, ls="--", lw=1.2, color=line.get_color(), label=f"{name} (overlapped)")
        if name == post.graded:
            ax.fill_between(us, s.serial / (1 + err), np.clip(s.serial * (1 + err), 0, 1),
                            color=line.get_color(), alpha=0.15,
                            label=f"{name}: x/ {1 + err:.2f}\n(model's error on the FSDP2 check)")
            g = s.at_200us.share_serial
            ax.errorbar([POST_LATENCY * 1e6], [g], yerr=[[g - g / (1 + err)], [min(1.0, g * (1 + err)) - g]], fmt="D",
                        color=line.get_color(), capsize=4, ms=6, label=f"graded: {g:.1%} at 200 us (modelled)")
    ax.semilogx(us, here.curve[0], color="k", lw=1.4, label="this machine's model (serial)")
    ax.axhline(post.share_target, color="r", lw=0.8, ls=":", label=f"{post.share_target:.0%} (the post)")
    ax.axvline(POST_LATENCY * 1e6, color="r", lw=0.8, ls=":")
    ax.set(xlabel="latency alpha per ring step (us)", ylabel="share of step in parameter sync", ylim=(0, 1),
           title=f"ZeRO-3 model, {cluster.world_size}x A100 (typed-in)\n{post.tokens} tokens/GPU, MFU {cluster.mfu}, "
                 f"{cluster.bandwidth / 1e9:.0f} GB/s")
    ax = axes[1, 0]
    for m, shares in sens.shares.items():
        ax.semilogx(sens.tokens, shares, "o-", ms=3, label=f"MFU {m:.2f}")
    ax.axhline(post.share_target, color="r", lw=0.8, ls=":")
    ax.set(xlabel="tokens per GPU per step", ylabel="share at 200 us (serial)",
           title=f"{sens.model}:\nwhat the post leaves open", ylim=(0, 1))
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=len(sens.shares))
    ax = axes[1, 1]
    sizes = np.array(calib.measured["sizes"], dtype=float)
    for op in ("all_gather", "reduce_scatter", "all_reduce"):
        ax.loglog(sizes, np.array(calib.measured["seconds"][op]) * 1e3, "o", ms=4, label=f"{op} (measured)")
    for op, color in zip(FITTED_OPS, ("C0", "C1")):
        a, b = calib.fits[op]
        ax.loglog(sizes, calib.ring_seconds(op, sizes) * 1e3, "-", color=color, lw=1,
                  label=f"{op} fit: alpha {a * 1e6:.0f} us, B {b / 1e9:.2f} GB/s")
    ax.set_xticks(sizes, [_binary(x) for x in sizes], fontsize=8)  # the sizes timed (log ticks crowd a short span)
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set(xlabel="gathered tensor (bytes; K = 2^10, M = 2^20)", ylabel="ms per collective",
           title=f"gloo, {calib.world_size} ranks on loopback\nFSDP2 sync: measured {here.sync_measured * 1e3:.0f} "
                 f"ms, model {here.predicted.comm * 1e3:.0f} ms")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=1)
    for a in axes.flat:
        a.title.set_fontsize(10)
    fig.tight_layout()
    _legend_in_slot(fig, axes[0, 1], *axes[0, 0].get_legend_handles_labels(), title="share vs latency (left)")
    return fig


def c5_texts(post: PostSetting, calib: Calibration, here: HereCheck, metrics: dict[str, float],
             packed: PackedShares | None = None) -> dict[str, str]:
    """``scale``, ``measured_text`` and ``note`` for C5's verdict, from the run's metrics (``packed``: the
    packed-weight line, reported in the note; the grade stays the bf16 model's)."""
    m, cluster, graded = metrics, post.cluster, post.models[post.graded]
    alpha, bandwidth = calib.fits["all_gather"]
    cross = graded.crossing[0]
    others = [name for name in post.models if name != post.graded]
    return dict(
        scale=(f"alpha-beta model of ZeRO-3 ({3 * graded.spec.shape.n_layers + 2} collectives/step) for {post.graded} "
               f"on {cluster.name}, {post.tokens} tokens/GPU, MFU {cluster.mfu}, {cluster.bandwidth / 1e9:.0f} GB/s; "
               f"collectives calibrated on {calib.world_size} gloo ranks here (alpha {alpha * 1e6:.0f} us, "
               f"B {bandwidth / 1e9:.2f} GB/s), FSDP2 check {here.tokens} tokens x {here.n_params / 1e6:.1f}M params"),
        measured_text=(f"modelled, not measured (arithmetic on the typed-in A100 setting; the gloo calibration does "
                       f"not enter it): share at 200 us {sync_share_estimate(post, here).describe(3)}; "
                       f"{m['sync_share_at_200us']:.1%} serial, "
                       f"{m['sync_share_at_200us_overlapped']:.1%} overlapped; {post.share_target:.0%} reached at "
                       f"alpha = " + ("never (<10 s)" if cross is None else f"{cross * 1e6:.0f} us") + "; "
                       + ", ".join(f"{name}: {m[name + '_sync_share_at_200us']:.1%}" for name in others)),
        note=(f"the share at 200 us depends on tokens per GPU and MFU more than on latency (up to "
              f"{m['sync_share_at_200us_max_over_sensitivity']:.0%} over 512-16384 tokens and MFU 0.3-0.7); "
              f"with FSDP's overlap almost all of the sync is hidden. {post.graded} needs "
              f"{format_bytes(m['state_bytes_per_gpu'], 'GB', 0)} of training state per GPU under ZeRO-3 on "
              f"{cluster.world_size} GPUs (80 GB each): it only runs with offload. FSDP2 check here, the model's "
              f"validation: model / measured sync time {m['fsdp_predicted_over_measured']:.2f} (a "
              f"{validation_error(here):.0%} error, the interval of the graded share), collectives {here.collectives} "
              f"measured vs {here.predicted.collectives} modelled. What would test the claim: the sync share of real "
              f"ZeRO-3/FSDP2 steps on GPUs at >= 200 us link latency (multi-node), from per-step profiles over "
              f"repeated blocks"
              + ("" if packed is None else _packed_note(packed, m, calib.world_size))),
    )


def _packed_note(packed: PackedShares, m: dict[str, float], world_size: int) -> str:
    parts = [f"{fmt} {m[f'allgather_bytes_per_param_{fmt}']:.3f} B/param -> "
             f"{m[packed.prefix(fmt) + 'sync_share_at_200us']:.1%}" for fmt in packed.formats]
    return (f". With the all-gather payload measured at FSDP2's collective (blocks of the check's model, {world_size} "
            f"gloo ranks), the share at 200 us for {packed.model} is: " + ", ".join(parts))


__all__ = ["PACKED_RULE", "PLAIN", "POST_LATENCY", "TOKEN_GRID", "Calibration", "HereCheck", "ModelShare",
           "PackedPayload", "PackedShares", "PostSetting", "Sensitivity", "Zero3Settings", "a100_cluster", "c5_texts",
           "calibrate", "check_here", "latency_grid", "packed_payload", "packed_ranks", "packed_shares", "plot_packed",
           "plot_sync_share", "post_setting", "sensitivity", "shard_block_size", "share_curve", "sync_share_estimate",
           "validation_error"]
