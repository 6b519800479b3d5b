"""Memory Virtualization with Adaptive Sparsity (post section 3.2, claims C7 and C15): tensors stored in fp16,
fp8 or fp4 by importance.

By role:

- ``codecs/``: the element arithmetic: the formats (bf16/fp16, fp8 e4m3 and e5m2, fp4 e2m1 two per byte, with
  per-block fp32 scales), round-to-nearest and stochastic rounding, the counter-based noise;
- ``_kernels/`` (private): the packed AdamW step and the dequantisation, one Python source compiled by
  ``torch.compile`` and run eagerly where compiling fails; ``compile_stats()`` reports what they did;
- ``packed/``: ``pack`` -> ``PackedTensor`` whose ``nbytes`` is its real storage; ``MVASWeight``, the managed
  parameter: a tensor subclass holding the packed payload and block scales, dequantised on every read (any op,
  autocast, checkpointing, ``torch.compile``), with its FSDP2 all-gather methods;
- ``plan/``: importance (Hutchinson's Hessian diagonal, the Fisher diagonal, HAWQ sensitivity), ``PrecisionPlan``
  from explicit rules (the post's CLIP ``precision_policy``) or a memory budget (a knapsack over tensors by
  sensitivity per byte saved), and ``MVASSchedule``, which re-plans the formats every K steps;
- ``interop/``: FSDP2 (``fsdp.fully_shard``), ``torch.distributed.checkpoint`` (``dcp``), dense state dicts and
  the packed safetensors form (``checkpoint``);
- ``store``: ``apply(model, plan)`` puts an ``MVASWeight`` in place of every parameter the plan packs;
- ``optim``: ``MVASAdamW``, AdamW writing packed weights (stochastic rounding or a master copy) with block-
  quantised moments.

Usage::

    plan = mvas.plan_for_budget(model, target_reduction=0.5)
    store = mvas.apply(model, plan)
    opt = mvas.MVASAdamW(model.parameters(), lr=3e-4)
"""

from macroarch.mvas._kernels import ENV as COMPILE_ENV
from macroarch.mvas._kernels import compile_stats, reset_compile_stats
from macroarch.mvas.codecs.formats import (
    ALIASES,
    FORMATS,
    ROUNDINGS,
    SCALE_DTYPE,
    Format,
    bytes_per_element,
    dtype_format,
    get_format,
    storage_bytes,
)
from macroarch.mvas.interop.checkpoint import (
    PACKED_WEIGHTS_NAME,
    dense_state_dict,
    load_packed,
    packed_state_dict,
    plan_of_packed,
    save_packed,
)
from macroarch.mvas.optim import MVASAdamW
from macroarch.mvas.packed.packed_tensor import PackedTensor, pack, quantization_error, quantize_dequantize, unpack
from macroarch.mvas.packed.weight import MVASWeight
from macroarch.mvas.plan.importance import (
    FisherDiagonal,
    HutchinsonEstimator,
    block_importance,
    fisher_diagonal,
    hutchinson_diagonal,
    sensitivity,
    tensor_importance,
)
from macroarch.mvas.plan.policy import (
    DEFAULT_KEEP_PATTERNS,
    MIN_NUMEL,
    PrecisionPlan,
    Rule,
    TensorPlan,
    packable,
    plan_for_budget,
    plan_from_rules,
    transfer_plan,
)
from macroarch.mvas.plan.precision_policy import (
    CLIP_TOWERS,
    clip_plan,
    clip_rules,
    parse_precision_policy,
    policy_rules,
    read_precision_policy,
    split_rules,
)
from macroarch.mvas.plan.schedule import MVASSchedule, PlanChange, expected_rounding_error, importance_plan
from macroarch.mvas.store import MVASStore, apply, is_packed_buffer

__all__ = [
    "ALIASES",
    "FisherDiagonal",
    "HutchinsonEstimator",
    "MVASAdamW",
    "MVASSchedule",
    "MVASStore",
    "MVASWeight",
    "PACKED_WEIGHTS_NAME",
    "PlanChange",
    "apply",
    "dense_state_dict",
    "load_packed",
    "packed_state_dict",
    "plan_of_packed",
    "save_packed",
    "block_importance",
    "expected_rounding_error",
    "fisher_diagonal",
    "hutchinson_diagonal",
    "importance_plan",
    "is_packed_buffer",
    "sensitivity",
    "tensor_importance",
    "transfer_plan",
    "CLIP_TOWERS",
    "DEFAULT_KEEP_PATTERNS",
    "FORMATS",
    "MIN_NUMEL",
    "ROUNDINGS",
    "SCALE_DTYPE",
    "Format",
    "PackedTensor",
    "PrecisionPlan",
    "Rule",
    "TensorPlan",
    "bytes_per_element",
    "clip_plan",
    "clip_rules",
    "dtype_format",
    "get_format",
    "pack",
    "packable",
    "parse_precision_policy",
    "plan_for_budget",
    "plan_from_rules",
    "policy_rules",
    "quantization_error",
    "quantize_dequantize",
    "read_precision_policy",
    "split_rules",
    "storage_bytes",
    "unpack",
    "COMPILE_ENV",
    "compile_stats",
    "reset_compile_stats",
]
