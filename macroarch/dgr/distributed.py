"""DGR under DDP and FSDP2: each group steps as soon as its gradients are *reduced* (issue 18, post section 3.1).

DGR (``macroarch.dgr.pipeline``) steps a group's optimizer inside backward, from the post-accumulate-grad hook
of the group's last gradient. Across processes that hook fires too early: the gradient is still this rank's
own. Here the group steps once every one of its gradients has been averaged by the data-parallel engine the
user trains with, so DGR-sync gives exactly the weights that the engine with a plain optimizer step gives:

- **DDP** (``data_parallel``): a DDP communication hook (``register_comm_hook``) replaces DDP's all-reduce
  with the same one (divide the bucket by the world size, ``all_reduce`` SUM: DDP's own arithmetic, so the
  averages are bitwise DDP's). A bucket's all-reduce is launched as DDP launches it, and waited for when the
  next bucket is ready (so it still overlaps the backward of the layers in between) or at the end of
  backward; then its parameters are handed to the DGR optimizer as arrived, and every group whose
  parameters have all arrived steps. The DGR optimizer's own gradient hooks are removed (``close()``).
- **FSDP2** (``fully_shard_groups``): ``fully_shard`` runs the post-accumulate-grad hooks of each *sharded*
  parameter after its group's reduce-scatter has written the averaged shard into ``.grad`` (torch's
  optimizer-in-backward contract; on CUDA inside the post-reduce stream, so a step is ordered after the
  reduction). So the DGR optimizer is simply built on the sharded parameters: the groups, found by name
  on the model before sharding (``regroup``), step on their local shards (DTensors) right after their
  last FSDP unit is reduced. By default each block of the grouping's repeated stacks is its own FSDP unit
  and the root holds the rest.

Failures: a peer that dies makes a collective fail (gloo: the closed connection, at once; a silent peer: the
process group's timeout, or ``timeout=`` here for DDP's buckets); under DDP the error names the bucket, the
rank and the cause. Nothing waits forever.

The ``macroarch.comm.GradientBucketer`` (our own bucketed all-reduce) remains for the C9 measurements only
(bucket sizes and windows the post prescribes); training across processes goes through DDP or FSDP2 here.

Limits and deviations: ``accumulation_steps`` must be 1 (with DDP's ``no_sync`` or FSDP2's
``set_requires_gradient_sync(False)`` the reduction, and so DGR's hooks, skip the micro-steps; that
bookkeeping is not done); DDP with ``find_unused_parameters`` is not supported; the memory DGR saves by
releasing gradients is not saved under DDP, whose buckets hold every gradient anyway. Tested on gloo (CPU):
sync mode with ``torch.optim.AdamW`` and ``CompensatedAdamW``; interleaved mode under DDP and FSDP2 against one
process on the global batch (equal to rounding, replicas bitwise equal), also with ``gradient_as_bucket_view=True``,
whose ``.grad`` views into DDP's buckets are copied before they are queued (``pipeline._owned``: the next pass
overwrites the buckets; before the copy, the queued gradients silently became the next step's).
The DDP path hands gradients to ``DGROptimizer._grad_ready`` (same package): its public twin would be a
one-line ``DGROptimizer.grad_ready``.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from macroarch._compat.autograd import at_backward_end, backward_pass_id
from macroarch.dgr.grouping import Grouping
from macroarch.dgr.pipeline import DGROptimizer
from macroarch.dgr.wrapper import DGRWrapper

STRATEGIES = ("ddp", "fsdp2")


@dataclass
class DistributedDGR:
    """What a training loop needs after ``data_parallel`` / ``fully_shard_groups``.

    Attributes:
        model: what the loop calls: the ``DistributedDataParallel`` module, or the (sharded) ``DGRWrapper``.
        wrapper: the ``DGRWrapper`` (its ``module`` is the user's model).
        optimizer: the ``DGROptimizer``: ``loss.backward(); optimizer.step(); optimizer.zero_grad()``.
        strategy: ``"ddp"`` or ``"fsdp2"``.
        ddp_steps: the DDP hook's state (buckets reduced so far), None under FSDP2.
    """

    model: nn.Module
    wrapper: DGRWrapper
    optimizer: DGROptimizer
    strategy: str
    ddp_steps: DDPGroupSteps | None = None


def regroup(grouping: Grouping, module: nn.Module) -> Grouping:
    """``grouping``'s groups over ``module``'s *current* parameters, matched by name: after ``fully_shard``
    replaced the parameters by sharded ones, the groups found on the unsharded model still hold."""
    current = dict(module.named_parameters(remove_duplicate=False))
    missing = [n for g in grouping for n in g.names if n not in current]
    if missing:
        raise ValueError(f"regroup: {len(missing)} parameter name(s) of the grouping are not parameters of "
                         f"{type(module).__name__}: {missing[:5]}; group the same model (before wrapping it)")
    groups = tuple(dataclasses.replace(g, params=tuple(current[n] for n in g.names)) for g in grouping)
    return dataclasses.replace(grouping, groups=groups)


def _check_ready(wrapper: DGRWrapper, where: str) -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{where}: torch.distributed is not initialised: call init_process_group('gloo' or "
                           "'nccl') first (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)")
    if not isinstance(wrapper, DGRWrapper):
        raise ValueError(f"{where}: wrapper={type(wrapper).__name__} must be a DGRWrapper")
    if wrapper.grouping is None:
        raise ValueError(f"{where}: the DGRWrapper has no groups yet; pass example_inputs= (or loss_fn=) to it, or "
                         "call build_groups(example), before distributing it")
    if wrapper.has_optimizer:
        raise ValueError(f"{where}: the DGRWrapper already has an optimizer, whose hooks would step on unreduced "
                         "gradients; let this function build it (pass optimizer_cls and its arguments)")
    if wrapper.pipeline_config.accumulation_steps != 1:
        raise ValueError(f"{where}: accumulation_steps={wrapper.pipeline_config.accumulation_steps} is not "
                         "supported across processes (only 1): accumulate in the batch, or train without DGR")


class DDPGroupSteps:
    """State of the DDP communication hook that steps DGR groups once their buckets are all-reduced.

    Args:
        ddp: a ``DistributedDataParallel`` around the DGRWrapper whose optimizer is ``optimizer``.
        optimizer: the ``DGROptimizer``; its own gradient hooks are removed.
        timeout: seconds to wait for one bucket's all-reduce (None: the process group's timeout).

    Attributes:
        buckets_reduced: all-reduces completed since construction.
    """

    def __init__(self, ddp: nn.parallel.DistributedDataParallel, optimizer: DGROptimizer,
                 timeout: float | None = None) -> None:
        import torch.distributed as dist

        self.optimizer = optimizer
        self.process_group = ddp.process_group
        self.rank, self.world_size = dist.get_rank(self.process_group), dist.get_world_size(self.process_group)
        self.timeout = None if timeout is None else datetime.timedelta(seconds=timeout)
        self.buckets_reduced = 0
        self._pending: collections.deque = collections.deque()  # (bucket index, params, grads, work)
        self._task = -1
        optimizer.close()
        ddp.register_comm_hook(self, _ddp_hook)

    def _launch(self, bucket: Any) -> torch.futures.Future:
        import torch.distributed as dist

        task = backward_pass_id()
        if task != self._task:  # the first bucket of a new backward pass
            self._task = task
            self._pending.clear()  # left only by a backward pass that failed
            at_backward_end(self._drain)
        buffer = bucket.buffer()
        buffer.div_(self.world_size)  # DDP's order: divide, then sum (no fp16 overflow)
        work = dist.all_reduce(buffer, group=self.process_group, async_op=True)
        self._drain()  # the buckets launched before this one: overlapped with backward until now
        self._pending.append((bucket.index(), bucket.parameters(), bucket.gradients(), work))
        return work.get_future().then(lambda fut: fut.value()[0])

    def _drain(self) -> None:
        """Wait for the pending all-reduces, in launch order, and let the groups they complete step."""
        while self._pending:
            index, params, grads, work = self._pending.popleft()
            try:
                work.wait() if self.timeout is None else work.wait(self.timeout)
            except Exception as exc:
                self._pending.clear()
                raise RuntimeError(f"DGR under DDP: the all-reduce of bucket {index} failed on rank {self.rank} of "
                                   f"{self.world_size} ({type(exc).__name__}: {str(exc)[:300]}); a peer rank has "
                                   "probably died, stalled or run different collectives") from exc
            self.buckets_reduced += 1
            with torch.no_grad():
                for p, g in zip(params, grads):
                    if p.grad is None:
                        continue  # no gradient here (DDP's unused parameter): step() updates its group
                    if p.grad.data_ptr() != g.data_ptr():  # not gradient_as_bucket_view: p.grad is the local one
                        p.grad.copy_(g)
                    self.optimizer._grad_ready(p)


def _ddp_hook(state, bucket):  # no annotations: DDP compares them with the classes, not strings
    return state._launch(bucket)


def data_parallel(wrapper: DGRWrapper, optimizer_cls: Callable[..., torch.optim.Optimizer], *,
                  process_group: Any = None, timeout: float | None = None, ddp_kwargs: dict[str, Any] | None = None,
                  **optimizer_kwargs: Any) -> DistributedDGR:
    """DDP around ``wrapper`` and its DGR optimizer (``optimizer_cls(**optimizer_kwargs)`` per group), whose
    groups step once their DDP buckets are all-reduced (module docstring). ``ddp_kwargs`` go to
    ``DistributedDataParallel`` (``device_ids`` defaults to the parameters' CUDA device)."""
    _check_ready(wrapper, "data_parallel")
    ddp_kwargs = dict(ddp_kwargs or {})
    if ddp_kwargs.get("find_unused_parameters"):
        raise ValueError("data_parallel: find_unused_parameters=True is not supported with DGR")
    device = next(wrapper.parameters()).device
    if device.type == "cuda":
        ddp_kwargs.setdefault("device_ids", [device.index])
    ddp = nn.parallel.DistributedDataParallel(wrapper, process_group=process_group, **ddp_kwargs)
    optimizer = wrapper.optimizer(optimizer_cls, **optimizer_kwargs)
    steps = DDPGroupSteps(ddp, optimizer, timeout=timeout)
    return DistributedDGR(ddp, wrapper, optimizer, "ddp", steps)


def shard_blocks(module: nn.Module, blocks: list[str], shard: Callable[..., Any] | None = None,
                 **fully_shard_kwargs: Any) -> None:
    """FSDP2's usual plan: every block (a submodule name) its own unit, then the root (the rest), each through
    ``shard`` (default ``torch.distributed.fsdp.fully_shard``; ``macroarch.mvas.interop.fsdp.fully_shard`` for managed
    weights)."""
    if shard is None:
        from torch.distributed.fsdp import fully_shard as shard
    for name in blocks:
        shard(module.get_submodule(name), **fully_shard_kwargs)
    shard(module, **fully_shard_kwargs)


def fully_shard_groups(wrapper: DGRWrapper, optimizer_cls: Callable[..., torch.optim.Optimizer], *,
                       mesh: Any = None, shard: Callable[[nn.Module], None] | None = None,
                       reshard_after_forward: bool = True, **optimizer_kwargs: Any) -> DistributedDGR:
    """Shard ``wrapper.module`` with FSDP2 and build its DGR optimizer on the sharded parameters, so that each
    group steps after its reduce-scatter (module docstring).

    Args:
        wrapper: a DGRWrapper whose groups were built on the unsharded model, without an optimizer yet.
        optimizer_cls, optimizer_kwargs: the per-group optimizer (it must accept DTensor parameters).
        mesh: the device mesh (None: FSDP2's default, all ranks).
        shard: ``shard(module)`` applying ``fully_shard`` your way; default: each block, then the root. A
            model sharded already (any ``FSDPModule`` inside) is used as it is.
        reshard_after_forward: passed to ``fully_shard`` by the default plan.
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    _check_ready(wrapper, "fully_shard_groups")
    module = wrapper.module
    if not any(isinstance(m, FSDPModule) for m in module.modules()):
        if shard is not None:
            shard(module)
        else:
            kwargs = {"reshard_after_forward": reshard_after_forward} | ({} if mesh is None else {"mesh": mesh})
            shard_blocks(module, [name for stack in wrapper.grouping.stacks for name in stack], **kwargs)
    grouping = regroup(wrapper.grouping, module)
    plain = [n for g in grouping for n, p in zip(g.names, g.params) if not isinstance(p, DTensor)]
    if plain:
        raise ValueError(f"fully_shard_groups: {len(plain)} parameter(s) are not sharded by FSDP2 (not DTensors): "
                         f"{plain[:5]}; the shard function must cover the whole model (fully_shard the root last)")
    wrapper.grouping = grouping
    return DistributedDGR(wrapper, wrapper, wrapper.optimizer(optimizer_cls, **optimizer_kwargs), "fsdp2")


__all__ = ["STRATEGIES", "DDPGroupSteps", "DistributedDGR", "data_parallel", "fully_shard_groups", "regroup",
           "shard_blocks"]
