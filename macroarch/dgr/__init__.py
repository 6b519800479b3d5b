"""Dynamic Graph Reorganization (post section 3.1, claim C6): topology-aware parameter groups, group updates
during backward (sync or interleaved with delays), and DC-ASGD delay compensation.

- ``grouping``: ``build_groups`` / ``group_parameters`` -> ``Grouping`` of ``ParamGroup``s, ``backward_order``;
- ``compensation``: ``GradientCompensator`` and the DC-ASGD formulas as functions;
- ``pipeline``: ``DGROptimizer`` (a ``torch.optim.Optimizer``) and its ``PipelineConfig``;
- ``wrapper``: ``DGRWrapper(module, group_size=8, ...)``, the post's API.
"""

from macroarch.dgr.grouping import Grouping, ParamGroup, backward_order, build_groups, group_parameters, run_example
from macroarch.dgr.pipeline import CLIP_MODES, MODES, DGROptimizer, PipelineConfig
from macroarch.dgr.wrapper import DGRWrapper
from macroarch.optim.compensation import (
    DC_ASGD_A_LAMBDA,
    DC_ASGD_A_MOMENTUM,
    DC_ASGD_C_LAMBDA,
    GradientCompensator,
    adaptive_lambda,
    dc_asgd_compensate,
    update_meansquare,
)

__all__ = [
    "CLIP_MODES",
    "DC_ASGD_A_LAMBDA",
    "DC_ASGD_A_MOMENTUM",
    "DC_ASGD_C_LAMBDA",
    "DGROptimizer",
    "DGRWrapper",
    "GradientCompensator",
    "Grouping",
    "MODES",
    "ParamGroup",
    "PipelineConfig",
    "adaptive_lambda",
    "backward_order",
    "build_groups",
    "dc_asgd_compensate",
    "group_parameters",
    "run_example",
    "update_meansquare",
]
