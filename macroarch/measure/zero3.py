"""ZeRO-3 communication cost: how much of a training step parameter synchronisation takes (post 2.2, claim C5).

ZeRO stage 3 (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models") and FSDP (Zhao et al. 2023, PyTorch FSDP; ``torch.distributed.fsdp.fully_shard``) shard parameters,
gradients and optimizer state over ``n`` data-parallel ranks. With one FSDP unit per transformer block and a
root unit (embeddings, final norm, head), as ``fully_shard`` is applied in practice, one training step
(one micro-batch per rank) runs:

- forward: all-gather the root's parameters, then each block's (prefetched one block ahead), compute;
- backward: all-gather each block's parameters again (they were freed after forward:
  ``reshard_after_forward=True``; the root's are kept), compute, reduce-scatter the block's gradients;
  the root's gradients are reduce-scattered last.

That is ``3 * n_layers + 2`` collectives per step, each moving ``(n - 1) / n`` of its unit's bytes per rank.

**Collective time**: the alpha-beta (Hockney) model of the ring algorithms (Thakur, Rabenseifner & Gropp 2005;
Patarasuk & Yuan 2009, bandwidth-optimal all-reduce), for ``S`` bytes in the gathered (or reduced) tensor::

    all-gather, reduce-scatter:  (n - 1) * alpha + (n - 1) / n * S / B
    all-reduce:              2 * (n - 1) * alpha + 2 * (n - 1) / n * S / B

``alpha`` is the latency of one ring step, ``B`` the bandwidth each way per rank (NCCL's "bus bandwidth").
The post's "communication latency" is read as ``alpha``: each collective pays it ``n - 1`` times.
:func:`fit_alpha_beta` calibrates ``alpha`` and ``B`` from collectives timed on a real process group.

**Compute time**: training FLOPs per token ``6 * (matmul parameters) + 6 * n_layers * seq_len * d_model``
(Kaplan et al. 2020, table 1: forward ``2N + 2 n_layer n_ctx d``, times 3 for forward + backward; embedding
lookups cost nothing, the LM head is a matmul), backward twice forward, over ``peak FLOP/s * MFU``.

**Step time**: without overlap, compute plus every collective. With FSDP's overlap, :func:`zero3_step`
simulates the schedule above on two resources, the compute stream and the link (collectives in issue order,
one at a time): a block's gather is issued when the previous block starts computing, its reduce-scatter when
its backward ends. The *sync share* is ``(step - compute) / step``: the part of the step spent waiting for
parameter synchronisation. Deviations: the head and the embedding are one root unit; activation recompute,
optimizer step and data loading are not modelled (they would lower the share).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from macroarch.models.spec import ModelSpec, TransformerShape


@dataclass(frozen=True)
class Cluster:
    """Ranks, their link and their compute.

    Attributes:
        name: what it is, for tables.
        world_size: data-parallel ranks ``n`` (>= 1).
        latency: ``alpha``, seconds per ring step.
        bandwidth: ``B``, bytes per second each way per rank.
        peak_flops: peak FLOP/s per rank in the compute dtype.
        mfu: model FLOPs utilisation, the fraction of peak that training reaches.
        scatter_latency, scatter_bandwidth: the same for reduce-scatters, when they run at another speed than
            all-gathers (gloo's do); None: as all-gathers.
    """

    name: str
    world_size: int
    latency: float
    bandwidth: float
    peak_flops: float
    mfu: float = 1.0
    scatter_latency: float | None = None
    scatter_bandwidth: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size={self.world_size!r} must be an int >= 1")
        for name in ("latency", "scatter_latency"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"{name}={value!r} must be >= 0 seconds")
        for name in ("bandwidth", "peak_flops", "scatter_bandwidth"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name}={value!r} must be positive")
        if not 0 < self.mfu <= 1:
            raise ValueError(f"mfu={self.mfu!r} must lie in (0, 1]")

    def with_latency(self, latency: float) -> Cluster:
        """The same cluster with every collective's latency set to ``latency``."""
        return replace(self, latency=latency, scatter_latency=None if self.scatter_latency is None else latency)

    @property
    def scatter_link(self) -> tuple[float, float]:
        """``(latency, bandwidth)`` of reduce-scatters."""
        return (self.latency if self.scatter_latency is None else self.scatter_latency,
                self.bandwidth if self.scatter_bandwidth is None else self.scatter_bandwidth)


@dataclass(frozen=True)
class Unit:
    """One FSDP unit: its parameter count and its training FLOPs per token (forward + backward)."""

    name: str
    params: int
    flops_per_token: float


@dataclass(frozen=True)
class StepTime:
    """One ZeRO-3 training step, in seconds, with and without overlap of communication and compute."""

    compute: float
    gather: float  # all all-gathers
    reduce_scatter: float  # all reduce-scatters
    latency_part: float  # of gather + reduce_scatter: the (n - 1) * alpha terms of all collectives
    collectives: int
    overlapped: float  # simulated step with FSDP's overlap

    @property
    def comm(self) -> float:
        return self.gather + self.reduce_scatter

    @property
    def serial(self) -> float:
        return self.compute + self.comm

    @property
    def share_serial(self) -> float:
        """Share of the step spent in parameter sync when nothing overlaps."""
        return self.comm / self.serial

    @property
    def share_overlapped(self) -> float:
        """Share of the step spent waiting for parameter sync that compute did not hide."""
        return (self.overlapped - self.compute) / self.overlapped


def all_gather_time(nbytes: float, n: int, latency: float, bandwidth: float) -> float:
    """Ring all-gather (or reduce-scatter) of a tensor of ``nbytes`` in total over ``n`` ranks."""
    if n <= 1:
        return 0.0
    return (n - 1) * latency + (n - 1) / n * nbytes / bandwidth


reduce_scatter_time = all_gather_time


def all_reduce_time(nbytes: float, n: int, latency: float, bandwidth: float) -> float:
    """Ring all-reduce: a reduce-scatter followed by an all-gather."""
    return 2 * all_gather_time(nbytes, n, latency, bandwidth)


def fsdp_units(model: ModelSpec | TransformerShape, seq_len: int | None = None) -> list[Unit]:
    """The root unit (embeddings, final norm, head) and one unit per block, with FLOPs per token."""
    from macroarch.measure.memory.analytic import parameter_count

    s = model.shape if isinstance(model, ModelSpec) else model
    seq_len = seq_len or s.max_seq_len
    one_layer = parameter_count(replace(s, n_layers=2)) - parameter_count(replace(s, n_layers=1))
    root_params = parameter_count(s) - s.n_layers * one_layer
    norm_params = 4 * s.d_model if s.family == "gpt2" else 2 * s.d_model  # norms are not matmuls
    block_flops = 6 * (one_layer - norm_params) + 6 * seq_len * s.d_model
    root = Unit("root (embeddings, final norm, head)", root_params, 6 * s.vocab_size * s.d_model)
    return [root] + [Unit(f"block {i}", one_layer, block_flops) for i in range(s.n_layers)]


def training_flops(model: ModelSpec | TransformerShape, tokens: int, seq_len: int | None = None) -> float:
    """Forward + backward FLOPs of ``tokens`` tokens (Kaplan et al. 2020's count; module docstring)."""
    return tokens * sum(u.flops_per_token for u in fsdp_units(model, seq_len))


def zero3_step(model: ModelSpec | TransformerShape | Sequence[Unit], cluster: Cluster, tokens_per_rank: int,
               *, seq_len: int | None = None, param_bytes: int = 2, grad_bytes: int = 2,
               compute_seconds: float | None = None) -> StepTime:
    """Time of one ZeRO-3 step (module docstring) for ``tokens_per_rank`` tokens on each rank.

    Args:
        model: a spec or shape (units from :func:`fsdp_units`), or the units themselves (root first).
        cluster: ranks, link and compute.
        tokens_per_rank: micro-batch size times sequence length on one rank.
        seq_len: sequence length for the attention FLOPs; the model's ``max_seq_len`` by default.
        param_bytes: bytes per gathered parameter (2 for bf16/fp16).
        grad_bytes: bytes per reduce-scattered gradient element (2 for bf16/fp16, 4 for fp32).
        compute_seconds: the measured compute time of the whole step, spread over units by FLOPs, instead
            of FLOPs / (peak * MFU).
    """
    units = list(model) if isinstance(model, Sequence) else fsdp_units(model, seq_len)
    if not units or not all(isinstance(u, Unit) for u in units):
        raise ValueError("model must be a ModelSpec, a TransformerShape or a sequence of Units (root first)")
    if not isinstance(tokens_per_rank, int) or tokens_per_rank < 1:
        raise ValueError(f"tokens_per_rank={tokens_per_rank!r} must be a positive int")
    n, alpha, bw = cluster.world_size, cluster.latency, cluster.bandwidth
    flops = [u.flops_per_token * tokens_per_rank for u in units]
    rate = sum(flops) / compute_seconds if compute_seconds else cluster.peak_flops * cluster.mfu
    fwd = [f / 3 / rate for f in flops]
    bwd = [2 * f / 3 / rate for f in flops]
    gather = [all_gather_time(u.params * param_bytes, n, alpha, bw) for u in units]
    scatter_alpha, scatter_bw = cluster.scatter_link
    scatter = [reduce_scatter_time(u.params * grad_bytes, n, scatter_alpha, scatter_bw) for u in units]
    blocks = len(units) - 1
    collectives = (2 + 3 * blocks) if n > 1 else 0
    total_gather = gather[0] + 2 * sum(gather[1:])
    total_scatter = sum(scatter)
    latency_part = (n - 1) * ((1 + 2 * blocks) * alpha + (1 + blocks) * scatter_alpha) if n > 1 else 0.0
    return StepTime(compute=sum(fwd) + sum(bwd), gather=total_gather, reduce_scatter=total_scatter,
                    latency_part=latency_part, collectives=collectives,
                    overlapped=_simulate(fwd, bwd, gather, scatter))


def _simulate(fwd: list[float], bwd: list[float], gather: list[float], scatter: list[float]) -> float:
    """FSDP's overlapped schedule (module docstring); index 0 is the root unit, 1..L the blocks."""
    link_free = 0.0

    def comm(issued: float, duration: float) -> float:  # one link: collectives run one at a time, in issue order
        nonlocal link_free
        link_free = max(link_free, issued) + duration
        return link_free

    blocks = len(fwd) - 1
    # Forward: the root's gather, block 1's right behind it, then block i+1's when block i starts computing.
    now = comm(0.0, gather[0])  # the embedding lookup costs no FLOPs: the root's FLOPs are the head's
    ready = {1: comm(0.0, gather[1])} if blocks else {}
    for i in range(1, blocks + 1):
        start = max(now, ready[i])
        if i < blocks:
            ready[i + 1] = comm(start, gather[i + 1])
        now = start + fwd[i]
    now += fwd[0]  # final norm and head
    # Backward: the root stays gathered; the last block's gather is issued as backward starts (head first),
    # block i-1's when block i starts, block i's reduce-scatter when its backward ends, the root's last.
    ready = {blocks: comm(now, gather[blocks])} if blocks else {}
    now += bwd[0]
    for i in range(blocks, 0, -1):
        start = max(now, ready[i])
        if i > 1:
            ready[i - 1] = comm(start, gather[i - 1])
        now = start + bwd[i]
        comm(now, scatter[i])
    return max(now, comm(now, scatter[0]))


def sync_share(model: ModelSpec | TransformerShape | Sequence[Unit], cluster: Cluster, tokens_per_rank: int, *,
               overlap: bool = False, **kwargs) -> float:
    """Share of the step spent in parameter sync (``overlap``: only what compute does not hide)."""
    step = zero3_step(model, cluster, tokens_per_rank, **kwargs)
    return step.share_overlapped if overlap else step.share_serial


def latency_for_share(model: ModelSpec | TransformerShape | Sequence[Unit], cluster: Cluster, tokens_per_rank: int,
                      share: float, *, overlap: bool = False, lo: float = 1e-9, hi: float = 10.0,
                      **kwargs) -> float | None:
    """The latency ``alpha`` at which the sync share reaches ``share`` (bisection in log alpha).

    None if it is never reached below ``hi`` seconds; ``lo`` if it is reached already at ``lo``.
    """
    if not 0 < share < 1:
        raise ValueError(f"share={share!r} must lie in (0, 1)")

    def at(alpha: float) -> float:
        return sync_share(model, cluster.with_latency(alpha), tokens_per_rank, overlap=overlap, **kwargs)

    if at(lo) >= share:
        return lo
    if at(hi) < share:
        return None
    a, b = math.log(lo), math.log(hi)
    for _ in range(100):
        mid = (a + b) / 2
        a, b = (mid, b) if at(math.exp(mid)) < share else (a, mid)
    return math.exp(b)


def fit_alpha_beta(nbytes: Sequence[float], seconds: Sequence[float], world_size: int) -> tuple[float, float]:
    """``(alpha, B)`` of the ring all-gather / reduce-scatter formula fitted to timed collectives.

    ``nbytes`` are the gathered (full) tensor sizes. Least squares on the relative error, so that the
    small collectives (latency) weigh as much as the large ones (bandwidth); ``alpha`` is clipped at 0.
    """
    import numpy as np

    if world_size < 2:
        raise ValueError("a fit needs world_size >= 2: one rank does not communicate")
    s, t = np.asarray(nbytes, dtype=float), np.asarray(seconds, dtype=float)
    if s.shape != t.shape or len(s) < 2 or not (t > 0).all():
        raise ValueError("fit_alpha_beta needs >= 2 matching sizes and positive times")
    n = world_size
    # t = a + b * s  with  a = (n-1) alpha,  b = (n-1) / (n B); rows divided by t (relative error).
    design = np.stack([np.ones_like(s), s], axis=1) / t[:, None]
    (a, b), *_ = np.linalg.lstsq(design, np.ones_like(t), rcond=None)
    if b <= 0:
        raise ValueError("the timings do not grow with size: cannot fit a bandwidth")
    return max(float(a), 0.0) / (n - 1), (n - 1) / (n * float(b))
