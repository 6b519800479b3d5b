"""MVAS from a target reduction, for a model that has no values: the budget solved per role, as rules.

``MVASConfig(target_reduction=r)`` asks ``mvas.plan_for_budget`` for the formats that save ``r`` of the weights'
bytes at the least total sensitivity, and its sensitivity is each tensor's squared rounding error, which needs the
weights' values. The planner's models are shapes only (``"meta"``, fake tensors), so here the same knapsack runs with
a value-free proxy: every element of every tensor is as sensitive as a standard normal one (the mean squared
rounding error of 2^16 N(0, 1) draws in that format and block size, measured once). It is solved

- once over one block of each repeated stack (a name's role is the name with its layer indices replaced by ``*``:
  ``model.layers.*.mlp.up_proj.weight``), so every block of a stack gets the same formats, and
- once over everything else (embeddings, heads, the parts outside any stack),

each to the target, so the whole model meets it at any depth and the depth extrapolation sees identical blocks.
The result is a ``precision_policy`` (role -> format) for ``MVASConfig``. Deviation, stated in every plan that
uses it: with trained weights' sensitivities the knapsack may pick other tensors for each format (the bytes saved
are the same, to within a tensor's step); with equal proxies per element, ties go to the first tensors in the
model's order.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import nn

_INDEX = re.compile(r"\.\d+\.")
FORMATS = ("fp16", "fp8_e4m3", "fp4_e2m1")
"""``plan_for_budget``'s default formats, highest first."""


@functools.cache
def _error_per_element(fmt: str, block_size: int | None) -> float:
    from macroarch.mvas import quantization_error

    n = 1 << 16
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    return quantization_error(x, fmt, block_size) / n


def _proxy(tensors: Mapping[str, torch.Tensor], block_size: int | None) -> dict[str, dict[str, float]]:
    from macroarch.mvas.plan.policy import block_for

    return {name: {f: t.numel() * _error_per_element(f, block_for(t.numel(), f, block_size)) for f in FORMATS}
            for name, t in tensors.items()}


def _solve(tensors: Mapping[str, torch.Tensor], reduction: float, mvas: Any) -> dict[str, str]:
    from macroarch.mvas import plan_for_budget

    if not tensors:
        return {}
    plan = plan_for_budget(dict(tensors), _proxy(tensors, mvas.block_size), target_reduction=reduction,
                           formats=FORMATS, block_size=mvas.block_size, min_numel=mvas.min_numel)
    return {t.name: t.format for t in plan.tensors if not t.reason.startswith("kept")}


def policy_for_target(meta: nn.Module, mvas: Any) -> tuple[Any, str]:
    """``mvas`` (an ``MVASConfig`` with ``target_reduction``) as rules for ``meta`` (the full model, any device), and
    a sentence saying how they were made. Raises ValueError where the target cannot be met (``plan_for_budget``
    names the smallest achievable bytes)."""
    blocks: dict[str, torch.Tensor] = {}
    rest: dict[str, torch.Tensor] = {}
    for name, p in {id(p): (n, p) for n, p in meta.named_parameters()}.values():
        role = _INDEX.sub(".*.", name)
        if role == name:
            rest[name] = p
        elif role not in blocks:
            blocks[role] = p  # the first block of its stack (input side first)
    r = mvas.target_reduction
    try:
        rules = {**_solve(blocks, r, mvas), **_solve(rest, r, mvas)}
    except ValueError as e:
        raise ValueError(f"mvas.target_reduction {r:g}: {e}") from None
    formats = sorted(set(rules.values()), key=FORMATS.index)
    how = (f"from target_reduction {r:g}: plan_for_budget solved without the weights' values (every element as "
           f"sensitive as a standard normal one), once per role over one block and once over the rest, so every "
           f"block has the same formats ({', '.join(formats) or 'none packed'}); trained weights may put other "
           f"tensors in each format (macroarch.planner.target)")
    return replace(mvas, precision_policy=rules, target_reduction=None), how


__all__ = ["FORMATS", "policy_for_target"]
