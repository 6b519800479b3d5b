"""The AdamW step, written once (Loshchilov & Hutter 2019; the post's optimizer, sections 4.1 and 5.1).

Every optimizer of this project runs this arithmetic: ``CompensatedAdamW`` (and ``MasterWeightAdamW``, which is
it with ``master_weights=True``) on the parameters or their fp32 master copies, ``MVASAdamW`` on the values it
decodes from packed storage (``macroarch.mvas.kernels``, eager or compiled by ``torch.compile``). What differs
between them is storage, never the math (torchao's ``single_param_adam`` is the model).

- ``check_hyperparameters``: the one argument check (``lr``, ``betas``, ``eps``, ``weight_decay``), errors naming
  the bad value;
- ``adamw_scalars``: the per-step scalars (bias corrections, step size), computed in Python floats as torch does;
- ``adamw_update_``: the elementwise update, in place, op for op ``torch.optim.AdamW``'s single-tensor path
  (``torch.optim.adam._single_tensor_adam`` with decoupled weight decay), so a call on the tensors torch would
  update is bitwise torch's result; it takes the scalars as arguments, so a compiled caller passes them as
  graph inputs (no recompilation when the step or the learning rate changes);
- ``adamw_step_``: one tensor's step from the hyperparameters;
- ``local``: the local shard of a ``DTensor`` (FSDP2 parameters and gradients), other tensors as they are.

Deviations from ``torch.optim.AdamW``: no amsgrad, maximize, capturable or differentiable modes; the math is
computed in the dtype of the tensors given (callers pass fp32 views or masters; with 16-bit tensors it is, like
torch's, 16-bit storage between ops).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

__all__ = ["AdamWScalars", "adamw_scalars", "adamw_step_", "adamw_update_", "check_hyperparameters", "local"]


def _number(name: str, value: Any, *, hi: float | None = None) -> float:
    """``value`` as a float in ``[0, hi)`` (``[0, inf)`` without ``hi``), or a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r} must be a finite number")
    if value < 0 or (hi is not None and value >= hi):
        raise ValueError(f"{name}={value!r} must lie in [0, {hi:g})" if hi is not None else
                         f"{name}={value!r} must be >= 0")
    return float(value)


def check_hyperparameters(lr: Any, betas: Any, eps: Any, weight_decay: Any,
                          where: str = "") -> tuple[float, tuple[float, float], float, float]:
    """``(lr, (beta1, beta2), eps, weight_decay)`` as floats, or a ValueError naming the bad one (prefixed by
    ``where``, e.g. ``"param_groups[1]"``): ``lr``, ``eps``, ``weight_decay`` >= 0, both betas in [0, 1)."""
    prefix = f"{where}['" if where else ""
    suffix = "']" if where else ""
    lr = _number(f"{prefix}lr{suffix}", lr)
    if not (isinstance(betas, tuple | list) and len(betas) == 2):
        raise ValueError(f"{prefix}betas{suffix}={betas!r} must be a pair (beta1, beta2)")
    betas = (_number(f"{prefix}betas{suffix}[0]", betas[0], hi=1.0),
             _number(f"{prefix}betas{suffix}[1]", betas[1], hi=1.0))
    return lr, betas, _number(f"{prefix}eps{suffix}", eps), _number(f"{prefix}weight_decay{suffix}", weight_decay)


class AdamWScalars(NamedTuple):
    """The scalars of one AdamW step at step ``t``: Python floats, computed as ``torch.optim.AdamW`` computes them,
    each the value one op of ``adamw_update_`` takes."""

    decay: float  # 1 - lr * weight_decay: the decoupled weight decay factor
    avg_weight: float  # 1 - beta1: the lerp weight of the first moment
    beta2: float
    sq_weight: float  # 1 - beta2
    eps: float
    neg_step_size: float  # -lr / (1 - beta1^t)
    bias_correction2_sqrt: float  # (1 - beta2^t) ** 0.5


def adamw_scalars(step: float, lr: float, beta1: float, beta2: float, eps: float,
                  weight_decay: float) -> AdamWScalars:
    """The scalars of step ``step`` (1 for the first update), each computed as ``torch.optim.AdamW`` does."""
    return AdamWScalars(1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, eps, -(lr / (1 - beta1 ** step)),
                        (1 - beta2 ** step) ** 0.5)


def adamw_update_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                  decay: float, avg_weight: float | torch.Tensor, beta2: float, sq_weight: float, eps: float,
                  neg_step_size: float, bias_correction2_sqrt: float, *, decay_always: bool = True) -> None:
    """One AdamW update of ``param``, ``exp_avg`` and ``exp_avg_sq`` in place, from ``adamw_scalars``' values
    (``avg_weight`` may be a 0-d tensor of ``param``'s dtype: a compiled kernel cannot branch on a symbolic lerp
    weight). ``decay_always=False`` skips the multiplication by a ``decay`` of exactly 1 (as torch does without
    weight decay; the product is the same, the pass is saved)."""
    if decay_always or decay != 1.0:
        param.mul_(decay)
    exp_avg.lerp_(grad, avg_weight)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=sq_weight)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=neg_step_size)


def adamw_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                step: float, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """AdamW step ``step`` (already counted: 1 for the first) of one tensor, in place: bitwise
    ``torch.optim.AdamW`` (single-tensor path) on the same tensors."""
    scalars = adamw_scalars(step, lr, beta1, beta2, eps, weight_decay)
    adamw_update_(param, grad, exp_avg, exp_avg_sq, *scalars, decay_always=False)


def local(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """The local shard of a ``DTensor`` (``to_local()``, which shares its storage), any other tensor (or None)
    as it is: optimizers update the shard a rank holds and keep their state local."""
    if tensor is not None and hasattr(tensor, "to_local") and hasattr(tensor, "device_mesh"):
        return tensor.to_local()
    return tensor
