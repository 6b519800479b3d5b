"""AdamW over fp32 master weights for a 16-bit model: the standard mixed-precision optimizer.

Micikevicius et al. 2018 (Mixed Precision Training) and ZeRO (Rajbhandari et al. 2020, section 3.1):
the model's parameters and gradients are 16-bit (bf16 or fp16), the optimizer keeps an fp32 master
copy of every weight plus fp32 Adam moments, updates the master copy and writes it back rounded to
16 bits. That is the 2 + 2 + 4 + 4 + 4 = 16 bytes per parameter that ``PRECISIONS["bf16_mixed"]``
counts; this optimizer exists so that ``macroarch.measure.memory.measured`` can watch those bytes exist.

The update itself is torch's own (``torch.optim.adam.adam`` with decoupled weight decay, i.e. AdamW),
run one parameter at a time so that the fp32 copy of a gradient is a transient of one tensor, never of
the whole model. All state (master copy, m, v, step) is created in ``__init__``, not lazily on the
first step, so memory is steady from the first step on.

A step is all or nothing: an inf or NaN in any gradient, or a non-finite loss returned by the closure,
skips it (masters, moments, step counters and weights untouched) and counts it in ``skipped_nonfinite``
(saved in ``state_dict``).

Deviations: no loss scaling (bf16 needs none; fp16 training would pair this with ``torch.amp.GradScaler``),
no foreach/fused kernels, no amsgrad.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch.optim.adam import adam

from macroarch.dgr.pipeline import all_finite
from macroarch.optim._state import restore_saved_state


class MasterWeightAdamW(torch.optim.Optimizer):
    """AdamW that keeps fp32 master weights and moments for (16-bit) parameters.

    Args:
        params: parameters or parameter groups, as for ``torch.optim.AdamW``.
        lr, betas, eps, weight_decay: as for ``torch.optim.AdamW``.
        master_dtype: dtype of the master copy and of the moments.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        master_dtype: torch.dtype = torch.float32,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"lr={lr} must be non-negative")
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"betas={betas} must lie in [0, 1)")
        if not eps >= 0.0:
            raise ValueError(f"eps={eps} must be non-negative")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay={weight_decay} must be non-negative")
        if not master_dtype.is_floating_point:
            raise ValueError(f"master_dtype={master_dtype} must be a floating-point dtype")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.master_dtype = master_dtype
        self.skipped_nonfinite = 0
        self.step_was_skipped = False  # whether the last step() skipped (LR schedulers may hold back)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p] = {
                    "master": p.detach().to(master_dtype, copy=True),
                    "exp_avg": torch.zeros_like(p, dtype=master_dtype),
                    "exp_avg_sq": torch.zeros_like(p, dtype=master_dtype),
                    # A 0-d fp32 step counter, as torch.optim.AdamW keeps (non-capturable).
                    "step": torch.tensor(0.0, dtype=torch.float32),
                }

    def master_weights(self) -> list[torch.Tensor]:
        """The master copies, one per parameter, in parameter-group order."""
        return [self.state[p]["master"] for g in self.param_groups for p in g["params"]]

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["skipped_nonfinite"] = self.skipped_nonfinite
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        self.skipped_nonfinite = int(state_dict.pop("skipped_nonfinite", 0))
        super().load_state_dict(state_dict)
        # torch.optim casts loaded state to each parameter's dtype, which would round the master copy
        # and the moments to 16 bits; put the saved full-precision values back.
        restore_saved_state(self, state_dict, ("master", "exp_avg", "exp_avg_sq"))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        self.step_was_skipped = (loss is not None and not all_finite([torch.as_tensor(loss).detach()])) or (
            not all_finite(grads))
        if self.step_was_skipped:
            self.skipped_nonfinite += 1
            return loss
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                # (numel,) fp32 copy of one gradient, dropped when this parameter is done.
                grad = p.grad.to(self.master_dtype)
                adam(
                    [state["master"]], [grad], [state["exp_avg"]], [state["exp_avg_sq"]], [], [state["step"]],
                    foreach=False, decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2,
                    lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
                )
                del grad
                p.copy_(state["master"])  # round the updated master copy back into the 16-bit weight
        return loss
