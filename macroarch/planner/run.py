"""One full training step per combination of techniques, under fake tensors, at full depth.

A combination is a set of techniques stacked on the model the way a user would:

- ``mvas``: ``compose.apply`` with the policy's ``MVASConfig`` (packed weights, ``MVASAdamW`` with block-quantised
  moments); ``master`` adds MVAS's fp32 master copies (``MVASConfig.master_weights``);
- ``dgr``: DGR-sync groups of ``group_size`` blocks (with MVAS through ``compose.apply``; without it a
  ``DGRWrapper`` running the dtype recipe's optimizer per group, ``atomic_steps`` off as in ``DGRConfig``);
- ``checkpoint``: activation checkpointing of the repeated blocks, non-reentrant (the modules the model names,
  ``Model.checkpoint_units``, as PointNet's T-Nets beside its blocks; else the library's switch: transformers'
  ``gradient_checkpointing_enable``, timm's and open_clip's ``set_grad_checkpointing``; else
  ``torch.utils.checkpoint`` around each block of ``find_repeated_layers``);
- without MVAS, the dtype recipe's optimizer: ``MasterWeightAdamW`` (fp32 master and moments) for recipes with a
  master copy, else ``torch.optim.AdamW`` (moments in the parameter dtype).

The step (forward with the loss, backward, optimizer step, ``zero_grad``) is measured by
``macroarch.measure.fit.measure_training``: MemTracker's live bytes under ``FakeTensorMode`` with CPU kernels,
after the optimizer's state exists (a steady-state step), on the CPU's kernels or (``Setup.device="cuda"``, on a
machine with a GPU: autograd's backward needs a CUDA context even for fake tensors) CUDA's. ``fsdp2`` is not run
(no process group exists here): :func:`fsdp2_model` derives it from the one-device step, and says so. A
:class:`StepCache` keeps every step measured, so plans that share a model (one per budget, per size) share them.

Depth. A model of many identical blocks is measured at three shallow depths and extrapolated to its full depth,
affine in depth: ``extrapolate_peak`` for the peak, phase by phase (setup, forward, backward up to the first
block's, the rest of backward, optimizer: the phase holding the peak can change with depth, as a 7B Llama's with
MVAS moves from backward at 2-4 blocks to the update at 32), ``extrapolate_by_depth`` for the categories. The
third depth must agree to the byte, and under DGR the gradients, the largest group's, must be the same at the two
deepest. Where that check fails, or the depth cannot be changed, the full model is measured. The depths can also
be given (``depth_plan(depths=...)``: the first two fix the line, every further one, the full depth too, must agree
to the byte; none: the full model). The largest-batch search extrapolates each size from the two shallowest depths
the same way.
"""

from __future__ import annotations

import contextlib
import math
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from macroarch.measure.fit import TrainingStep, extrapolate_peak, fake_module, measure_training
from macroarch.measure.memory import (
    MemoryReport,
    PhasePeak,
    PrecisionPolicy,
    StepMemory,
    extrapolate_by_depth,
    measure_step,
)
from macroarch.planner.models import Model

TECHNIQUES = ("mvas", "master", "dgr", "checkpoint", "fsdp2")
CATEGORY_NAMES = {"parameters": "weights", "gradients": "gradients", "master_weights": "master",
                  "optimizer_state": "optimizer", "activations": "activations"}
"""MemTracker's categories (``macroarch.measure.memory.measured``) -> the planner's names."""


@dataclass(frozen=True)
class Setup:
    """What every combination shares.

    Attributes:
        policy: the dtype recipe (``PRECISIONS``): parameter, gradient, moment and master dtypes.
        mvas: the ``MVASConfig`` that ``mvas`` applies (``master`` turns its ``master_weights`` on).
        group_size: DGR's blocks per group.
        devices: the device count ``fsdp2`` shards over.
        device: whose kernels the fake step runs (``"cpu"``, or ``"cuda"`` where a GPU is present).
        fake: fake tensors (else real ones: small models only, ``fake_step``).
    """

    policy: PrecisionPolicy
    mvas: Any
    group_size: int
    devices: int
    device: str = "cpu"
    fake: bool = True


@dataclass(frozen=True)
class Bytes:
    """A step's bytes per device at full depth.

    Attributes:
        categories: ``weights``, ``gradients``, ``master``, ``optimizer``, ``activations``: each one's own maximum
            over the step (the state, and what the forward pass keeps for backward).
        peak: the largest total of live bytes during the step (temporaries, inputs and buffers included): not the
            sum of the categories.
        at_peak: MemTracker's categories at the peak (they sum to it).
        phase: the phase of the step the peak falls in (``setup``, ``forward``, ``backward``, ``backward_tail``,
            ``optimizer``; None where unknown: the analytic fallback).
        phases: each phase's peak and MemTracker's categories at it (``macroarch.measure.fit.TrainingStep``;
            extrapolated in depth as the peak is; empty where unknown).
    """

    categories: dict[str, int]
    peak: int
    at_peak: dict[str, int] = field(default_factory=dict)
    phase: str | None = None
    phases: dict[str, PhasePeak] = field(default_factory=dict)


def _as_bytes(step: StepMemory) -> Bytes:
    cats = {CATEGORY_NAMES[k]: step.max_by_category[k] for k in CATEGORY_NAMES}
    return Bytes(cats, step.peak_bytes, dict(step.by_category), getattr(step, "peak_phase", None),
                 dict(getattr(step, "phases", None) or {}))


# ----------------------------------------------------------------------------------------------- one step
def _checkpoint(model: nn.Module, units: Callable[[nn.Module], list[nn.Module]] | None = None) -> None:
    """Non-reentrant activation checkpointing of ``units(model)``, else of the repeated blocks (module docstring)."""
    if units is None:
        if getattr(model, "supports_gradient_checkpointing", False):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            return
        if hasattr(model, "set_grad_checkpointing"):
            model.set_grad_checkpointing(True)
            return
    from macroarch.models import find_repeated_layers

    for block in units(model) if units is not None else [b for _, b in find_repeated_layers(model)]:
        forward = block.forward

        def wrapped(*args: Any, _forward: Callable = forward, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _forward(*args, **kwargs)
            return torch.utils.checkpoint.checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        block.forward = wrapped


def _plain_optimizer(policy: PrecisionPolicy) -> tuple[type, dict]:
    from macroarch.optim import MasterWeightAdamW

    if policy.master_dtype is not None:
        return MasterWeightAdamW, {"master_dtype": policy.master_dtype}
    return torch.optim.AdamW, {"foreach": False}


def _stack(net: nn.Module, combo: frozenset[str], setup: Setup, loss: Callable[[Any], torch.Tensor],
           checkpoint_units: Callable[[nn.Module], list[nn.Module]] | None = None
           ) -> tuple[Any, torch.optim.Optimizer]:
    """``(runner, optimizer)`` of ``combo`` on ``net`` (module docstring)."""
    from macroarch import compose
    from macroarch.config import DGRConfig, MacroConfig

    if "checkpoint" in combo:
        _checkpoint(net, checkpoint_units)
    if "mvas" in combo:
        mvas = replace(setup.mvas, master_weights=True) if "master" in combo else setup.mvas
        dgr = DGRConfig(group_size=setup.group_size) if "dgr" in combo else DGRConfig()
        stack = compose.apply(net, MacroConfig(mvas=mvas, dgr=dgr), loss_fn=loss,
                              compute_dtype=setup.policy.activation_dtype, seed=0)
        return stack.model, stack.optimizer
    cls, kwargs = _plain_optimizer(setup.policy)
    params = [p for p in net.parameters() if p.requires_grad]
    if "dgr" in combo:
        from macroarch.dgr import DGRWrapper

        wrapper = DGRWrapper(net, group_size=setup.group_size, loss_fn=loss, atomic_steps=False)
        return wrapper, wrapper.optimizer(cls, **kwargs)
    return net, cls(params, **kwargs)


def _mvas_optimizers(optimizer: torch.optim.Optimizer) -> list:
    """The ``MVASAdamW`` instances behind ``optimizer`` (DGR runs one per group)."""
    from macroarch import mvas

    inner = getattr(optimizer, "_inner", [optimizer])  # DGROptimizer's per-group optimizers
    return [o for o in inner if isinstance(o, mvas.MVASAdamW)]


_TEMPORARIES: dict[tuple, int] = {}
"""``_update_temporaries`` by everything it depends on: the same update holds the same bytes in every step."""


def _update_temporaries(p: torch.Tensor, setup: Setup, combo: frozenset[str]) -> int:
    """The most bytes ``MVASAdamW``'s update of ``p`` holds beside the state: one real update, under the fake
    tracker, of a parameter stored as ``p`` is (its format, or dense) with ``p``'s shape, its rows capped so that
    it holds at most about two step chunks (2^21 elements; the update works a chunk at a time)."""
    from macroarch import mvas

    fmt = p.format if isinstance(p, mvas.MVASWeight) else None
    shape = tuple(p.shape)
    if p.numel() > 1 << 21 and len(shape) > 1:
        cols = math.prod(shape[1:])
        shape = (max(1, -(-(1 << 21) // cols)), *shape[1:])
    master = "master" in combo or setup.mvas.master_weights
    key = (shape, fmt, p.dtype, setup.policy.param_dtype, setup.policy.activation_dtype, setup.mvas.block_size,
           setup.mvas.state_format, setup.mvas.min_numel, master)
    if key in _TEMPORARIES:
        return _TEMPORARIES[key]
    holder = nn.Module()
    holder.weight = nn.Parameter(torch.empty(shape, dtype=p.dtype if fmt is None else setup.policy.param_dtype))
    if fmt is not None:
        plan = mvas.plan_from_rules(holder, [("*", fmt)], block_size=setup.mvas.block_size, min_numel=0,
                                    keep_patterns=())
        mvas.apply(holder, plan, compute_dtype=setup.policy.activation_dtype)
    opt = mvas.MVASAdamW(holder.parameters(), state_format=setup.mvas.state_format, master_weights=master,
                         min_state_numel=setup.mvas.min_numel, seed=0)
    opt.init_state()
    grad_dtype = setup.policy.activation_dtype if fmt is not None else p.dtype
    holder.weight.grad = torch.zeros(holder.weight.shape, dtype=grad_dtype)
    _TEMPORARIES[key] = measure_step(opt.step, holder, opt, holder.weight.grad).max_by_category["temporaries"]
    return _TEMPORARIES[key]


REAL_UPDATE_CALLS = 256
"""Above this many MVASAdamW kernel calls per step (about one per 2^20 elements of each tensor) the update is stood
in for (``fake_step``); at or below it the real update runs under fake tensors."""


def _update_calls(net: nn.Module) -> int:
    return sum(-(-p.numel() // (1 << 20)) for p in net.parameters() if p.requires_grad)


def _stand_in_step(optimizer: torch.optim.Optimizer, temporaries: Callable[[torch.Tensor], int]) -> Callable:
    """``optimizer.step`` in memory only: for each parameter with a gradient, in order, its update's temporaries
    allocated and freed (so the tracker sees them where the real update would hold them). Wrapped as torch wraps
    every optimizer's ``step`` (``Optimizer.profile_hook_step``), so step hooks run: MemTracker's mark what the
    step allocates as optimizer temporaries (without them it would count the scratch as activations)."""
    def step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    scratch = torch.empty(temporaries(p), dtype=torch.uint8, device=p.device)
                    del scratch

    return types.MethodType(torch.optim.Optimizer.profile_hook_step(step), optimizer)


def fake_step(model: Model, combo: frozenset[str], setup: Setup, batch_size: int, seq: int | None,
              units: int | None, stacks: dict | None = None) -> StepMemory:
    """One steady-state training step of ``combo`` on ``model`` at ``units`` depth units (None: full depth),
    under fake tensors (with ``Setup.fake`` off, on real ones: the model built and randomly initialised on the
    device, for models small enough to hold, where a real step is the faster one; CPU kernels count the same
    bytes either way).

    With MVAS on a model of more than ``REAL_UPDATE_CALLS`` update chunks the optimizer's update is stood in for,
    not run: ``MVASAdamW`` updates about 2^20 elements per kernel call, and under fake tensors each call costs its
    Python dispatch (minutes for a 7B model). Each parameter's update, where the step (or DGR's hook in backward)
    would run it, allocates and frees what that update was measured to hold beside the state
    (``_update_temporaries``); it reads the gradients and writes the state in place, so nothing else changes.
    Either way MVAS's state is created by ``init_state`` (what a first step creates, without running one).

    ``stacks``: the model, its techniques and optimizer built by earlier calls (with their fake mode), by
    everything but the batch size; one built for ``(combo, setup, units, seq)`` measures this batch's step too,
    a steady-state step after another (the same bytes as a fresh one, without building the model, stacking the
    techniques and creating the optimizer's state again)."""
    dtype = setup.policy.param_dtype
    key = (combo, setup_key(setup, combo), units, seq)
    held = None if stacks is None else stacks.get(key)
    if held is None:
        from macroarch._compat.fake import fake_tensor_mode

        mode = fake_tensor_mode() if setup.fake else contextlib.nullcontext()
        meta = model.build(units, dtype, seq) if setup.fake else None  # outside FakeTensorMode: __init__s read values
        parts: tuple | None = None
    else:
        (mode, parts), meta = held, None

    def build() -> tuple:
        nonlocal parts
        batch = {k: v.to(setup.device) for k, v in model.batch(batch_size, seq, setup.policy.activation_dtype).items()}
        if parts is None:
            parts = _built(model, combo, setup, meta, units, seq, batch)
        return (*parts, batch)

    step = measure_training(build, model.loss, mode=mode)
    if stacks is not None:
        stacks[key] = (mode, parts)
    return step


def _built(model: Model, combo: frozenset[str], setup: Setup, meta: nn.Module | None, units: int | None,
           seq: int | None, batch: dict) -> tuple:
    """``(net, runner, optimizer)`` of ``combo`` on ``model``, fake from ``meta`` or real, with the optimizer's
    state (MVAS's, by ``init_state``) and MVAS's update stood in for where the model is large (``fake_step``)."""
    if setup.fake:
        net = fake_module(meta, setup.device)
    else:
        torch.manual_seed(0)
        net = model.build(units, setup.policy.param_dtype, seq, device=setup.device)
    runner, optimizer = _stack(net, combo, setup, lambda m: model.loss(m, batch), model.checkpoint_units)
    if "mvas" in combo:
        stand_in = setup.fake and _update_calls(net) > REAL_UPDATE_CALLS
        for o in _mvas_optimizers(optimizer):
            o.init_state()
            if stand_in:  # measured here, before the step's tracker starts: their own allocations are not its
                held = {id(p): _update_temporaries(p, setup, combo) for g in o.param_groups for p in g["params"]}
                o.step = _stand_in_step(o, lambda p, held=held: held[id(p)])
    return net, runner, optimizer


# ----------------------------------------------------------------------------------------------- full depth
def _report(step: StepMemory) -> MemoryReport:
    """``step`` in the form ``extrapolate_by_depth`` reads (activations: their maximum, reached as forward ends)."""
    return MemoryReport(model="", precision="", batch_size=0, seq_len=0, device="cpu", fake=True,
                        peak_bytes=step.peak_bytes, by_category=dict(step.by_category),
                        max_by_category=dict(step.max_by_category), phases={},
                        end_of_forward={"activations": step.max_by_category["activations"]}, seconds=step.seconds)


@dataclass(frozen=True)
class DepthPlan:
    """Where a combination is measured: ``depths`` (units) extrapolated to ``full`` units, or the full model."""

    depths: tuple[int, ...]
    full: int | None

    @property
    def extrapolated(self) -> bool:
        return bool(self.depths)


def depth_plan(model: Model, combo: frozenset[str], setup: Setup, check: bool = True,
               depths: Sequence[int] | None = None) -> DepthPlan:
    """Three shallow depths (two without ``check``) from which ``combo`` extrapolates, or the full model.

    The shallowest holds two blocks (and under DGR a whole group) in each stack; with an MVAS
    ``[shallow, deep]`` policy the depths step by two units (so that ``ceil(shallow_fraction * n)`` grows by the
    same count per step) and the full depth must lie on that grid; where the two shallowest hold more units than
    the full model, it is measured whole (cheaper). ``depths`` given: those (without ``check``, the first two), ``()``
    the full model; the caller has checked them (``check_depths``)."""
    if not model.scalable:
        return DepthPlan((), None)
    if depths is not None:
        return DepthPlan(tuple(depths) if check else tuple(depths)[:2], model.full_units)
    # two blocks at least: a repeated container (DGR needs one), and the first block's backward, whose temporaries
    # differ from the others', is not the only one; under DGR a whole group in each stack
    first = math.ceil(2 / min(model.unit))
    if "dgr" in combo:
        first = max(first, math.ceil(setup.group_size / min(model.unit)))
    pairs = "mvas" in combo and any(not isinstance(v, str) for v in (setup.mvas.precision_policy or {}).values())
    step = 2 if pairs else 1
    first += (first % 2) if pairs else 0
    picked = tuple(first + i * step for i in range(3 if check else 2))
    # the whole model where the depths do not fit under it, or where two of them (what each size of a search
    # measures) would cost more than it
    if picked[-1] >= model.full_units or (model.full_units - first) % step or sum(picked[:2]) > model.full_units:
        return DepthPlan((), model.full_units)
    return DepthPlan(picked, model.full_units)


def check_depths(model: Model, depths: Sequence[int] | None) -> tuple[int, ...] | None:
    """``depths`` as ``plan`` takes them: None (the planner's own), ``()`` (the full model), or two or more
    increasing depth units up to the full depth (the first two fix the line, the others check it). ValueError
    naming what is wrong."""
    if depths is None:
        return None
    depths = tuple(depths)
    if not depths:
        return ()
    if not model.scalable:
        raise ValueError(f"{model.name}: depths={list(depths)}, but its depth is fixed (give depths=() or None)")
    if (len(depths) < 2 or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in depths)
            or list(depths) != sorted(set(depths)) or depths[-1] > model.full_units):
        raise ValueError(f"{model.name}: depths={list(depths)} must be two or more increasing depth units from 1 to "
                         f"its {model.full_units} (one unit: {_unit_text(model)})")
    return depths


@dataclass(frozen=True)
class Measured:
    """A combination's bytes at full depth and how they were obtained (``how``: one sentence)."""

    bytes: Bytes
    how: str
    depth: DepthPlan
    seconds: float = 0.0


def measure_full(model: Model, combo: frozenset[str], setup: Setup, batch_size: int, seq: int | None,
                 depth: DepthPlan, cache: StepCache | None = None) -> Measured:
    """``combo``'s bytes at full depth by ``depth`` (module docstring); a failed extrapolation check measures the
    full model instead and says why. Steps already in ``cache`` are not measured again."""
    def step(units: int | None) -> TrainingStep:
        if cache is None:
            return fake_step(model, combo, setup, batch_size, seq, units)
        return cache.step(model, combo, setup, batch_size, seq, units)

    if depth.extrapolated:
        reports = {d: step(d) for d in depth.depths}
        seconds = sum(r.seconds for r in reports.values())
        try:
            peak = extrapolate_peak(reports, depth.full)
            cats = extrapolate_by_depth({d: _report(r) for d, r in reports.items()}, depth.full,
                                        constant=("gradients",) if "dgr" in combo else ())
        except ValueError as e:
            full = step(None)
            return Measured(_as_bytes(full), f"measured at full depth (extrapolation refused: {e})",
                            DepthPlan((), depth.full), seconds + full.seconds)
        listed = ", ".join(str(d) for d in depth.depths)
        checked = depth.depths[2:]
        check = (f"checked to the byte at {', '.join(map(str, checked))}" if checked
                 else "not checked on a third depth")
        how = (f"extrapolated in depth from {listed} of {depth.full} depth units ({_unit_text(model)}), each phase "
               f"of the step affine on its own (the full depth's peak falls in the {peak.peak_phase} phase), {check}")
        return Measured(Bytes({CATEGORY_NAMES[k]: v for k, v in cats.items()}, peak.peak_bytes, peak.by_category,
                              peak.peak_phase, dict(peak.phases)), how, depth, seconds)
    full = step(None)
    return Measured(_as_bytes(full), "measured at full depth", depth, full.seconds)


def setup_key(setup: Setup, combo: frozenset[str]) -> str:
    """What of ``setup`` a step of ``combo`` depends on (the MVAS config only with ``mvas``, the group size only
    with ``dgr``), as a key: a plain step planned beside MVAS is the plain step planned alone."""
    return repr((setup.policy, setup.mvas if "mvas" in combo else None,
                 setup.group_size if "dgr" in combo else None, setup.device, setup.fake))


class StepCache:
    """Fake-tensor steps already measured, by everything a step depends on: the model (a ``Model``, or one
    ``dataclasses.replace`` made from it with other ``frames``), the combination, the setup, the batch, ``seq``
    and the depth. Pass one to every ``plan`` call that shares a model (a plan per budget, per crop), so that none
    measures a step twice; it also keeps each largest-size search's measurements (``searches``), so that a later
    search, for another budget, starts from what the earlier ones measured (``largest_fitting`` brackets from
    them), and each model as built with its techniques, so that a step of another batch size is measured on it
    (``fake_step``'s ``stacks``)."""

    def __init__(self) -> None:
        self._steps: dict[tuple, TrainingStep] = {}
        self._stacks: dict[tuple, dict] = {}  # per model: what fake_step built, for other batch sizes
        self._builders: dict[int, Any] = {}  # keeps each model's builder alive, so that its id stays its own
        self.searches: dict[tuple, Any] = {}
        self.seconds = 0.0
        """Wall time of the steps measured through this cache (building the model included)."""

    def model_key(self, model: Model) -> tuple:
        """The model's builder (kept alive here, so that its id stays its own) and its clip length."""
        self._builders.setdefault(id(model.builder), model.builder)
        return id(model.builder), model.frames

    def step(self, model: Model, combo: frozenset[str], setup: Setup, batch_size: int, seq: int | None,
             units: int | None) -> TrainingStep:
        key = (self.model_key(model), combo, setup_key(setup, combo), batch_size, seq,
               None if units == model.full_units else units)
        if key not in self._steps:
            start = time.perf_counter()
            stacks = self._stacks.setdefault(self.model_key(model), {})
            self._steps[key] = fake_step(model, combo, setup, batch_size, seq, units, stacks)
            self.seconds += time.perf_counter() - start
        return self._steps[key]

    def __len__(self) -> int:
        return len(self._steps)


def _unit_text(model: Model) -> str:
    if len(model.unit) == 1:
        return f"{model.unit[0]} block{'s' if model.unit[0] > 1 else ''} each"
    return "a unit: " + " + ".join(str(u) for u in model.unit) + " blocks of the repeated stacks"


# ----------------------------------------------------------------------------------------------- FSDP2
@dataclass(frozen=True)
class Units:
    """Dense bytes of the FSDP2 units ``compose.apply(distributed="fsdp2")`` makes: each block of the largest
    repeated stack (the largest block's), then the root (everything else)."""

    block_weights: int
    root_weights: int


def fsdp_units(model: Model, dtype: torch.dtype, seq: int | None) -> Units:
    from macroarch.models import find_repeated_layers

    meta = model.build(None, dtype, seq)
    seen: set[int] = set()

    def nbytes(module: nn.Module) -> int:
        total = 0
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * p.element_size()
        return total

    blocks = [nbytes(b) for _, b in find_repeated_layers(meta)]
    return Units(max(blocks, default=0), nbytes(meta))


def fsdp2_model(one: Bytes, units: Units, dense_weights: int, devices: int) -> Bytes:
    """FSDP2 over ``devices``, modelled from the one-device step ``one`` (not measured: module docstring).

    Per device: weights, gradients, master copies and optimizer state are 1/N of the one-device bytes (FSDP2
    shards every tensor on dim 0; its padding of dim 0 to a multiple of N is not counted); activations are the
    one-device ones (the batch is per device). The peak is the one-device peak with the state at it sharded,
    plus what FSDP2 holds unsharded: the root unit's weights and gradients (the root is not resharded after
    forward), two blocks' weights (the one computing and the one prefetched) and one block's gradients before
    their reduce-scatter. A unit's bytes are its dense bytes scaled by the step's weights (and gradients) over
    the model's dense weights (packed weights under MVAS)."""
    n = devices
    state = ("parameters", "gradients", "optimizer_state", "master_weights")
    shard = {k: -(-v // n) for k, v in one.categories.items() if k != "activations"}
    packing = one.categories["weights"] / dense_weights if dense_weights else 1.0
    grads = one.categories["gradients"] / dense_weights if dense_weights else 1.0
    gathered = (round(units.root_weights * packing * (n - 1) / n) + round(units.root_weights * grads * (n - 1) / n)
                + round(2 * units.block_weights * packing) + round(units.block_weights * grads))
    at_peak = dict(one.at_peak)
    for k in state:
        at_peak[k] = -(-at_peak.get(k, 0) // n)
    sharded = sum(one.at_peak.get(k, 0) for k in state) - sum(at_peak[k] for k in state)
    at_peak["other"] = at_peak.get("other", 0) + gathered
    return Bytes({**shard, "activations": one.categories["activations"]}, one.peak - sharded + gathered, at_peak,
                 one.phase)


__all__ = ["CATEGORY_NAMES", "TECHNIQUES", "Bytes", "DepthPlan", "Measured", "Setup", "StepCache", "Units",
           "check_depths", "depth_plan", "fake_step", "fsdp2_model", "fsdp_units", "measure_full", "setup_key"]
