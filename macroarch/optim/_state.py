"""One fix for optimizers that keep state in another dtype than their parameters.

``torch.optim.Optimizer.load_state_dict`` casts every floating state tensor to its parameter's dtype (and
device). For an fp32 master copy of a bf16 parameter that rounds the master to 16 bits; for packed fp8 / fp4
moments it turns the payload into floats. The optimizers here (``MasterWeightAdamW``, ``CompensatedAdamW``,
``MVASAdamW``) call ``restore_saved_state`` after torch's loader to put those tensors back as they were saved.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch


def restore_saved_state(optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any],
                        keys: Collection[str]) -> None:
    """After ``torch.optim.Optimizer.load_state_dict(state_dict)``: the state tensors named in ``keys`` as saved
    (dtype kept, copied to the parameter's device), matched to parameters by the saved param-group order."""
    saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, p in zip(saved_ids, params):
        for key, value in state_dict["state"].get(index, {}).items():
            if key in keys and torch.is_tensor(value):
                optimizer.state[p][key] = value.detach().to(device=p.device, copy=True)
