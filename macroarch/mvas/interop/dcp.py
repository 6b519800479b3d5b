"""Distributed checkpoints of MVAS models across layouts (issue 18): ``torch.distributed.checkpoint`` (DCP) saves
the packed weights, and ``MVASAdamW``'s quantised moments, from N ranks and loads them on M, bit for bit.

DCP reshards plain and ``DTensor`` entries by element ranges; a managed weight is given to it as what it stores:

- ``<key>__mvas_payload`` and ``<key>__mvas_scales``: the flat payload (fp8 codes, fp4 bytes, ...) and the fp32
  block scales, each a 1-D tensor; under FSDP2 (``macroarch.mvas.interop.fsdp``) a ``DTensor`` sharded on dim 0 whose
  local tensor *is* the rank's shard storage (no copy): a rank's dim-0 shard of the weight is a contiguous run of
  whole blocks, so its payload and scales are contiguous runs of the flat arrays, and any other even dim-0 layout
  reads its own runs back (2 ranks -> 1 -> 2 gives the saved bytes);
- optimizer state (``optim.<key>.<state name>``): moments packed flat (and their scales) as 1-D entries sharded
  like the payload, dense moments and master copies sharded like the weight, the step count replicated.

``load`` checks the checkpoint's metadata against the model before anything is read, and refuses (ValueError,
naming the tensor and both sides) a checkpoint of another plan (a weight dense on one side and packed on the
other, another format, another block size), another shape, or optimizer state whose per-shard layout differs:
``MVASAdamW`` decides per shard whether to quantise a moment (``min_state_numel``, ``state_block_size``
dividing the shard), so the moments of some world sizes cannot be carried to others; load the weights alone
(``optimizer=None``) then. Other entries are DCP's (dense tensors, DTensors) and reshard as usual.

Deviation: optimizer state is reached through the optimizer's ``state`` dict, keyed by the parameters (DTensors
under FSDP2, as ``MVASAdamW`` keys them) or by their local tensors; an optimizer with no
state yet gets it from its public ``init_state()`` (``MVASAdamW``, ``CompensatedAdamW``) before a load.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import torch.distributed.checkpoint as dist_cp
from torch import nn

from macroarch.mvas.codecs.formats import FORMATS
from macroarch.mvas.store import PAYLOAD_SUFFIX, SCALES_SUFFIX
from macroarch.mvas.packed.weight import MVASWeight

__all__ = ["OPTIM_PREFIX", "check_compatible", "checkpoint_state", "ensure_state", "load", "save"]

OPTIM_PREFIX = "optim."


def _local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)


def _shard_like(param: torch.Tensor, local: torch.Tensor, flat: bool) -> torch.Tensor:
    """``local`` (a rank's piece) as a DTensor laid out as ``param`` is: sharded like it (same shape as the local
    shard) or, ``flat``, a 1-D array sharded on dim 0 of ``local.numel() x shards`` elements. A plain ``param``
    gives ``local`` itself."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return local
    if not flat:
        return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                                  stride=param.stride())
    shards = math.prod(param.device_mesh.size(i) for i, p in enumerate(param.placements) if isinstance(p, Shard))
    return DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                              shape=torch.Size([local.numel() * shards]), stride=(1,))


def _optimizer_keys(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, tuple[str, torch.Tensor]]:
    """id of each tensor the optimizer may key its state by (a parameter or its local shard) -> (name, parameter)."""
    keys: dict[int, tuple[str, torch.Tensor]] = {}
    for name, p in model.named_parameters():
        keys[id(p)] = keys[id(_local(p))] = (name, p)
    return keys


def ensure_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter of ``optimizer`` its (zero) state if it has none yet, as a load needs it: the
    optimizer's public ``init_state()`` (``MVASAdamW``, ``CompensatedAdamW``), which keeps existing state."""
    init = getattr(optimizer, "init_state", None)
    if init is not None:
        init()
        return
    if not all(optimizer.state.get(t) for group in optimizer.param_groups for t in group["params"]):
        raise ValueError(f"{type(optimizer).__name__} has no state to load into yet and no init_state() (take one "
                         "step, or load the weights alone with optimizer=None)")


def checkpoint_state(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """The state DCP saves and loads in place: ``model.state_dict()`` with each managed weight as its payload and
    scales, plus the optimizer's state (module docstring). Every tensor shares storage with the model/optimizer."""
    out: dict[str, Any] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        local = _local(value)
        if isinstance(local, MVASWeight):
            out[key + PAYLOAD_SUFFIX] = _shard_like(value, local.payload, flat=True)
            if local.scales is not None:
                out[key + SCALES_SUFFIX] = _shard_like(value, local.scales, flat=True)
        else:
            out[key] = value.detach()
    if optimizer is None:
        return out
    keys = _optimizer_keys(model, optimizer)
    for group in optimizer.param_groups:
        for t in group["params"]:
            if id(t) not in keys:
                raise ValueError(f"an optimizer parameter of shape {tuple(t.shape)} is not one of the model's")
            name, param = keys[id(t)]
            for state_key, v in optimizer.state.get(t, {}).items():
                if not torch.is_tensor(v):
                    continue  # sizes and flags: the loading side has its own
                entry = f"{OPTIM_PREFIX}{name}.{state_key}"
                if v.dim() == 0:
                    out[entry] = v
                else:
                    out[entry] = _shard_like(param, v, flat=tuple(v.shape) != tuple(_local(param).shape))
    return out


def save(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Save ``checkpoint_state(model, optimizer)`` with DCP (collective under a process group)."""
    dist_cp.save(checkpoint_state(model, optimizer), checkpoint_id=os.fspath(path))


def _describe(dtype: torch.dtype, numel: int, scales: int | None, is_payload: bool) -> str:
    """A payload's format and blocks, in words."""
    if not is_payload:
        return f"{dtype} x {numel}"
    names = [f.name for f in FORMATS.values() if f.storage_dtype == dtype and f.block_scaled == (scales is not None)]
    fmt = names[0] if names else str(dtype)
    if scales is None:
        return fmt
    elements = numel * (2 if fmt == "fp4_e2m1" else 1)
    return f"{fmt} in blocks of {elements // max(scales, 1)}"


def check_compatible(path: str | os.PathLike, state: dict[str, Any]) -> None:
    """Raise ValueError unless every entry of ``state`` (``checkpoint_state``) is in the checkpoint at ``path`` with
    the same dtype and global size, with a message that names the tensor, the plan or layout saved and this one."""
    metadata = dist_cp.FileSystemReader(os.fspath(path)).read_metadata().state_dict_metadata
    problems = []
    for key, value in state.items():
        if not torch.is_tensor(value):
            continue
        saved = metadata.get(key)
        dtype, size = value.dtype, tuple(value.shape)
        if key.endswith(PAYLOAD_SUFFIX) or key.endswith(SCALES_SUFFIX):
            base = key.removesuffix(PAYLOAD_SUFFIX).removesuffix(SCALES_SUFFIX)
            payload, scales = state.get(base + PAYLOAD_SUFFIX), state.get(base + SCALES_SUFFIX)
            saved_payload, saved_scales = metadata.get(base + PAYLOAD_SUFFIX), metadata.get(base + SCALES_SUFFIX)
            mine = _describe(payload.dtype, payload.numel(), None if scales is None else scales.numel(), True)
            if saved_payload is None:
                theirs = "dense" if base in metadata else "absent"
            else:
                theirs = _describe(saved_payload.properties.dtype, math.prod(saved_payload.size),
                                   None if saved_scales is None else math.prod(saved_scales.size), True)
            if saved_payload is None or theirs != mine or tuple(saved_payload.size) != tuple(payload.shape):
                problems.append(f"weight {base!r}: the checkpoint holds it {theirs}, this model {mine} "
                                "(another MVAS plan: load with the plan it was saved under, then re-pack)")
            continue
        if saved is None or not hasattr(saved, "size"):
            where = "optimizer state" if key.startswith(OPTIM_PREFIX) else "tensor"
            problems.append(f"{where} {key!r}: not in the checkpoint"
                            + (" (the weight is packed there)" if key + PAYLOAD_SUFFIX in metadata else ""))
            continue
        if saved.properties.dtype != dtype or tuple(saved.size) != size:
            chunks = len(saved.chunks)
            what = (f"optimizer state {key!r}: saved as {saved.properties.dtype} x {tuple(saved.size)} in {chunks} "
                    f"shard(s), this layout holds {dtype} x {size}")
            if key.startswith(OPTIM_PREFIX):
                what += (" (moments are quantised or not per shard, by min_state_numel and state_block_size: this "
                         "world size cuts them differently; load the weights alone with optimizer=None)")
            else:
                what = f"tensor {key!r}: saved as {saved.properties.dtype} x {tuple(saved.size)}, here {dtype} x {size}"
            problems.append(what)
    if problems:
        problems = list(dict.fromkeys(problems))
        raise ValueError(f"checkpoint {os.fspath(path)} does not fit this model/optimizer layout (nothing loaded):\n  "
                         + "\n  ".join(problems))


@torch.no_grad()
def load(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load a ``save`` checkpoint into ``model`` (and ``optimizer``) in place, in this process's layout (any world
    size whose shards are whole blocks); refused before reading anything if ``check_compatible`` fails."""
    if optimizer is not None:
        ensure_state(optimizer)
    state = checkpoint_state(model, optimizer)
    check_compatible(path, state)
    dist_cp.load(state, checkpoint_id=os.fspath(path))
    for p in model.parameters():
        local = _local(p)
        if isinstance(local, MVASWeight):
            local.mark_written()
