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

**What else travels** (exact resume, integrity): DCP holds tensors only, so ``save`` also writes, beside DCP's
files, one file per rank (``EXTRAS_NAME``, with ``torch.save``): the sha256 of every tensor chunk that rank wrote
(payloads, scales, dense tensors, optimizer state; keyed as DCP's metadata keys the chunk: its name and global
offset), and the optimizer's ``state_dict()`` without its per-parameter state (the param groups with their
scheduled learning rates, ``MVASAdamW``'s stochastic-rounding seed and skip count, ``CompensatedAdamW``'s and DGR's
extras). ``load`` reads them with ``torch.load(weights_only=True)`` and puts the optimizer's back through its own
``load_state_dict`` after the tensors, so a resumed run continues as the uninterrupted one. At the world size it was
saved with each rank gets its own optimizer extras; at another, rank 0's, which is exact for what every rank holds
alike (param groups, seeds, counters), and refused if they hold tensors (per-rank queues and snapshots do not
reshard).

**All or nothing.** ``load`` refuses an incompatible checkpoint before reading it (``check_compatible``). Then it
verifies the checkpoint before writing anything (``verify``): every saved chunk of every tensor it will load is read
whole, in the layout it was saved in whatever this process's layout (one tensor at a time, the ranks sharing the
tensors: the checkpoint is read twice in all), and its sha256 compared with the one recorded at save; a truncated
or unreadable file, flipped bytes or a chunk without a digest is refused, and so are values no save writes
(``unusable``: NaN, infinite or negative scales, payload and moment codes that decode to NaN or infinity,
non-finite moments). One problem on any rank refuses on every rank, with a ``ValueError`` naming the tensors; the
model and the optimizer are untouched (state that ``ensure_state`` created for the load is dropped again). Only
then does DCP write into the model's and optimizer's tensors in place; should that still fail part-way (the files
changed meanwhile: DCP's ``CheckpointException`` is a ``BaseException``), every tensor it can write was copied
first and is put back, and a ``RuntimeError`` says that nothing was loaded (``KeyboardInterrupt`` and
``SystemExit`` pass through as they are, after the restore). A parameter that had no optimizer state when the
checkpoint was saved (DGR's interleaved mode delays group g's first step by g steps) has none after the load.

**Trust.** DCP's ``.metadata`` file is a Python pickle that torch unpickles when a checkpoint is read (and DCP loads
non-tensor entries with ``torch.load(weights_only=False)``): loading a crafted checkpoint runs its code. Load only
checkpoints from a trusted source: the sha256 digests detect corruption, not a checkpoint crafted with digests
to match. The extras file is read with ``torch.load(weights_only=True)``, which refuses any
code; the packed safetensors form and ``torch.load(weights_only=True)`` of a state dict run none either.

Deviation: optimizer state is reached through the optimizer's ``state`` dict, keyed by the parameters (DTensors
under FSDP2, as ``MVASAdamW`` keys them) or by their local tensors; an optimizer with no
state yet gets it from its public ``init_state()`` (``MVASAdamW``, ``CompensatedAdamW``) before a load.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed.checkpoint as dist_cp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

from macroarch.mvas.codecs.codes import FP8_DTYPES
from macroarch.mvas.codecs.formats import FORMATS
from macroarch.mvas.interop.state_dict import PAYLOAD_SUFFIX, SCALES_SUFFIX, TensorSnapshot
from macroarch.mvas.packed.packed_tensor import bad_scales, nonfinite_codes
from macroarch.mvas.packed.weight import MVASWeight
from macroarch.optim.functional import local

__all__ = ["EXTRAS_NAME", "OPTIM_PREFIX", "check_compatible", "checkpoint_state", "ensure_state", "load",
           "optimizer_extras", "read_digests", "read_extras", "save", "unusable", "verify"]

OPTIM_PREFIX = "optim."
EXTRAS_NAME = "mvas_extras.rank{rank}.pt"
"""File of one rank's sha256 digests and optimizer ``state_dict()`` without its per-parameter state, beside DCP's
files (module docstring)."""

Digests = dict[str, dict[tuple[int, ...], str]]
"""tensor name -> global offset of a saved chunk -> sha256 of the chunk's bytes (hex), as ``save`` records them."""


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


@contextlib.contextmanager
def _one_process() -> Iterator[None]:
    """DCP's calls without collectives (``no_dist=True``): without its warning that it assumes so, which it gives
    whether or not ``no_dist`` was asked for (here it is, deliberately: one process, or one rank's own reading)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized", UserWarning)
        yield


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def optimizer_extras(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` without ``"state"`` (the per-parameter tensors DCP holds): the param groups and any
    optimizer's own entries (seeds, counters, DGR's queues)."""
    return {k: v for k, v in optimizer.state_dict().items() if k != "state"}


def _sha256(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes in row-major order (its dtype's own encoding), hex."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    return hashlib.sha256(flat.numpy()).hexdigest()


class _DigestingSavePlanner(DefaultSavePlanner):
    """DCP's default save planner that also records the sha256 of every tensor chunk this rank writes, keyed as
    DCP's metadata keys it (name, global offset)."""

    def __init__(self) -> None:
        super().__init__()
        self.sha256: Digests = {}

    def resolve_data(self, write_item: Any) -> Any:
        data = super().resolve_data(write_item)
        if torch.is_tensor(data):
            self.sha256.setdefault(write_item.index.fqn, {})[tuple(write_item.index.offset)] = _sha256(data)
        return data


def save(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Save ``checkpoint_state(model, optimizer)`` with DCP (collective under a process group), and each rank's
    sha256 digests and ``optimizer_extras`` beside it (``EXTRAS_NAME``, module docstring)."""
    import torch.distributed as dist

    path = os.fspath(path)
    rank, world = _rank_and_world()
    planner = _DigestingSavePlanner()
    with _one_process() if world == 1 else contextlib.nullcontext():
        dist_cp.save(checkpoint_state(model, optimizer), checkpoint_id=path, planner=planner, no_dist=world == 1)
    extras = None if optimizer is None else optimizer_extras(optimizer)
    target = os.path.join(path, EXTRAS_NAME.format(rank=rank))
    torch.save({"world_size": world, "sha256": planner.sha256, "extras": extras}, target + ".partial")
    os.replace(target + ".partial", target)  # never a half-written file under the name load reads
    if world > 1:
        dist.barrier()  # every rank's file is there when save returns


def _read_saved(path: str, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s ``EXTRAS_NAME`` file at ``path``, read with ``torch.load(weights_only=True)``."""
    file = os.path.join(path, EXTRAS_NAME.format(rank=rank))
    if not os.path.exists(file):
        raise ValueError(f"checkpoint {path} has no {EXTRAS_NAME.format(rank=rank)} (the sha256 of each tensor that "
                         "rank saved, and its optimizer's param groups, seeds, counters): saved by an older version "
                         "or copied without it, so it cannot be verified; nothing was loaded")
    try:
        saved = torch.load(file, weights_only=True)
    except Exception as exc:  # weights_only refuses anything but tensors and plain values
        raise ValueError(f"checkpoint {path}: {EXTRAS_NAME.format(rank=rank)} cannot be read ({type(exc).__name__}: "
                         f"{exc}); nothing was loaded") from exc
    if not isinstance(saved, dict) or not {"world_size", "sha256", "extras"} <= saved.keys():
        raise ValueError(f"checkpoint {path}: {EXTRAS_NAME.format(rank=rank)} is not a macroarch extras file (no "
                         "world_size, sha256 and extras); nothing was loaded")
    return saved


def read_digests(path: str | os.PathLike) -> Digests:
    """The sha256 of every tensor chunk saved at ``path``, from every saving rank's file; ValueError if one is
    missing or unreadable."""
    path = os.fspath(path)
    world = _read_saved(path, 0)["world_size"]
    digests: Digests = {}
    for rank in range(world):
        for name, chunks in _read_saved(path, rank)["sha256"].items():
            digests.setdefault(name, {}).update(chunks)
    return digests


def read_extras(path: str | os.PathLike) -> dict[str, Any]:
    """This rank's ``optimizer_extras`` saved at ``path`` (rank 0's at another world size); ValueError if the
    checkpoint holds none or they cannot go to this world size."""
    path = os.fspath(path)
    rank, world = _rank_and_world()
    saved = _read_saved(path, 0)
    if saved["world_size"] == world and rank:
        saved = _read_saved(path, rank)
    if saved["extras"] is None:
        raise ValueError(f"checkpoint {path} was saved without an optimizer (its {EXTRAS_NAME.format(rank=0)} holds "
                         "no optimizer extras: param groups, seeds, counters); nothing was loaded. Load the weights "
                         "alone with optimizer=None")
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


def _what(key: str) -> str:
    """A checkpoint entry in words: a managed weight's payload or scales, optimizer state, or a tensor."""
    for suffix, part in ((PAYLOAD_SUFFIX, "payload"), (SCALES_SUFFIX, "scales")):
        if key.endswith(suffix):
            return f"weight {key.removesuffix(suffix)!r} ({part})"
    if key.startswith(OPTIM_PREFIX):
        return f"optimizer state {key.removeprefix(OPTIM_PREFIX)}"
    return f"tensor {key!r}"


def unusable(key: str, t: torch.Tensor) -> int:
    """How many values of checkpoint entry ``key`` no save writes: NaN, infinite or negative scales (a weight's, or
    a packed moment's ``*_scales``), payload and moment codes that decode to NaN or infinity (fp8 codes as bytes,
    16-bit payloads' NaN), non-finite dense moments and master copies. Zero for the other entries (dense weights
    and buffers: a model may hold anything there)."""
    if key.endswith(SCALES_SUFFIX) or (key.startswith(OPTIM_PREFIX) and key.endswith("_scales")):
        return bad_scales(t)
    if key.endswith(PAYLOAD_SUFFIX):
        return nonfinite_codes(t)
    if key.startswith(OPTIM_PREFIX):
        if t.dtype in FP8_DTYPES:
            return nonfinite_codes(t)
        return int((~torch.isfinite(t)).sum()) if t.is_floating_point() else 0
    return 0


class _DigestCheckingLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner that hashes each saved chunk as it lands in a full-size tensor: (name, offset) ->
    (the region read, its sha256, whether it starts at the chunk's origin)."""

    def __init__(self) -> None:
        super().__init__()
        self.read: dict[tuple[str, tuple[int, ...]], tuple[tuple[int, ...], str, bool]] = {}

    def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
        index = read_item.storage_index
        self.read[(index.fqn, tuple(index.offset))] = (tuple(read_item.lengths), _sha256(tensor),
                                                       not any(read_item.storage_offsets))


def _verify_entry(path: str, key: str, metadata: Any, digests: Digests) -> list[str]:
    """The problems of checkpoint entry ``key`` (module docstring): each saved chunk read whole into a full-size
    tensor, its sha256 against the recorded one, then its values (``unusable``)."""
    full = torch.empty(tuple(metadata.size), dtype=metadata.properties.dtype)
    planner = _DigestCheckingLoadPlanner()
    try:
        with _one_process():
            dist_cp.load({key: full}, checkpoint_id=path, planner=planner, no_dist=True)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001  (CheckpointException is a BaseException)
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]  # DCP's: a traceback per rank
        reason = lines[-1][:160] if lines else ""
        return [f"{_what(key)}: unreadable ({type(exc).__name__}: {reason})"]
    problems = []
    for chunk in metadata.chunks:
        offset = tuple(chunk.offsets)
        expected, read = digests.get(key, {}).get(offset), planner.read.get((key, offset))
        where = f"{_what(key)}, chunk at {list(offset)}"
        if expected is None:
            problems.append(f"{where}: no sha256 was recorded for it at save")
        elif read is None or read[0] != tuple(chunk.sizes) or not read[2]:
            problems.append(f"{where}: not read whole (DCP read {read and list(read[0])} of {list(chunk.sizes)})")
        elif read[1] != expected:
            problems.append(f"{where}: sha256 {read[1][:16]}... is not the {expected[:16]}... recorded at save "
                            "(its bytes changed: a corrupt or altered file)")
    if problems:
        return problems
    bad = unusable(key, full)
    return [f"{_what(key)}: {bad} values are NaN, infinite or negative (codes no save writes)"] if bad else []


def verify(path: str | os.PathLike, state: dict[str, Any]) -> list[str]:
    """What is wrong with the entries of ``state`` (``checkpoint_state``) in the checkpoint at ``path``: sha256
    mismatches, chunks without a digest, unreadable data, unusable values (module docstring). This rank checks every
    ``world``-th entry; combine the verdicts with ``_agree``. Reads the checkpoint, writes nothing."""
    path = os.fspath(path)
    digests = read_digests(path)
    metadata = dist_cp.FileSystemReader(path).read_metadata().state_dict_metadata
    rank, world = _rank_and_world()
    keys = [key for key, value in state.items() if torch.is_tensor(value)]
    return [problem for key in keys[rank::world] for problem in _verify_entry(path, key, metadata[key], digests)]


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
    before anything is written if ``check_compatible`` or ``verify`` (sha256 of every saved chunk, usable values)
    fails on any rank, and put back as it was if writing fails part-way.

    Trust: torch unpickles the checkpoint's ``.metadata`` (module docstring): load only checkpoints from a trusted
    source; the sha256 digests catch corruption, not a crafted checkpoint."""
    path = os.fspath(path)
    fresh = [] if optimizer is None else [t for group in optimizer.param_groups for t in group["params"]
                                          if not optimizer.state.get(t)]
    if optimizer is not None:
        ensure_state(optimizer)
    try:
        state = checkpoint_state(model, optimizer)
        unsaved = [] if optimizer is None else _unsaved_state(path, model, optimizer, state)
        check_compatible(path, state)
        extras = None if optimizer is None else read_extras(path)
        problems = verify(path, state)
        if _agree(bool(problems)):
            raise ValueError(f"checkpoint {path} is refused, nothing was loaded:\n  "
                             + ("\n  ".join(problems[:10]) if problems else "a problem found on another rank (see "
                                                                             "its error)"))
    except BaseException:
        _drop_state(optimizer, fresh)
        raise
    snapshot = TensorSnapshot(_local(v) for v in state.values() if torch.is_tensor(v))
    dropped: dict[torch.Tensor, Any] = {}
    try:
        failure = None
        try:
            one = _rank_and_world()[1] == 1
            with _one_process() if one else contextlib.nullcontext():
                dist_cp.load(state, checkpoint_id=path, no_dist=one)
        except BaseException as exc:  # CheckpointException is a BaseException
            failure = exc
        if _agree(failure is not None):
            raise failure if failure is not None else RuntimeError("the load failed on another rank")
        if optimizer is not None:
            dropped = {t: optimizer.state.pop(t) for t in unsaved if t in optimizer.state}
            optimizer.load_state_dict({**optimizer.state_dict(), **extras})
    except BaseException as exc:
        snapshot.restore()
        for t, own in dropped.items():
            optimizer.state[t] = own
        _drop_state(optimizer, fresh)
        _mark_written(model)
        if isinstance(exc, KeyboardInterrupt | SystemExit | ValueError):
            raise
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]  # DCP's: a traceback per rank
        raise RuntimeError(f"loading checkpoint {path} failed part-way ({type(exc).__name__}: "
                           f"{lines[-1] if lines else ''}); the model and optimizer were put back as they were: "
                           "nothing was loaded") from exc
    _mark_written(model)


def _unsaved_state(path: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                   state: dict[str, Any]) -> list[torch.Tensor]:
    """The optimizer's parameters (as its ``state`` keys them) that had no state when the checkpoint was saved (DGR's
    interleaved mode: a group delayed by g steps has not stepped in the first g), with their entries taken out of
    ``state``: the load leaves them without state, as the saved optimizer was."""
    saved = dist_cp.FileSystemReader(path).read_metadata().state_dict_metadata
    keys = _optimizer_keys(model, optimizer)
    unsaved = []
    for group in optimizer.param_groups:
        for t in group["params"]:
            prefix = f"{OPTIM_PREFIX}{keys[id(t)][0]}."
            entries = [key for key in state if key.startswith(prefix) and "." not in key.removeprefix(prefix)]
            if entries and not any(key in saved for key in entries):
                unsaved.append(t)
                for key in entries:
                    del state[key]
    return unsaved


def _drop_state(optimizer: torch.optim.Optimizer | None, params: list[torch.Tensor]) -> None:
    """Drop the state ``ensure_state`` gave ``params`` (a load that did not happen leaves none)."""
    for p in params:
        optimizer.state.pop(p, None)


def _mark_written(model: nn.Module) -> None:
    for p in model.parameters():
        local = _local(p)
        if isinstance(local, MVASWeight):
            local.mark_written()
