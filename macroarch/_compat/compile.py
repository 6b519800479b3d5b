"""The private ``torch.compile`` settings the MVAS kernels (``macroarch.mvas._kernels``) compile under.

Imported by the kernels' runner when a kernel first compiles, never at ``import macroarch``; the release is checked
against the package's range then (``version.check``: a warning once outside it). Each setting falls back to torch's
default where its private name has moved: the kernels then still compile and stay correct, with more recompiles (a
warning from dynamo says so).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from macroarch._compat import version

__all__ = ["below_autograd", "kernel_config", "mark_rows_dynamic"]


@functools.cache
def _dynamo() -> Any:
    version.check("macroarch._compat.compile (compiled MVAS kernels)")
    import torch._dynamo  # the submodule holds the settings below; importing it costs nothing once compiling

    return torch._dynamo


def mark_rows_dynamic(t: torch.Tensor) -> None:
    """Mark dim 0 of ``t`` dynamic: one compiled kernel serves every number of rows."""
    # torch._dynamo.maybe_mark_dynamic: no public counterpart (torch.compile(dynamic=True) would make the row length,
    # which must stay static, symbolic too; the automatic dynamic shapes compile each kernel twice)
    mark = getattr(_dynamo(), "maybe_mark_dynamic", None)
    if mark is not None:
        mark(t, 0)


def kernel_config(recompile_limit: int) -> contextlib.AbstractContextManager[Any]:
    """Dynamo settings for the kernels: ``recompile_limit`` kernels per source (one per storage combination; dynamo's
    default is 8), and ``.item()`` on the step's scalars traced as symbolic numbers (``capture_scalar_outputs``: a new
    learning rate or step count does not recompile)."""
    # torch._dynamo.config: these two settings have no torch.compile option; the limit was cache_size_limit before 2.7
    config = _dynamo().config
    settings = {"capture_scalar_outputs": True}
    if hasattr(config, "recompile_limit"):
        settings.update(recompile_limit=recompile_limit, accumulated_recompile_limit=4 * recompile_limit)
    else:
        settings.update(cache_size_limit=recompile_limit)
    return config.patch(**settings)


def below_autograd() -> contextlib.AbstractContextManager[Any]:
    """Autograd's dispatch keys off, as inside a tensor subclass's ``__torch_dispatch__``: kernels called from there and
    from an optimizer then see the same dispatch state, so one compiled kernel serves both instead of two."""
    # torch._C._AutoDispatchBelowADInplaceOrView: the RAII guard __torch_dispatch__ runs under; no public equivalent.
    # Fallback: nothing (a second compiled kernel for the other state, the same values)
    version.check("macroarch._compat.compile (compiled MVAS kernels)")
    guard = getattr(torch._C, "_AutoDispatchBelowADInplaceOrView", None)
    return contextlib.nullcontext() if guard is None else guard()
