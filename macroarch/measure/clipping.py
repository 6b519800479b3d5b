"""How much gradient-norm clipping shortens the optimizer's steps (claim C3).

The post (section 2.1) says that "in BERT-large training, frequent gradient clipping lowers the effective
learning rate by 27-35% and slows convergence". It defines neither quantity; this module does.

**Clipping** is what ``torch.nn.utils.clip_grad_norm_`` applies: with ``||g||`` the L2 norm of all
gradients together, every gradient is multiplied by the clip coefficient
``c = min(1, max_norm / (||g|| + 1e-6))``; a step is *clipped* when ``c < 1``.

**The probe.** Training runs with clipping, as in practice. At every step ``t``, with the raw gradient
``g_t`` of the current weights ``w_t``:

1. a *shadow* optimizer (same class and hyper-parameters, its own state, fed the *unclipped* gradients
   of this same trajectory) takes the step it would take; ``du_t = w' - w_t`` is recorded and the
   weights are restored bit for bit;
2. the real optimizer steps with ``c_t * g_t``: ``dc_t = w_{t+1} - w_t``.

So both updates start from the same weights and see the same gradient stream; they differ only in
clipping, in this step and (through the optimizer state: momentum, Adam's moments) in all earlier ones.
The real trajectory is exactly plain training with ``clip_grad_norm_``: the shadow never touches it.

**Definitions** (over the ``T`` steps of a run, ``r_t = ||dc_t|| / ||du_t||``):

- ``effective_lr_reduction = 1 - mean_t r_t`` (primary): by what fraction clipping shortens a typical
  step. Negative when clipping *lengthens* steps, which Adam can do (below).
- ``effective_lr_reduction_ratio_of_means = 1 - sum_t ||dc_t|| / sum_t ||du_t||``: the same for the
  total distance travelled; it weights steps by their length.
- ``clip_fraction``: the share of steps with ``c_t < 1``.

The updates are measured as the actual change of the stored weights, so they include the optimizer's
weight decay (identical in both, since ``w_t`` is) and the rounding of ``w + step`` to the parameter
dtype: a relative error up to ``ulp(w) / |step|`` per element, negligible unless the steps are
~1e-6 of the weights.

**What to expect.**

- Plain SGD (no momentum, no weight decay): ``du = -lr g``, ``dc = -lr c g``, so ``r_t = c_t``
  exactly and the reduction is ``1 - mean(c_t)``: clipping *is* a per-step learning-rate cut.
- SGD with momentum: ``r_t`` is a momentum-weighted average of recent coefficients (exactly so when the
  gradients are parallel).
- Adam(W): the update ``m_hat / (sqrt(v_hat) + eps)`` is invariant to scaling every gradient by one
  constant ``c`` up to eps: per element, ``r = (sqrt(v_hat) + eps) / (sqrt(v_hat) + eps / c)``, within
  ``eps / (c sqrt(v_hat))`` of 1. Clipping matters only through how ``c_t`` *varies* over time: it
  reweights steps against each other. Gradients whose norm falls during training leave a raw ``v_hat``
  that remembers the large early gradients, while clipped gradients all have norm ``max_norm``, so the
  clipped steps can be *longer* than the unclipped ones.

``steps_to_target`` measures the other half of the claim, convergence speed: the first step at which a
run's moving-average loss reaches a target. The runs it compares (the same model, seeds and data, with and
without clipping) are in ``macroarch.experiments.gradient_explosion``; the unclipped one goes through the
project's training loop, ``macroarch.experiments.loop.train_lm``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch
from torch import nn

CLIP_EPS = 1e-6
"""The eps ``torch.nn.utils.clip_grad_norm_`` adds to the norm before dividing."""

LossFn = Callable[[nn.Module, Any], torch.Tensor]
MakeOptimizer = Callable[[nn.Module], torch.optim.Optimizer]
MakeScheduler = Callable[[torch.optim.Optimizer], Any]


def clip_coefficient(grad_norm: float | torch.Tensor, max_norm: float, eps: float = CLIP_EPS) -> float | torch.Tensor:
    """``min(1, max_norm / (grad_norm + eps))``: the factor ``clip_grad_norm_`` multiplies gradients by.

    A tensor ``grad_norm`` gives a tensor computed with the same ops (and so the same rounding) as torch.
    """
    _check_max_norm(max_norm)
    if isinstance(grad_norm, torch.Tensor):
        return torch.clamp(max_norm / (grad_norm + eps), max=1.0)
    return min(1.0, max_norm / (grad_norm + eps))


@dataclass(frozen=True)
class StepRecord:
    """One probed step.

    Attributes:
        step: index of the step, from 0.
        loss: loss at the weights before the step.
        grad_norm: L2 norm of all raw gradients (before clipping).
        clip_coefficient: factor the gradients were multiplied by (1.0 when not clipped).
        clipped: ``clip_coefficient < 1``.
        clipped_update_norm: ``||dc||``, the step the real (clipped) optimizer took.
        unclipped_update_norm: ``||du||``, the step the shadow (unclipped) optimizer would have taken.
        update_ratio: ``||dc|| / ||du||``; NaN when ``||du|| == 0``.
        update_cosine: cosine between ``dc`` and ``du``; NaN when either is zero.
    """

    step: int
    loss: float
    grad_norm: float
    clip_coefficient: float
    clipped: bool
    clipped_update_norm: float
    unclipped_update_norm: float
    update_ratio: float
    update_cosine: float


@dataclass(frozen=True)
class ClippingTrace:
    """A probed run: one array per ``StepRecord`` field (same names), and the threshold."""

    max_norm: float
    step: np.ndarray
    loss: np.ndarray
    grad_norm: np.ndarray
    clip_coefficient: np.ndarray
    clipped: np.ndarray
    clipped_update_norm: np.ndarray
    unclipped_update_norm: np.ndarray
    update_ratio: np.ndarray
    update_cosine: np.ndarray

    @classmethod
    def from_records(cls, records: list[StepRecord], max_norm: float) -> ClippingTrace:
        if not records:
            raise ValueError("records is empty: probe at least one step")
        columns = {f.name: np.array([getattr(r, f.name) for r in records]) for f in fields(StepRecord)}
        return cls(max_norm=max_norm, **columns)

    def summary(self) -> dict[str, float]:
        """The definitions of the module docstring, plus the ranges the notebook plots."""
        clipped = self.clipped.astype(bool)
        ratio = self.update_ratio
        return {
            "steps": int(len(self.step)),
            "max_norm": float(self.max_norm),
            "clip_fraction": float(clipped.mean()),
            "effective_lr_reduction": float(1.0 - np.nanmean(ratio)),
            "effective_lr_reduction_ratio_of_means": float(
                1.0 - self.clipped_update_norm.sum() / self.unclipped_update_norm.sum()
            ),
            "effective_lr_reduction_clipped_steps": float(1.0 - np.nanmean(ratio[clipped])) if clipped.any()
            else math.nan,
            "mean_clip_coefficient": float(self.clip_coefficient.mean()),
            "mean_update_cosine": float(np.nanmean(self.update_cosine)),
            "grad_norm_min": float(self.grad_norm.min()),
            "grad_norm_median": float(np.median(self.grad_norm)),
            "grad_norm_max": float(self.grad_norm.max()),
            "loss_first": float(self.loss[0]),
            "loss_last": float(self.loss[-1]),
        }


class ClippingProbe:
    """Trains ``model`` with gradient clipping and measures, each step, the update without it.

    Args:
        model: the model to train, in place.
        loss_fn: ``loss_fn(model, batch) -> scalar loss``.
        make_optimizer: ``make_optimizer(model) -> Optimizer``; called twice, for the real optimizer and
            for the shadow, which must come out as two separate instances over the same parameters.
        max_norm: clipping threshold, > 0.

    An LR scheduler may drive ``probe.optimizer``: the shadow copies the real optimizer's
    hyper-parameters (everything in its param groups but the parameters) before each step.
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn, make_optimizer: MakeOptimizer, max_norm: float) -> None:
        _check_max_norm(max_norm)
        self.model = model
        self.loss_fn = loss_fn
        self.max_norm = float(max_norm)
        self.optimizer = make_optimizer(model)
        self.shadow_optimizer = make_optimizer(model)
        if self.optimizer is self.shadow_optimizer:
            raise ValueError("make_optimizer returned the same optimizer twice; it must build a new one per call")
        self.params = _optimizer_params(self.optimizer)
        if [id(p) for p in _optimizer_params(self.shadow_optimizer)] != [id(p) for p in self.params]:
            raise ValueError("make_optimizer built optimizers over different parameters on two calls")
        self.records: list[StepRecord] = []

    @torch.no_grad()
    def _shadow_update(self) -> list[torch.Tensor]:
        """``du`` for every parameter; leaves weights and gradients exactly as they were."""
        weights = [p.detach().clone() for p in self.params]
        grads = [None if p.grad is None else p.grad.clone() for p in self.params]
        _copy_hyperparameters(self.optimizer, self.shadow_optimizer)
        self.shadow_optimizer.step()
        deltas = [p - w for p, w in zip(self.params, weights)]
        for p, w, g in zip(self.params, weights, grads):
            p.copy_(w)
            p.grad = g  # an optimizer may legally rewrite p.grad in place; the real one must see it raw
        return deltas

    def step(self, batch: Any) -> StepRecord:
        """One training step with clipping on ``batch``; returns (and appends to ``records``) its record."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model, batch)
        loss.backward()

        du = self._shadow_update()
        with torch.no_grad():
            weights = [p.detach().clone() for p in self.params]
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm)
        coefficient = float(clip_coefficient(grad_norm, self.max_norm))
        self.optimizer.step()
        with torch.no_grad():
            dc = [p - w for p, w in zip(self.params, weights)]
            norm_c, norm_u, dot = _norm(dc), _norm(du), _dot(dc, du)

        record = StepRecord(
            step=len(self.records),
            loss=float(loss.detach()),
            grad_norm=float(grad_norm),
            clip_coefficient=coefficient,
            clipped=coefficient < 1.0,
            clipped_update_norm=norm_c,
            unclipped_update_norm=norm_u,
            update_ratio=norm_c / norm_u if norm_u > 0 else math.nan,
            update_cosine=dot / (norm_c * norm_u) if norm_c > 0 and norm_u > 0 else math.nan,
        )
        self.records.append(record)
        return record

    def trace(self) -> ClippingTrace:
        return ClippingTrace.from_records(self.records, self.max_norm)


def measure_clipping(
    model: nn.Module,
    loss_fn: LossFn,
    batches: Iterable[Any],
    make_optimizer: MakeOptimizer,
    max_norm: float,
    steps: int,
    make_scheduler: MakeScheduler | None = None,
    seed: int | None = None,
) -> ClippingTrace:
    """Probe ``steps`` clipped training steps of ``model`` (trained in place) on the first ``steps`` batches.

    ``make_scheduler(optimizer)`` adds an LR schedule (stepped after every step); ``seed`` seeds the
    RNG the loss draws from (dropout) without touching the global RNG outside this call.
    """
    _check_steps(steps)
    probe = ClippingProbe(model, loss_fn, make_optimizer, max_norm)
    scheduler = make_scheduler(probe.optimizer) if make_scheduler is not None else None
    with _seeded(seed):
        for batch in _take(batches, steps):
            probe.step(batch)
            if scheduler is not None:
                scheduler.step()
    return probe.trace()


def steps_to_target(losses: Iterable[float], target: float, window: int = 10) -> int | None:
    """First step at which the mean loss of the trailing ``window`` steps is <= ``target``; None if never.

    Only full windows count, so the earliest possible answer is ``window - 1`` (step indices from 0).
    """
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"window={window!r} must be a positive int")
    values = np.asarray(list(losses), dtype=np.float64)
    if len(values) < window:
        return None
    moving = np.convolve(values, np.ones(window) / window, mode="valid")  # moving[i] ends at step i + window - 1
    hits = np.flatnonzero(moving <= target)
    return int(hits[0]) + window - 1 if len(hits) else None


def _check_max_norm(max_norm: float) -> None:
    if not max_norm > 0:
        raise ValueError(f"max_norm={max_norm!r} must be positive (it is the clipping threshold)")


def _check_steps(steps: int) -> None:
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r} must be a positive int")


def _take(batches: Iterable[Any], steps: int) -> Iterator[Any]:
    iterator = iter(batches)
    for step in range(steps):
        try:
            yield next(iterator)
        except StopIteration:
            raise ValueError(f"batches ran out after {step} batches; steps={steps} needs one per step") from None


@contextlib.contextmanager
def _seeded(seed: int | None) -> Iterator[None]:
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _copy_hyperparameters(source: torch.optim.Optimizer, target: torch.optim.Optimizer) -> None:
    for src, dst in zip(source.param_groups, target.param_groups):
        dst.update({k: v for k, v in src.items() if k != "params"})


def _norm(tensors: list[torch.Tensor]) -> float:
    return math.sqrt(_dot(tensors, tensors))


def _dot(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    # float64 so that millions of squared float32 elements sum without losing the small ones
    return float(sum(torch.sum(x.double() * y.double()) for x, y in zip(a, b)))


__all__ = ["ClippingProbe", "ClippingTrace", "StepRecord", "clip_coefficient", "measure_clipping",
           "steps_to_target"]
