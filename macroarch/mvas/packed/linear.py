"""``F.linear`` with a managed weight in one autograd node: the fast path of ``MVASWeight.__torch_function__``.

Through dispatch (``macroarch.mvas.packed.weight``), a linear layer on an ``MVASWeight`` is ``t()`` (a new packed
view wrapper), ``mm`` (dequantise, replay the ``t``), and in backward the same again for ``mm`` of the saved view,
each step of it Python on top of the two dequantisations. ``MVASLinear`` does the same arithmetic as one
``autograd.Function``: forward dequantises
the weight and runs ``F.linear`` on the dense copy, saving the input and the *packed* weight (so, as through
dispatch, the dense weight lives for one op, not across the step); backward dequantises it again for the input's
gradient. Every result is bitwise what the dispatch path computes (autograd's ``mm`` backward formulas, which
``MVASLinear.backward`` spells out: ``grad @ W`` and ``grad^T @ x``; the bias gradient summed over rows).

``linear`` takes the fast path only where it is that same computation: a plain input of the weight's dtype
with at least two dimensions, a plain (or no) bias, a weight that is no view, no ``torch.autocast`` (which casts
the operands inside dispatch), no dispatch mode (memory trackers and op counters keep seeing the dispatch path),
and not while ``torch.compile`` traces (the dispatch path is what AOTAutograd traces through). Everywhere else it
returns None and the caller takes the dispatch path.

Double backward (``create_graph=True``) stays exact: with grad mode on, backward multiplies by the packed
weight itself, through dispatch, so the second-order terms reach it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from macroarch.mvas._kernels import unwatched

_PLAIN = (torch.Tensor, torch.nn.Parameter)


class MVASLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` for an ``MVASWeight`` ``weight`` (module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight.dequantize(), bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        rows = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[0]:  # create_graph: through the packed weight, so second-order terms reach it
            grad_x = grad.matmul(weight if torch.is_grad_enabled() else weight.dequantize())
        if ctx.needs_input_grad[1]:
            grad_weight = rows.t().mm(x.reshape(-1, x.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = rows.sum(0)
        return grad_x, grad_weight, grad_bias


def linear(weight: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """``F.linear(*args, **kwargs)`` (``args[1]`` is the managed ``weight``) through ``MVASLinear``, or None where the
    fast path does not apply (module docstring). On the path of every linear layer: cheapest checks first."""
    x = args[0]
    if kwargs:
        if len(kwargs) > 1 or "bias" not in kwargs:
            return None
        bias = kwargs["bias"]
    else:
        bias = args[2] if len(args) > 2 else None
    if (len(args) > 3 or type(x) not in _PLAIN or x.dtype != weight.compute_dtype or weight.is_view or x.dim() < 2
            or (bias is not None and type(bias) not in _PLAIN) or not unwatched()
            or torch.is_autocast_enabled(x.device.type)):
        return None
    if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                         or (bias is not None and bias.requires_grad))):
        return F.linear(x, weight.dequantize(), bias)
    return MVASLinear.apply(x, weight, bias)
