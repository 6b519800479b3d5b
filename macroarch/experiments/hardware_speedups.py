"""Notebook 09's experiments (claim C11, post section 5.2): speedups per GPU from a step-time model, validated here.

The post gives "theoretical" and "achieved" speedups on A100, V100 and RTX 3090 and advises disabling ECC on
consumer cards, without saying speedup of what over what. This module:

1. **measures this machine** (:func:`machine`): matmul throughput in fp32 and bf16, copy bandwidth and per-op
   host overhead, the row this machine adds to the accelerator table (``macroarch.measure.hardware``);
2. **counts what this implementation moves** (:func:`trace_traffic`): one training step of a small Llama
   under a dispatch mode that records every aten op with its bytes (views excluded) and matmul FLOPs, for the
   baseline (AdamW, 16-bit weights + fp32 master; fp32 AdamW where bf16 is emulated) and for MVAS + DGR
   (``macroarch.compose.apply``): bytes per byte of activations, per parameter of the optimizer step, per packed
   element of a de-quantisation, and host ops;
3. **validates the step-time model** (:func:`validate`): small Llamas of several widths trained for real,
   both variants in lock step (``experiments.loop.train_round_robin``), against ``measure.step_time``'s
   prediction from (1) and (2) alone: no timing is fitted;
4. **predicts per card** (:func:`predict_cards`): each card of the table, a ladder of Llama sizes, a node of
   ``world_size`` cards, the fastest configuration each method fits (``step_time.best_plan``); the
   speedups the post's two words can mean (:data:`READINGS`), and what ECC costs.

The graded numbers are :func:`estimates`: each card's speedup is a *prediction* (``modelled``, the step-time model's
speed-ratio error from (3) as its interval, and whether the model met its own step-time bound in its method), and
the ECC advice is *looked up* (each consumer card's ECC state as shipped, from the table); both grade "not testable
here" (``macroarch.repro.claims``), saying what measurement would test them. :func:`metrics` names the numbers
beside them.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from macroarch._progress import tqdm
from macroarch._table import format_table
from macroarch.experiments.loop import lm_step, train_round_robin
from macroarch.experiments.settings import Settings
from macroarch.measure import hardware as hw
from macroarch.measure.machine import COMPUTE_DTYPES, describe, machine_info, torch_dtype
from macroarch.measure.memory.analytic import parameter_count
from macroarch.measure.stats import Estimate, looked_up, modelled
from macroarch.measure.step_time import (
    FUSED_BASELINE,
    Device,
    Efficiency,
    Method,
    Plan,
    Traffic,
    Workload,
    activation_bytes,
    best_plan,
    fused_mvas_traffic,
    mixed_precision,
    speedup,
    step_time,
    tensor_count,
)
from macroarch.models import get_model_spec
from macroarch.models.spec import TransformerShape

BASELINE, MACRO = "baseline", "MVAS + DGR"
BYTE_VOCAB = 256
STEP_TIME_BOUND = 0.60
"""The step-time error the model promises where it is validated (the registry's ``STEP_TIME_MODEL_BOUND``)."""


@dataclass(frozen=True)
class HardwareSettings(Settings):
    """Notebook 09's settings: its parameters cell, less ``profile`` (``HardwareSettings.from_params(params)``)."""

    threads: int
    """Torch intra-op threads."""
    matmul_n: int
    """This machine's row: n x n matmul timed for its throughput."""
    copy_mb: int
    """This machine's row: MB copied for its bandwidth."""
    widths: tuple[int, ...]
    """Validation sweep: widths of the small Llamas trained for real."""
    layers: int
    """Validation sweep: layers of every model."""
    seq_len: int
    """Validation sweep: tokens per sequence."""
    batch_size: int
    """Validation sweep: sequences per step."""
    steps: int
    """Validation sweep: steps per variant and width, both variants in turn; must exceed ``warmup``."""
    trace_width: int
    """Width at which each variant's traffic is counted (1 and 2 layers)."""
    cards: tuple[str, ...]
    """Table rows predicted."""
    sizes: tuple[str, ...]
    """The Llama ladder (keys of :data:`LADDER`)."""
    seed: int = 0
    """Initial weights and batches."""
    compute_dtype: str = "float32"
    """Validation dtype (``auto`` is resolved by the notebook before the settings are built)."""
    device: str = "cpu"
    """Where the validation trains and this machine's row is measured."""
    head_dim: int = 64
    """Width per attention head."""
    warmup: int = 2
    """Steps left out of the timing (allocation, lazy state)."""
    target_reduction: float = 0.55
    """MVAS budget: the share of the 16-bit weight bytes saved."""
    error_bound: float = STEP_TIME_BOUND
    """The step-time error the model must stay under on this machine."""
    gpu_seq_len: int = 2048
    """Tokens per sequence on the cards."""
    global_batch: int = 512
    """Sequences per optimizer step over the node; a multiple of ``world_size``."""
    world_size: int = 8
    """Cards per node (the post's 8x A100, section 4.2)."""
    matmul_efficiency: float = 0.7
    """Share of peak dense throughput large training matmuls reach."""
    bandwidth_efficiency: float = 0.8
    """Share of peak memory bandwidth elementwise kernels reach."""
    link_efficiency: float = 0.8
    """Share of the link bandwidth collectives reach."""
    memory_reserve: float = 0.1
    """Share of card memory kept for the CUDA context, allocator and workspaces."""

    def __post_init__(self) -> None:
        self._positive("threads", "matmul_n", "copy_mb", "layers", "seq_len", "batch_size", "steps", "trace_width",
                       "head_dim", "error_bound", "gpu_seq_len", "global_batch", "world_size", "matmul_efficiency",
                       "bandwidth_efficiency", "link_efficiency")
        self._non_negative("warmup")
        self._fraction("target_reduction", "memory_reserve", "matmul_efficiency", "bandwidth_efficiency",
                       "link_efficiency")
        self._non_empty("widths", "cards", "sizes")
        self._one_of("compute_dtype", COMPUTE_DTYPES)
        self._device()
        if self.steps <= self.warmup:
            self._fail("steps", f"more than warmup={self.warmup} (the first steps are not timed)")
        if self.global_batch % self.world_size:
            self._fail("global_batch", f"a multiple of world_size={self.world_size}")
        unknown = [x for x in self.sizes if x not in LADDER]
        if unknown:
            self._fail("sizes", f"keys of the Llama ladder {list(LADDER)}")

    @property
    def efficiency(self) -> Efficiency:
        return Efficiency(self.matmul_efficiency, self.bandwidth_efficiency, self.link_efficiency)

#: how "theoretical" and "achieved" are read (the notebook explains why)
READINGS = {
    "theoretical": "the configuration MVAS + DGR's memory allows (micro-batch, no recomputation, no sharding, fp8 "
                   "matmuls where the card has them) with its own extra work costing nothing",
    "achieved": "the same with that work paid at fused-kernel traffic (de-quantisation twice per micro-step, "
                "MVASAdamW)",
    "as implemented": "the same with this repository's kernels (traffic and ops counted on this machine)",
}


# ----------------------------------------------------------------------------------------------- models
def small_llama(width: int, layers: int, head_dim: int, seq_len: int):
    """A Llama of ``layers`` x ``width`` on the byte vocabulary (``llama_65b_tiny``'s architecture, scaled)."""
    heads = max(1, width // head_dim)
    return get_model_spec("llama_65b_tiny").scaled(n_layers=layers, d_model=width, n_heads=heads, n_kv_heads=heads,
                                                   d_ff=int(8 * width / 3) // 32 * 32, max_seq_len=seq_len)


def _macro_config(target_reduction: float):
    from macroarch.config import DGRConfig, MacroConfig, MVASConfig, OptimConfig

    return MacroConfig(optim=OptimConfig(lr=1e-3, weight_decay=0.0), mvas=MVASConfig(target_reduction=target_reduction),
                       dgr=DGRConfig(group_size=1))


def build_variants(spec, batch: tuple[torch.Tensor, torch.Tensor], *, compute_dtype: str, target_reduction: float,
                   device: str = "cpu", seed: int = 0, dgr: bool = True) -> dict[str, tuple]:
    """``{name: (model to call, optimizer, store)}``: the baseline and MVAS (+ DGR, one group per layer) from the
    same initial weights. The baseline is what is fair on this hardware: 16-bit weights with an fp32 master and
    fp32 moments (mixed precision) when computing in bf16, plain fp32 AdamW when computing in fp32."""
    from macroarch import compose
    from macroarch.optim import MasterWeightAdamW

    dtype = torch_dtype(compute_dtype)
    torch.manual_seed(seed)
    initial = spec.build().to(device=device, dtype=dtype)
    base = copy.deepcopy(initial)
    opt = (MasterWeightAdamW(base.parameters(), lr=1e-3, weight_decay=0.0) if dtype != torch.float32
           else torch.optim.AdamW(base.parameters(), lr=1e-3, weight_decay=0.0))
    config = _macro_config(target_reduction)
    if not dgr:
        config = replace(config, dgr=replace(config.dgr, group_size=None))
    stack = compose.apply(copy.deepcopy(initial), config, example_inputs=dict(input_ids=batch[0], labels=batch[1]),
                          compute_dtype=dtype, seed=seed)
    return {BASELINE: (base, opt, None), MACRO: (stack.model, stack.optimizer, stack.store)}


def fair_baseline(compute_dtype: str) -> str:
    """Which baseline :func:`build_variants` trains in this dtype, and why it is the fair one."""
    if compute_dtype == "float32":
        return ("fp32 weights and AdamW (16 B/param): this machine emulates bf16, so 16-bit training is not what "
                "anyone would run here; MVAS de-quantises to fp32")
    return (f"{compute_dtype} weights and gradients, fp32 master and moments (mixed precision, 16 B/param): how "
            f"16-bit training is done; MVAS de-quantises to {compute_dtype}")


def random_batches(count: int, batch_size: int, seq_len: int, seed: int, device: str = "cpu"):
    """Byte-token batches (speed does not depend on the data)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, BYTE_VOCAB, (batch_size, seq_len), generator=g).to(device)
        out.append((ids, ids))
    return out


# ---------------------------------------------------------------------------------------- what it moves
@dataclass
class Traced:
    """What one step of each variant moves, counted at the reference size, and the MVAS plan's mix."""

    traffic: dict[str, Traffic]
    weight_bytes: float  # mean stored bytes per parameter under MVAS (packed and dense together)
    managed_fraction: float  # share of parameters stored packed
    low_precision_fraction: float  # share of weight-matmul parameters in fp8/fp4
    packed_weight_bytes: float  # mean bytes per packed element (with scales)
    state_bytes: float  # MVASAdamW's state per parameter
    plan_text: str
    reference: str


def trace_traffic(width: int, head_dim: int, seq_len: int, batch_size: int, *, mach: Machine, compute_dtype: str,
                  target_reduction: float, device: str = "cpu", seed: int = 0) -> Traced:
    """Count one training step of each variant at ``width`` with 1 and 2 layers (module docstring, 2), and time
    the optimizer step and a de-quantisation of every packed weight alone: the fraction of ``mach``'s bandwidth
    those kernels reach (their host ops' time taken out) is their efficiency."""
    batch = random_batches(1, batch_size, seq_len, seed, device)[0]
    dev = torch.device(device)
    counts: dict[int, dict[str, dict[str, hw.OpCounter]]] = {}
    seconds: dict[str, dict[str, float]] = {}
    for layers in (1, 2):
        spec = small_llama(width, layers, head_dim, seq_len)
        runs = build_variants(spec, batch, compute_dtype=compute_dtype, target_reduction=target_reduction,
                              device=device, seed=seed, dgr=False)
        counts[layers] = {}
        for name, (model, opt, store) in runs.items():
            def fwd_bwd(model=model):
                model(input_ids=batch[0], labels=batch[1]).loss.backward()

            def dequant(store=store):
                for n in store:
                    store.dense(n)

            fwd_bwd()  # warm-up: lazy state, first allocations
            opt.step()
            c = {"fwd_bwd": hw.count_ops(fwd_bwd), "step": hw.count_ops(opt.step)}
            if store is not None:
                c["dequant"] = hw.count_ops(dequant)
            if layers == 2:  # the same gradients stepped again: the optimizer's time, and the materialisations'
                seconds[name] = {"step": hw.best_seconds(opt.step, dev, 3)}
                if store is not None:
                    seconds[name]["dequant"] = hw.best_seconds(dequant, dev, 3)
            opt.zero_grad(set_to_none=True)
            counts[layers][name] = c
        if layers == 2:
            spec2, store2, opt2 = spec, runs[MACRO][2], runs[MACRO][1]
    shape, plan = spec2.shape, store2.plan
    n = parameter_count(shape)
    compute = "fp32" if compute_dtype == "float32" else "bf16"
    act = activation_bytes(Workload(shape, seq_len, batch_size, flash_attention=False, compute=compute,
                                    device_type=dev.type))["all"]
    managed = sum(store2.packed(name).numel for name in store2)
    bandwidth, overhead = mach.device.bandwidth, mach.device.op_overhead

    def efficiency(counter: hw.OpCounter, t: float) -> float:
        kernel = max(t - counter.ops * overhead, 1e-9)  # the host's share is the model's host term
        return min(1.0, counter.bytes / bandwidth / kernel)

    traffic = {}
    for name in (BASELINE, MACRO):
        one, two = counts[1][name], counts[2][name]
        per_layer = two["fwd_bwd"].ops - one["fwd_bwd"].ops
        deq = two.get("dequant")
        # the fwd+bwd bytes of MVAS include two materialisations of every packed weight: counted apart
        elementwise = two["fwd_bwd"].bytes - (2 * deq.bytes if deq else 0)
        traffic[name] = Traffic(
            activation=elementwise / act, optimizer=two["step"].bytes / n, dequant=deq.bytes / managed if deq else 0.0,
            accumulate=2 * torch_dtype(compute_dtype).itemsize, ops_fixed=one["fwd_bwd"].ops - per_layer,
            ops_per_layer=per_layer, ops_per_tensor=two["step"].ops / tensor_count(shape),
            optimizer_efficiency=efficiency(two["step"], seconds[name]["step"]),
            dequant_efficiency=efficiency(deq, seconds[name]["dequant"]) if deq else 1.0,
            source=f"counted and timed on this machine: a {shape.n_layers}-layer x {width} Llama")
    packed_bytes = sum(store2.packed(nm).nbytes for nm in store2)
    matmuls = [t for t in plan.tensors if t.name.endswith(("proj.weight", "lm_head.weight"))]
    low = sum(t.numel for t in matmuls if t.format.startswith(("fp8", "fp4")))
    return Traced(traffic=traffic, weight_bytes=plan.bytes() / n, managed_fraction=managed / n,
                  low_precision_fraction=low / max(1, sum(t.numel for t in matmuls)),
                  packed_weight_bytes=packed_bytes / managed, state_bytes=_state_bytes(opt2) / n,
                  plan_text=plan.describe().splitlines()[-1],
                  reference=f"{shape.n_layers}-layer x {width} Llama, {batch_size}x{seq_len} tokens")


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of an optimizer's per-parameter state (moments, scales, master copies; step counters left out)."""
    return sum(v.numel() * v.element_size() for state in opt.state.values() for v in state.values()
               if isinstance(v, torch.Tensor) and v.numel() > 1)


# ------------------------------------------------------------------------------------------- this machine
@dataclass
class Machine:
    """This machine's measured row of the table and the same numbers as the step-time model's device."""

    row: hw.Accelerator
    device: Device
    info: dict


def machine(device: str = "cpu", *, matmul_n: int = 1024, copy_mb: float = 64, repeats: int = 5) -> Machine:
    row, overhead = hw.measure_machine(device, matmul_n=matmul_n, copy_mb=copy_mb, repeats=repeats)
    return Machine(row, hw.machine_device(row, overhead, device), machine_info(device))


def methods_from_trace(traced: Traced, compute_dtype: str) -> dict[str, Method]:
    """The two variants as the step-time model sees them, with the traffic counted on this machine."""
    dense = torch_dtype(compute_dtype).itemsize
    base = replace(mixed_precision(traced.traffic[BASELINE], dense_bytes=dense), name=BASELINE)
    macro = Method(MACRO, weight_bytes=traced.weight_bytes, grad_bytes=float(dense), state_bytes=traced.state_bytes,
                   traffic=traced.traffic[MACRO], managed_fraction=traced.managed_fraction,
                   low_precision_fraction=traced.low_precision_fraction, frees_gradients=True)
    return {BASELINE: base, MACRO: macro}


# ------------------------------------------------------------------------------------------- validation
@dataclass
class Point:
    """One width of the validation sweep: measured and predicted seconds per step of each variant."""

    width: int
    params: int
    measured: dict[str, float]
    predicted: dict[str, float]
    parts: dict[str, dict[str, float]]

    def error(self, name: str) -> float:
        """Relative error of the predicted step time: predicted / measured - 1."""
        return self.predicted[name] / self.measured[name] - 1

    @property
    def measured_ratio(self) -> float:
        """Speed of MVAS + DGR relative to the baseline (baseline step / macro step), measured."""
        return self.measured[BASELINE] / self.measured[MACRO]

    @property
    def predicted_ratio(self) -> float:
        return self.predicted[BASELINE] / self.predicted[MACRO]

    @property
    def ratio_error(self) -> float:
        return self.predicted_ratio / self.measured_ratio - 1


@dataclass
class Validation:
    points: list[Point]
    compute_dtype: str
    layers: int
    seq_len: int
    batch_size: int
    steps: int

    @property
    def max_error(self) -> float:
        """Largest |predicted / measured - 1| of a step time, over widths and both variants."""
        return max(abs(p.error(n)) for p in self.points for n in (BASELINE, MACRO))

    @property
    def mean_error(self) -> float:
        return statistics.mean(abs(p.error(n)) for p in self.points for n in (BASELINE, MACRO))

    @property
    def max_ratio_error(self) -> float:
        """Largest |predicted / measured - 1| of the speed ratio: the error carried beside each card's speedup."""
        return max(abs(p.ratio_error) for p in self.points)


def validate(widths: Sequence[int], *, layers: int, head_dim: int, seq_len: int, batch_size: int, steps: int,
             traced: Traced, mach: Machine, compute_dtype: str, target_reduction: float, warmup: int = 2,
             device: str = "cpu", seed: int = 0) -> Validation:
    """Train both variants at each width for ``steps`` steps (interleaved), and predict each step's time from
    ``traced`` and ``mach`` alone (module docstring, 3)."""
    if steps <= warmup:
        raise ValueError(f"steps={steps} must exceed warmup={warmup}: the first steps are not timed")
    methods = methods_from_trace(traced, compute_dtype)
    compute = "fp32" if compute_dtype == "float32" else "bf16"
    points = []
    for width in tqdm(widths, desc="validation sweep", mininterval=5):
        spec = small_llama(width, layers, head_dim, seq_len)
        batches = random_batches(steps, batch_size, seq_len, seed, device)
        runs = build_variants(spec, batches[0], compute_dtype=compute_dtype, target_reduction=target_reduction,
                              device=device, seed=seed)
        seconds, step = _step_clock(runs, device)
        logs = train_round_robin({name: (model, opt) for name, (model, opt, _) in runs.items()}, batches, step=step)
        base, ids = runs[BASELINE][0], batches[0][0]
        shapes = hw.count_ops(lambda base=base, ids=ids: base(input_ids=ids, labels=ids).loss.backward()).matmuls
        runs[BASELINE][1].zero_grad(set_to_none=True)
        mm = hw.matmul_seconds(shapes, device)
        w = Workload(spec.shape, seq_len, batch_size, flash_attention=False, compute=compute,
                     device_type=torch.device(device).type)
        times = {name: step_time(w, m, mach.device, matmul_seconds=mm) for name, m in methods.items()}
        # the fastest timed step: load from other processes only ever adds time (the rates are best-of too)
        times_of = seconds or {name: log.seconds for name, log in logs.items()}
        points.append(Point(width, parameter_count(spec.shape),
                            measured={name: min(times_of[name][warmup:]) for name in logs},
                            predicted={name: t.total for name, t in times.items()},
                            parts={name: t.parts() for name, t in times.items()}))
    return Validation(points, compute_dtype, layers, seq_len, batch_size, steps)


def _step_clock(runs: dict[str, tuple], device: str):
    """``(seconds, step)``: on a CPU with one thread, the loop's step timed in CPU seconds of this thread, which a
    process that takes the core away (a shared machine) does not inflate; elsewhere ``(None, lm_step)`` and the
    loop's wall times count."""
    now = hw.clock(torch.device(device))
    if now is time.perf_counter:
        return None, lm_step
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    owner = {id(model): name for name, (model, _, _) in runs.items()}

    def step(model, optimizer, batch) -> float:
        start = now()
        loss = lm_step(model, optimizer, batch)
        seconds[owner[id(model)]].append(now() - start)
        return loss

    return seconds, step


def validation_table(v: Validation) -> str:
    rows = [("width", "params", "baseline ms meas / pred", "err", "MVAS + DGR ms meas / pred", "err",
             "speed ratio meas / pred")]
    for p in v.points:
        cells = [f"{p.measured[n] * 1e3:.1f} / {p.predicted[n] * 1e3:.1f}" for n in (BASELINE, MACRO)]
        rows.append((p.width, f"{p.params / 1e6:.2f}M", cells[0], f"{p.error(BASELINE):+.0%}", cells[1],
                     f"{p.error(MACRO):+.0%}", f"{p.measured_ratio:.2f}x / {p.predicted_ratio:.2f}x"))
    return format_table(rows) + (f"\nstep-time error: max {v.max_error:.0%}, mean {v.mean_error:.0%}; speed-ratio "
                                 f"error: max {v.max_ratio_error:.0%}")


# ------------------------------------------------------------------------------------------- predictions
def _llama(d: int, layers: int, heads: int, d_ff: int) -> TransformerShape:
    return TransformerShape(family="llama", n_layers=layers, d_model=d, n_heads=heads, n_kv_heads=heads, d_ff=d_ff,
                            vocab_size=32000, max_seq_len=2048, tied_embeddings=False, norm_eps=1e-6)


#: Llama-shaped models from 125M to 65B parameters (LLaMA's own shapes at 7B, 13B, 33B, 65B; the C1 ~10B model)
LADDER: dict[str, TransformerShape] = {
    "125M": _llama(768, 12, 12, 2048),
    "350M": _llama(1024, 24, 16, 2816),
    "760M": _llama(1536, 24, 16, 4096),
    "1.3B": _llama(2048, 24, 16, 5632),
    "2.7B": _llama(2560, 32, 32, 6912),
    "7B": _llama(4096, 32, 32, 11008),
    "10B": get_model_spec("llama_10b").shape,
    "13B": _llama(5120, 40, 40, 13824),
    "33B": _llama(6656, 60, 52, 17920),
    "65B": get_model_spec("llama_65b").shape,
}


def gpu_methods(traced: Traced) -> dict[str, Method]:
    """The baseline and the macro-architecture on a GPU, in bf16 (fp16 on V100), under each reading of the post
    (:data:`READINGS`); the plan's mix of formats and the optimizer state are those measured on this machine."""
    base = replace(mixed_precision(FUSED_BASELINE), name=BASELINE)
    macro = Method(MACRO, weight_bytes=traced.weight_bytes, grad_bytes=2.0, state_bytes=traced.state_bytes,
                   traffic=fused_mvas_traffic(traced.packed_weight_bytes), managed_fraction=traced.managed_fraction,
                   low_precision_fraction=traced.low_precision_fraction, frees_gradients=True, fp8_matmuls=True)
    implemented = replace(macro, name="as implemented", traffic=replace(traced.traffic[MACRO], optimizer_efficiency=1.0,
                                                                        dequant_efficiency=1.0), fp8_matmuls=False)
    return {BASELINE: base, "theoretical": macro.priced_as(base), "achieved": macro, "as implemented": implemented}


@dataclass
class CardResult:
    """One card: the fastest plan of each method at each model size, and the speedups over the baseline."""

    card: hw.Accelerator
    plans: dict[str, dict[str, Plan | None]]  # size -> method -> plan

    def speedups(self, reading: str) -> dict[str, float]:
        return {size: speedup(p[BASELINE], p[reading]) for size, p in self.plans.items()}

    def best(self, reading: str) -> tuple[float, str]:
        """The largest speedup over the sizes the baseline can train, and that size."""
        values = {s: v for s, v in self.speedups(reading).items() if not math.isnan(v)}
        if not values:
            return math.nan, "-"
        size = max(values, key=values.get)
        return values[size], size

    def largest(self, method: str) -> str:
        fits = [size for size, p in self.plans.items() if p[method] is not None]
        return fits[-1] if fits else "none"


@dataclass
class Predictions:
    cards: dict[str, CardResult]
    methods: dict[str, Method]
    eff: Efficiency
    seq_len: int
    global_batch: int
    world_size: int
    reserve: float


def predict_cards(cards: Sequence[str], sizes: Sequence[str], traced: Traced, *, eff: Efficiency, seq_len: int,
                  global_batch: int, world_size: int, reserve: float) -> Predictions:
    """Each card x each model size: the fastest plan of every method (``step_time.best_plan``) on a node of
    ``world_size`` cards training ``global_batch`` sequences of ``seq_len`` per optimizer step."""
    if global_batch % world_size:
        raise ValueError(f"global_batch={global_batch} must be a multiple of world_size={world_size}")
    methods = gpu_methods(traced)
    out = {}
    for name in tqdm(cards, desc="cards", mininterval=5):
        card = hw.get_accelerator(name)
        device = card.device()
        plans = {size: {m: best_plan(LADDER[size], method, device, seq_len=seq_len,
                                     batch_per_rank=global_batch // world_size, world_size=world_size, eff=eff,
                                     reserve=reserve)
                        for m, method in methods.items()}
                 for size in sizes}
        out[name] = CardResult(card, plans)
    return Predictions(out, methods, eff, seq_len, global_batch, world_size, reserve)


@dataclass
class Ecc:
    """What ECC costs on one card and what disabling it would buy in the default state and if it were on."""

    card: str
    state: str
    capacity_cost: float | None
    bandwidth_cost: float | None
    gain_default: float  # speedup from "disable ECC" as the card ships (1: nothing changes)
    gain_if_on: float  # speedup from disabling it if it were on (largest over the sizes)


def ecc_effects(pred: Predictions) -> list[Ecc]:
    """For every card: the baseline's best plan with ECC on against off (its capacity and, where published,
    bandwidth cost), over the ladder; the default state decides what the post's advice changes."""
    out = []
    base = pred.methods[BASELINE]
    for name, r in pred.cards.items():
        card = r.card
        if not card.has_ecc:
            out.append(Ecc(name, card.ecc, None, None, 1.0, 1.0))
            continue
        on, off = card.device(ecc_on=True), card.device()
        gains = []
        for size in r.plans:
            kw = dict(seq_len=pred.seq_len, batch_per_rank=pred.global_batch // pred.world_size,
                      world_size=pred.world_size, eff=pred.eff, reserve=pred.reserve)
            with_ecc, without = best_plan(LADDER[size], base, on, **kw), best_plan(LADDER[size], base, off, **kw)
            if with_ecc is not None and without is not None:
                gains.append(speedup(with_ecc, without))
        gain_if_on = max(gains) if gains else 1.0
        default_on = card.ecc.startswith("on")
        out.append(Ecc(name, card.ecc, card.ecc_capacity_cost, card.ecc_bandwidth_cost,
                       gain_if_on if default_on else 1.0, gain_if_on))
    return out


# ------------------------------------------------------------------------------------------- what is graded
def metrics(v: Validation, pred: Predictions, eccs: list[Ecc], mach: Machine | None) -> dict[str, float]:
    """The numbers beside the graded ones, as bare values (``model_step_error``, ``model_ratio_error``, the
    measured speed ratios here, this machine's row) and the graded ones' values (:func:`estimates` carries them
    as modelled and looked up)."""
    out: dict[str, float] = {
        "model_step_error": v.max_error, "model_step_error_mean": v.mean_error, "model_ratio_error": v.max_ratio_error,
        "measured_speed_ratio_min": min(p.measured_ratio for p in v.points),
        "measured_speed_ratio_max": max(p.measured_ratio for p in v.points),
    }
    if mach is not None:
        out |= {"machine_bf16_tflops": mach.row.bf16_tflops, "machine_fp32_tflops": mach.row.fp32_tflops,
                "machine_bandwidth_gbs": mach.row.bandwidth_gbs}
    for r in pred.cards.values():
        for reading in ("theoretical", "achieved", "as implemented"):
            value, _ = r.best(reading)
            out[f"{r.card.key}_{reading.replace('as ', '')}_speedup"] = value
    consumer = [e for e in eccs if e.card in hw.CONSUMER]
    if consumer:
        out["ecc_disable_speedup"] = max(e.gain_default for e in consumer)
        out["ecc_disable_speedup_if_on"] = max(e.gain_if_on for e in consumer)
    return {k: v for k, v in out.items() if not (isinstance(v, float) and math.isnan(v))}


ECC_SOURCE = "the cards' data sheets as tabulated in macroarch.measure.hardware: ECC state as shipped"
CARD_KEYS = ("a100", "v100", "rtx3090")
"""The cards the post gives speedups for (metric prefixes)."""


def model_check(v: Validation, bound: float = STEP_TIME_BOUND) -> str:
    """How the step-time model fared in its validation, in words (goes into each prediction's method)."""
    verdict = (f"over its {bound:.0%} bound: failed validation" if v.max_error > bound
               else f"within its {bound:.0%} bound")
    return f"step-time model checked on {len(v.points)} widths here: step-time error {v.max_error:.0%} ({verdict})"


def estimates(v: Validation, pred: Predictions, eccs: list[Ecc], bound: float = STEP_TIME_BOUND
              ) -> dict[str, Estimate]:
    """The graded numbers: ``<card>_{theoretical,achieved}_speedup`` as predictions whose interval is the model's
    measured speed-ratio error (``modelled``; the step-time error and its bound in the method), and
    ``ecc_disable_speedup`` looked up (the consumer cards' ECC state as shipped). Neither is a measurement."""
    m = metrics(v, pred, eccs, None)
    check = f"{model_check(v, bound)}; the interval is its speed-ratio error"
    out = {f"{card}_{what}_speedup": modelled(m[f"{card}_{what}_speedup"], v.max_ratio_error, model=check, unit="x")
           for card in CARD_KEYS for what in ("theoretical", "achieved") if f"{card}_{what}_speedup" in m}
    if "ecc_disable_speedup" in m:
        out["ecc_disable_speedup"] = looked_up(m["ecc_disable_speedup"], ECC_SOURCE, unit="x")
    return out


# ------------------------------------------------------------------------------------------- tables
def hardware_table(rows: Sequence[hw.Accelerator]) -> str:
    return format_table(hw.table_rows(list(rows))) + "\n\nsources:\n" + hw.legend(list(rows))


def traced_table(traced: Traced) -> str:
    rows = [("per step", "bytes / activation byte", "optimizer B/param", "dequant B/element", "optimizer eff",
             "dequant eff", "ops (fixed + per layer)", "optimizer ops/tensor")]
    for name, t in traced.traffic.items():
        rows.append((name, f"{t.activation:.1f}", f"{t.optimizer:.1f}", f"{t.dequant:.2f}",
                     f"{t.optimizer_efficiency:.2f}", f"{t.dequant_efficiency:.2f}",
                     f"{t.ops_fixed:.0f} + {t.ops_per_layer:.0f}", f"{t.ops_per_tensor:.1f}"))
    rows.append(("fused (GPU)", f"{FUSED_BASELINE.activation:.1f}", f"{FUSED_BASELINE.optimizer:.1f} / "
                 f"{fused_mvas_traffic(traced.packed_weight_bytes).optimizer:.1f}",
                 f"{fused_mvas_traffic(traced.packed_weight_bytes).dequant:.2f}", "1", "1", "-", "-"))
    return (format_table(rows) + f"\nMVAS plan at {traced.reference}: {traced.weight_bytes:.3f} B/param stored "
            f"({traced.managed_fraction:.1%} of parameters packed, {traced.packed_weight_bytes:.3f} B/element with "
            f"scales), {traced.low_precision_fraction:.0%} of matmul weights in fp8/fp4, optimizer state "
            f"{traced.state_bytes:.2f} B/param")


def prediction_table(pred: Predictions, error: float) -> str:
    rows = [("card", "largest model: baseline / MVAS+DGR", "theoretical", "achieved", "as implemented", "post")]
    for name, r in pred.cards.items():
        cells = []
        for reading in ("theoretical", "achieved", "as implemented"):
            value, size = r.best(reading)
            cells.append("-" if math.isnan(value) else f"{value:.2f}x +-{error:.0%} ({size})")
        post = hw.POST_SPEEDUPS.get(name)
        rows.append((name, f"{r.largest(BASELINE)} / {r.largest('achieved')}", *cells,
                     f"{post[0]}x / {post[1]}x" if post else "-"))
    return format_table(rows)


def plan_table(pred: Predictions, card: str) -> str:
    """Per model size on one card: what each method's fastest plan is and how fast."""
    r = pred.cards[card]
    rows = [("size", "baseline", "MVAS + DGR (achieved)", "theoretical", "achieved")]
    for size, p in r.plans.items():
        rows.append((size, p[BASELINE].describe() if p[BASELINE] else "does not fit",
                     p["achieved"].describe() if p["achieved"] else "does not fit",
                     *(f"{speedup(p[BASELINE], p[k]):.2f}x" for k in ("theoretical", "achieved"))))
    return card + "\n" + format_table(rows)


def ecc_table(eccs: list[Ecc]) -> str:
    rows = [("card", "ECC", "cost when on (capacity / bandwidth)", "disabling it: as shipped / if it were on")]
    for e in eccs:
        cost = "-" if e.capacity_cost is None else (
            f"{e.capacity_cost:.2%} / {'not published' if e.bandwidth_cost is None else f'{e.bandwidth_cost:.2%}'}")
        rows.append((e.card, e.state, cost, f"{e.gain_default:.3f}x / {e.gain_if_on:.3f}x"))
    return format_table(rows)


# ------------------------------------------------------------------------------------------- figures
FONT = 8
"""The smallest text of the figures, in points: 8 pt prints at 6.7 pt in an 8 in figure scaled to the report's page."""


def _below(ax: plt.Axes, ncol: int = 1, offset: float = 0.16) -> None:
    ax.legend(fontsize=FONT, loc="upper center", bbox_to_anchor=(0.5, -offset), ncol=ncol, frameon=False)


def plot_validation(v: Validation) -> Figure:
    """The step-time model against this machine: each variant's fastest measured step and the model's prediction
    per width; and the speed ratio both give (the quantity the post's speedups are), with the model's error."""
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(7.8, 4.4), layout="constrained")
    params = [p.params / 1e6 for p in v.points]
    for name, color in ((BASELINE, "C0"), (MACRO, "C3")):
        ax.plot(params, [p.measured[name] * 1e3 for p in v.points], "o", color=color, label=f"{name}, measured")
        ax.plot(params, [p.predicted[name] * 1e3 for p in v.points], "-", color=color, label=f"{name}, model")
    ax.set(xscale="log", yscale="log", xlabel="parameters (M)", ylabel="step time (ms)",
           title=f"step time: {v.layers}-layer Llama, {v.batch_size}x{v.seq_len} tokens,\n{v.compute_dtype}; model "
                 f"error max {v.max_error:.0%} (bound {STEP_TIME_BOUND:.0%})")
    ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))  # 1-2-5 ticks, labelled plainly ("20", not "2x10^1")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    _below(ax, ncol=2)
    bx.plot(params, [p.measured_ratio for p in v.points], "o", color="k", label="measured (fastest steps)")
    bx.plot(params, [p.predicted_ratio for p in v.points], "-", color="k", label="model")
    bx.axhline(1.0, color="grey", lw=0.8, ls=":", label="no effect")
    bx.set(xscale="log", xlabel="parameters (M)", ylabel="speed, MVAS + DGR / baseline (x)",
           title=f"speed ratio: model error max {v.max_ratio_error:.0%}")
    _below(bx)
    for a in (ax, bx):  # log-axis minor labels collide ("3x10^0 4x10^0"): the sweep's sizes instead
        a.xaxis.set_minor_formatter(NullFormatter())
        a.set_xticks(params, [f"{x:.2g}" for x in params])
        a.title.set_fontsize(9)
    return fig


def plot_predictions(pred: Predictions, error: float, targets: Sequence[Any]) -> Figure:
    """Above: the modelled speedups per model size on the cards the post names (achieved with the model's error as a
    band). Below: each card's best speedup over the ladder, theoretical and achieved, with the model's speed-ratio
    error as error bars (modelled, not measured), and for the post's cards its numbers (black ticks) and the
    regions that grade reproduced (green bands) from ``targets``: the registry's C11 targets, passed in by the
    notebook (anything with ``metric``, ``lo`` and ``hi``)."""
    by_metric = {t.metric: t for t in targets}
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(7.8, 9.0), layout="constrained")
    for i, name in enumerate(hw.POST_SPEEDUPS):
        if name not in pred.cards:
            continue
        r, color = pred.cards[name], f"C{i}"
        sizes = list(r.plans)
        x = [parameter_count(LADDER[s]) / 1e9 for s in sizes]
        achieved = np.array([r.speedups("achieved")[s] for s in sizes])
        ax.plot(x, [r.speedups("theoretical")[s] for s in sizes], "--", color=color, label=f"{name}, theoretical")
        ax.plot(x, achieved, "-o", color=color, ms=3, label=f"{name}, achieved (band: +-{error:.0%})")
        ax.fill_between(x, achieved * (1 - error), achieved * (1 + error), color=color, alpha=0.12)
    ax.axhline(1.0, color="grey", lw=0.8, label="no speedup")
    ax.set(xscale="log", xlabel="model parameters (B), Llama ladder", ylabel="speedup over the baseline (modelled, x)",
           title=f"step-time model per model size, {pred.world_size} cards per node (a gap: the baseline does not fit)")
    ax.xaxis.set_minor_formatter(NullFormatter())  # minor labels collide on a log axis ("3x10^0 4x10^0")
    _below(ax, ncol=2, offset=0.15)
    names = list(pred.cards)
    xs = np.arange(len(names))
    width = 0.38
    for j, (reading, color) in enumerate((("theoretical", "C7"), ("achieved", "C2"))):
        values = [pred.cards[n].best(reading)[0] for n in names]
        bx.bar(xs + (j - 0.5) * width, values, width, color=color, alpha=0.8, label=f"model, {reading} (+-{error:.0%})",
               yerr=[v * error for v in values], capsize=2)
    post_label = band_label = None
    for k, n in enumerate(names):
        if n not in hw.POST_SPEEDUPS:
            continue
        for j, (reading, value) in enumerate(zip(("theoretical", "achieved"), hw.POST_SPEEDUPS[n])):
            left = k + (j - 1) * width
            t = by_metric.get(f"{pred.cards[n].card.key}_{reading}_speedup")
            if t is not None:
                band_label = bx.fill_between([left, left + width], t.lo, t.hi, color="C2", alpha=0.25, lw=0,
                                             label=None if band_label else "post +-10%: graded reproduced")
            post_label = bx.plot([left, left + width], [value] * 2, color="k", lw=2,
                                 label=None if post_label else "post's theoretical / achieved")
    bx.axhline(1.0, color="grey", lw=0.8)
    bx.set_xticks(xs, [n.replace(" SXM", "\nSXM").replace(" PCIe", "\nPCIe") for n in names], fontsize=FONT)
    bx.set(xlabel="card", ylabel="best speedup over the ladder (modelled, x)",
           title="per card: modelled, not measured (bars: the model's speed-ratio error)")
    _below(bx, ncol=2, offset=0.22)
    for a in (ax, bx):
        a.title.set_fontsize(9)
    return fig


# ------------------------------------------------------------------------------------------- verdict texts
def texts(v: Validation, pred: Predictions, eccs: list[Ecc], mach: Machine, *, profile: str,
          bound: float = STEP_TIME_BOUND) -> dict[str, str]:
    """``scale``, ``measured_text`` and ``note`` for ``get_claim("C11").grade``: each graded number as its
    :meth:`Estimate.describe` (value, the model's error as its interval, how it was made, modelled or looked up)."""
    err = v.max_ratio_error
    est = estimates(v, pred, eccs, bound)

    def described(metric: str) -> str:
        return est[metric].describe(3) if metric in est else "none (the baseline fits no model size)"

    parts = []
    for name, (theo, ach) in hw.POST_SPEEDUPS.items():
        if name in pred.cards:
            key, size = pred.cards[name].card.key, pred.cards[name].best("achieved")[1]
            parts.append(f"{name.split(' SXM')[0]} (post {theo}x / {ach}x; best at {size}): theoretical "
                         f"{described(f'{key}_theoretical_speedup')}, achieved {described(f'{key}_achieved_speedup')}")
    consumer = [e for e in eccs if e.card in hw.CONSUMER]
    ecc = "; ".join(f"{e.card}: {e.state.split(':')[0].split(';')[0]}" for e in consumer)
    measured = ("predicted by the step-time model, not measured: " + "; ".join(parts)
                + (f"; disabling ECC on consumer cards {est['ecc_disable_speedup'].describe(3)} ({ecc})"
                   if "ecc_disable_speedup" in est else ""))
    gpu = mach.info.get("gpu")
    scale = (f"step-time model from published specs: {pred.world_size}-card node, {pred.global_batch} x "
             f"{pred.seq_len} tokens per step, Llama {next(iter(LADDER))}-{list(LADDER)[-1]}, matmul efficiency "
             f"{pred.eff.matmul:g}, bandwidth {pred.eff.bandwidth:g}, link {pred.eff.link:g}; validated on "
             f"{describe(mach.info, v.compute_dtype)}: {v.layers}-layer Llama x {[p.width for p in v.points]}, "
             f"{v.batch_size}x{v.seq_len} tokens, step-time error max {v.max_error:.0%} (mean {v.mean_error:.0%}), "
             f"speed-ratio error max {err:.0%}")
    evidence = (f"measured on {gpu}: MVAS + DGR / baseline speed {min(p.measured_ratio for p in v.points):.2f}-"
                f"{max(p.measured_ratio for p in v.points):.2f}x" if gpu else
                f"no GPU here ({profile} profile): the cards are predicted, not measured; this machine measures "
                f"MVAS + DGR at {min(p.measured_ratio for p in v.points):.2f}-"
                f"{max(p.measured_ratio for p in v.points):.2f}x the baseline's speed")
    how = "; ".join(f"{name.split(' SXM')[0]} at {size}: baseline {p[BASELINE].describe()}, MVAS + DGR "
                    f"{p['achieved'].describe()}" for name in hw.POST_SPEEDUPS if name in pred.cards
                    for size in [pred.cards[name].best("achieved")[1]] if size in pred.cards[name].plans
                    for p in [pred.cards[name].plans[size]])
    note = (f"theoretical = {READINGS['theoretical']}; achieved = {READINGS['achieved']}; {evidence}; none of A100, "
            f"V100, RTX 3090 has fp8 tensor cores, so MVAS's memory savings are all they can turn into speed; where "
            f"they gain most: {how}")
    return {"scale": scale, "measured_text": measured, "note": note}
