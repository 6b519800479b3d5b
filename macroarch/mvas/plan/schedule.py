"""Re-planning MVAS formats during training (post section 3.2: precision "adjusted dynamically by training phase").

``MVASSchedule(store, every=K, warmup=W)`` keeps a running importance of every managed tensor and, every ``K``
optimizer steps once ``W`` have passed, solves the budget knapsack again (``plan_for_budget``: HAWQ
sensitivity, importance times quantisation error, per byte saved) and moves tensors between tiers with
``store.replan``. Each move is recorded as a ``PlanChange`` and, with a tracking run, logged to it.

- **Importance** defaults to the empirical Fisher diagonal (an EMA of squared gradients), read by a
  ``post_accumulate_grad`` hook on each managed parameter, so it needs no call in the training loop and also
  sees the gradients of DGR, which frees each group's gradients during backward (create the schedule
  *before* the DGR optimizer, so its hook runs first). ``estimator=`` replaces it by any callable returning
  ``{name: diagonal}``, e.g. Hutchinson's on a dense copy of the model. Hutchinson's estimate cannot run on
  the managed model itself: the weights re-materialised in backward are not differentiable, so a
  Hessian-vector product would miss the second-order terms through them.
- **Sensitivity** is HAWQ's ``0.5 * sum_i h_ii * err_i`` with ``err_i`` the *expected* squared rounding error
  of each candidate format at the weight's magnitude (``expected_rounding_error``), not the realised one: the
  stored weights already lie on their format's grid, so their realised error in that format is zero.
- **Budget**: the managed tensors' bytes stay under ``target_bytes`` (default: what they take when the
  schedule starts), so re-planning redistributes precision, it does not spend more memory. The set of managed
  tensors is fixed; tensors kept in their own dtype stay so.
- A tensor moved up a tier is re-packed from its current (low-precision) values: precision lost earlier is not
  recovered, only future updates are stored finer (with an fp32 master copy in ``MVASAdamW`` the next step
  writes from the master).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from macroarch.mvas.codecs.formats import get_format
from macroarch.mvas.plan.importance import FisherDiagonal
from macroarch.mvas.plan.policy import (
    DEFAULT_KEEP_PATTERNS,
    MIN_NUMEL,
    NamedTensors,
    PrecisionPlan,
    block_for,
    named_tensors,
    packable,
    plan_for_budget,
)

if TYPE_CHECKING:
    from macroarch.mvas.store import MVASStore  # the schedule works on a store, which sits above plan/


@torch.no_grad()
def expected_rounding_error(w: torch.Tensor, fmt: str, block_size: int | None = 32) -> torch.Tensor:
    """Per element, the mean squared error of rounding a value near ``w`` to ``fmt``: ``spacing^2 / 12``.

    ``spacing`` is the distance between the format's neighbouring values around ``w`` (at its block's scale).
    Unlike the realised error ``(q(w) - w)^2`` it does not vanish for weights that already lie on the
    format's grid, which is what re-planning sees: a tensor stored in fp8 reads back exactly representable in
    fp8 (and in any finer format), so the realised error would make its current format look free.
    """
    fmt_ = get_format(fmt)
    x = w.detach().float().reshape(-1)
    if fmt_.block_scaled:
        blocks = x.view(1, -1) if block_size is None else x.view(-1, block_size)
        scale = (blocks.abs().amax(dim=1, keepdim=True) / fmt_.max_normal).expand_as(blocks).reshape(-1)
    else:
        scale = torch.ones_like(x)
    y = torch.where(scale > 0, x.abs() / torch.where(scale > 0, scale, 1.0), 0.0)
    min_exponent = 1 - (2 ** (fmt_.exponent_bits - 1) - 1)  # below it, subnormal spacing
    exponent = torch.floor(torch.log2(y.clamp_min(torch.finfo(torch.float32).tiny))).clamp_min(min_exponent)
    spacing = torch.exp2(exponent - fmt_.mantissa_bits) * scale
    return (spacing.square() / 12).view(w.shape)


@torch.no_grad()
def importance_plan(tensors: NamedTensors, importance: Mapping[str, torch.Tensor], *,
                    target_bytes: int | None = None, weight_bytes: float | None = None,
                    formats: Sequence[str] = ("fp16", "fp8_e4m3", "fp4_e2m1"), block_size: int | None = 32,
                    min_numel: int = MIN_NUMEL, keep_patterns: Sequence[str] = DEFAULT_KEEP_PATTERNS) -> PrecisionPlan:
    """The budget plan (``plan_for_budget``) with HAWQ sensitivity from ``importance`` (a diagonal per tensor:
    Fisher, Hutchinson) and each format's *expected* rounding error (``expected_rounding_error``).

    Give ``target_bytes`` for all tensors, or ``weight_bytes``: the mean bytes per element of the tensors that
    are not kept (``min_numel``, ``keep_patterns``), the kept ones costing their own dtype.
    """
    items = dict(named_tensors(tensors))
    eligible, kept = packable(items, min_numel, keep_patterns)
    if (target_bytes is None) == (weight_bytes is None):
        raise ValueError("give exactly one of target_bytes and weight_bytes")
    if weight_bytes is not None:
        target_bytes = int(weight_bytes * sum(t.numel() for t in eligible.values())) + kept
    missing = [n for n in eligible if n not in importance]
    if missing:
        raise ValueError(f"importance has no diagonal for {len(missing)} tensors to plan, e.g. {missing[0]!r}")
    formats = [get_format(f).name for f in formats]
    sens = {n: {f: 0.5 * float((importance[n].double() * expected_rounding_error(
        t, f, block_for(t.numel(), f, block_size)).double()).sum()) for f in formats} for n, t in eligible.items()}
    return plan_for_budget(items, sens, target_bytes=target_bytes, formats=formats, block_size=block_size,
                           min_numel=min_numel, keep_patterns=keep_patterns)


@dataclass(frozen=True)
class PlanChange:
    """One tensor moved between tiers at ``step``."""

    step: int
    name: str
    old: str
    new: str


class MVASSchedule:
    """Re-plan ``store`` every ``every`` steps after ``warmup`` steps (module docstring).

    Args:
        store: the model's ``MVASStore``.
        every: optimizer steps between re-plans.
        warmup: steps before the first re-plan (the importance needs gradients first).
        formats: candidate formats, highest precision first.
        target_bytes: bytes the managed tensors may take (default: their bytes now).
        block_size: block size of scaled formats in new plans.
        beta: EMA factor of the Fisher diagonal.
        estimator: ``() -> {name: diagonal}`` to use instead of the Fisher EMA.
        run: a ``macroarch.repro.tracking`` run (or anything with ``log(step=..., **metrics)``) to log changes to.
    """

    def __init__(self, store: MVASStore, *, every: int = 100, warmup: int = 100,
                 formats: Sequence[str] = ("fp16", "fp8_e4m3", "fp4_e2m1"), target_bytes: int | None = None,
                 block_size: int | None = 32, beta: float = 0.99,
                 estimator: Callable[[], Mapping[str, torch.Tensor]] | None = None, run: Any = None) -> None:
        for name, value in (("every", every), ("warmup", warmup)):
            if not isinstance(value, int) or value < (1 if name == "every" else 0):
                raise ValueError(f"{name}={value!r} must be an int >= {1 if name == 'every' else 0}")
        self.formats = [get_format(f).name for f in formats]
        if not self.formats:
            raise ValueError("formats is empty: give at least one candidate format")
        if not store.entries:
            raise ValueError("the store manages no tensor: nothing to re-plan")
        self.store, self.every, self.warmup, self.block_size = store, every, warmup, block_size
        self.target_bytes = store.packed_bytes() if target_bytes is None else int(target_bytes)
        self.estimator, self.run = estimator, run
        self.steps = 0
        self.history: list[PlanChange] = []
        self.fisher = FisherDiagonal(beta=beta)
        self._handles = []
        if estimator is None:
            for name, entry in store.entries.items():
                self._handles.append(entry.param.register_post_accumulate_grad_hook(self._observer(name)))

    def _observer(self, name: str):
        def hook(p: torch.Tensor) -> None:
            if p.grad is not None:
                g = p.grad.detach().float()
                self.fisher._add(name, g * g)
        return hook

    def importance(self) -> dict[str, torch.Tensor]:
        """The current importance diagonal of every managed tensor."""
        diag = dict(self.estimator()) if self.estimator is not None else self.fisher.diagonal()
        missing = [n for n in self.store.entries if n not in diag]
        if missing:
            raise ValueError(f"no importance yet for {len(missing)} managed tensors (e.g. {missing[0]!r}): they "
                             "have had no gradient; raise warmup")
        return {n: diag[n] for n in self.store.entries}

    def plan(self) -> PrecisionPlan:
        """The budget plan for the managed tensors from the current importance and weights."""
        weights = {n: self.store.dense(n) for n in self.store.entries}
        managed = importance_plan(weights, self.importance(), target_bytes=self.target_bytes, formats=self.formats,
                                  block_size=self.block_size, min_numel=0, keep_patterns=())
        new = {t.name: t for t in managed.tensors}
        return PrecisionPlan(tuple(new.get(t.name, t) for t in self.store.plan.tensors),
                             sensitivity=managed.sensitivity, sensitivity_bound=managed.sensitivity_bound)

    def step(self) -> list[PlanChange]:
        """Call once per optimizer step; re-plans when due and returns the changes made (often none)."""
        self.steps += 1
        if self.steps < self.warmup or (self.steps - self.warmup) % self.every != 0:
            return []
        changes = [PlanChange(self.steps, n, old, new) for n, old, new in self.store.replan(self.plan())]
        self.history += changes
        if self.run is not None:
            self.run.log(step=self.steps, mvas_replan_changes=len(changes), mvas_packed_bytes=self.store.packed_bytes())
        return changes

    def close(self) -> None:
        """Remove the gradient hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "fisher": self.fisher.state_dict(), "target_bytes": self.target_bytes}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.steps, self.target_bytes = int(state["steps"]), int(state["target_bytes"])
        self.fisher.load_state_dict(state["fisher"])
