"""The post's gradient scale, ``scale = 2^5 / max_grad_norm`` (section 4.1), as a loss scaler.

The post writes, for the parameter-update stage::

    scale = (2**5) / max_grad_norm  # adaptive scaling
    grads = grads * scale.to(grads.dtype)

and does not define ``max_grad_norm``. Here it is the running maximum of the (unscaled) gradient norm over
the last ``window`` observations, so the scaled gradient's norm stays at or below ``target`` = 2^5 = 32.

Deviation from the post: multiplying gradients that backward has already produced cannot undo an fp16
underflow that happened inside backward, and AdamW is invariant to a constant factor on its gradient (up to
``eps``). A gradient scale only does work as a *loss* scale, so that is how it is used, exactly like
``torch.amp.GradScaler`` (Micikevicius et al. 2018, "Mixed Precision Training", section 3.2): the loss is
multiplied by the scale before backward (``scaler.scale(loss).backward()``), the optimizer divides it back out
before the update (``CompensatedAdamW(grad_scale=...)``), and a non-finite gradient skips the update and
lowers the scale. What differs from GradScaler is only how the scale is chosen: GradScaler starts at 2^16,
halves on overflow and doubles after 2000 clean steps (probing the top of fp16's range); this rule sets it from
the observed gradient norm (a fixed headroom below the largest recent norm).

Overflow: a non-finite gradient means the norm was larger than the scale allowed for. It is recorded in the
window as the norm that would make the next scale ``backoff`` times the scale just used, so the scale stays
lowered until that entry leaves the window, and then follows the measured norms again.

One scaler may be shared by several optimizers (one per DGR group): the scale applied to a loss is frozen
when ``scale(loss)`` is called, so every optimizer that steps on the gradients of that backward divides by
the same number even if another one has already reported an overflow. The window then counts one observation
per optimizer update, i.e. per group update under DGR, and ``max_grad_norm`` is the largest group norm.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import Any

import torch

POST_TARGET = 2.0**5
"""The post's numerator: the scaled gradient norm is kept at or below 2^5."""


def norm_rule_scale(max_grad_norm: float, target: float = POST_TARGET) -> float:
    """The post's ``target / max_grad_norm`` (``target`` = 2^5)."""
    if not (math.isfinite(max_grad_norm) and max_grad_norm > 0):
        raise ValueError(f"max_grad_norm={max_grad_norm!r} must be a finite number > 0")
    return target / max_grad_norm


@dataclass(frozen=True)
class NormScaleConfig:
    """Settings of :class:`NormGradScaler`.

    Attributes:
        target: the numerator, 2^5 in the post: the largest scaled gradient norm aimed for.
        window: how many gradient-norm observations the running maximum spans, >= 1.
        backoff: the factor in (0, 1) by which an overflow lowers the scale.
        init_scale: the scale before any gradient has been seen; None is ``target`` (a norm of 1 assumed).
        max_scale: upper clamp, for gradients that are (nearly) zero.
    """

    target: float = POST_TARGET
    window: int = 100
    backoff: float = 0.5
    init_scale: float | None = None
    max_scale: float = 2.0**24

    def __post_init__(self) -> None:
        if not (isinstance(self.target, int | float) and math.isfinite(self.target) and self.target > 0):
            raise ValueError(f"target={self.target!r} must be a finite number > 0")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window={self.window!r} must be an int >= 1")
        if not (isinstance(self.backoff, int | float) and 0.0 < self.backoff < 1.0):
            raise ValueError(f"backoff={self.backoff!r} must lie in (0, 1)")
        if self.init_scale is not None and not (math.isfinite(self.init_scale) and self.init_scale > 0):
            raise ValueError(f"init_scale={self.init_scale!r} must be a finite number > 0 or None")
        if not (math.isfinite(self.max_scale) and self.max_scale > 0):
            raise ValueError(f"max_scale={self.max_scale!r} must be a finite number > 0")


class NormGradScaler:
    """Loss scale ``target / max_grad_norm`` over a window of observed gradient norms (module docstring).

    Usage (with ``CompensatedAdamW(grad_scale=scaler)``, which unscales and reports norms)::

        scaler.scale(loss).backward()
        opt.step()

    Attributes read by notebooks: ``overflows`` (updates skipped for non-finite gradients), ``observations``.
    """

    def __init__(self, config: NormScaleConfig | None = None, **overrides: Any) -> None:
        if config is None:
            config = NormScaleConfig(**overrides)
        elif overrides:
            raise ValueError(f"pass a NormScaleConfig or its fields, not both (got {sorted(overrides)})")
        if not isinstance(config, NormScaleConfig):
            raise ValueError(f"config={config!r} must be a NormScaleConfig")
        self.config = config
        self._norms: collections.deque[float] = collections.deque(maxlen=config.window)
        self._applied: float | None = None  # the scale frozen by the last scale(loss)
        self.overflows = 0
        self.observations = 0

    def __repr__(self) -> str:
        return f"NormGradScaler(scale={self.get_scale():.4g}, {self.config})"

    @property
    def max_grad_norm(self) -> float | None:
        """The running maximum over the window; None before the first observation."""
        return max(self._norms) if self._norms else None

    def get_scale(self) -> float:
        """The scale the next ``scale(loss)`` will apply."""
        cfg = self.config
        norm = self.max_grad_norm
        if norm is None:
            scale = cfg.target if cfg.init_scale is None else cfg.init_scale
        else:
            scale = norm_rule_scale(norm, cfg.target) if norm > 0 else cfg.max_scale
        return min(scale, cfg.max_scale)

    @property
    def applied_scale(self) -> float:
        """The scale of the last ``scale(loss)``: what the current gradients carry."""
        if self._applied is None:
            raise RuntimeError("grad_scale is set but no loss was scaled: call scaler.scale(loss).backward() "
                               "(or opt.scale_loss(loss).backward()) instead of loss.backward()")
        return self._applied

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale``; freezes that scale for the optimizers stepping on this backward's gradients."""
        self._applied = self.get_scale()
        return loss * self._applied

    def update(self, grad_norm: float) -> None:
        """Record the unscaled gradient norm of one update; a non-finite norm is an overflow."""
        self.observations += 1
        if math.isfinite(grad_norm):
            self._norms.append(float(grad_norm))
        else:
            self.backoff()

    def backoff(self) -> None:
        """Lower the scale by ``backoff`` (relative to the scale last applied, or the current one)."""
        self.overflows += 1
        used = self._applied if self._applied is not None else self.get_scale()
        # The norm that makes target / norm = backoff * used: the scale stays down while this entry is in the window.
        self._norms.append(self.config.target / (used * self.config.backoff))

    def state_dict(self) -> dict[str, Any]:
        return {"config": dict(self.config.__dict__), "norms": list(self._norms), "applied": self._applied,
                "overflows": self.overflows, "observations": self.observations}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        missing = sorted({"config", "norms", "applied", "overflows", "observations"} - set(state_dict))
        if missing:
            raise ValueError(f"NormGradScaler state_dict lacks {missing}; was it made by state_dict()?")
        self.config = NormScaleConfig(**state_dict["config"])
        self._norms = collections.deque(state_dict["norms"], maxlen=self.config.window)
        self._applied = state_dict["applied"]
        self.overflows, self.observations = int(state_dict["overflows"]), int(state_dict["observations"])
