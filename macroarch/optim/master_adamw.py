"""AdamW over fp32 master weights for a 16-bit model: the standard mixed-precision optimizer.

Micikevicius et al. 2018 (Mixed Precision Training) and ZeRO (Rajbhandari et al. 2020, section 3.1):
the model's parameters and gradients are 16-bit (bf16 or fp16), the optimizer keeps an fp32 master
copy of every weight plus fp32 Adam moments, updates the master copy and writes it back rounded to
16 bits. That is the 2 + 2 + 4 + 4 + 4 = 16 bytes per parameter that ``PRECISIONS["bf16_mixed"]``
counts; this optimizer exists so that ``macroarch.measure.memory.measured`` can watch those bytes exist.

It is ``CompensatedAdamW(master_weights=True)`` (``macroarch.optim.compensated_adamw``, whose update is the
one AdamW of ``macroarch.optim.functional``, one tensor at a time, so that the fp32 copy of a gradient is a
transient of one tensor, never of the whole model), with two differences: all state (master copy, m, v,
step) is created in ``__init__``, not lazily on the first step, so memory is steady from the first step on;
and ``master_weights()`` lists the masters. A step is all or nothing, as there: an inf or NaN in any gradient,
or a non-finite loss returned by the closure, skips it and counts it in ``skipped_nonfinite``.

Deviations: parameters already in ``master_dtype`` (fp32) are updated in place, without a copy; no loss
scaling (bf16 needs none; fp16 training would pair this with ``torch.amp.GradScaler``, or use
``CompensatedAdamW(grad_scale="norm")``), no amsgrad.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from macroarch.optim.compensated_adamw import CompensatedAdamW


class MasterWeightAdamW(CompensatedAdamW):
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
        super().__init__(params, lr, betas, eps, weight_decay, master_weights=True, master_dtype=master_dtype)
        self.init_state()

    def uses_master(self, p: torch.Tensor) -> bool:
        """A master copy for every parameter not already in ``master_dtype``."""
        return p.dtype != self.master_dtype

    def master_weights(self) -> list[torch.Tensor]:
        """The master copies, one per parameter, in parameter-group order (a parameter already in
        ``master_dtype`` is its own)."""
        return [self.state[p].get("master", p) for p in self._params()]

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        skipped = state_dict.pop("skipped_nonfinite", None)  # written by the standalone version of this class
        super().load_state_dict(state_dict)
        if skipped is not None:
            self.stats["skipped_nonfinite"] = int(skipped)
