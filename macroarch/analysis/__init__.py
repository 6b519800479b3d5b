"""Analysis of training dynamics: what the post's claims say about gradients, measured on real modules.

- ``gradients``: per-layer gradient norms, controlled-spectrum stacks, Jacobian spectra, growth-rate fits
  and gradient-variance estimators (claims C2 and C6);
- ``clipping``: the update an optimizer makes with and without gradient clipping on one gradient stream
  (claim C3);
- ``hyperconnections``: residual, Hyper-Connection and mHC blocks, a small LM built from them, and the
  composite gain of their residual mixing (reference R1).
"""

from macroarch.analysis.clipping import (
    ClippingProbe,
    ClippingTrace,
    StepRecord,
    clip_coefficient,
    measure_clipping,
    steps_to_target,
    train_loss_curve,
)
from macroarch.analysis.gradients import (
    GradientNormRecorder,
    GradientVariance,
    GrowthFit,
    NormSpread,
    controlled_stack,
    end_to_end_singular_values,
    find_repeated_layers,
    fit_growth_rate,
    layer_jacobian_singular_values,
    layer_norm_spread,
    minibatch_gradient_variance,
    random_orthogonal,
)
from macroarch.analysis.hyperconnections import (
    RESIDUAL_KINDS,
    CompositeGain,
    HCLMConfig,
    HCTransformerLM,
    HyperConnection,
    LMOutput,
    ManifoldHyperConnection,
    ResidualConnection,
    StreamConnection,
    composite_gain,
    make_connection,
    mixing_matrices,
    sinkhorn_knopp,
)

__all__ = [
    "RESIDUAL_KINDS",
    "ClippingProbe",
    "ClippingTrace",
    "CompositeGain",
    "GradientNormRecorder",
    "GradientVariance",
    "GrowthFit",
    "HCLMConfig",
    "HCTransformerLM",
    "HyperConnection",
    "LMOutput",
    "ManifoldHyperConnection",
    "NormSpread",
    "ResidualConnection",
    "StepRecord",
    "StreamConnection",
    "clip_coefficient",
    "composite_gain",
    "controlled_stack",
    "end_to_end_singular_values",
    "find_repeated_layers",
    "fit_growth_rate",
    "layer_jacobian_singular_values",
    "layer_norm_spread",
    "make_connection",
    "measure_clipping",
    "minibatch_gradient_variance",
    "mixing_matrices",
    "random_orthogonal",
    "sinkhorn_knopp",
    "steps_to_target",
    "train_loss_curve",
]
