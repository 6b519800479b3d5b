"""Delay compensation for stale gradients (post section 3.1, DGR's ``GradientCompensator``): DC-ASGD.

Zheng et al. 2017, "Asynchronous Stochastic Gradient Descent with Delay Compensation" (ICML). A gradient
``g = grad L(w_then)`` that arrives after the weights have moved on to ``w_now`` is corrected with the first
term of its Taylor expansion, the Hessian replaced by the cheap diagonal of the outer product ``g g^T``
(for a log-likelihood loss an unbiased estimate of the Fisher, which approximates the Hessian):

    g~ = g + lambda * g * g * (w_now - w_then)                      (DC-ASGD-c, constant lambda)

The adaptive variant (DC-ASGD-a) scales lambda per element by the running size of the gradient:

    meansquare = m * meansquare + (1 - m) * g * g                     (an EMA, as in RMSProp; starts at 0)
    lambda_t   = lambda0 / sqrt(meansquare + eps)

Defaults: the paper's CIFAR-10 runs use lambda0 = 0.04 for DC-ASGD-c and lambda0 = 2 for DC-ASGD-a, with
m = 0.95; those are the defaults here (``lambda_=None`` picks by variant). ``eps`` = 1e-7 is our choice
of the small constant that keeps the square root away from zero.

Deviations from the paper: there a parameter server receives gradients from workers; here the stale
gradient comes from a delayed group of one model (``macroarch.dgr.pipeline``, mode ``"interleaved"``),
and ``w_then`` is the snapshot of that group's weights taken when its gradient was computed. Gradients in
16-bit dtypes are compensated in float32 and cast back. ``meansquare`` tensors are replaced, never
modified in place, so a caller may keep the old ones to undo an update (the pipeline does, on failure).
Each adaptive parameter costs one extra tensor of its size.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any

import torch

DC_ASGD_C_LAMBDA = 0.04
"""lambda0 of DC-ASGD-c in the paper's CIFAR-10 experiments."""
DC_ASGD_A_LAMBDA = 2.0
"""lambda0 of DC-ASGD-a in the paper's CIFAR-10 experiments."""
DC_ASGD_A_MOMENTUM = 0.95
"""The paper's m, the EMA constant of the mean square."""


def dc_asgd_compensate(
    grad: torch.Tensor, w_now: torch.Tensor, w_then: torch.Tensor, lambda_: float | torch.Tensor
) -> torch.Tensor:
    """``grad + lambda_ * grad * grad * (w_now - w_then)``; ``lambda_`` a number or an elementwise tensor."""
    return grad + lambda_ * grad * grad * (w_now - w_then)


def update_meansquare(meansquare: torch.Tensor | None, grad: torch.Tensor, momentum: float) -> torch.Tensor:
    """``momentum * meansquare + (1 - momentum) * grad**2`` (a new tensor); ``None`` counts as zeros."""
    fresh = (1.0 - momentum) * grad * grad
    return fresh if meansquare is None else momentum * meansquare + fresh


def adaptive_lambda(meansquare: torch.Tensor, lambda0: float, eps: float) -> torch.Tensor:
    """DC-ASGD-a's elementwise ``lambda0 / sqrt(meansquare + eps)``."""
    return lambda0 / torch.sqrt(meansquare + eps)


class GradientCompensator:
    """DC-ASGD delay compensation, constant (``adaptive=False``) or adaptive lambda (module docstring).

    Args:
        lambda_: lambda (constant variant) or lambda0 (adaptive); None picks the paper's value for the
            variant, 0.04 or 2.
        adaptive: use DC-ASGD-a's ``lambda0 / sqrt(meansquare + eps)``.
        momentum: the EMA constant m of the mean square (adaptive only), in [0, 1).
        eps: added under the square root (adaptive only), > 0.

    State: ``meansquare[key]`` for each tensor compensated with the adaptive variant, keyed by the caller's
    name for it. ``state_dict()``/``load_state_dict()`` round-trip it with the settings.
    """

    def __init__(self, lambda_: float | None = None, adaptive: bool = False, momentum: float = DC_ASGD_A_MOMENTUM,
                 eps: float = 1e-7) -> None:
        if not isinstance(adaptive, bool):
            raise ValueError(f"adaptive={adaptive!r} must be True or False")
        if lambda_ is None:
            lambda_ = DC_ASGD_A_LAMBDA if adaptive else DC_ASGD_C_LAMBDA
        if isinstance(lambda_, bool) or not isinstance(lambda_, int | float) or not (math.isfinite(lambda_)
                                                                                    and lambda_ >= 0):
            raise ValueError(f"lambda_={lambda_!r} must be a finite number >= 0 (0 turns compensation off)")
        if isinstance(momentum, bool) or not isinstance(momentum, int | float) or not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum={momentum!r} must lie in [0, 1)")
        if isinstance(eps, bool) or not isinstance(eps, int | float) or not (math.isfinite(eps) and eps > 0):
            raise ValueError(f"eps={eps!r} must be a finite number > 0")
        self.lambda_ = float(lambda_)
        self.adaptive = adaptive
        self.momentum = float(momentum)
        self.eps = float(eps)
        self.meansquare: dict[Hashable, torch.Tensor] = {}

    def __repr__(self) -> str:
        variant = "DC-ASGD-a" if self.adaptive else "DC-ASGD-c"
        extra = f", momentum={self.momentum}, eps={self.eps}" if self.adaptive else ""
        return f"GradientCompensator({variant}, lambda_={self.lambda_}{extra})"

    def compensate(self, key: Hashable, grad: torch.Tensor, w_now: torch.Tensor, w_then: torch.Tensor) -> torch.Tensor:
        """The compensated gradient of one tensor; updates ``meansquare[key]`` in the adaptive variant."""
        if grad.shape != w_now.shape or grad.shape != w_then.shape:
            raise ValueError(f"{key!r}: grad {tuple(grad.shape)}, w_now {tuple(w_now.shape)} and w_then "
                             f"{tuple(w_then.shape)} must have one shape")
        wide = torch.float32 if grad.dtype in (torch.float16, torch.bfloat16) else grad.dtype
        g, now, then = grad.to(wide), w_now.detach().to(wide), w_then.to(wide)
        if self.adaptive:
            meansquare = update_meansquare(self.meansquare.get(key), g, self.momentum)
            self.meansquare[key] = meansquare
            lambda_ = adaptive_lambda(meansquare, self.lambda_, self.eps)
        else:
            lambda_ = self.lambda_
        return dc_asgd_compensate(g, now, then, lambda_).to(grad.dtype)

    @torch.no_grad()
    def __call__(
        self,
        keys: Sequence[Hashable],
        grads: Sequence[torch.Tensor | None],
        w_nows: Sequence[torch.Tensor],
        w_thens: Sequence[torch.Tensor],
    ) -> list[torch.Tensor | None]:
        """``compensate`` over lists; a None gradient (the tensor got none) stays None."""
        if not len(keys) == len(grads) == len(w_nows) == len(w_thens):
            raise ValueError(f"keys, grads, w_nows, w_thens have lengths {len(keys)}, {len(grads)}, {len(w_nows)}, "
                             f"{len(w_thens)}; they must be equal")
        return [None if g is None else self.compensate(k, g, now, then)
                for k, g, now, then in zip(keys, grads, w_nows, w_thens)]

    def state_dict(self) -> dict[str, Any]:
        """Settings and the mean squares (references, as ``torch.optim.Optimizer.state_dict`` gives)."""
        return {"lambda_": self.lambda_, "adaptive": self.adaptive, "momentum": self.momentum, "eps": self.eps,
                "meansquare": dict(self.meansquare)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore settings and mean squares (cloned) from ``state_dict()``; a missing key raises."""
        missing = sorted({"lambda_", "adaptive", "momentum", "eps", "meansquare"} - set(state_dict))
        if missing:
            raise ValueError(f"GradientCompensator state_dict lacks {missing}; was it made by state_dict()?")
        checked = GradientCompensator(state_dict["lambda_"], state_dict["adaptive"], state_dict["momentum"],
                                      state_dict["eps"])
        self.lambda_, self.adaptive, self.momentum, self.eps = (checked.lambda_, checked.adaptive, checked.momentum,
                                                                checked.eps)
        self.meansquare = {k: v.detach().clone() for k, v in state_dict["meansquare"].items()}
