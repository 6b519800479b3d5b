"""Tensor-subclass dispatch helpers: the private torch APIs ``MVASWeight`` (``macroarch.mvas.packed.weight``), its
linear layer and ``MVASAdamW`` need, in one place.

Every name is looked up when first called, never when ``macroarch`` is imported; the release is checked against the
package's range (``version.check``: a warning once outside it) and, where a name has moved, a helper falls back to a
slower public path or raises ``version.missing``'s error naming the name and the release.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

from macroarch._compat import version

__all__ = ["AtenOps", "dispatch_modes_active", "make_wrapper_subclass", "modes_disabled", "private_aten_ops",
           "torch_function_disabled", "writes", "written_arguments"]

_PURPOSE = "macroarch._compat.subclass (MVAS weights)"


@functools.cache
def _stack_length() -> Callable[[], int]:
    # torch._C._len_torch_dispatch_stack: whether a dispatch mode (MemTracker, FakeTensorMode, op counters) is on,
    # asked on every weight read; no public API reports it. Fallback: the public-but-underscored mode getter.
    version.check(_PURPOSE)
    try:
        return torch._C._len_torch_dispatch_stack
    except AttributeError:
        from torch.utils import _python_dispatch

        return lambda: int(_python_dispatch._get_current_dispatch_mode() is not None)


def dispatch_modes_active() -> bool:
    """Whether any ``TorchDispatchMode`` is on the stack now."""
    return bool(_stack_length()())


def modes_disabled() -> contextlib.AbstractContextManager[Any]:
    """Every dispatch mode off for shape arithmetic on meta tensors that is no op of the program (a tracer or a
    counter must not see it); a no-op context when none is on (entering one costs more than the meta ops)."""
    if not dispatch_modes_active():
        return contextlib.nullcontext()
    # torch.utils._python_dispatch._disable_current_modes: no public way to step outside every active mode
    version.check(_PURPOSE)
    try:
        from torch.utils._python_dispatch import _disable_current_modes
    except ImportError as error:
        raise version.missing("torch.utils._python_dispatch._disable_current_modes",
                              "stepping outside a dispatch mode for a weight's shape arithmetic", error) from error
    return _disable_current_modes()


def torch_function_disabled() -> contextlib.AbstractContextManager[Any]:
    """Subclass ``__torch_function__`` overrides off (what ``torch.Tensor.__torch_function__`` itself enters),
    for bookkeeping on parameters that needs none of them."""
    # torch._C.DisableTorchFunctionSubclass: the public torch.overrides has no equivalent context manager
    guard = getattr(torch._C, "DisableTorchFunctionSubclass", None)
    return contextlib.nullcontext() if guard is None else guard()


def make_wrapper_subclass(cls: type, size: Any, *, strides: Any, dtype: torch.dtype, device: torch.device,
                          requires_grad: bool) -> torch.Tensor:
    """An instance of the wrapper subclass ``cls`` with no storage of its own (torchao's subclasses use the same
    constructor: torch has no public one)."""
    version.check(_PURPOSE)
    try:
        make = torch.Tensor._make_wrapper_subclass
    except AttributeError as error:
        raise version.missing("torch.Tensor._make_wrapper_subclass", "MVAS weights (a tensor subclass)",
                              error) from error
    return make(cls, size, strides=strides, dtype=dtype, device=device, requires_grad=requires_grad)


def written_arguments(func: Any, args: tuple, kwargs: dict) -> Iterator[Any]:
    """The tensors an ATen op writes to (its schema's ``a!`` arguments), lists flattened."""
    # OpOverload._schema: the only description of which arguments an op mutates
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        if isinstance(value, list | tuple):
            yield from value
        else:
            yield value


@functools.cache
def writes(func: Any) -> bool:
    """Whether an ATen op's schema writes any of its arguments."""
    return any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)


class AtenOps(NamedTuple):
    """The ATen ops with private names that a wrapper subclass's ``__torch_dispatch__`` must recognise."""

    to_copy: Any  #: ``aten._to_copy.default``: what ``Tensor.to(dtype or device)`` and autocast's casts dispatch as
    unsafe_view: Any  #: ``aten._unsafe_view.default``: what ``reshape`` of a contiguous tensor dispatches as


@functools.cache
def private_aten_ops() -> AtenOps:
    """The private-named ATen ops of ``AtenOps``, looked up on the first dispatch."""
    version.check(_PURPOSE)
    aten = torch.ops.aten
    try:
        # private names, public behaviour: every cast and device move of a subclass reaches __torch_dispatch__ as
        # _to_copy, and reshape as _unsafe_view (not flagged is_view), so a subclass that keeps its storage through
        # them must match these two ops; neither has a public alias (torch.ops.aten has no to_copy or unsafe_view)
        return AtenOps(to_copy=aten._to_copy.default, unsafe_view=aten._unsafe_view.default)
    except (AttributeError, RuntimeError) as error:
        raise version.missing("torch.ops.aten._to_copy / _unsafe_view", "casts and reshapes of MVAS weights",
                              error) from error
