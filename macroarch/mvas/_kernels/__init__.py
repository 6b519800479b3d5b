"""Private: the MVAS kernels (one Python source, compiled by ``torch.compile``, run eagerly where compiling fails or
cannot apply) and the machinery that compiles, counts and checks them (``runner``, ``guard``)."""

from macroarch.mvas._kernels.kernels import (
    ENV,
    MIN_COMPILED_DEQUANTIZE,
    StepSpec,
    adamw_step,
    canonical_spec,
    compile_enabled,
    compile_stats,
    dequantize,
    reset_compile_stats,
)
from macroarch.mvas._kernels.runner import unwatched, vec_isa

__all__ = ["ENV", "MIN_COMPILED_DEQUANTIZE", "StepSpec", "adamw_step", "canonical_spec", "compile_enabled",
           "compile_stats", "dequantize", "reset_compile_stats", "unwatched", "vec_isa"]
