"""Loading the state of optimizers that keep state in another dtype than their parameters, all or nothing.

``torch.optim.Optimizer.load_state_dict`` casts every floating state tensor to its parameter's dtype (and
device). For an fp32 master copy of a bf16 parameter that rounds the master to 16 bits; for packed fp8 / fp4
moments it turns the payload into floats. The optimizers here (``MasterWeightAdamW``, ``CompensatedAdamW``,
``MVASAdamW``) call ``restore_saved_state`` after torch's loader to put those tensors back as they were saved.

torch's loader checks only the number of parameters per group: the state of another model (a wider layer's
``exp_avg`` for this one's weight) loads, and the next step uses it or fails in the middle. ``check_saved_state``
compares every saved tensor with the parameter it will belong to; the optimizers call it before torch's loader, so
a refused state dict changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch

from macroarch.optim.functional import local

__all__ = ["check_saved_state", "restore_saved_state", "saved_pairs"]


def saved_pairs(optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]) -> list[tuple[int, Any, torch.Tensor]]:
    """``(index, saved id, parameter)`` for every parameter of ``optimizer``, matched to ``state_dict``'s ids by the
    saved param-group order (as torch's loader matches them). Raises ValueError if the groups or their sizes
    differ."""
    saved_groups = state_dict.get("param_groups") if isinstance(state_dict, Mapping) else None
    if not isinstance(saved_groups, list) or not isinstance(state_dict.get("state"), Mapping):
        raise ValueError("the optimizer state dict has no 'state' and 'param_groups': pass what state_dict() "
                         "returned; nothing was loaded")
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(f"the optimizer state dict has {len(saved_groups)} param groups, this optimizer "
                         f"{len(optimizer.param_groups)}; nothing was loaded")
    sizes = [len(g["params"]) for g in saved_groups], [len(g["params"]) for g in optimizer.param_groups]
    if sizes[0] != sizes[1]:
        raise ValueError(f"the optimizer state dict's param groups hold {sizes[0]} parameters, this optimizer's "
                         f"{sizes[1]}: it is of another model; nothing was loaded")
    saved_ids = [i for group in saved_groups for i in group["params"]]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return [(index, saved, p) for index, (saved, p) in enumerate(zip(saved_ids, params))]


def check_saved_state(optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any], dense_keys: Collection[str],
                      check: Callable[[int, torch.Tensor, Mapping[str, Any]], list[str]] | None = None) -> None:
    """Raise ValueError, naming each parameter (its index in the optimizer) and both shapes, unless ``state_dict``'s
    per-parameter state fits ``optimizer``'s parameters: the same groups and sizes, every tensor in ``dense_keys``
    shaped as its parameter (or a DTensor parameter's local shard), ``step`` one number. ``check(index, param,
    saved_state)`` adds an optimizer's own problems (packed moments). Reads only: call it before torch's loader."""
    problems = []
    for index, saved_id, p in saved_pairs(optimizer, state_dict):
        saved = state_dict["state"].get(saved_id)
        if saved is None:
            continue
        shapes = {tuple(p.shape), tuple(local(p).shape)}
        for key, value in saved.items():
            if not torch.is_tensor(value):
                continue
            if key == "step":
                if value.numel() != 1:
                    problems.append(f"parameter {index}: step has shape {tuple(value.shape)}, not one number")
            elif key in dense_keys and tuple(value.shape) not in shapes:
                problems.append(f"parameter {index}: {key} {tuple(value.shape)}, the parameter "
                                f"{tuple(local(p).shape)}")
        if check is not None:
            problems += [f"parameter {index}: {problem}" for problem in check(index, p, saved)]
    if problems:
        raise ValueError(f"the optimizer state dict does not fit this optimizer's parameters ({len(problems)} "
                         "problems: " + "; ".join(problems[:5]) + (" ..." if len(problems) > 5 else "")
                         + "): it is of another model or corrupt; nothing was loaded")


def restore_saved_state(optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any],
                        keys: Collection[str]) -> None:
    """After ``torch.optim.Optimizer.load_state_dict(state_dict)``: the state tensors named in ``keys`` as saved
    (dtype kept, copied to the parameter's device), matched to parameters by the saved param-group order."""
    for _, saved_id, p in saved_pairs(optimizer, state_dict):
        for key, value in state_dict["state"].get(saved_id, {}).items():
            if key in keys and torch.is_tensor(value):
                optimizer.state[p][key] = value.detach().to(device=p.device, copy=True)
