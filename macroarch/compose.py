"""Stack the macro-architecture's techniques on a model, in the one order in which they compose.

``apply(model, config)`` is the single place that knows the order (in the spirit of torchtitan's
``parallelize_llama``); notebooks, experiments and benchmarks call it instead of repeating it::

    config = load_config("configs/clip_post.yaml")      # the post's own block, or a MacroConfig
    stack = compose.apply(model, config, example_inputs=batch)
    for batch in loader:
        loss = loss_fn(stack.model, batch)
        loss.backward()                                 # with DGR, groups step here
        stack.optimizer.step()
        stack.optimizer.zero_grad()
        stack.after_step()                              # MVAS re-planning, if configured

The order, and why it is this one:

1. **MVAS store** (``mvas.apply``): packs the planned weights and serves them just in time. It comes first
   because everything after it holds parameters by identity (DGR's groups, the optimizer's param groups) and
   must see the managed parameters, not the dense ones it replaces.
2. **MVAS schedule** (``MVASSchedule``, only with ``mvas.replan_every``): its gradient hooks accumulate the
   Fisher importance, so they must be registered before DGR's hooks, which step each group and free its
   gradients during backward.
3. **DGR** (``DGRWrapper``): groups from the autograd graph of one forward pass (``example_inputs`` /
   ``loss_fn``, or the first training forward).
4. **The optimizer**: ``MVASAdamW`` when weights are packed (it writes them back, with stochastic rounding or
   a master copy, and keeps block-quantised moments), else ``CompensatedAdamW`` (with every option off it is
   ``torch.optim.AdamW``); under DGR it runs per group (``wrapper.optimizer``).

Across processes, a gradient all-reduce (``GradientBucketer``, DDP's hooks) must act on a gradient before
DGR's step consumes it: build it on ``stack.model`` before the first backward. That is not done here.

All or nothing: nothing is applied until the whole config, the precision plan and the loss function's signature
have been checked, so a bad config raises :class:`~macroarch.config.ConfigError` naming it and leaves the model
as it was; a step that fails later (the forward pass DGR groups from, the optimizer) is undone, and the model is
bitwise as it was (``apply``).

The loss function is the loop's, ``loss_fn(model, batch)``: DGR calls it once as ``loss_fn(model,
example_inputs)``, so pass one batch as ``example_inputs`` (a one-parameter ``loss_fn(model)`` that closes over its
own batch is taken without it).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from macroarch import mvas
from macroarch.config import ConfigError, MacroConfig, load_config
from macroarch.dgr import DGRWrapper
from macroarch.dgr.distributed import data_parallel, fully_shard_groups, shard_blocks
from macroarch.layers import find_repeated_layers
from macroarch.optim import CompensatedAdamW

DISTRIBUTED = (None, "ddp", "fsdp2")


@dataclass
class Stack:
    """What a training loop needs after :func:`apply`.

    Attributes:
        model: what the loop calls: the ``DGRWrapper`` when DGR is on, else the model itself.
        module: the user's model (inside the wrapper, if any): for saving, evaluation, attribute access.
        optimizer: a ``torch.optim.Optimizer`` (schedulers and ``state_dict`` work).
        store: the ``MVASStore`` (None without MVAS).
        schedule: the ``MVASSchedule`` (None without re-planning).
        config: the config that was applied.
    """

    model: nn.Module
    module: nn.Module
    optimizer: torch.optim.Optimizer
    store: Any = None
    schedule: Any = None
    config: MacroConfig | None = None

    def after_step(self) -> None:
        """Call once after each ``optimizer.step()``: advances the MVAS schedule, if any."""
        if self.schedule is not None:
            self.schedule.step()

    def describe(self) -> str:
        parts = [f"optimizer: {type(self.optimizer).__name__}"]
        if self.store is not None:
            parts.append(self.store.plan.describe().splitlines()[-1])
        if isinstance(self.model, DGRWrapper) and self.model.grouping is not None:
            parts.append(f"DGR: {len(self.model.grouping.groups)} groups of up to {self.model.group_size} blocks")
        return "\n".join(parts)


def precision_plan(model: nn.Module, config: MacroConfig) -> mvas.PrecisionPlan | None:
    """The MVAS plan ``config`` asks for on ``model`` (None without MVAS); the model is not touched."""
    if not config.uses_mvas:
        return None
    c = config.mvas
    if c.precision_policy is not None:
        try:
            rules = mvas.policy_rules(model, c.precision_policy, shallow_fraction=c.shallow_fraction,
                                      embedding_is_shallow=c.embedding_is_shallow)
        except ValueError as e:
            raise ConfigError(f"mvas: {e}") from None
        return mvas.plan_from_rules(model, rules, block_size=c.block_size, min_numel=c.min_numel)
    try:
        return mvas.plan_for_budget(model, target_reduction=c.target_reduction, block_size=c.block_size,
                                    min_numel=c.min_numel)
    except ValueError as e:
        raise ConfigError(f"mvas.target_reduction: {e}") from None


def apply(model: nn.Module, config: MacroConfig | str | Any, *, example_inputs: Any = None,
          loss_fn: Callable[..., Any] | None = None, compute_dtype: torch.dtype | None = None,
          plan: mvas.PrecisionPlan | None = None, seed: int | None = None, run: Any = None,
          distributed: str | None = None) -> Stack:
    """Apply ``config`` (a :class:`MacroConfig`, a YAML path or a mapping) to ``model`` in the documented order.

    All or nothing: the config, the plan, the loss function's signature and the process group are checked before
    the model is touched (a :class:`ConfigError` naming what is wrong); if a later step raises (the loss function's
    forward pass, building the optimizer), what was applied is undone (the model's own parameter objects back in
    place, its buffers and gradients as they were, hooks removed) and a ``RuntimeError`` names the step. Not
    undone: a failure inside FSDP2's ``fully_shard`` or DDP's construction, the last step with ``distributed``.

    Args:
        model: any ``nn.Module``, already on its device and in its dtype.
        example_inputs: one training batch; with DGR its groups are built from one forward pass on it
            (``loss_fn(model, example_inputs)``, or ``model(example_inputs)`` without ``loss_fn``), so that
            ``stack.optimizer`` exists at once. Required with DGR unless ``loss_fn`` takes the model alone.
        loss_fn: the training loop's ``loss_fn(model, batch)``, called once as ``loss_fn(model, example_inputs)``
            to build DGR's groups. A one-parameter ``loss_fn(model)`` (a closure over its own batch) is taken
            without ``example_inputs``.
        compute_dtype: the dtype MVAS dequantises weights to (default: each parameter's own).
        plan: an MVAS plan to use instead of the one the config describes (e.g. from importance).
        seed: seed of MVASAdamW's stochastic rounding.
        run: a tracking run the MVAS schedule logs its tier moves to.
        distributed: ``None`` (one process), ``"ddp"`` or ``"fsdp2"`` over the default process group (started
            by torchrun): ``stack.model`` is then the DDP module, or the model sharded by FSDP2 (each block of
            its repeated stack a unit, then the root; managed weights through ``mvas.fsdp.fully_shard``, so
            they are all-gathered packed). With DGR the groups step after their gradients are reduced
            (``macroarch.dgr.distributed``). MVAS with DDP is refused: DDP replicates dense parameters.
    """
    if distributed not in DISTRIBUTED:
        raise ConfigError(f"distributed={distributed!r} must be one of {DISTRIBUTED}")
    if not isinstance(config, MacroConfig):
        config = load_config(config)
    if config.uses_dgr:
        _check_example(example_inputs, loss_fn)
    if plan is None:
        plan = precision_plan(model, config)  # every check before the model is touched
    if distributed is not None and not torch.distributed.is_initialized():
        raise ConfigError(f"distributed={distributed!r}: no default process group; start the script with torchrun "
                          f"and call torch.distributed.init_process_group() first")
    if distributed == "ddp" and plan is not None:
        raise ConfigError("distributed='ddp' with MVAS: DDP keeps dense replicas of every parameter, which is what "
                          "MVAS exists to avoid; use distributed='fsdp2' (packed shards and all-gathers)")
    undo = _Undo(model)
    try:
        return _stack(model, config, undo, example_inputs=example_inputs, loss_fn=loss_fn,
                      compute_dtype=compute_dtype, plan=plan, seed=seed, run=run, distributed=distributed)
    except Exception as exc:
        undo()
        raise RuntimeError(f"compose.apply: {undo.step} raised {type(exc).__name__}: {exc}; the model was restored "
                           "as it was (its own parameters, buffers and gradients)") from exc


def _stack(model: nn.Module, config: MacroConfig, undo: _Undo, *, example_inputs: Any, loss_fn: Any,
           compute_dtype: torch.dtype | None, plan: mvas.PrecisionPlan | None, seed: int | None, run: Any,
           distributed: str | None) -> Stack:
    """The steps of ``apply`` in order, each registered with ``undo`` as it is done."""
    o = config.optim
    kwargs: dict[str, Any] = dict(lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    store = schedule = None
    if plan is not None:
        undo.step = "mvas.apply"
        store = mvas.apply(model, plan, compute_dtype=compute_dtype)
        undo.store = store
        if config.mvas.replan_every is not None:
            undo.step = "mvas.MVASSchedule"
            schedule = mvas.MVASSchedule(store, every=config.mvas.replan_every, warmup=config.mvas.replan_every,
                                         block_size=config.mvas.block_size, run=run)
            undo.closers.append(schedule.close)
        optimizer_cls = mvas.MVASAdamW
        kwargs.update(state_format=config.mvas.state_format, master_weights=config.mvas.master_weights,
                      min_state_numel=config.mvas.min_numel, seed=seed)
    else:
        optimizer_cls = CompensatedAdamW
    if config.uses_dgr:
        d = config.dgr
        undo.step = "DGRWrapper (its forward pass on example_inputs / loss_fn)"
        wrapper = DGRWrapper(model, group_size=d.group_size, mode=d.mode, accumulation_steps=d.accumulation_steps,
                             max_grad_norm=d.max_grad_norm, atomic_steps=d.atomic_steps,
                             example_inputs=example_inputs, loss_fn=loss_fn)
        if distributed == "ddp":
            undo.step = "DDP (macroarch.dgr.distributed.data_parallel)"
            d_run = data_parallel(wrapper, optimizer_cls, **kwargs)
        elif distributed == "fsdp2":
            undo.step = "FSDP2 (macroarch.dgr.distributed.fully_shard_groups)"
            shard = functools.partial(_shard_blocks, blocks=[n for s in wrapper.grouping.stacks for n in s],
                                      managed=store is not None)
            d_run = fully_shard_groups(wrapper, optimizer_cls, shard=shard, **kwargs)
        else:
            undo.step = f"the DGR optimizer ({optimizer_cls.__name__} per group)"
            return Stack(wrapper, model, wrapper.optimizer(optimizer_cls, **kwargs), store, schedule, config)
        return Stack(d_run.model, model, d_run.optimizer, store, schedule, config)
    outer = model
    if distributed == "ddp":
        undo.step = "DDP"
        device = next(model.parameters()).device
        outer = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    elif distributed == "fsdp2":
        undo.step = "FSDP2 (fully_shard)"
        _shard_blocks(model, blocks=[name for name, _ in find_repeated_layers(model)], managed=store is not None)
    undo.step = f"the optimizer ({optimizer_cls.__name__})"
    return Stack(outer, model, optimizer_cls(model.parameters(), **kwargs), store, schedule, config)


def _check_example(example_inputs: Any, loss_fn: Callable[..., Any] | None) -> None:
    """DGR builds its groups from one forward pass: refuse, before anything is applied, a call that cannot run it."""
    if loss_fn is None:
        if example_inputs is None:
            raise ConfigError("dgr is on: pass example_inputs=batch (one training batch; and loss_fn=, the loop's "
                              "loss_fn(model, batch), if the model's output alone is not the loss) so the groups and "
                              "the optimizer can be built now")
        return
    if not callable(loss_fn):
        raise ConfigError(f"loss_fn={loss_fn!r} must be a callable loss_fn(model, batch)")
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # a builtin or extension callable: it is called as given
        return
    arguments = ("model",) if example_inputs is None else ("model", "example_inputs")
    try:
        signature.bind(*arguments)
    except TypeError:
        if example_inputs is None:
            raise ConfigError(
                f"loss_fn{signature} needs a batch, and no example_inputs was given: DGR builds its groups from one "
                "forward pass, loss_fn(model, example_inputs). Pass one training batch: compose.apply(model, config, "
                "example_inputs=batch, loss_fn=loss_fn)") from None
        raise ConfigError(f"loss_fn{signature} cannot be called as loss_fn(model, example_inputs), which is how DGR "
                          "builds its groups; give it the loop's signature loss_fn(model, batch)") from None


class _Undo:
    """What ``apply`` needs to put ``model`` back as it was: its own parameter objects where they are registered
    (tied ones under every name), its buffers' values, its gradients, and the hooks and stores the steps add."""

    def __init__(self, model: nn.Module) -> None:
        self.step = "checking"
        self.store: Any = None
        self.closers: list[Callable[[], None]] = []
        self.params = [(m, name, p, None if p.grad is None else p.grad.clone())
                       for m in model.modules() for name, p in m.named_parameters(recurse=False,
                                                                                    remove_duplicate=False)]
        self.buffers = [(m, name, b, b.clone()) for m in model.modules()
                        for name, b in m.named_buffers(recurse=False, remove_duplicate=False)]

    @torch.no_grad()
    def __call__(self) -> None:
        for close in reversed(self.closers):
            close()
        if self.store is not None:
            self.store.remove()  # its load hook; the parameters it made are replaced below
        for m, name, p, grad in self.params:
            setattr(m, name, p)
            p.grad = grad
        for m, name, b, value in self.buffers:
            b.copy_(value)
            setattr(m, name, b)


def _shard_blocks(module: nn.Module, blocks: list[str], managed: bool) -> None:
    """``shard_blocks``, with packed all-gathers (``mvas.fsdp.fully_shard``) when weights are managed."""
    from macroarch.mvas.interop.fsdp import fully_shard as packed

    shard_blocks(module, blocks, packed if managed else None)
