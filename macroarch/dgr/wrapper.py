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
- compensation (``macroarch.dgr.compensation``): the ``GradientCompensator`` used in interleaved mode.

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
wrapper as on the model; ``accepts_loss_kwargs`` follows the wrapped forward. With HF Trainer use
``macroarch.integrations.MacroTrainer``, which keeps ``max_grad_norm``, gradient accumulation and the LR
schedule right, logs the real gradient norm, and saves the wrapped model.

Deviation from the post: its snippet builds the optimizer inside the wrapper implicitly; here the
optimizer class is the caller's choice, and everything DGR adds lives in the returned optimizer.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from macroarch.dgr.compensation import GradientCompensator
from macroarch.dgr.grouping import Grouping, _check_group_size, build_groups, group_parameters
from macroarch.dgr.pipeline import DGROptimizer, PipelineConfig

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
        self.group_size = _check_group_size(group_size)
        self.strict = strict
        self.pipeline_config = PipelineConfig(
            mode=mode, delays=_listed(delays), accumulation_steps=accumulation_steps,
            max_grad_norm=_listed(max_grad_norm), clip_mode=clip_mode, atomic_steps=atomic_steps)
        if compensator is not None and mode != "interleaved":
            raise ValueError(f"compensator={compensator!r} only applies to mode='interleaved' (mode={mode!r})")
        self.compensator = compensator
        self.grouping: Grouping | None = None
        self._optimizer: DGROptimizer | None = None
        self.register_state_dict_post_hook(_strip_prefix)
        self.register_load_state_dict_pre_hook(_add_prefix)
        self.register_load_state_dict_post_hook(_report_without_prefix)
        if example_inputs is not None or loss_fn is not None:
            self.build_groups(example_inputs, loss_fn=loss_fn)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        output = self.module(*args, **kwargs)
        if self.grouping is None and torch.is_grad_enabled():
            # The first forward with a graph: group from it, no extra pass needed.
            self.grouping = group_parameters(self.module, output, self.group_size, strict=self.strict)
        return output

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
