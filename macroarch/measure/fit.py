"""What fits: the largest batch (or clip, or crop) whose whole training step fits a byte budget.

The post's application claims (section 6: PointNet trains with a 4x batch, video models reach 128 frames,
AlphaFold2-style models need 55% less memory) are statements about what fits in a card's memory. This module
answers "what fits" by measurement, never by formula:

- ``measure_training(build, loss_fn)``: the peak of live tensor bytes, by category, of one full training step
  (forward with the loss, backward, optimizer step, ``zero_grad``) of any model, and each phase's peak, with
  ``measure_step``'s ``MemTracker`` (``macroarch.measure.memory.measured``). ``build()`` returns the model, what
  to call (the model, or a wrapper such as ``DGRWrapper``), the optimizer and the batch; the optimizer's state
  exists before the tracked step, so the step is a steady-state one. With ``fake=True`` (the default) everything
  runs under ``FakeTensorMode``: exact bytes of CPU kernels, no memory used, so a 688M-parameter folding trunk on
  a 512-residue crop is measured on a laptop. Build full-size models on the ``"meta"`` device and let
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
  each phase of the step (setup, forward, backward, optimizer) affine in depth on its own and checked on a
  third depth; the peak is the largest extrapolated phase (the
  phase that holds it can change with depth). ``macroarch.measure.memory.extrapolate_by_depth`` does the same
  for the categories' maxima; this is the *peak* (and the categories at it), which is what a budget must hold.

Deviations and limits: the peak is the sum of live tensor storages (MemTracker's count). A CUDA run also needs
the CUDA context, cuBLAS/cuDNN workspaces and the caching allocator's rounding and fragmentation, so a size
that fits here can still fail on a card by those amounts; budgets are in bytes as given (GB = 1e9).
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from macroarch.measure.memory.measured import PhasePeak, StepMemory, create_optimizer_state

Batch = Mapping[str, torch.Tensor]
Built = tuple[nn.Module, Callable[..., Any], torch.optim.Optimizer, Batch]


def fake_module(module: nn.Module, device: str | torch.device = "cpu") -> nn.Module:
    """``module`` (built on ``"meta"``) with every parameter and buffer replaced by an empty tensor on ``device``.

    Call it inside ``FakeTensorMode``: the tensors are then fake (shapes, dtypes, no data). Tied parameters stay
    tied. Plain tensor attributes are replaced too (VideoMAE keeps its sinusoidal position table as one, built
    from numpy on the CPU whatever the device). The tensors are replaced in place by assignment (a buffer keeps
    its persistence), not with ``nn.Module._apply``, which would try to swap a fake parameter's storage and fail."""
    done: dict[int, torch.Tensor] = {}

    def empty(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in done:
            new = torch.empty(t.shape, dtype=t.dtype, device=device)
            done[id(t)] = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new
        return done[id(t)]

    for m in module.modules():
        tensors = [*m.named_parameters(recurse=False, remove_duplicate=False),
                   *m.named_buffers(recurse=False, remove_duplicate=False)]
        replaced = {name for name, _ in tensors}
        for name, t in tensors:
            setattr(m, name, empty(t))
        for key, value in list(vars(m).items()):
            if isinstance(value, torch.Tensor) and not key.startswith("_") and key not in replaced:
                setattr(m, key, empty(value))
    return module


@dataclass(frozen=True)
class TrainingStep(StepMemory):
    """``StepMemory`` of a training step with the peak of each of its phases.

    Attributes:
        phases: ``"setup"`` (the state in place before the step), ``"forward"`` (the loss included),
            ``"backward"`` up to the backward of the first block of the model's largest repeated stack and
            ``"backward_tail"`` from there (with DGR both run group updates; without a stack of two blocks the
            tail is empty), ``"optimizer"`` (``step`` and ``zero_grad``): each phase's largest total and the
            categories at it. ``peak_bytes`` is the largest of them.
    """

    phases: dict[str, PhasePeak] = field(default_factory=dict)

    @property
    def peak_phase(self) -> str | None:
        """The phase the step's peak falls in (None without phases)."""
        if not self.phases:
            return None
        return max(self.phases, key=lambda k: self.phases[k].peak_bytes)


def measure_training(build: Callable[[], Built], loss_fn: Callable[[Any, Batch], torch.Tensor], *,
                     fake: bool = True, mode: Any = None) -> TrainingStep:
    """Peak live bytes, by category, of one training step of what ``build()`` returns, and each phase's peak.

    ``build() -> (model, runner, optimizer, batch)``: ``runner`` is what the loss calls (the model itself or a
    wrapper around it), ``batch`` a mapping of tensors; ``loss_fn(runner, batch)`` returns the loss. The model,
    optimizer and batch are tracked from before the step (module docstring of ``measured``: parameters,
    gradients, optimizer state, master weights, activations, temporaries, other). ``mode``: the fake mode to run
    in, instead of a new one (``fake`` is then ignored): one whose tensors ``build`` returns again, to measure
    another step of a model built in it earlier (a steady-state step after a steady-state step: the same bytes).
    """
    from macroarch._compat.fake import fake_tensor_mode

    if mode is not None:
        with mode:
            return _measure(build, loss_fn)
    if fake:
        with fake_tensor_mode():
            return _measure(build, loss_fn)
    return _measure(build, loss_fn)


def _first_tensor(output: Any) -> torch.Tensor | None:
    """The first tensor of a block's output that takes part in backward (a tensor, or one in a tuple, list or
    dict, as transformers' layers return)."""
    if isinstance(output, Mapping):
        output = tuple(output.values())
    items = output if isinstance(output, tuple | list) else (output,)
    return next((t for t in items if isinstance(t, torch.Tensor) and t.requires_grad), None)


def _on_first_block_backward(model: nn.Module, mark: Callable[[], None]) -> Callable[[], None]:
    """Call ``mark()`` once, when the backward of the first block of ``model``'s largest repeated stack begins (a
    hook on the gradient of that block's output); returns what removes the hook. No stack of two blocks: no mark."""
    from macroarch.models import find_repeated_layers

    blocks = find_repeated_layers(model)
    if not blocks:
        return lambda: None
    state = {"armed": False, "fired": False}

    def on_grad(grad: torch.Tensor) -> None:
        if not state["fired"]:
            state["fired"] = True
            mark()

    def after_forward(module: nn.Module, args: Any, output: Any) -> None:
        out = _first_tensor(output)
        # once: a checkpointed block runs its forward again inside backward, and that output gets no gradient
        if out is not None and not state["armed"] and torch.is_grad_enabled():
            state["armed"] = True
            out.register_hook(on_grad)  # the closure holds no tensor: nothing is kept alive

    return blocks[0][1].register_forward_hook(after_forward).remove


def _measure(build: Callable[[], Built], loss_fn: Callable[[Any, Batch], torch.Tensor]) -> TrainingStep:
    # measure_step's tracker, with the step's phases marked (measure_step itself sees one opaque step)
    from macroarch.measure.memory.measured import tracker_for

    model, runner, optimizer, batch = build()
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    if any(not optimizer.state.get(p) for p in params):  # lazily created state: one step on zero gradients
        create_optimizer_state(optimizer, params)
    # Python's cycle collector frees tensors held in reference cycles whenever its allocation counters say so, at
    # a point of the step that can move with the model's depth and so break the affine extrapolation: it is kept
    # off during the step, so whatever cycles hold stays counted until the step ends (an upper bound) and the
    # bytes are the same on every run. (No collection before: garbage from before the step holds no tensor this
    # tracker counts.)
    tracker = tracker_for(model, optimizer, *batch.values())
    # backward's peak is at its start (the head's gradients beside every activation) or, where a block's gradients
    # outweigh its activations, at its end, and which one wins can change with depth: the first block's backward
    # divides the two (``backward``, ``backward_tail``)
    remove = _on_first_block_backward(model, lambda: tracker.start_phase("backward_tail"))
    start = time.perf_counter()
    gc.disable()
    try:
        with tracker:
            tracker.start_phase("forward")
            loss = loss_fn(runner, batch)
            tracker.start_phase("backward")
            loss.backward()
            if "backward_tail" not in tracker.phases:  # no stack of two blocks, or its output took no gradient
                tracker.start_phase("backward_tail")
            tracker.start_phase("optimizer")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        gc.enable()
        remove()
    return TrainingStep(peak_bytes=tracker.peak.peak_bytes, by_category=dict(tracker.peak.by_category),
                        max_by_category=dict(tracker.max_by_category), seconds=time.perf_counter() - start,
                        phases=dict(tracker.phases))


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

    # a known size from ``start`` up that fits says ``start`` fits too (the peak grows with the size): not measured
    known_fit = any(n >= start and n % multiple == 0 and n <= max_size and r.peak_bytes <= budget_bytes
                    for n, r in reports.items())
    if not known_fit and peak(start) > budget_bytes:
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


def _affine(values: Mapping[int, Mapping[str, int]], n_layers: int, what: str) -> dict[str, int]:
    """Each key of ``values`` (by depth) extrapolated to ``n_layers``, affine in depth through the two shallowest
    depths; every further depth must agree to the byte (ValueError naming ``what`` and the key otherwise)."""
    depths = sorted(values)
    (l1, l2), out = depths[:2], {}
    for key in values[l1]:
        b1, b2 = values[l1][key], values[l2][key]
        slope = (b2 - b1) / (l2 - l1)
        for d in depths[2:]:
            predicted = b1 + (d - l1) * slope
            if abs(predicted - values[d][key]) > 1e-6 * max(1, values[d][key]):
                raise ValueError(f"{what}: {key} bytes are not affine in depth (predicted {predicted:.0f} at {d} "
                                 f"layers from {l1} and {l2}, measured {values[d][key]})")
        out[key] = round(b1 + (n_layers - l1) * slope)
    return out


def _merged_backward(phases: Mapping[str, PhasePeak]) -> dict[str, PhasePeak]:
    """``phases`` with ``backward_tail`` folded into ``backward`` (the larger of the two peaks)."""
    out = {k: v for k, v in phases.items() if k != "backward_tail"}
    if "backward_tail" in phases:
        tail = phases["backward_tail"]
        if "backward" not in out or tail.peak_bytes > out["backward"].peak_bytes:
            out["backward"] = tail
    return out


def extrapolate_peak(reports: Mapping[int, StepMemory], n_layers: int) -> TrainingStep:
    """The step of an ``n_layers`` model from ``reports`` at two or more smaller depths (same model otherwise).

    The step's peak is the largest of its phases' peaks (``TrainingStep.phases``: setup, forward, backward,
    backward_tail, optimizer), and the phase that holds it can change with depth: activations and the logits'
    temporaries dominate a shallow model's forward, weights + gradients + optimizer state a deep model's update.
    Each phase's peak, and the categories at it, is affine in the number of identical layers once it falls at
    the same point of that phase (the last layer's backward, the update of the largest tensor...): ``b(L) =
    b(l1) + (L - l1) * (b(l2) - b(l1)) / (l2 - l1)``. So each phase is extrapolated on its own and the full
    depth's peak is the largest extrapolated phase, with that phase's categories. A third depth must agree to
    the byte, phase by phase (ValueError naming the phase and what differs). Reports without phases (a plain
    ``StepMemory``) are extrapolated as one phase, which is only right where the peak stays in one phase.

    Why backward is two phases: while block ``k`` runs its backward, the activations of blocks below it and the
    gradients of blocks above it are alive, so the bytes are affine in ``k`` and backward's peak is at its start
    (activations outweigh gradients, per block) or its end (the other way), and with two constants of different
    size the two can swap between shallow and full depth. Ending ``backward`` where the first block's backward
    begins puts the end in ``backward_tail``; ``backward`` can then still swap from its start to the second
    block's backward, but only where gradients outweigh activations, and then the tail, which holds one block's
    gradients more, is larger. With depths below 2 blocks there is no first block to divide at: both parts are
    taken as one.

    Each category's own maximum over the step is not affine (it falls at different points at different depths:
    the temporaries of the first layer's backward are not those of the others), so ``max_by_category`` is
    empty. ``seconds`` is the sum over the measurements.
    """
    depths = sorted(reports)
    if len(depths) < 2:
        raise ValueError(f"extrapolate_peak needs reports at two or more depths; got {depths}")
    seconds = sum(r.seconds for r in reports.values())
    phased = [dict(getattr(reports[d], "phases", None) or {}) for d in depths]
    if all(phased):
        if depths[0] < 2 or any(p.keys() != phased[0].keys() for p in phased):
            phased = [_merged_backward(p) for p in phased]  # one block: no first block to divide backward at
        phases = {}
        for name in phased[0]:
            values = {d: {"peak": p[name].peak_bytes, **p[name].by_category} for d, p in zip(depths, phased,
                                                                                              strict=True)}
            got = _affine(values, n_layers, f"the {name} phase's peak")
            phases[name] = PhasePeak(got.pop("peak"), got)
        top = max(phases.values(), key=lambda p: p.peak_bytes)
        return TrainingStep(peak_bytes=top.peak_bytes, by_category=dict(top.by_category), max_by_category={},
                            seconds=seconds, phases=phases)
    values = {d: {"peak": reports[d].peak_bytes, **reports[d].by_category} for d in depths}
    got = _affine(values, n_layers, "the step's peak")
    return TrainingStep(peak_bytes=got.pop("peak"), by_category=got, max_by_category={}, seconds=seconds)


__all__ = ["Fit", "MeasureCache", "TrainingStep", "extrapolate_peak", "fake_module", "largest_fitting",
           "measure_training"]
