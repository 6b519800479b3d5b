"""A step-time model of training a decoder-only transformer, with and without the macro-architecture (claim C11).

Post section 5.2 states speedups per GPU (A100 3.2x theoretical / 2.8x achieved, ...). A speedup from MVAS + DGR
can only come from what their memory savings allow (a larger micro-batch, no activation recomputation, state
that fits without ZeRO-3 sharding) and, on cards with fp8 tensor cores, from running the low-precision weights'
matmuls in fp8; it is paid for by (de)quantising the weights just in time and by the optimizer's packed state.
This module prices one optimizer step of a :class:`Workload` with a :class:`Method` on a :class:`Device`:

- **matmuls**: the training FLOPs of Kaplan et al. 2020 (``macroarch.measure.zero3.training_flops``: ``6 N``
  per token plus attention), plus one more forward with full recomputation, at the device's peak rate for
  the compute dtype times ``Efficiency.matmul``; with ``Method.fp8_matmuls`` and a device that has an fp8
  rate, the share of weight-matmul FLOPs on fp8/fp4-stored weights runs at the fp8 rate;
- **elementwise work** (norms, activations, softmax, rotary, residuals, loss): ``Traffic.activation`` bytes
  moved per byte of saved activations (the exact count of ``macroarch.measure.memory.analytic``, with the
  attention scores left out under flash attention), a third more with recomputation (the forward's share);
  the gradient buffer's read-modify-write per extra accumulation micro-step;
- **(de)quantisation**: ``Traffic.dequant`` bytes per packed weight element per materialisation, twice per
  micro-step (forward, and backward's re-materialisation), three times with recomputation;
- **optimizer step**: ``Traffic.optimizer`` bytes per parameter (per shard under ZeRO-3);
  all bytes at the device's bandwidth times ``Efficiency.bandwidth``;
- **communication** over ``world_size`` data-parallel ranks with the calibrated alpha-beta ring model of claim
  C5 (``macroarch.measure.zero3``): replicated state all-reduces the 16-bit gradients once per step, overlapped
  with the last micro-step's backward (only the excess counts); sharded state (ZeRO-3) gathers parameters and
  reduce-scatters gradients every micro-step with FSDP's overlapped schedule (``zero3_step``);
- **host**: ``ops * Device.op_overhead`` for the ops the step dispatches; it adds to the device time on a CPU
  and hides behind it on a GPU (``Device.asynchronous``: the longer of the two counts).

:func:`memory_bytes` counts what one card holds (the methods' state bytes per parameter, activations of one
micro-batch or their checkpoints) and :func:`best_plan` picks, among the micro-batches, recomputation and
sharding that fit, the one with the least time per token: that is how a method's memory turns into speed.

Deviations, all on the side of the macro-architecture: pipeline and tensor parallelism, CPU offload,
activation casts to fp8 and kernel-launch gaps are not modelled; weight reads of compute-bound matmuls are not
counted (they are hidden at the sequence lengths used).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from macroarch.measure.memory.analytic import activation_terms, parameter_count
from macroarch.measure.zero3 import Cluster, all_reduce_time, fsdp_units, training_flops, zero3_step
from macroarch.models.spec import TransformerShape

#: a recomputed forward repeats this share of a micro-step's elementwise traffic (forward, and backward's two)
RECOMPUTE_SHARE = 1 / 3


@dataclass(frozen=True)
class Device:
    """What the model needs of one accelerator (or CPU).

    Attributes:
        name: what it is.
        matmul_flops: peak matmul FLOP/s by compute dtype (``"bf16"`` = the 16-bit tensor rate, ``"fp32"``,
            optionally ``"fp8"``).
        bandwidth: memory bandwidth, bytes/s.
        memory: memory capacity, bytes.
        link_bandwidth: bytes/s each way per device for collectives (None: a single device).
        link_latency: seconds per ring step of a collective.
        op_overhead: seconds the host spends per dispatched op.
        asynchronous: the host runs ahead of the device (GPU): a step takes the longer of host and device time;
            otherwise (CPU) they add.
    """

    name: str
    matmul_flops: Mapping[str, float]
    bandwidth: float
    memory: float
    link_bandwidth: float | None = None
    link_latency: float | None = None
    op_overhead: float = 0.0
    asynchronous: bool = True

    def __post_init__(self) -> None:
        if "bf16" not in self.matmul_flops and "fp32" not in self.matmul_flops:
            raise ValueError(f"{self.name}: matmul_flops needs a 'bf16' or 'fp32' rate")
        if not all(v > 0 for v in self.matmul_flops.values()) or not self.bandwidth > 0:
            raise ValueError(f"{self.name}: rates and bandwidth must be positive")


@dataclass(frozen=True)
class Efficiency:
    """Fractions of the device's peak that the work reaches (1: the rates are achievable ones, as measured).

    Attributes:
        matmul: of the matmul rate (large bf16 GEMMs reach 0.6-0.8 of datasheet peak).
        bandwidth: of memory bandwidth, for elementwise kernels.
        link: of the link bandwidth, for collectives (NCCL's bus bandwidth against the link's).
    """

    matmul: float = 1.0
    bandwidth: float = 1.0
    link: float = 1.0

    def __post_init__(self) -> None:
        for name in ("matmul", "bandwidth", "link"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"Efficiency.{name}={getattr(self, name)!r} must lie in (0, 1]")


@dataclass(frozen=True)
class Traffic:
    """Memory traffic and host ops of the non-matmul work of one implementation.

    Attributes:
        activation: bytes moved by elementwise work (forward + backward) per byte of saved activations.
        optimizer: bytes read and written per parameter by one optimizer step.
        dequant: bytes per packed weight element per materialisation (read packed, write dense); 0: no MVAS.
        accumulate: bytes per parameter per extra accumulation micro-step (read-modify-write of the gradient).
        ops_fixed, ops_per_layer: host ops of one micro-step's forward + backward: a fixed part and per layer.
        ops_per_tensor: host ops of the optimizer step per parameter tensor.
        optimizer_efficiency, dequant_efficiency: the fraction of the device's bandwidth the optimizer's and the
            de-quantisation's kernels reach (1: bandwidth-bound kernels; less where they are compute- or
            latency-bound, as bit manipulation and random numbers for stochastic rounding are on a CPU).
        source: how the numbers were obtained.
    """

    activation: float
    optimizer: float
    dequant: float = 0.0
    accumulate: float = 4.0
    ops_fixed: float = 0.0
    ops_per_layer: float = 0.0
    ops_per_tensor: float = 0.0
    optimizer_efficiency: float = 1.0
    dequant_efficiency: float = 1.0
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("activation", "optimizer", "dequant", "accumulate", "ops_fixed", "ops_per_layer",
                     "ops_per_tensor"):
            if getattr(self, name) < 0:
                raise ValueError(f"Traffic.{name}={getattr(self, name)!r} must be >= 0")
        for name in ("optimizer_efficiency", "dequant_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"Traffic.{name}={getattr(self, name)!r} must lie in (0, 1]")


#: What fused kernels must move. Elementwise: each saved activation written in forward, read in backward, its
#: gradient written and read (4x). AdamW with an fp32 master (mixed precision): read the 16-bit gradient, master,
#: m, v (2 + 4 + 4 + 4), write master, m, v and the 16-bit weight (4 + 4 + 4 + 2) = 28 bytes.
FUSED_BASELINE = Traffic(activation=4.0, optimizer=28.0, accumulate=4.0,
                         source="fused kernels, counted: 4 passes over activations, AdamW + fp32 master 28 B/param")


def fused_mvas_traffic(weight_bytes: float, moment_bytes: float = 2 * (1 + 4 / 128), dense_bytes: int = 2) -> Traffic:
    """What fused MVAS kernels must move: a materialisation reads the packed weight (``weight_bytes`` per
    element with its scales) and writes the dense one; MVASAdamW reads the gradient, the packed weight and the
    packed moments and writes weight and moments back."""
    return Traffic(activation=FUSED_BASELINE.activation, optimizer=dense_bytes + 2 * weight_bytes + 2 * moment_bytes,
                   dequant=weight_bytes + dense_bytes, accumulate=FUSED_BASELINE.accumulate,
                   source=f"fused kernels, counted: dequant {weight_bytes:.2f} + {dense_bytes} B/element, MVASAdamW "
                          f"{dense_bytes + 2 * weight_bytes + 2 * moment_bytes:.2f} B/param")


@dataclass(frozen=True)
class Method:
    """A way of training: the bytes its state takes per parameter and how it computes.

    Attributes:
        name: for tables.
        weight_bytes: mean bytes per parameter of the stored weights (packed and dense together).
        grad_bytes: bytes per gradient element.
        state_bytes: optimizer state (moments, master copy) per parameter.
        managed_fraction: share of parameters stored packed and materialised just in time (MVAS).
        low_precision_fraction: share of the weight-matmul FLOPs whose weights are stored in fp8 or fp4.
        frees_gradients: DGR: gradients live one layer group at a time (only without accumulation: with it they
            must persist across micro-steps).
        fp8_matmuls: run the low-precision share of the weight matmuls at the fp8 rate where the device has one.
        traffic: the implementation's memory traffic and host ops.
    """

    name: str
    weight_bytes: float
    grad_bytes: float
    state_bytes: float
    traffic: Traffic
    managed_fraction: float = 0.0
    low_precision_fraction: float = 0.0
    frees_gradients: bool = False
    fp8_matmuls: bool = False

    def __post_init__(self) -> None:
        for name in ("managed_fraction", "low_precision_fraction"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"Method.{name}={getattr(self, name)!r} must lie in [0, 1]")
        if min(self.weight_bytes, self.grad_bytes, self.state_bytes) < 0:
            raise ValueError(f"{self.name}: bytes per parameter must be >= 0")

    @property
    def bytes_per_param(self) -> float:
        return self.weight_bytes + self.grad_bytes + self.state_bytes

    def priced_as(self, other: Method) -> Method:
        """This method's memory and matmul precision with ``other``'s traffic: what its savings buy if its own
        extra work (de-quantisation, packed optimizer) cost nothing."""
        return replace(self, name=f"{self.name} (its costs left out)", traffic=other.traffic)


def mixed_precision(traffic: Traffic = FUSED_BASELINE, dense_bytes: int = 2) -> Method:
    """The baseline: 16-bit weights and gradients, fp32 master and Adam moments (ZeRO's 16 B/param); with
    ``dense_bytes=4``, plain fp32 AdamW (the same 16 B/param)."""
    state = 12.0 if dense_bytes == 2 else 8.0
    return Method(f"AdamW {'16-bit + fp32 master' if dense_bytes == 2 else 'fp32'}", float(dense_bytes),
                  float(dense_bytes), state, traffic)


@dataclass(frozen=True)
class Workload:
    """One data-parallel rank's share of a training step.

    Attributes:
        shape: the model.
        seq_len: tokens per sequence.
        micro_batch: sequences per forward/backward.
        accumulation: micro-steps per optimizer step.
        recompute: full activation recomputation (one checkpoint per layer).
        world_size: data-parallel ranks.
        sharded: ZeRO-3 (parameters, gradients and optimizer state sharded over the ranks).
        flash_attention: attention without saved scores (GPU kernels); False: eager attention, as the models
            built here run it.
        compute: ``"bf16"`` (16-bit tensor rate) or ``"fp32"``.
        device_type: whose kernels' saved activations to count (``"cuda"`` or ``"cpu"``).
    """

    shape: TransformerShape
    seq_len: int
    micro_batch: int
    accumulation: int = 1
    recompute: bool = False
    world_size: int = 1
    sharded: bool = False
    flash_attention: bool = True
    compute: str = "bf16"
    device_type: str = "cuda"

    def __post_init__(self) -> None:
        for name in ("seq_len", "micro_batch", "accumulation", "world_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"Workload.{name}={getattr(self, name)!r} must be a positive int")
        if self.compute not in ("bf16", "fp32"):
            raise ValueError(f"Workload.compute={self.compute!r} must be 'bf16' or 'fp32'")

    @property
    def tokens(self) -> int:
        """Tokens per rank per optimizer step."""
        return self.micro_batch * self.seq_len * self.accumulation

    @property
    def dense_bytes(self) -> int:
        return 2 if self.compute == "bf16" else 4


_SCORE_TERMS = ("attn.softmax", "attn.probs_cast", "attn.dropout")


def activation_bytes(w: Workload) -> dict[str, int]:
    """Saved activations of one micro-batch: ``all`` (every storage the forward saves) and ``held`` (what stays
    alive through the step: all of it, or with recomputation the layer inputs plus one layer's worth)."""
    import torch

    dtype = torch.bfloat16 if w.compute == "bf16" else torch.float32
    terms = activation_terms(w.shape, w.micro_batch, w.seq_len, dtype, w.device_type)
    if w.flash_attention:  # scores are recomputed in the kernel; it saves a log-sum-exp per row instead
        terms = [t for t in terms if not t.name.startswith(_SCORE_TERMS)]
        lse = 4 * w.micro_batch * w.shape.n_heads * w.seq_len
    else:
        lse = 0
    L = w.shape.n_layers
    per_layer = sum(t.nbytes for t in terms if t.where == "layer") + lse
    outside = sum(t.total for t in terms if t.where != "layer")
    total = L * per_layer + outside
    if not w.recompute:
        return {"all": total, "held": total}
    checkpoints = L * w.micro_batch * w.seq_len * w.shape.d_model * dtype.itemsize
    return {"all": total, "held": checkpoints + per_layer + outside}


def layer_parameters(shape: TransformerShape) -> int:
    return parameter_count(replace(shape, n_layers=2)) - parameter_count(replace(shape, n_layers=1))


def tensor_count(shape: TransformerShape) -> int:
    """Parameter tensors of the built model (for per-tensor host ops)."""
    per_layer = 12 if shape.family == "gpt2" else 9
    outside = 4 if shape.family == "gpt2" else 3 if shape.tied_embeddings else 4
    return shape.n_layers * per_layer + outside


@dataclass(frozen=True)
class StepTime:
    """One optimizer step, seconds by part (device parts summed over micro-steps)."""

    matmul: float
    elementwise: float
    dequant: float
    optimizer: float
    comm: float  # exposed (not hidden behind compute)
    host: float
    device: float  # every device part together
    total: float
    tokens: int

    @property
    def per_token(self) -> float:
        return self.total / self.tokens

    def parts(self) -> dict[str, float]:
        return {"matmul": self.matmul, "elementwise": self.elementwise, "dequant": self.dequant,
                "optimizer": self.optimizer, "comm": self.comm, "host": self.host}


def step_time(w: Workload, m: Method, device: Device, eff: Efficiency = Efficiency(), *,
              matmul_seconds: float | None = None) -> StepTime:
    """Seconds of one optimizer step of ``w`` trained with ``m`` on ``device`` (module docstring).

    ``matmul_seconds``: the measured time of one micro-step's matmuls (each shape timed alone), instead of
    FLOPs / (peak * efficiency); how a CPU, whose matmul rate depends much on the shape, is checked.
    """
    if w.compute not in device.matmul_flops:
        raise ValueError(f"{device.name} has no {w.compute} matmul rate; it has {sorted(device.matmul_flops)}")
    s, tr = w.shape, m.traffic
    n_params = parameter_count(s)
    micro_tokens = w.micro_batch * w.seq_len
    flops = training_flops(s, micro_tokens, w.seq_len)
    attention = 6 * s.n_layers * w.seq_len * s.d_model * micro_tokens
    if w.recompute:
        flops, attention = flops * 4 / 3, attention * 4 / 3
    fp8 = m.fp8_matmuls and "fp8" in device.matmul_flops and w.compute == "bf16"
    low = (flops - attention) * m.low_precision_fraction if fp8 else 0.0
    rate = device.matmul_flops[w.compute] * eff.matmul
    t_mm = (flops - low) / rate + (low / (device.matmul_flops["fp8"] * eff.matmul) if low else 0.0)
    if matmul_seconds is not None:
        t_mm = matmul_seconds * (4 / 3 if w.recompute else 1)
    bandwidth = device.bandwidth * eff.bandwidth
    act = activation_bytes(w)["all"]
    t_elem = tr.activation * act * (1 + RECOMPUTE_SHARE * w.recompute) / bandwidth
    managed = m.managed_fraction * n_params
    t_deq = tr.dequant * managed * (2 + w.recompute) / (bandwidth * tr.dequant_efficiency)
    shards = w.world_size if w.sharded else 1
    t_acc = (w.accumulation - 1) * tr.accumulate * n_params / shards / bandwidth
    t_opt = tr.optimizer * n_params / shards / (bandwidth * tr.optimizer_efficiency)
    micro = t_mm + t_elem + t_deq
    comm = 0.0
    if w.world_size > 1:
        if device.link_bandwidth is None:
            raise ValueError(f"{device.name} has no link: world_size must be 1")
        link, alpha = device.link_bandwidth * eff.link, device.link_latency or 0.0
        if w.sharded:
            cluster = Cluster(device.name, w.world_size, alpha, link, peak_flops=rate)
            z = zero3_step(fsdp_units(s, w.seq_len), cluster, micro_tokens, seq_len=w.seq_len,
                           param_bytes=m.weight_bytes, grad_bytes=m.grad_bytes,
                           compute_seconds=micro)
            comm = w.accumulation * (z.overlapped - z.compute)
        else:  # overlapped with the last micro-step's backward (two thirds of its compute)
            comm = max(0.0, all_reduce_time(m.grad_bytes * n_params, w.world_size, alpha, link) - 2 / 3 * micro)
    device_time = w.accumulation * micro + t_acc + t_opt + comm
    ops = w.accumulation * (tr.ops_fixed + s.n_layers * tr.ops_per_layer) + tensor_count(s) * tr.ops_per_tensor
    host = ops * device.op_overhead
    total = max(device_time, host) if device.asynchronous else device_time + host
    return StepTime(matmul=w.accumulation * t_mm, elementwise=w.accumulation * t_elem + t_acc,
                    dequant=w.accumulation * t_deq, optimizer=t_opt, comm=comm, host=host, device=device_time,
                    total=total, tokens=w.tokens)


def memory_bytes(w: Workload, m: Method) -> dict[str, float]:
    """Bytes one rank holds at its peak: weights, gradients, optimizer state, activations, buffers."""
    s = w.shape
    n_params, per_layer = parameter_count(s), layer_parameters(s)
    shards = w.world_size if w.sharded else 1
    grads = m.grad_bytes * n_params / shards
    if m.frees_gradients and w.accumulation == 1:  # DGR: one layer group's gradients at a time
        grads = min(grads, m.grad_bytes * per_layer)
    buffers = 0.0
    if w.sharded:  # FSDP holds the unit being computed and the one prefetched, gathered
        buffers += 2 * w.dense_bytes * per_layer
    if m.managed_fraction:  # the dense weights of the module being computed, materialised just in time
        buffers += w.dense_bytes * per_layer
    return {"weights": m.weight_bytes * n_params / shards, "gradients": grads,
            "optimizer_state": m.state_bytes * n_params / shards, "activations": activation_bytes(w)["held"],
            "buffers": buffers}


@dataclass(frozen=True)
class Plan:
    """The fastest way a method trains a model on one card: its workload, time and memory."""

    workload: Workload
    time: StepTime
    memory: dict[str, float]

    @property
    def per_token(self) -> float:
        return self.time.per_token

    def describe(self) -> str:
        w = self.workload
        how = "ZeRO-3" if w.sharded else "replicated"
        return (f"micro-batch {w.micro_batch} x {w.accumulation}, {'recompute, ' if w.recompute else ''}{how}, "
                f"{sum(self.memory.values()) / 1e9:.1f} GB")


def best_plan(shape: TransformerShape, m: Method, device: Device, *, seq_len: int, batch_per_rank: int,
              world_size: int = 1, eff: Efficiency = Efficiency(), reserve: float = 0.1,
              compute: str = "bf16") -> Plan | None:
    """The fastest configuration that fits ``(1 - reserve)`` of the device's memory, or None if none does.

    Candidates: micro-batches that divide ``batch_per_rank`` (sequences per rank per optimizer step, so every
    candidate trains on the same tokens per step), with and without recomputation, replicated and (with more
    than one rank) ZeRO-3. ``reserve`` is what the CUDA context, allocator fragmentation and workspaces take.
    """
    if not 0 <= reserve < 1:
        raise ValueError(f"reserve={reserve!r} must lie in [0, 1)")
    usable = device.memory * (1 - reserve)
    best: Plan | None = None
    micro_batches = [b for b in range(1, batch_per_rank + 1) if batch_per_rank % b == 0]
    for sharded in (False, True) if world_size > 1 else (False,):
        for b in micro_batches:
            for recompute in (False, True):
                w = Workload(shape, seq_len, b, batch_per_rank // b, recompute, world_size, sharded, compute=compute)
                mem = memory_bytes(w, m)
                if sum(mem.values()) > usable:
                    continue
                plan = Plan(w, step_time(w, m, device, eff), mem)
                if best is None or plan.per_token < best.per_token * (1 - 1e-9):
                    best = plan
    return best


def speedup(base: Plan | None, other: Plan | None) -> float:
    """Tokens per second of ``other`` over ``base``; nan when either cannot train the model."""
    if base is None or other is None:
        return math.nan
    return base.per_token / other.per_token
