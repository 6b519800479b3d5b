"""``DGRWrapper``: the post's DGR API (section 3.1), ``DGRWrapper(module, group_size=8)`` with a compensator.

The wrapper is an ``nn.Module`` whose forward calls the wrapped module. It ties together the three parts
of DGR in this package:

- grouping (``macroarch.dgr.grouping``): built from the autograd graph of the first forward pass run
  with gradients enabled, or explicitly with ``build_groups(example)``, or at construction from
  ``example_inputs``/``loss_fn``;
- scheduling (``macroarch.dgr.pipeline``): ``wrapper.optimizer(torch.optim.AdamW, lr=...)`` returns a
  ``DGROptimizer``, a ``torch.optim.Optimizer`` with one param group per DGR group that updates groups
  during backward, so the loop stays ``loss.backward(); opt.step(); opt.zero_grad()`` and LR schedulers
  and ``state_dict()`` work;
- compensation (``macroarch.optim.compensation``): the ``GradientCompensator`` used in interleaved mode.

Usage::

    model = DGRWrapper(net, group_size=8, example_inputs={"input_ids": ids, "labels": ids})
    opt = model.optimizer(torch.optim.AdamW, lr=3e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, step / 100))
    for batch in batches:
        model(**batch).loss.backward()  # groups are updated here, output side first
        opt.step()                      # updates what backward left, if anything
        opt.zero_grad()
        sched.step()

Names: ``wrapper.state_dict()`` is the wrapped module's, key for key (no ``module.`` prefix), and
``load_state_dict`` takes such a dict, also when the wrapper sits inside a larger model (the prefix is
removed and added back by state-dict hooks; missing/unexpected keys are reported without it).
``named_parameters()`` does carry the ``module.`` prefix, as with DDP; group names do not.

One optimizer per wrapper: ``optimizer()`` called again closes the previous one (removes its hooks).

The schedule is ``wrapper.pipeline_config`` (a ``PipelineConfig``). Attributes the wrapper does not have are
read from the wrapped model (``wrapper.config`` is the model's ``config``, likewise ``loss_type``,
``save_pretrained`` ...), so code that reads or sets ``model.config`` (``transformers.Trainer``) works on the
wrapper as on the model; ``accepts_loss_kwargs`` and ``inspect.signature(wrapper.forward)`` follow the wrapped
forward (Trainer keeps only the dataset columns that signature names). With HF Trainer use
``macroarch.integrations.MacroTrainer``, which keeps ``max_grad_norm``, gradient accumulation and the LR
schedule right, logs the real gradient norm, and saves the wrapped model: a plain ``Trainer`` trains, but
its clipping sees no gradient (DGR has stepped and freed them), so ``max_grad_norm`` does nothing and it logs
``grad_norm`` 0, and without ``optimizers=(wrapper.optimizer(...), None)`` it builds an optimizer of its own and
DGR does nothing; either is said once, at the first step or forward (a ``UserWarning`` naming ``MacroTrainer``).

Clipping belongs to DGR (``max_grad_norm=``): ``torch.nn.utils.clip_grad_norm_`` or
``accelerator.clip_grad_norm_`` after ``backward()`` finds no gradient of a group that has stepped, and
returns 0.

Deviation from the post: its snippet builds the optimizer inside the wrapper implicitly; here the
optimizer class is the caller's choice, and everything DGR adds lives in the returned optimizer.
"""

from __future__ import annotations

import inspect
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from macroarch.dgr.grouping import Grouping, build_groups, check_group_size, group_parameters
from macroarch.dgr.pipeline import DGROptimizer, PipelineConfig
from macroarch.optim.compensation import GradientCompensator

_PREFIX = "module."


def _strip_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """state_dict post-hook: ``<prefix>module.<key>`` -> ``<prefix><key>`` (metadata too)."""
    inner = prefix + _PREFIX
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner):]] = state_dict.pop(key)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        for key in [k for k in metadata if k == inner[:-1] or k.startswith(inner)]:
            metadata[(prefix + key[len(inner):]) if key != inner[:-1] else prefix[:-1]] = metadata.pop(key)


def _add_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """load_state_dict pre-hook: ``<prefix><key>`` -> ``<prefix>module.<key>``."""
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(prefix + _PREFIX)]:
        state_dict[prefix + _PREFIX + key[len(prefix):]] = state_dict.pop(key)


def _report_without_prefix(module: nn.Module, incompatible_keys: Any) -> None:
    """load_state_dict post-hook: report missing/unexpected keys under the names the user gave."""
    for keys in (incompatible_keys.missing_keys, incompatible_keys.unexpected_keys):
        keys[:] = [k.replace(_PREFIX, "", 1) if k.startswith(_PREFIX) else k for k in keys]


def _listed(value: Any) -> Any:
    """A sequence argument as a tuple (the frozen config's form); anything else unchanged."""
    return tuple(value) if isinstance(value, list | tuple) else value


class _SignedForward:
    """``DGRWrapper.forward``: the wrapper's forward, whose ``inspect.signature`` on an instance is the wrapped
    module's forward's. ``transformers.Trainer`` keeps only the dataset columns that the model's forward names
    and would drop every column for ``(*args, **kwargs)`` ("The batch received was empty"). A non-data
    descriptor, so that assigning ``wrapper.forward`` (accelerate's mixed precision does) still works."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function

    def __get__(self, wrapper: DGRWrapper | None, owner: type | None = None) -> Any:
        return self.function if wrapper is None else _BoundForward(self.function, wrapper)


class _BoundForward:
    """``wrapper.forward`` bound to its wrapper, signed as the wrapped module's forward (``_SignedForward``)."""

    __slots__ = ("__func__", "__self__")

    def __init__(self, function: Callable[..., Any], wrapper: DGRWrapper) -> None:
        self.__func__, self.__self__ = function, wrapper

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__func__(self.__self__, *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self.__self__.module.forward)


def _plain_trainer() -> Any:
    """The ``transformers.Trainer`` whose method is on the call stack, unless it is a ``MacroTrainer`` (or a
    subclass of it); None if there is none, also when transformers is not loaded (nothing is imported here).
    Trainer offers no hook through which a model or optimizer could learn that a plain Trainer drives it."""
    trainer_cls = getattr(sys.modules.get("transformers.trainer"), "Trainer", None)
    if trainer_cls is None:
        return None
    frame = sys._getframe(1)
    while frame is not None and not isinstance(frame.f_locals.get("self"), trainer_cls):
        frame = frame.f_back
    if frame is None:
        return None
    trainer = frame.f_locals["self"]
    macro_trainer = getattr(sys.modules.get("macroarch.integrations"), "MacroTrainer", None)
    return None if macro_trainer is not None and isinstance(trainer, macro_trainer) else trainer


def _warn_if_trainer_bypasses_dgr(wrapper: DGRWrapper) -> None:
    """At a wrapper's first forward with gradients and no DGR optimizer: under a plain ``transformers.Trainer``,
    Trainer has built an optimizer of its own over the wrapper's parameters, so DGR does nothing. Warn once."""
    trainer = _plain_trainer()
    if trainer is not None:
        own = type(getattr(trainer.optimizer, "optimizer", trainer.optimizer)).__name__  # inside accelerate's wrapper
        warnings.warn(
            f"{type(trainer).__name__} (transformers.Trainer) is training a DGRWrapper with an optimizer of its own "
            f"({own}): no DGR optimizer exists, so DGR updates nothing and this is "
            "plain training. Use macroarch.integrations.MacroTrainer (same arguments), which builds the DGR "
            "optimizer from Trainer's optimizer settings, or pass optimizers=(wrapper.optimizer(...), None)",
            UserWarning, stacklevel=4)


def _check_the_loop_at_first_step(optimizer: DGROptimizer) -> None:
    """At ``optimizer``'s first ``step()``, warn once if a plain ``transformers.Trainer`` drives it: its clipping
    and gradient norm silently do nothing under DGR (module docstring). ``MacroTrainer`` is the fix."""

    checked = False  # the hook stays (removing it while torch iterates the hooks would raise) and returns at once

    def check(opt: Any, args: Any, kwargs: Any) -> None:
        nonlocal checked
        if checked:
            return
        checked = True
        trainer = _plain_trainer()
        if trainer is None:
            return
        max_norm = trainer.args.max_grad_norm
        clipping = (f"its gradient clipping (max_grad_norm={max_norm}) clips nothing and "
                    if max_norm and max_norm > 0 else "")
        warnings.warn(
            f"{type(trainer).__name__} (transformers.Trainer) is training with a DGR optimizer: DGR updates each "
            f"group during backward and frees its gradients, so {clipping}the grad_norm it logs is 0. Use "
            "macroarch.integrations.MacroTrainer (same arguments): max_grad_norm becomes DGR's per-group clipping, "
            "the logged grad_norm is the real one, and DGR's accumulation follows gradient_accumulation_steps",
            UserWarning, stacklevel=4)

    optimizer.register_step_pre_hook(check)


class DGRWrapper(nn.Module):
    """Dynamic Graph Reorganization around ``module`` (module docstring).

    Args:
        module: any ``nn.Module`` with trainable parameters.
        group_size: consecutive blocks of a repeated container per group, >= 1.
        mode: ``"sync"`` or ``"interleaved"`` (``macroarch.dgr.pipeline``).
        delays: interleaved only: an int for every group, one per group, or None (group index in backward
            order).
        compensator: interleaved only: a ``GradientCompensator`` for the delayed gradients; None for none.
        example_inputs: if given (or ``loss_fn``), the groups are built now from one forward pass on it:
            a tensor, a tuple of positional arguments or a dict of keyword arguments.
        loss_fn: ``loss_fn(module, example_inputs)`` (or ``loss_fn(module)``) returning the loss, for
            models whose output alone does not reach every parameter that training uses.
        strict: raise if a parameter is shared by layers of different groups (``grouping``).
        accumulation_steps, max_grad_norm, clip_mode, atomic_steps: see ``PipelineConfig``.
    """

    def __init__(
        self,
        module: nn.Module,
        group_size: int = 8,
        mode: str = "sync",
        delays: int | Sequence[int] | None = None,
        compensator: GradientCompensator | None = None,
        *,
        example_inputs: Any = None,
        loss_fn: Callable[..., Any] | None = None,
        strict: bool = False,
        accumulation_steps: int = 1,
        max_grad_norm: float | Sequence[float | None] | None = None,
        clip_mode: str = "per_group",
        atomic_steps: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise ValueError(f"module={module!r} must be an nn.Module")
        if not any(p.requires_grad for p in module.parameters()):
            raise ValueError(f"module: {type(module).__name__} has no trainable parameters (requires_grad=True)")
        if compensator is not None and not isinstance(compensator, GradientCompensator):
            raise ValueError(f"compensator={compensator!r} must be a GradientCompensator or None")
        self.module = module
        self.group_size = check_group_size(group_size)
        self.strict = strict
        self.pipeline_config = PipelineConfig(
            mode=mode, delays=_listed(delays), accumulation_steps=accumulation_steps,
            max_grad_norm=_listed(max_grad_norm), clip_mode=clip_mode, atomic_steps=atomic_steps)
        if compensator is not None and mode != "interleaved":
            raise ValueError(f"compensator={compensator!r} only applies to mode='interleaved' (mode={mode!r})")
        self.compensator = compensator
        self.grouping: Grouping | None = None
        self._optimizer: DGROptimizer | None = None
        self._loop_checked = False  # whether a forward has checked for a Trainer that bypasses DGR
        self.register_state_dict_post_hook(_strip_prefix)
        self.register_load_state_dict_pre_hook(_add_prefix)
        self.register_load_state_dict_post_hook(_report_without_prefix)
        if example_inputs is not None or loss_fn is not None:
            self.build_groups(example_inputs, loss_fn=loss_fn)

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._optimizer is None and not self._loop_checked and torch.is_grad_enabled():
            self._loop_checked = True
            _warn_if_trainer_bypasses_dgr(self)
        output = self.module(*args, **kwargs)
        if self.grouping is None and torch.is_grad_enabled():
            # The first forward with a graph: group from it, no extra pass needed.
            self.grouping = group_parameters(self.module, output, self.group_size, strict=self.strict)
        return output

    forward = _SignedForward(_forward)

    def build_groups(self, example: Any = None, *, loss_fn: Callable[..., Any] | None = None) -> Grouping:
        """(Re)build the groups from one forward pass on ``example`` (see ``grouping.build_groups``)."""
        self.grouping = build_groups(self.module, example, loss_fn=loss_fn, group_size=self.group_size,
                                     strict=self.strict)
        return self.grouping

    def optimizer(self, optimizer_cls: Callable[..., torch.optim.Optimizer], **optimizer_kwargs: Any) -> DGROptimizer:
        """A ``DGROptimizer`` running ``optimizer_cls(**optimizer_kwargs)`` per group with this wrapper's schedule."""
        if self.grouping is None:
            raise ValueError(
                "DGRWrapper.optimizer: the groups come from a forward pass and none has run yet; pass "
                "example_inputs= (or loss_fn=) to DGRWrapper, call build_groups(example), or run one forward first"
            )
        if self._optimizer is not None:
            self._optimizer.close()
        self._optimizer = DGROptimizer(self.grouping, optimizer_cls, self.pipeline_config, self.compensator,
                                       **optimizer_kwargs)
        _check_the_loop_at_first_step(self._optimizer)
        return self._optimizer

    def __getattr__(self, name: str) -> Any:
        """Parameters, buffers and submodules as any module; then the wrapped model's attributes (``config``,
        ``loss_type``, ``save_pretrained`` ...), so code written for the model (``transformers.Trainer``) reads
        them through the wrapper."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":  # not set yet (during __init__)
                raise
            return getattr(self.module, name)

    @property
    def accepts_loss_kwargs(self) -> bool:
        """Whether the wrapped model's forward takes loss keyword arguments (``transformers.Trainer`` asks)."""
        accepts = getattr(self.module, "accepts_loss_kwargs", None)
        if accepts is not None:
            return bool(accepts)
        signature = inspect.signature(self.module.forward)
        return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())

    @property
    def has_optimizer(self) -> bool:
        """Whether ``optimizer()`` has been called: its gradient hooks then step each group during backward
        (something that must act on gradients first, a bucketer's all-reduce, has to be set up before)."""
        return self._optimizer is not None

    def describe(self) -> str:
        """The group table (``Grouping.describe``)."""
        if self.grouping is None:
            raise ValueError("no groups yet: run a forward pass or build_groups(example) first")
        return self.grouping.describe()
