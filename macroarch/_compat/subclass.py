"""Tensor-subclass dispatch helpers: the private torch APIs ``MVASWeight`` (``macroarch.mvas.packed.weight``), its
linear layer and ``MVASAdamW`` need, in one place.

Written against torch 2.13 and 2.14 (``SUPPORTED``). Every name is looked up when first called, never when
``macroarch`` is imported; a release outside the range is checked once and, where a name has moved, falls back to a
slower public path or raises an error that names the release.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["SUPPORTED", "check_release", "dispatch_modes_active", "make_wrapper_subclass", "modes_disabled",
           "torch_function_disabled", "writes", "written_arguments"]

SUPPORTED = ((2, 13), (2, 14))
"""The torch releases (major, minor) these helpers were written against."""


def _release() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def _missing(what: str, error: BaseException) -> RuntimeError:
    return RuntimeError(f"macroarch needs {what}, which torch {torch.__version__} does not have ({error}); "
                        f"macroarch supports torch {'.'.join(map(str, SUPPORTED[0]))} to "
                        f"{'.'.join(map(str, SUPPORTED[-1]))}")


@functools.cache
def _stack_length() -> Callable[[], int]:
    # torch._C._len_torch_dispatch_stack: whether a dispatch mode (MemTracker, FakeTensorMode, op counters) is on,
    # asked on every weight read; no public API reports it. Fallback: the public-but-underscored mode getter.
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
    try:
        from torch.utils._python_dispatch import _disable_current_modes
    except ImportError as error:
        raise _missing("torch.utils._python_dispatch._disable_current_modes", error) from error
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
    check_release()
    return torch.Tensor._make_wrapper_subclass(cls, size, strides=strides, dtype=dtype, device=device,
                                               requires_grad=requires_grad)


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


@functools.cache
def check_release() -> None:
    """Raise RuntimeError if this torch is older than the oldest release supported."""
    if _release() < SUPPORTED[0]:
        raise RuntimeError(f"macroarch needs torch {'.'.join(map(str, SUPPORTED[0]))} or newer; this is torch "
                           f"{torch.__version__}")
