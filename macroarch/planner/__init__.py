"""``plan``: will my model train on my GPUs, and with which techniques? Answered on a CPU, under fake tensors.

``plan(model, batch, seq, gpu=... | budget_gb=..., devices=..., techniques="mvas,dgr,checkpoint,fsdp2")`` runs one
full training step of every combination of the techniques under ``FakeTensorMode`` and returns a ``Plan``: bytes
per device by category (weights, gradients, master, optimizer, activations) and the measured peak, whether each
fits and by how much, the largest batch (or sequence, clip, point cloud) that fits, and the cheapest fitting
combination by the benchmarks' measured slowdowns. ``custom(name, build, make_batch, loss, layers=...)`` makes a
model no spec names plannable; ``StepCache`` shares the steps measured between plans of one model (a plan per
budget, per size); ``rules_from_plan`` carries an MVAS plan made on a small model to a full-size one by role.
``macroarch.planner.cli`` is the ``macroarch plan`` command (also ``python -m macroarch.planner``).

- ``models``: a model spec (config.json, project builder, open_clip, timm, ``module:fn``) resolved to a builder;
- ``run``: the techniques stacked on the model, one fake step, depth extrapolation, FSDP2's sharding (modelled);
- ``target``: an MVAS target reduction as per-role rules, for models without values;
- ``roles``: an MVAS plan made on a small model as per-role rules;
- ``slowdown``: the measured step-time ratios, read from the benchmarks' committed runs;
- ``core``: ``plan`` itself; ``report``: text and the bar chart; ``cli``: the command.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"Combination": "macroarch.planner.core", "Plan": "macroarch.planner.core", "plan": "macroarch.planner.core",
            "PlanError": "macroarch.planner.models", "custom": "macroarch.planner.models",
            "StepCache": "macroarch.planner.run", "rules_from_plan": "macroarch.planner.roles",
            "figure": "macroarch.planner.report", "plot": "macroarch.planner.report"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Names are imported on first use, so the CLI parser (``planner.cli``) is built without importing torch."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'macroarch.planner' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
