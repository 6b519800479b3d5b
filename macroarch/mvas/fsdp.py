"""MVAS on FSDP2: managed weights sharded, all-gathered and held in their packed form (issue 18, post section 3.2
with the C5 ZeRO-3 synchronisation cost in view).

``fully_shard(module, ...)`` is ``torch.distributed.fsdp.fully_shard`` for a module whose weights are
``MVASWeight`` s (``macroarch.mvas.tensor``). It checks that every managed weight can be cut into its ranks'
dim-0 shards at whole blocks, then lets FSDP2 shard it; the storage operations FSDP2 applies on the way
(``chunk``/``split``/``narrow`` on dim 0, ``new_zeros``, ``copy_``, ``view``, ``as_strided``) work on the packed
storage itself, so each rank's sharded parameter is a ``DTensor`` whose local tensor is an ``MVASWeight`` holding
that rank's run of the payload and its block scales, bit for bit those of the unsharded weight.

Through FSDP2's tensor-subclass extension points (the mechanism of torchao's fp8 all-gather):

- ``pre_all_gather`` (``MVASWeight.fsdp_pre_all_gather``): the all-gather inputs are the shard's **payload and
  scales**, flat; FSDP2 packs them (as bytes, dtypes differing) into its one all-gather per group, so the
  bytes on the wire are the packed bytes (fp8: 1 + 4/block bytes per element, fp4: 0.5 + 4/block);
- ``post_all_gather``: the gathered payload and scales become the unsharded weight, an ``MVASWeight`` in the
  compute dtype (FSDP2's ``MixedPrecisionPolicy.param_dtype`` when set), **dequantised on every read** as any
  managed weight is; FSDP2 frees and re-fills the gathered storage each step and the weight keeps reading it.

Gradients are FSDP2's: dense, reduce-scattered in the compute (or ``reduce_dtype``) dtype. ``MVASAdamW`` updates
each rank's local shard (``p.to_local()``, an ``MVASWeight``) in place, which the next all-gather reads; its moments
are the shard's size, quantised and kept on that rank.

Deviations and limits: shards must be even (dim 0 divisible by the world size: FSDP2 pads uneven shards to the
padded *outer* size, which a packed all-gather input cannot have) and whole blocks (rows per shard x row
length a multiple of the block size, and even for fp4); a weight with one scale for the whole tensor cannot be
sharded. ``fully_shard`` refuses either with a ValueError naming the weight; ``torch``'s own ``fully_shard`` on
managed weights refuses them as non-contiguous (use this one). ``reshard_after_forward`` as an int (resharding
to a smaller mesh) is not supported for packed weights (FSDP2 raises NotImplementedError).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from macroarch.mvas import tensor as _tensor
from macroarch.mvas.formats import get_format
from macroarch.mvas.tensor import MVASWeight

__all__ = ["check_shardable", "fully_shard", "local_tensor", "post_all_gather", "pre_all_gather",
           "shard_problem", "sharding"]


@contextlib.contextmanager
def sharding() -> Iterator[None]:
    """While FSDP2 shards managed weights: they report ``is_contiguous()`` (the storage is what is sharded) and
    ``new_zeros`` / ``new_empty`` give packed zero weights (FSDP2's padded shard buffers)."""
    previous = _tensor._SHARDING
    _tensor._SHARDING = True
    try:
        yield
    finally:
        _tensor._SHARDING = previous


def shard_problem(name: str, weight: MVASWeight, world_size: int) -> str | None:
    """Why ``weight`` cannot be sharded on dim 0 over ``world_size`` ranks at whole blocks, or None if it can."""
    what = f"MVAS weight {name!r} ({weight.format}, block {weight.block_size}, shape {tuple(weight.shape)})"
    if weight.is_view:
        return f"{what} is a view; shard the weight itself"
    if weight.dim() == 0 or weight.shape[0] % world_size:
        return (f"{what}: dim 0 must divide evenly over the {world_size} ranks (packed shards cannot be padded); "
                "pick a world size that divides it, or keep this tensor dense in the plan")
    numel = weight.numel()
    shard = numel // world_size
    unit = weight.write_unit
    if world_size > 1 and (unit == numel or shard % unit):
        block = weight.block_size or numel
        return (f"{what}: each rank's shard of {shard} elements must be whole blocks of {block}"
                f"{' and whole bytes' if weight.format == 'fp4_e2m1' else ''}; pick a block size that divides "
                f"{shard} (the shard's row count x row length), or keep this tensor dense in the plan")
    return None


def check_shardable(module: nn.Module, world_size: int) -> None:
    """Raise ValueError naming every managed weight of ``module`` that FSDP2 cannot shard over ``world_size``
    ranks in packed form (``shard_problem``)."""
    problems = [problem for name, p in module.named_parameters() if type(p) is MVASWeight
                if (problem := shard_problem(name, p, world_size)) is not None]
    if problems:
        raise ValueError("cannot shard these managed weights with FSDP2:\n  " + "\n  ".join(problems))


def fully_shard(module: nn.Module, **kwargs: Any) -> nn.Module:
    """``torch.distributed.fsdp.fully_shard(module, **kwargs)`` for a module with managed weights: checked by
    ``check_shardable`` against the mesh's size first, then sharded in packed form (``sharding``)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = kwargs.get("mesh")
    if mesh is None:
        world_size = torch.distributed.get_world_size()
    else:
        world_size = mesh.size(-1) if mesh.ndim > 1 else mesh.size()  # HSDP shards over the last dimension
    check_shardable(module, world_size)
    with sharding():
        return torch_fully_shard(module, **kwargs)


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """The rank's own tensor of a parameter: a DTensor's local shard (an ``MVASWeight`` for a managed weight), or
    the parameter itself."""
    return getattr(p, "_local_tensor", p)


# ---------------------------------------------------------------------------------------- extension points
def pre_all_gather(weight: MVASWeight, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...],
                   module: nn.Module, mp_policy: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
    """The all-gather inputs of a rank's shard: its flat payload and (for scaled formats) scales, and the metadata
    ``post_all_gather`` needs (format, block size, the unsharded shape)."""
    if weight.is_view:
        raise TypeError(f"FSDP2 all-gathers a view of an MVAS weight ({weight!r}); the sharded parameter must be "
                        "the shard itself (shard with macroarch.mvas.fsdp.fully_shard)")
    world_size = mesh.size()
    problem = shard_problem("(sharded)", _unsharded_meta(weight, outer_size), world_size)
    if problem is not None:  # reached only by sharding through torch's fully_shard without the checks
        raise ValueError(problem)
    inputs = (weight.payload,) if weight.scales is None else (weight.payload, weight.scales)
    return inputs, (weight.format, weight.block_size, tuple(outer_size))


def post_all_gather(weight: MVASWeight, outputs: tuple[torch.Tensor, ...], metadata: Any, param_dtype: torch.dtype,
                    *, out: torch.Tensor | None = None) -> Any:
    """The unsharded weight on the gathered payload and scales (FSDP2 owns their storage: it frees it after use
    and re-fills it at the next all-gather, which the weight, built once, then reads; ``out`` is that weight)."""
    fmt, block, shape = metadata
    if out is not None:
        inner = getattr(out, "payload", None)
        if inner is None or inner.untyped_storage().data_ptr() != outputs[0].untyped_storage().data_ptr():
            raise RuntimeError("FSDP2 re-gathered an MVAS weight into storage the unsharded weight does not read")
        return None
    payload = outputs[0].reshape(-1)
    scales = outputs[1].reshape(-1) if len(outputs) > 1 else None
    unsharded = MVASWeight(payload, scales, fmt, block, shape, param_dtype)
    return unsharded, tuple(t for t in (payload, scales) if t is not None)


def _unsharded_meta(weight: MVASWeight, shape: torch.Size) -> MVASWeight:
    """A stand-in of the unsharded weight (meta storage) for the shard checks."""
    fmt = get_format(weight.format)
    numel = math.prod(shape)
    payload = torch.empty((numel + 1) // 2 if fmt.name == "fp4_e2m1" else numel, dtype=fmt.storage_dtype,
                          device="meta")
    scales = None
    if fmt.block_scaled:
        scales = torch.empty(1 if weight.block_size is None else numel // weight.block_size, device="meta")
    return MVASWeight(payload, scales, weight.format, weight.block_size, tuple(shape), weight.dtype)
