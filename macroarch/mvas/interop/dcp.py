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

**What else travels** (exact resume): DCP holds tensors only, so ``save`` also writes, beside DCP's files, each
rank's optimizer ``state_dict()`` without its per-parameter state (``EXTRAS_NAME``: the param groups with their
scheduled learning rates, ``MVASAdamW``'s stochastic-rounding seed and skip count, ``CompensatedAdamW``'s and
DGR's extras), with ``torch.save``; ``load`` reads it with ``torch.load(weights_only=True)`` and puts it back through
the optimizer's own ``load_state_dict`` after the tensors, so a resumed run continues as the uninterrupted one. At
the world size it was saved with each rank gets its own; at another, rank 0's, which is exact for what every rank
holds alike (param groups, seeds, counters), and refused if it holds tensors (per-rank queues and snapshots do not
reshard).

**All or nothing.** ``load`` refuses an incompatible checkpoint before reading it (``check_compatible``). Then
DCP writes into the model's and optimizer's tensors in place and may fail part-way (a truncated or unreadable
file: its ``CheckpointException`` is a ``BaseException``): every tensor it can write is copied first and put back
on any failure, optimizer state that ``ensure_state`` created is dropped again, and a ``RuntimeError`` says that
nothing was loaded (``KeyboardInterrupt`` and ``SystemExit`` pass through as they are, after the restore). What
it read is checked before it is kept: managed weights (``MVASWeight.validate``: finite non-negative scales, no
payload code that decodes to NaN or infinity) and the optimizer state (finite moments, valid packed codes and
scales); one bad tensor on any rank restores every rank. DCP carries no checksums: bytes flipped into valid codes
load undetected (the packed safetensors form, ``macroarch.mvas.interop.checkpoint``, verifies a sha256 per tensor).

**Trust.** DCP's ``.metadata`` file is a Python pickle that torch unpickles when a checkpoint is read (and DCP loads
non-tensor entries with ``torch.load(weights_only=False)``): loading a crafted checkpoint runs its code. Load only
checkpoints from a trusted source. The extras file is read with ``torch.load(weights_only=True)``, which refuses any
code; the packed safetensors form and ``torch.load(weights_only=True)`` of a state dict run none either.

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

from macroarch.mvas.codecs.codes import FP8_DTYPES
from macroarch.mvas.codecs.formats import FORMATS
from macroarch.mvas.packed.packed_tensor import bad_scales, nonfinite_codes
from macroarch.mvas.packed.weight import MVASWeight
from macroarch.mvas.store import PAYLOAD_SUFFIX, SCALES_SUFFIX, TensorSnapshot
from macroarch.optim.functional import local

__all__ = ["EXTRAS_NAME", "OPTIM_PREFIX", "check_compatible", "check_loaded", "checkpoint_state", "ensure_state",
           "load", "optimizer_extras", "read_extras", "save"]

OPTIM_PREFIX = "optim."
EXTRAS_NAME = "mvas_optimizer_extras.rank{rank}.pt"
"""File of one rank's optimizer ``state_dict()`` without its per-parameter state, beside DCP's files."""


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor itself (``to_local()`` without autograd returns it, not a view), else ``t``."""
    with torch.no_grad():
        return local(t)


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


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def optimizer_extras(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` without ``"state"`` (the per-parameter tensors DCP holds): the param groups and any
    optimizer's own entries (seeds, counters, DGR's queues)."""
    return {k: v for k, v in optimizer.state_dict().items() if k != "state"}


def save(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Save ``checkpoint_state(model, optimizer)`` with DCP (collective under a process group), and each rank's
    ``optimizer_extras`` beside it (``EXTRAS_NAME``, module docstring)."""
    path = os.fspath(path)
    if optimizer is not None:
        rank, world = _rank_and_world()
        os.makedirs(path, exist_ok=True)
        torch.save({"world_size": world, "extras": optimizer_extras(optimizer)},
                   os.path.join(path, EXTRAS_NAME.format(rank=rank)))
    dist_cp.save(checkpoint_state(model, optimizer), checkpoint_id=path)


def read_extras(path: str | os.PathLike) -> dict[str, Any]:
    """This rank's ``optimizer_extras`` saved at ``path`` (rank 0's at another world size), read with
    ``torch.load(weights_only=True)``; ValueError if there are none or they cannot go to this world size."""
    path = os.fspath(path)
    rank, world = _rank_and_world()
    own = os.path.join(path, EXTRAS_NAME.format(rank=rank))
    first = os.path.join(path, EXTRAS_NAME.format(rank=0))
    if not os.path.exists(first):
        raise ValueError(f"checkpoint {path} holds no optimizer extras ({EXTRAS_NAME.format(rank=0)}: param groups, "
                         "seeds, counters): saved without an optimizer or by an older version; nothing was loaded. "
                         "Load the weights alone with optimizer=None")
    try:
        saved = torch.load(first, weights_only=True)
        if saved["world_size"] == world and os.path.exists(own):
            saved = torch.load(own, weights_only=True)
    except Exception as exc:  # weights_only refuses anything but tensors and plain values
        raise ValueError(f"checkpoint {path}: the optimizer extras cannot be read ({type(exc).__name__}: {exc}); "
                         "nothing was loaded") from exc
    if saved["world_size"] != world and any(torch.is_tensor(t) and t.dim() > 0 for t in _leaves(saved["extras"])):
        raise ValueError(f"checkpoint {path} was saved on {saved['world_size']} ranks with per-rank tensors in the "
                         f"optimizer's state_dict (DGR's queues, DC-ASGD snapshots), which do not reshard to "
                         f"{world}; nothing was loaded. Load it on {saved['world_size']} ranks, or the weights alone "
                         "(optimizer=None)")
    return saved["extras"]


def _leaves(tree: Any) -> list[Any]:
    if isinstance(tree, dict):
        return [x for v in tree.values() for x in _leaves(v)]
    if isinstance(tree, list | tuple):
        return [x for v in tree for x in _leaves(v)]
    return [tree]


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


def check_loaded(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> list[str]:
    """What is unusable in ``model``'s managed weights (``MVASWeight.validate``) and ``optimizer``'s state tensors
    (non-finite floats, fp8 codes that decode to NaN or infinity, negative scales), by name; this rank's tensors."""
    problems = []
    for name, p in model.named_parameters():
        local = _local(p)
        if isinstance(local, MVASWeight):
            try:
                local.validate()
            except ValueError as exc:
                problems.append(f"weight {name!r}: {exc}")
    if optimizer is None:
        return problems
    keys = _optimizer_keys(model, optimizer)
    for group in optimizer.param_groups:
        for t in group["params"]:
            name = keys[id(t)][0] if id(t) in keys else "?"
            for key, v in optimizer.state.get(t, {}).items():
                if not torch.is_tensor(v):
                    continue
                v = _local(v)
                bad = nonfinite_codes(v) if v.dtype in FP8_DTYPES else (
                    int((~torch.isfinite(v)).sum()) if v.is_floating_point() else 0)
                if key.endswith("_scales"):
                    bad = bad_scales(v)
                if bad:
                    problems.append(f"optimizer state {name}.{key}: {bad} values are NaN, infinite or negative")
    return problems


def _agree(failed: bool) -> bool:
    """Whether any rank failed (every rank's verdict combined under a process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return failed
    flag = torch.tensor([1.0 if failed else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


@torch.no_grad()
def load(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load a ``save`` checkpoint into ``model`` (and ``optimizer``, with its non-tensor state) in place, in this
    process's layout (any world size whose shards are whole blocks). All or nothing (module docstring): refused
    before reading anything if ``check_compatible`` fails, and put back as it was if reading fails part-way or what
    it read is unusable.

    Trust: torch unpickles the checkpoint's ``.metadata`` (module docstring): load only checkpoints from a trusted
    source."""
    path = os.fspath(path)
    fresh = [] if optimizer is None else [t for group in optimizer.param_groups for t in group["params"]
                                          if not optimizer.state.get(t)]
    if optimizer is not None:
        ensure_state(optimizer)
    try:
        state = checkpoint_state(model, optimizer)
        check_compatible(path, state)
        extras = None if optimizer is None else read_extras(path)
    except BaseException:
        _drop_state(optimizer, fresh)
        raise
    snapshot = TensorSnapshot(_local(v) for v in state.values() if torch.is_tensor(v))
    try:
        failure = None
        try:
            dist_cp.load(state, checkpoint_id=path)
        except BaseException as exc:  # CheckpointException is a BaseException
            failure = exc
        problems = [] if failure is not None else check_loaded(model, optimizer)
        if _agree(failure is not None or bool(problems)):
            if failure is not None:
                raise failure
            raise ValueError(f"checkpoint {path} holds unusable values (nothing was loaded):\n  "
                             + ("\n  ".join(problems[:10]) if problems else "on another rank"))
        if optimizer is not None:
            optimizer.load_state_dict({**optimizer.state_dict(), **extras})
    except BaseException as exc:
        snapshot.restore()
        _drop_state(optimizer, fresh)
        _mark_written(model)
        if isinstance(exc, KeyboardInterrupt | SystemExit | ValueError):
            raise
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]  # DCP's: a traceback per rank
        raise RuntimeError(f"loading checkpoint {path} failed part-way ({type(exc).__name__}: "
                           f"{lines[-1] if lines else ''}); the model and optimizer were put back as they were: "
                           "nothing was loaded") from exc
    _mark_written(model)


def _drop_state(optimizer: torch.optim.Optimizer | None, params: list[torch.Tensor]) -> None:
    """Drop the state ``ensure_state`` gave ``params`` (a load that did not happen leaves none)."""
    for p in params:
        optimizer.state.pop(p, None)


def _mark_written(model: nn.Module) -> None:
    for p in model.parameters():
        local = _local(p)
        if isinstance(local, MVASWeight):
            local.mark_written()
