"""MVAS on FSDP2: managed weights sharded, all-gathered and held in their packed form (post section 3.2 with the C5
ZeRO-3 synchronisation cost in view).

``fully_shard(module, ...)`` is ``torch.distributed.fsdp.fully_shard`` for a module whose weights are
``MVASWeight`` s (``macroarch.mvas.packed.weight``). It checks that every managed weight can be cut into its ranks'
dim-0 shards at whole blocks, then lets FSDP2 shard it; the storage operations FSDP2 applies on the way
(``chunk``/``split``/``narrow`` on dim 0, ``new_zeros``, ``copy_``, ``view``, ``as_strided``) work on the packed
storage itself, so each rank's sharded parameter is a ``DTensor`` whose local tensor is an ``MVASWeight`` holding
that rank's run of the payload and its block scales, bit for bit those of the unsharded weight.

Through FSDP2's tensor-subclass extension points, methods of ``MVASWeight`` (the mechanism of torchao's fp8
all-gather):

- ``MVASWeight.fsdp_pre_all_gather``: the all-gather inputs are the shard's **payload and
  scales**, flat; FSDP2 packs them (as bytes, dtypes differing) into its one all-gather per group, so the
  bytes on the wire are the packed bytes (fp8: 1 + 4/block bytes per element, fp4: 0.5 + 4/block);
- ``MVASWeight.fsdp_post_all_gather``: the gathered payload and scales become the unsharded weight, an ``MVASWeight``
  in the
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

from typing import Any

import torch
from torch import nn

from macroarch.mvas.packed.weight import MVASWeight, shard_problem, sharding
from macroarch.optim.functional import local

__all__ = ["check_shardable", "fully_shard", "local_tensor", "shard_problem", "sharding"]


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
    the parameter itself. Read without autograd: ``DTensor.to_local()`` then hands back the shard itself, not a
    differentiable view of it."""
    with torch.no_grad():
        return local(p)
