"""The post's convergence recipe (section 5.1) as functions that compose with torch LR schedulers.

"The learning rate needs recalibrating: start at 1.2-1.5x the usual value, lengthen warmup by 30%, and
trigger automatic scaling when the loss fluctuates by more than 15%." The last part is
``macroarch.optim.spike_guard.LossSpikeGuard``; this module holds the first two:

- ``scaled_lr(base_lr, multiplier)`` and ``scale_lr(optimizer, multiplier)``: the LR multiplier, on a number
  or on every param group of an optimizer. Call ``scale_lr`` *before* building a scheduler: torch schedulers
  record each group's ``initial_lr`` when they are built and scale from it.
- ``extended_warmup(warmup_steps, extension)``: ``ceil(warmup_steps * (1 + extension))``, +30% by default.
- ``warmup_cosine(warmup_steps, total_steps, min_lr_ratio)``: the LR factor of step ``t`` (linear warmup from
  ``1 / warmup_steps`` to 1, then cosine decay to ``min_lr_ratio``), for ``torch.optim.lr_scheduler.LambdaLR``;
- ``recipe_scheduler(optimizer, warmup_steps, total_steps, lr_multiplier=..., warmup_extension=...)``: both,
  applied to an optimizer, as a ``LambdaLR``. The decay ends at ``total_steps`` whatever the warmup, so a
  longer warmup takes its steps from the high-LR plateau, not from the end of training.

The post's values are ``POST_LR_MULTIPLIERS`` (1.2-1.5) and ``POST_WARMUP_EXTENSION`` (0.3); the functions'
defaults are neutral (1.0 and 0.0), so a recipe is always asked for explicitly.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

POST_LR_MULTIPLIERS = (1.2, 1.5)
"""The post's range for the initial-LR multiplier."""
POST_WARMUP_EXTENSION = 0.3
"""The post's warmup lengthening: +30%."""


def _positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}={value!r} must be a finite number > 0")
    return float(value)


def _steps(name: str, value: int, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}")
    return value


def scaled_lr(base_lr: float, multiplier: float = 1.0) -> float:
    """``base_lr * multiplier``."""
    if isinstance(base_lr, bool) or not isinstance(base_lr, int | float) or not (math.isfinite(base_lr)
                                                                                 and base_lr >= 0):
        raise ValueError(f"base_lr={base_lr!r} must be a finite number >= 0")
    return float(base_lr) * _positive("multiplier", multiplier)


def scale_lr(optimizer: torch.optim.Optimizer, multiplier: float) -> torch.optim.Optimizer:
    """Multiply every param group's ``lr`` by ``multiplier`` (in place); returns the optimizer.

    Raises ValueError if a scheduler was already built on it (a group has ``initial_lr``): that scheduler would
    keep scaling from the old value.
    """
    multiplier = _positive("multiplier", multiplier)
    if any("initial_lr" in group for group in optimizer.param_groups):
        raise ValueError("optimizer: a LR scheduler was already built on it (param groups have 'initial_lr'); "
                         "call scale_lr before building the scheduler")
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * multiplier
    return optimizer


def extended_warmup(warmup_steps: int, extension: float = 0.0) -> int:
    """``ceil(warmup_steps * (1 + extension))``: the post's +30% is ``extension=0.3``."""
    warmup_steps = _steps("warmup_steps", warmup_steps)
    if isinstance(extension, bool) or not isinstance(extension, int | float) or not (math.isfinite(extension)
                                                                                     and extension > -1):
        raise ValueError(f"extension={extension!r} must be a finite number > -1")
    # round() first: 10 * 1.3 is 13.000000000000002 in floating point and must stay 13.
    return math.ceil(round(warmup_steps * (1.0 + extension), 9))


def warmup_cosine(warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.1) -> Callable[[int], float]:
    """LR factor of step ``t`` (0-based): ``(t + 1) / warmup_steps`` during warmup, then cosine from 1 down to
    ``min_lr_ratio`` at ``total_steps`` (and ``min_lr_ratio`` after). For ``LambdaLR``."""
    warmup_steps = _steps("warmup_steps", warmup_steps)
    total_steps = _steps("total_steps", total_steps, minimum=1)
    if warmup_steps > total_steps:
        raise ValueError(f"warmup_steps={warmup_steps} must not exceed total_steps={total_steps}")
    if isinstance(min_lr_ratio, bool) or not isinstance(min_lr_ratio, int | float) or not 0 <= min_lr_ratio <= 1:
        raise ValueError(f"min_lr_ratio={min_lr_ratio!r} must lie in [0, 1]")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        decay_steps = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / decay_steps)
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def recipe_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, *,
                     lr_multiplier: float = 1.0, warmup_extension: float = 0.0,
                     min_lr_ratio: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:
    """Scale the optimizer's LR by ``lr_multiplier``, then a ``LambdaLR`` with ``warmup_cosine`` over the
    warmup lengthened by ``warmup_extension`` (capped at ``total_steps``)."""
    warmup = min(extended_warmup(warmup_steps, warmup_extension), _steps("total_steps", total_steps, minimum=1))
    scale_lr(optimizer, lr_multiplier)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(warmup, total_steps, min_lr_ratio))
