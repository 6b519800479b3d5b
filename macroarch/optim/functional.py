"""The AdamW step, written once (Loshchilov & Hutter 2019; the post's optimizer, sections 4.1 and 5.1).

Every optimizer of this project runs this arithmetic: ``CompensatedAdamW`` (and ``MasterWeightAdamW``, which is
it with ``master_weights=True``) on the parameters or their fp32 master copies, ``MVASAdamW`` on the values it
decodes from packed storage (``macroarch.mvas._kernels``, eager or compiled by ``torch.compile``). What differs
between them is storage, never the math (torchao's ``single_param_adam`` is the model).

- ``check_hyperparameters``: the one argument check (``lr``, ``betas``, ``eps``, ``weight_decay``), errors naming
  the bad value;
- ``adamw_scalars``: the per-step scalars (bias corrections, step size), computed in Python floats as torch does;
- ``adamw_update_``: the elementwise update, in place, op for op ``torch.optim.AdamW``'s single-tensor path
  (``torch.optim.adam._single_tensor_adam`` with decoupled weight decay), so a call on the tensors torch would
  update is bitwise torch's result; it takes the scalars as arguments, so a compiled caller passes them as
  graph inputs (no recompilation when the step or the learning rate changes);
- ``adamw_step_``: one tensor's step from the hyperparameters;
- ``local``: the local shard of a ``DTensor`` (FSDP2 parameters and gradients), other tensors as they are;
- ``agree`` and ``all_finite``: an optimizer's per-step decision (skip or step, the gradient norm of a loss scale)
  the same on every rank. Under FSDP2 a rank sees only its shards of the gradients: an inf in rank 1's shard must
  skip the step on rank 0 too, or the ranks' step counters and weights part silently. When a parameter is a
  ``DTensor``, the local verdict (flags, squared norms) is summed over its ``device_mesh`` with one ``all_reduce``
  of a few float64 numbers per distinct mesh (FSDP2: one) per step; without DTensors nothing is communicated
  (DDP's gradients are already the same on every rank).

Deviations from ``torch.optim.AdamW``: no amsgrad, maximize, capturable or differentiable modes; the math is
computed in the dtype of the tensors given (callers pass fp32 views or masters; with 16-bit tensors it is, like
torch's, 16-bit storage between ops).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import torch

__all__ = ["AdamWScalars", "Agreement", "adamw_scalars", "adamw_step_", "adamw_update_", "agree", "all_finite",
           "finite_checked",
           "check_hyperparameters", "device_meshes", "local", "locally_finite", "owned_params"]


def _number(name: str, value: Any, *, hi: float | None = None) -> float:
    """``value`` as a float in ``[0, hi)`` (``[0, inf)`` without ``hi``), or a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r} must be a finite number")
    if value < 0 or (hi is not None and value >= hi):
        raise ValueError(f"{name}={value!r} must lie in [0, {hi:g})" if hi is not None else
                         f"{name}={value!r} must be >= 0")
    return float(value)


def check_hyperparameters(lr: Any, betas: Any, eps: Any, weight_decay: Any,
                          where: str = "") -> tuple[float, tuple[float, float], float, float]:
    """``(lr, (beta1, beta2), eps, weight_decay)`` as floats, or a ValueError naming the bad one (prefixed by
    ``where``, e.g. ``"param_groups[1]"``): ``lr``, ``eps``, ``weight_decay`` >= 0, both betas in [0, 1)."""
    prefix = f"{where}['" if where else ""
    suffix = "']" if where else ""
    lr = _number(f"{prefix}lr{suffix}", lr)
    if not (isinstance(betas, tuple | list) and len(betas) == 2):
        raise ValueError(f"{prefix}betas{suffix}={betas!r} must be a pair (beta1, beta2)")
    betas = (_number(f"{prefix}betas{suffix}[0]", betas[0], hi=1.0),
             _number(f"{prefix}betas{suffix}[1]", betas[1], hi=1.0))
    return lr, betas, _number(f"{prefix}eps{suffix}", eps), _number(f"{prefix}weight_decay{suffix}", weight_decay)


class AdamWScalars(NamedTuple):
    """The scalars of one AdamW step at step ``t``: Python floats, computed as ``torch.optim.AdamW`` computes them,
    each the value one op of ``adamw_update_`` takes."""

    decay: float  # 1 - lr * weight_decay: the decoupled weight decay factor
    avg_weight: float  # 1 - beta1: the lerp weight of the first moment
    beta2: float
    sq_weight: float  # 1 - beta2
    eps: float
    neg_step_size: float  # -lr / (1 - beta1^t)
    bias_correction2_sqrt: float  # (1 - beta2^t) ** 0.5


def adamw_scalars(step: float, lr: float, beta1: float, beta2: float, eps: float,
                  weight_decay: float) -> AdamWScalars:
    """The scalars of step ``step`` (1 for the first update), each computed as ``torch.optim.AdamW`` does."""
    return AdamWScalars(1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, eps, -(lr / (1 - beta1 ** step)),
                        (1 - beta2 ** step) ** 0.5)


def adamw_update_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                  decay: float, avg_weight: float | torch.Tensor, beta2: float, sq_weight: float, eps: float,
                  neg_step_size: float, bias_correction2_sqrt: float, *, decay_always: bool = True) -> None:
    """One AdamW update of ``param``, ``exp_avg`` and ``exp_avg_sq`` in place, from ``adamw_scalars``' values
    (``avg_weight`` may be a 0-d tensor of ``param``'s dtype: a compiled kernel cannot branch on a symbolic lerp
    weight). ``decay_always=False`` skips the multiplication by a ``decay`` of exactly 1 (as torch does without
    weight decay; the product is the same, the pass is saved)."""
    if decay_always or decay != 1.0:
        param.mul_(decay)
    exp_avg.lerp_(grad, avg_weight)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=sq_weight)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=neg_step_size)


def adamw_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                step: float, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """AdamW step ``step`` (already counted: 1 for the first) of one tensor, in place: bitwise
    ``torch.optim.AdamW`` (single-tensor path) on the same tensors."""
    scalars = adamw_scalars(step, lr, beta1, beta2, eps, weight_decay)
    adamw_update_(param, grad, exp_avg, exp_avg_sq, *scalars, decay_always=False)


def owned_params(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor] | None) -> list[torch.Tensor]:
    """``params`` (default: every parameter of ``optimizer``), each checked to be one of ``optimizer``'s: the
    selection of an optimizer's ``init_state(params)``."""
    mine = [p for group in optimizer.param_groups for p in group["params"]]
    if params is None:
        return mine
    params, known = list(params), {id(p) for p in mine}
    for p in params:
        if id(p) not in known:
            raise ValueError(f"init_state: a tensor of shape {tuple(p.shape)} is not a parameter of this optimizer")
    return params


def local(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """The local shard of a ``DTensor`` (``to_local()``, which shares its storage), any other tensor (or None)
    as it is: optimizers update the shard a rank holds and keep their state local."""
    if type(tensor) is not torch.Tensor and tensor is not None and hasattr(tensor, "to_local") \
            and hasattr(tensor, "device_mesh"):
        return tensor.to_local()
    return tensor


# ------------------------------------------------------------------------------ decisions across ranks (FSDP2)
def _is_dtensor(tensor: Any) -> bool:
    return tensor is not None and hasattr(tensor, "to_local") and hasattr(tensor, "device_mesh")


def device_meshes(tensors: Iterable[torch.Tensor | None]) -> list[Any]:
    """The distinct device meshes of the ``DTensor`` s among ``tensors``, in first-seen order (FSDP2's parameters
    share one; other tensors have none)."""
    meshes: list[Any] = []
    for t in tensors:
        if _is_dtensor(t) and not any(t.device_mesh is m or t.device_mesh == m for m in meshes):
            meshes.append(t.device_mesh)
    return meshes


def _replicas(param: Any) -> int:
    """Ranks of ``param``'s mesh holding each element of its local shard (the sizes of its Replicate dimensions):
    a squared norm summed over the mesh counts every copy, so each is weighted ``1 / replicas``."""
    replicas = 1
    for dim, placement in enumerate(param.placements):
        if placement.is_partial():
            raise ValueError(f"a gradient of a DTensor with placements {param.placements} is a partial sum on "
                             f"mesh dim {dim}: its norm needs the reduced gradient (reduce it first)")
        if placement.is_replicate():
            replicas *= param.device_mesh.size(dim)
    return replicas


def _sum_over(mesh: Any, values: torch.Tensor) -> torch.Tensor:
    """``values`` summed over every rank of ``mesh`` (one all_reduce per mesh dimension; 1-D meshes: one)."""
    import torch.distributed as dist

    values = values.to(mesh.device_type)
    for dim in range(mesh.ndim):
        dist.all_reduce(values, op=dist.ReduceOp.SUM, group=mesh.get_group(dim))
    return values.cpu()


class Agreement(NamedTuple):
    """One step's decision, the same on every rank of the parameters' meshes."""

    flags: tuple[bool, ...]  # each flag given: True if it is True on any rank
    norm: float  # the 2-norm of the whole gradients given (across their shards); 0.0 when none were given


def agree(flags: Sequence[bool], over: Iterable[torch.Tensor | None],
          grads: Iterable[tuple[torch.Tensor, torch.Tensor]] = ()) -> Agreement:
    """The decision of one optimizer step from each rank's view, identical on every rank.

    Args:
        flags: local verdicts (a non-finite value seen, a skip requested); each comes back True if any rank's is.
        over: the optimizer's parameters: the meshes of the ``DTensor`` s among them are those summed over; none
            (no DTensor): nothing is communicated, the flags come back as given.
        grads: ``(gradient, parameter)`` pairs (the gradient local or a DTensor) whose 2-norm is wanted: each
            tensor's norm in fp32, squared and summed in float64, the shards of a DTensor parameter's gradient summed
            over its mesh (a replicated one counted once), so it is the norm of the whole gradient. Without
            DTensors it is ``sqrt(sum(norm(g) ** 2))`` (``CompensatedAdamW.global_grad_norm``). inf/NaN propagate.

    Every rank must call it at the same step with the same parameters (it is a collective when ``over`` holds
    DTensors): callers call it once per update, whatever their local verdict.
    """
    grads = list(grads)
    meshes = device_meshes([*over, *(p for _, p in grads)])
    if not meshes:
        total = 0.0
        for g, _ in grads:
            total += float(torch.linalg.vector_norm(g, dtype=torch.float32)) ** 2
        return Agreement(tuple(bool(f) for f in flags), math.sqrt(total))
    squares = [0.0] * (len(meshes) + 1)  # per mesh, then the plain (same on every rank) gradients
    for g, p in grads:
        square = float(torch.linalg.vector_norm(local(g), dtype=torch.float32)) ** 2
        if _is_dtensor(p):
            index = next(i for i, m in enumerate(meshes) if p.device_mesh is m or p.device_mesh == m)
            squares[index] += square / _replicas(p)
        else:
            squares[-1] += square
    total, anywhere = squares[-1], [False] * len(flags)
    for index, mesh in enumerate(meshes):
        summed = _sum_over(mesh, torch.tensor([squares[index], *(float(bool(f)) for f in flags)],
                                              dtype=torch.float64)).tolist()
        total += summed[0]
        anywhere = [a or s > 0 for a, s in zip(anywhere, summed[1:])]
    return Agreement(tuple(anywhere), math.sqrt(total))


def locally_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every element of every (local) tensor is finite, with one synchronisation: each tensor's sum, in
    float32 for fp16 (whose own sum would overflow at 65504), then the sum of those sums, read once (inf and NaN
    propagate into a sum, which needs no temporary; a sum that overflows float32, elements near 1e36 and beyond,
    counts as non-finite). One op per tensor and one more for all of them, no ``isfinite`` per tensor: DGR makes
    this check before each group steps. A bf16 tensor is summed as bf16: torch accumulates it in float32 all the
    same, and bf16 has float32's range, while ``sum(dtype=float32)`` would first copy it to float32. What each
    choice saves: ``docs/benchmarks.md``, "Measurements moved out of docstrings". This rank's tensors only."""
    for t in tensors:
        if t.is_meta or type(t).__name__ == "FakeTensor":
            return True  # fake tensors (full-size memory measurements) have no values to check
    checked = _CHECKED.get()
    if checked is not None and all(id(t) in checked for t in tensors):
        return True  # checked by the caller a moment ago (finite_checked)
    sums = [t.sum(dtype=torch.float32) if t.dtype is torch.float16 else t.sum() for t in tensors]
    return not sums or math.isfinite(torch.stack(sums).sum().item())


_CHECKED: contextvars.ContextVar[frozenset[int] | None] = contextvars.ContextVar("finite_checked", default=None)


@contextlib.contextmanager
def finite_checked(tensors: Iterable[torch.Tensor | None]) -> Iterator[None]:
    """Within it, ``locally_finite`` (and so ``all_finite``) of these very tensors (their local shards, by identity;
    None skipped) is True without summing them: for a caller that has just checked them and then runs an optimizer
    that checks them again. DGR checks a group's gradients before it clips and steps them, and ``MVASAdamW`` or
    ``CompensatedAdamW`` would sum the same tensors once more (its cost: ``docs/benchmarks.md``). An in-place change
    keeps the identity: pass only tensors that stay finite until the optimizer reads them (clipping does; DGR leaves
    out gradients it unscaled). The agreement across ranks (``agree``) still runs: every rank takes the same path."""
    held = [local(t) for t in tensors if t is not None]  # alive while the ids are looked up
    token = _CHECKED.set(frozenset(map(id, held)))
    try:
        yield
    finally:
        _CHECKED.reset(token)


def all_finite(tensors: Iterable[torch.Tensor | None], over: Iterable[torch.Tensor | None] = ()) -> bool:
    """Whether every element of every tensor (None skipped; a DTensor: its local shard) is finite on every rank:
    the local check (``locally_finite``, one sum per tensor) combined by ``agree`` over the
    meshes of the DTensors among ``tensors`` and ``over`` (pass the parameters: a collective then, every rank
    must call it)."""
    tensors = [t for t in tensors if t is not None]
    finite = locally_finite([local(t) for t in tensors])
    return not agree([not finite], [*tensors, *over]).flags[0]
