"""Memory accounting: exact analytic byte counts and measured live bytes of a real training step.

``analytic``: parameter counts, precision policies, training-state and activation bytes.
``measured``: ``measure_training_step`` with MemTracker, on real or fake tensors; ``measure_step`` for
any user-written step.
"""

from macroarch.measure.memory.analytic import (
    ACTIVATION_TOLERANCE,
    PRECISIONS,
    ActivationTerm,
    PrecisionPolicy,
    activation_bytes,
    activation_terms,
    format_bytes,
    get_precision,
    korthikanti_activation_bytes,
    loss_temporary_bytes,
    parameter_count,
    training_state_bytes,
)
from macroarch.measure.memory.measured import (
    CATEGORIES,
    PHASES,
    STATE_CATEGORIES,
    MemoryReport,
    PhasePeak,
    StepMemory,
    extrapolate_by_depth,
    measure_step,
    measure_training_step,
    training_bytes,
)

__all__ = [
    "ACTIVATION_TOLERANCE",
    "CATEGORIES",
    "PHASES",
    "PRECISIONS",
    "STATE_CATEGORIES",
    "ActivationTerm",
    "MemoryReport",
    "PhasePeak",
    "PrecisionPolicy",
    "StepMemory",
    "activation_bytes",
    "activation_terms",
    "extrapolate_by_depth",
    "format_bytes",
    "get_precision",
    "korthikanti_activation_bytes",
    "loss_temporary_bytes",
    "measure_step",
    "measure_training_step",
    "parameter_count",
    "training_bytes",
    "training_state_bytes",
]
