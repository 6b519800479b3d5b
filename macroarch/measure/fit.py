"""What fits: the largest batch (or clip, or crop) whose whole training step fits a byte budget.

The post's application claims (section 6: PointNet trains with a 4x batch, video models reach 128 frames,
AlphaFold2-style models need 55% less memory) are statements about what fits in a card's memory. This module
answers "what fits" by measurement, never by formula:

- ``measure_training(build, loss_fn)``: the peak of live tensor bytes, by category, of one full training step
  (forward with the loss, backward, optimizer step, ``zero_grad``) of any model, with ``measure_step``'s
  ``MemTracker`` (``macroarch.measure.memory.measured``). ``build()`` returns the model, what to call (the model,
  or a wrapper such as ``DGRWrapper``), the optimizer and the batch; the optimizer's state exists before the
  tracked step, so the step is a steady-state one. With ``fake=True`` (the default) everything runs under
  ``FakeTensorMode``: exact bytes of CPU kernels, no memory used, so a 688M-parameter folding trunk on a
  512-residue crop is measured on a laptop. Build full-size models on the ``"meta"`` device and let
  ``fake_module`` turn them into fake tensors (some ``__init__`` code reads values, which fake tensors refuse).
- ``largest_fitting(measure, budget_bytes)``: the largest size on a grid (multiples of ``multiple``) whose
  measured peak is at most the budget, and the peak one grid step above it (which must not fit). The peak is
  assumed to grow with the size. The search brackets the boundary by extrapolating the measured peaks (never
  by more than 64x), then narrows the bracket by interpolation with a bisection safeguard (a step that does not
  halve the bracket is followed by a midpoint), so an affine peak takes a handful of measurements and any
  monotone one at most about twice bisection's count; inside the bracket the step is the root of a parabola
  through the three nearest measurements (exact for a quadratic peak, close for a cubic one). ``MeasureCache``
  keeps every measurement, so the searches for several budgets share them.
- ``extrapolate_peak(reports, n_layers)``: the step of an ``n_layers`` model from measurements at a few depths,
  affine in depth, checked on a third depth, as ``macroarch.measure.memory.extrapolate_by_depth`` does for its
  categories; here for the *peak* (and the categories at it), which is what a budget has to hold.

Deviations and limits: the peak is the sum of live tensor storages (MemTracker's count). A CUDA run also needs
the CUDA context, cuBLAS/cuDNN workspaces and the caching allocator's rounding and fragmentation, so a size
that fits here can still fail on a card by those amounts; budgets are in bytes as given (GB = 1e9).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from macroarch.measure.memory.measured import StepMemory, create_optimizer_state, measure_step

Batch = Mapping[str, torch.Tensor]
Built = tuple[nn.Module, Callable[..., Any], torch.optim.Optimizer, Batch]


def fake_module(module: nn.Module, device: str | torch.device = "cpu") -> nn.Module:
    """``module`` (built on ``"meta"``) with every parameter and buffer replaced by an empty tensor on ``device``.

    Call it inside ``FakeTensorMode``: the tensors are then fake (shapes, dtypes, no data). Tied parameters stay
    tied. Plain tensor attributes are replaced too (VideoMAE keeps its sinusoidal position table as one, built
    from numpy on the CPU whatever the device). The tensors are replaced in place (not with
    ``nn.Module._apply``, which would try to swap a fake parameter's storage and fail)."""
    done: dict[int, torch.Tensor] = {}

    def empty(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in done:
            new = torch.empty(t.shape, dtype=t.dtype, device=device)
            done[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new
        return done[id(t)]

    for m in module.modules():
        for store in (m._parameters, m._buffers):
            for key, t in store.items():
                if t is not None:
                    store[key] = empty(t)
        for key, value in list(vars(m).items()):
            if isinstance(value, torch.Tensor) and not key.startswith("_"):
                setattr(m, key, empty(value))
    return module


def measure_training(build: Callable[[], Built], loss_fn: Callable[[Any, Batch], torch.Tensor], *,
                     fake: bool = True) -> StepMemory:
    """Peak live bytes, by category, of one training step of what ``build()`` returns.

    ``build() -> (model, runner, optimizer, batch)``: ``runner`` is what the loss calls (the model itself or a
    wrapper around it), ``batch`` a mapping of tensors; ``loss_fn(runner, batch)`` returns the loss. The model,
    optimizer and batch are tracked from before the step (module docstring of ``measured``: parameters,
    gradients, optimizer state, master weights, activations, temporaries, other).
    """
    from macroarch._compat.fake import fake_tensor_mode

    if fake:
        with fake_tensor_mode():
            return _measure(build, loss_fn)
    return _measure(build, loss_fn)


def _measure(build: Callable[[], Built], loss_fn: Callable[[Any, Batch], torch.Tensor]) -> StepMemory:
    model, runner, optimizer, batch = build()
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    if any(not optimizer.state.get(p) for p in params):  # lazily created state: one step on zero gradients
        create_optimizer_state(optimizer, params)

    def step() -> None:
        loss = loss_fn(runner, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return measure_step(step, model, optimizer, *batch.values())


class MeasureCache:
    """``measure(size) -> StepMemory`` remembered per size, so several budgets (and plots) share measurements."""

    def __init__(self, measure: Callable[[int], StepMemory]) -> None:
        self._measure = measure
        self.reports: dict[int, StepMemory] = {}

    def __call__(self, size: int) -> StepMemory:
        if size not in self.reports:
            self.reports[size] = self._measure(size)
        return self.reports[size]

    def peaks(self) -> dict[int, int]:
        """Every size measured so far and its peak bytes, by size."""
        return {n: self.reports[n].peak_bytes for n in sorted(self.reports)}


@dataclass(frozen=True)
class Fit:
    """The largest size that fits a budget, with the evidence.

    Attributes:
        size: the largest size on the grid whose peak is at most ``budget_bytes``.
        peak_bytes: its measured peak.
        next_size: one grid step above ``size``.
        next_peak_bytes: its measured peak (above the budget), or None when the search stopped at ``max_size``.
        budget_bytes: the budget.
        measurements: how many sizes were known when the search ended (measured by it, or already in the
            ``MeasureCache`` it was given).
    """

    size: int
    peak_bytes: int
    next_size: int
    next_peak_bytes: int | None
    budget_bytes: int
    measurements: int
    report: StepMemory | None = field(repr=False, compare=False, default=None)

    @property
    def capped(self) -> bool:
        """The search stopped at ``max_size``: larger sizes may fit too."""
        return self.next_peak_bytes is None


def _on_grid(x: float, multiple: int, up: bool) -> int:
    k = math.ceil(x / multiple) if up else math.floor(x / multiple)
    return int(k) * multiple


def largest_fitting(measure: Callable[[int], StepMemory], budget_bytes: int | float, *, start: int | None = None,
                    multiple: int = 1, max_size: int = 1 << 20, unit: str = "sample") -> Fit:
    """The largest multiple of ``multiple`` (from ``start``, default ``multiple``) whose ``measure(size).peak_bytes``
    is at most ``budget_bytes`` (module docstring for the search).

    Raises ValueError when even ``start`` does not fit, naming its peak (``unit`` names what a size counts).
    """
    if not isinstance(multiple, int) or multiple < 1:
        raise ValueError(f"multiple={multiple!r} must be a positive int")
    start = multiple if start is None else start
    if not isinstance(start, int) or start < 1 or start % multiple:
        raise ValueError(f"start={start!r} must be a positive multiple of {multiple}")
    if not budget_bytes > 0:
        raise ValueError(f"budget_bytes={budget_bytes!r} must be positive")
    if max_size < start:
        raise ValueError(f"max_size={max_size} is below start={start}")
    # what a MeasureCache already knows brackets the search for free (the peak grows with the size)
    reports: dict[int, StepMemory] = dict(measure.reports) if isinstance(measure, MeasureCache) else {}

    def peak(n: int) -> int:
        if n not in reports:
            reports[n] = measure(n)
        return reports[n].peak_bytes

    if peak(start) > budget_bytes:
        raise ValueError(f"a budget of {budget_bytes / 1e9:.3g} GB is below the peak of one step at the smallest "
                         f"size ({start} {unit}{'s' if start > 1 else ''}): {peak(start) / 1e9:.3g} GB")
    grid = [n for n in reports if n % multiple == 0 and start <= n <= max_size]
    lo = max(n for n in grid if peak(n) <= budget_bytes)
    hi = min((n for n in grid if n > lo and peak(n) > budget_bytes), default=None)
    while hi is None:  # bracket: extrapolate the two largest fitting sizes to the budget (at most 64x)
        if lo + multiple > max_size:
            return _fit(lo, None, budget_bytes, reports)
        fitting = sorted(n for n in grid if peak(n) <= budget_bytes)
        guess = 2 * lo
        if len(fitting) >= 2:
            a, b = fitting[-2], fitting[-1]
            slope = (peak(b) - peak(a)) / (b - a)
            if slope > 0:
                guess = b + (budget_bytes - peak(b)) / slope
        probe = max(min(_on_grid(guess, multiple, up=True), 64 * lo, _on_grid(max_size, multiple, up=False)),
                    lo + multiple)
        grid.append(probe)
        if peak(probe) <= budget_bytes:
            lo = probe
        else:
            hi = probe
    halve = False
    while hi - lo > multiple:  # narrow: interpolation, with a midpoint after any step that did not halve
        width = hi - lo
        if halve:
            probe = _on_grid((lo + hi) / 2, multiple, up=False)
        else:
            probe = _on_grid(_interpolate(reports, lo, hi, budget_bytes), multiple, up=False)
        probe = min(max(probe, lo + multiple), hi - multiple)
        if peak(probe) <= budget_bytes:
            lo = probe
        else:
            hi = probe
        halve = (hi - lo) > width / 2
    return _fit(lo, hi, budget_bytes, reports)


def _interpolate(reports: Mapping[int, StepMemory], lo: int, hi: int, budget: float) -> float:
    """Where the peak crosses ``budget`` between ``lo`` and ``hi``: through a parabola of the three measured sizes
    nearest the straight-line estimate (peaks grow as polynomials of the size: attention is quadratic in a clip,
    triangular attention cubic in a crop), or the straight line when that has no root in the bracket."""
    p_lo, p_hi = reports[lo].peak_bytes, reports[hi].peak_bytes
    line = lo + (budget - p_lo) / (p_hi - p_lo) * (hi - lo)
    near = sorted(reports, key=lambda n: abs(n - line))[:3]
    if len(near) == 3:
        xs = [float(n) for n in near]
        ys = [float(reports[n].peak_bytes) - budget for n in near]
        # Newton's divided differences: y(x) = y0 + d1 (x - x0) + d2 (x - x0)(x - x1)
        d01, d12 = (ys[1] - ys[0]) / (xs[1] - xs[0]), (ys[2] - ys[1]) / (xs[2] - xs[1])
        d2 = (d12 - d01) / (xs[2] - xs[0])
        a, b = d2, d01 - d2 * (xs[0] + xs[1])
        c = ys[0] - d01 * xs[0] + d2 * xs[0] * xs[1]
        if a != 0:
            disc = b * b - 4 * a * c
            if disc >= 0:
                roots = [(-b + sign * math.sqrt(disc)) / (2 * a) for sign in (1, -1)]
                inside = [r for r in roots if lo < r < hi]
                if inside:
                    return min(inside, key=lambda r: abs(r - line))
    return line


def _fit(lo: int, hi: int | None, budget: float, reports: dict[int, StepMemory]) -> Fit:
    return Fit(size=lo, peak_bytes=reports[lo].peak_bytes, next_size=hi if hi is not None else lo,
               next_peak_bytes=reports[hi].peak_bytes if hi is not None else None, budget_bytes=int(budget),
               measurements=len(reports), report=reports[lo])


def extrapolate_peak(reports: Mapping[int, StepMemory], n_layers: int) -> StepMemory:
    """The step of an ``n_layers`` model from ``reports`` at two or more smaller depths (same model otherwise).

    Peak bytes and each category at the peak are affine in the number of identical layers once the peak falls
    at the same point of the step (the last layer's backward, the optimizer...): ``b(L) = b(l1) + (L - l1) *
    (b(l2) - b(l1)) / (l2 - l1)``. A third depth must agree to the byte (ValueError naming what differs); each
    category's own maximum over the step is not (it falls at different points at different depths: the
    temporaries of the first layer's backward are not those of the others), so ``max_by_category`` is empty.
    ``seconds`` is the sum over the measurements.
    """
    depths = sorted(reports)
    if len(depths) < 2:
        raise ValueError(f"extrapolate_peak needs reports at two or more depths; got {depths}")
    (l1, l2) = depths[:2]

    def affine(get: Callable[[StepMemory], int], what: str) -> int:
        b1, b2 = get(reports[l1]), get(reports[l2])
        slope = (b2 - b1) / (l2 - l1)
        for d in depths[2:]:
            predicted = b1 + (d - l1) * slope
            if abs(predicted - get(reports[d])) > 1e-6 * max(1, get(reports[d])):
                raise ValueError(f"{what}: bytes are not affine in depth (predicted {predicted:.0f} at {d} layers "
                                 f"from {l1} and {l2}, measured {get(reports[d])})")
        return round(b1 + (n_layers - l1) * slope)

    first = reports[l1]
    return StepMemory(
        peak_bytes=affine(lambda r: r.peak_bytes, "peak"),
        by_category={k: affine(lambda r, k=k: r.by_category[k], f"{k} at the peak") for k in first.by_category},
        max_by_category={},
        seconds=sum(r.seconds for r in reports.values()),
    )


__all__ = ["Fit", "MeasureCache", "extrapolate_peak", "fake_module", "largest_fitting", "measure_training"]
