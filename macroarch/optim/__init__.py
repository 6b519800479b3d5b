"""The post's optimizer rules (sections 4.1 and 5.1, claims C8 and C10).

- ``compensated_adamw``: ``CompensatedAdamW``, AdamW with fp32 master weights (automatic from 4 accumulation
  steps on), gradient accumulation, the 2^5 / max_grad_norm gradient scale, DC-ASGD delay compensation and a
  loss-spike guard; with every option off it is ``torch.optim.AdamW``;
- ``scale``: ``NormGradScaler``, the post's gradient scale used as a loss scale (beside ``torch.amp.GradScaler``);
- ``spike_guard``: ``LossSpikeGuard``, "loss moves by more than 15% -> act";
- ``recipe``: the LR multiplier (1.2-1.5x) and the warmup extension (+30%) as functions for torch schedulers;
- ``master_adamw``: ``MasterWeightAdamW``, bf16/fp16 weights with an fp32 master copy (the mixed-precision baseline):
  ``CompensatedAdamW(master_weights=True)`` with its state created up front;
- ``functional``: the AdamW step written once (``adamw_step_``, ``adamw_update_``) and its argument check, run by
  every optimizer here and by ``macroarch.mvas.MVASAdamW``'s fused kernel.
"""

from macroarch.optim.compensated_adamw import (
    AUTO_MASTER_MIN_ACCUMULATION,
    LOW_PRECISION,
    CompensatedAdamW,
    global_grad_norm,
)
from macroarch.optim.functional import adamw_scalars, adamw_step_, adamw_update_, check_hyperparameters
from macroarch.optim.master_adamw import MasterWeightAdamW
from macroarch.optim.recipe import (
    POST_LR_MULTIPLIERS,
    POST_WARMUP_EXTENSION,
    extended_warmup,
    recipe_scheduler,
    scale_lr,
    scaled_lr,
    warmup_cosine,
)
from macroarch.optim.scale import POST_TARGET, NormGradScaler, NormScaleConfig, norm_rule_scale
from macroarch.optim.spike_guard import ACTIONS, LossSpikeGuard, SpikeTrigger

__all__ = [
    "MasterWeightAdamW",
    "ACTIONS",
    "AUTO_MASTER_MIN_ACCUMULATION",
    "LOW_PRECISION",
    "POST_LR_MULTIPLIERS",
    "POST_TARGET",
    "POST_WARMUP_EXTENSION",
    "CompensatedAdamW",
    "adamw_scalars",
    "adamw_step_",
    "adamw_update_",
    "check_hyperparameters",
    "LossSpikeGuard",
    "NormGradScaler",
    "NormScaleConfig",
    "SpikeTrigger",
    "extended_warmup",
    "global_grad_norm",
    "norm_rule_scale",
    "recipe_scheduler",
    "scale_lr",
    "scaled_lr",
    "warmup_cosine",
]
