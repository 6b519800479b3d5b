"""Memory Virtualization with Adaptive Sparsity (post section 3.2, claims C7 and C15): tensors stored in fp16,
fp8 or fp4 by importance.

- ``formats``: bf16/fp16, fp8 (e4m3, e5m2), fp4 e2m1 (two per byte) with per-block fp32 scales, round-to-nearest
  and stochastic rounding; ``pack`` -> ``PackedTensor`` whose ``nbytes`` is its real storage;
- ``policy``: ``PrecisionPlan`` from explicit rules (the post's CLIP ``precision_policy``) or a memory budget
  (a knapsack over tensors by sensitivity per byte saved).
"""

from macroarch.mvas.formats import (
    ALIASES,
    FORMATS,
    ROUNDINGS,
    SCALE_DTYPE,
    Format,
    PackedTensor,
    bytes_per_element,
    dtype_format,
    get_format,
    pack,
    quantization_error,
    quantize_dequantize,
    storage_bytes,
    unpack,
)
from macroarch.mvas.policy import (
    CLIP_TOWERS,
    DEFAULT_KEEP_PATTERNS,
    MIN_NUMEL,
    PrecisionPlan,
    Rule,
    TensorPlan,
    clip_plan,
    clip_rules,
    parse_precision_policy,
    plan_for_budget,
    plan_from_rules,
    read_precision_policy,
    split_rules,
)

__all__ = [
    "ALIASES",
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
    "parse_precision_policy",
    "plan_for_budget",
    "plan_from_rules",
    "quantization_error",
    "quantize_dequantize",
    "read_precision_policy",
    "split_rules",
    "storage_bytes",
    "unpack",
]
