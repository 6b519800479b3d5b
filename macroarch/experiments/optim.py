"""The training runs that notebooks 06 (C8, section 4.1) and 08 (C10, section 5.1) sweep.

Each function trains one causal LM (a transformers model whose forward takes ``input_ids`` and ``labels``)
on a list of ``(input_ids, labels)`` batches and returns a :class:`RunResult`; the notebooks choose the
sweep, plot and grade. Nothing here is specific to a model size or device: batches move to the model's
device, autocast and GradScaler use its device type.

- :func:`accumulation_run` (C8): one global batch per update, split into ``accumulation_steps`` micro-batches,
  so every accumulation count sees the same tokens per update and the same number of updates: in exact
  arithmetic all counts give the same trajectory, and any difference between them is precision. The
  optimizer is ``CompensatedAdamW`` with the master copy forced on or off; it counts the updates that
  round to zero.
- :func:`loss_scaling_run` (C8): fp32 weights, fp16 autocast (the setting ``torch.amp.GradScaler`` is made
  for), with no loss scale, GradScaler, or the post's ``2^5 / max_grad_norm`` (``NormGradScaler``).
  Overflows are skipped updates. Underflow is probed every ``probe_every`` updates against an fp32 backward
  at the same weights and batch: the fraction of gradient elements nonzero in fp32 that are zero in the
  fp16 run, and the relative error of the unscaled fp16 gradient.
- :func:`recipe_run` (C10): warmup + cosine schedule with the post's LR multiplier and warmup extension
  (``macroarch.optim.recipe``) on one of the ``STACKS``: ``"plain"`` (``torch.optim.AdamW``), ``"mvas"`` (MVAS +
  DGR + ``MVASAdamW``) or ``"macro"``
  (``DGRWrapper`` in sync mode stepping ``CompensatedAdamW`` per group, with the norm-rule scale and a
  ``LossSpikeGuard`` that lowers the LR). A stack is a function ``(model, example, lr) -> Setup``; a new
  variant (MVAS, say) is one more entry. Every stack's losses go through a guard, attached or not, so the
  plain stack reports how often the guard *would* have fired.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from macroarch.optim.compensated_adamw import CompensatedAdamW
from macroarch.optim.recipe import recipe_scheduler
from macroarch.optim.scale import NormGradScaler
from macroarch.optim.spike_guard import LossSpikeGuard

Batch = tuple[torch.Tensor, torch.Tensor]
SCALING_METHODS = ("none", "gradscaler", "norm_rule")


@dataclass
class RunResult:
    """What one training run measured.

    Attributes:
        losses: training loss of each update (mean over its micro-batches); stops where the run diverged.
        eval_loss: mean loss on the evaluation batches at the end; NaN if the run diverged.
        diverged_at: index of the first update with a non-finite loss (the run stops there), or None.
        seconds: wall time of the training loop.
        metrics: run-specific numbers (lost-update fraction, overflows, underflow, triggers, ...).
        series: run-specific per-update series (the scale, the LR, ...).
    """

    losses: list[float]
    eval_loss: float
    diverged_at: int | None
    seconds: float
    metrics: dict[str, float] = field(default_factory=dict)
    series: dict[str, list[float]] = field(default_factory=dict)

    @property
    def diverged(self) -> bool:
        return self.diverged_at is not None


def lm_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """The model's own causal-LM loss (transformers shifts the labels); the batch moves to the model's device."""
    device = next(model.parameters()).device
    return model(input_ids=batch[0].to(device), labels=batch[1].to(device)).loss


def _device_type(model: torch.nn.Module) -> str:
    return next(model.parameters()).device.type


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Sequence[Batch], autocast_dtype: torch.dtype | None = None) -> float:
    """Mean loss over ``batches`` (weighted by rows), in eval mode; the model's train/eval mode is restored."""
    was_training = model.training
    model.eval()
    total, rows = 0.0, 0
    try:
        for batch in batches:
            with torch.autocast(_device_type(model), dtype=autocast_dtype, enabled=autocast_dtype is not None):
                loss = lm_loss(model, batch)
            total += float(loss) * len(batch[0])
            rows += len(batch[0])
    finally:
        model.train(was_training)
    return total / rows


def _split(batch: Batch, parts: int) -> list[Batch]:
    rows = len(batch[0])
    if rows % parts:
        raise ValueError(f"accumulation_steps={parts} must divide the batch's {rows} rows")
    return list(zip(batch[0].chunk(parts), batch[1].chunk(parts)))


# --------------------------------------------------------------------------------------------- C8: accumulation
def accumulation_run(model: torch.nn.Module, batches: Sequence[Batch], eval_set: Sequence[Batch], *, lr: float,
                     accumulation_steps: int, master_weights: bool, weight_decay: float = 0.0,
                     on_update: Callable[[int, float], None] | None = None) -> RunResult:
    """Train ``model`` (in its own dtype) one update per batch, the batch split into ``accumulation_steps``
    micro-batches; ``CompensatedAdamW`` with the master copy forced on or off, counting lost updates.

    Metrics: ``lost_update_fraction`` (due updates that left the stored weight unchanged: the master when
    there is one), ``stalled_fraction`` (due updates that left the model's own weight unchanged).
    """
    opt = CompensatedAdamW(model.parameters(), lr=lr, weight_decay=weight_decay, master_weights=master_weights,
                           accumulation_steps=accumulation_steps, count_lost_updates=True)
    losses, diverged_at = [], None
    start = time.perf_counter()
    for update, batch in enumerate(batches):
        micro_losses = []
        for micro in _split(batch, accumulation_steps):
            loss = lm_loss(model, micro)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            micro_losses.append(loss.item())
        loss = sum(micro_losses) / len(micro_losses)
        if not math.isfinite(loss):
            diverged_at = update
            break
        losses.append(loss)
        if on_update is not None:
            on_update(update, loss)
    seconds = time.perf_counter() - start
    eval_loss = math.nan if diverged_at is not None else evaluate(model, eval_set)
    if not math.isfinite(eval_loss):
        diverged_at = len(losses) if diverged_at is None else diverged_at
    due = opt.stats["due_elements"]
    metrics = {"lost_update_fraction": opt.stats["lost_elements"] / due if due else math.nan,
               "stalled_fraction": opt.stats["stalled_elements"] / due if due else math.nan,
               "master_copies": sum(opt.master_weight(p) is not None for p in model.parameters())}
    return RunResult(losses, eval_loss, diverged_at, seconds, metrics)


# ------------------------------------------------------------------------------------------- C8: loss scaling
def _probe_underflow(model: torch.nn.Module, batch: Batch, scale: float) -> tuple[float, float] | None:
    """Compare the current (scaled, fp16-autocast) ``.grad`` with an fp32 backward at the same weights.

    Returns (fraction of elements nonzero in fp32 that are zero in the fp16 gradient, relative error of the
    unscaled fp16 gradient), or None if the fp16 gradient is not finite (an overflow, counted elsewhere).
    The model's ``.grad`` is left as it was.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad for p in params]
    if not all(torch.isfinite(g).all() for g in grads):
        return None
    for p in params:
        p.grad = None
    with torch.enable_grad():
        lm_loss(model, batch).backward()
    lost = nonzero = 0
    err_sq = ref_sq = 0.0
    for p, g in zip(params, grads):
        ref = p.grad
        mask = ref != 0
        nonzero += int(mask.sum())
        lost += int((mask & (g == 0)).sum())
        err_sq += float(((g.float() / scale - ref) ** 2).sum())
        ref_sq += float((ref**2).sum())
        p.grad = g
    return (lost / nonzero if nonzero else 0.0), math.sqrt(err_sq / ref_sq) if ref_sq else 0.0


def loss_scaling_run(model: torch.nn.Module, batches: Sequence[Batch], eval_set: Sequence[Batch], *, method: str,
                     lr: float, autocast_dtype: torch.dtype = torch.float16, probe_every: int = 10,
                     weight_decay: float = 0.0,
                     on_update: Callable[[int, float], None] | None = None) -> RunResult:
    """Train fp32 ``model`` under fp16 autocast with loss scaling ``method`` (``"none"``, ``"gradscaler"``,
    ``"norm_rule"``); AdamW update in every case (``CompensatedAdamW``, which is AdamW without options).

    Metrics: ``overflow_steps`` (updates skipped for non-finite gradients), ``underflow_fraction`` and
    ``grad_rel_error`` (means over the probes), ``final_scale``. Series: ``scale`` per update.
    """
    if method not in SCALING_METHODS:
        raise ValueError(f"method={method!r} must be one of {SCALING_METHODS}")
    if isinstance(probe_every, bool) or not isinstance(probe_every, int) or probe_every < 1:
        raise ValueError(f"probe_every={probe_every!r} must be an int >= 1")
    opt = CompensatedAdamW(model.parameters(), lr=lr, weight_decay=weight_decay,
                           grad_scale="norm" if method == "norm_rule" else None)
    amp_scaler = torch.amp.GradScaler(_device_type(model)) if method == "gradscaler" else None
    losses, scales, probes, overflows, diverged_at = [], [], [], 0, None
    start = time.perf_counter()
    for update, batch in enumerate(batches):
        with torch.autocast(_device_type(model), dtype=autocast_dtype):
            loss = lm_loss(model, batch)
        value = loss.item()
        if not math.isfinite(value):
            diverged_at = update
            break
        if amp_scaler is not None:
            scale = amp_scaler.get_scale()
            amp_scaler.scale(loss).backward()
        else:
            scale = 1.0 if opt.grad_scaler is None else opt.grad_scaler.get_scale()
            opt.scale_loss(loss).backward()
        if update % probe_every == 0:
            probe = _probe_underflow(model, batch, scale)
            if probe is not None:
                probes.append(probe)
        if amp_scaler is not None:
            amp_scaler.step(opt)
            amp_scaler.update()
            overflows += amp_scaler.get_scale() < scale  # GradScaler lowers its scale exactly when it skipped
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(value)
        scales.append(scale)
        if on_update is not None:
            on_update(update, value)
    seconds = time.perf_counter() - start
    if opt.grad_scaler is not None:
        overflows = opt.grad_scaler.overflows
    eval_loss = math.nan if diverged_at is not None else evaluate(model, eval_set, autocast_dtype)
    metrics = {"overflow_steps": overflows,
               "underflow_fraction": sum(p[0] for p in probes) / len(probes) if probes else math.nan,
               "grad_rel_error": sum(p[1] for p in probes) / len(probes) if probes else math.nan,
               "probes": len(probes), "final_scale": scales[-1] if scales else math.nan}
    return RunResult(losses, eval_loss, diverged_at, seconds, metrics, {"scale": scales})


# ---------------------------------------------------------------------------------------------- C10: recipe
@dataclass
class Setup:
    """What a stack hands the training loop: the module to call, its optimizer, how to scale the loss before
    backward, and the guard that acts on spikes (None: the stack has none; the loop still watches)."""

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scale_loss: Callable[[torch.Tensor], torch.Tensor]
    guard: LossSpikeGuard | None = None


def plain_stack(model: torch.nn.Module, example: Batch, lr: float, **options: Any) -> Setup:
    """``torch.optim.AdamW`` on the model as it is."""
    return Setup(model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=options.get("weight_decay", 0.0)),
                 lambda loss: loss)


def macro_stack(model: torch.nn.Module, example: Batch, lr: float, *, group_size: int = 2,
                spike_threshold: float = 0.15, guard_window: int = 20, **options: Any) -> Setup:
    """``DGRWrapper`` (sync) over ``model``, each group stepped by ``CompensatedAdamW`` with one shared
    ``NormGradScaler`` and one shared ``LossSpikeGuard`` (action ``"lower_lr"``)."""
    from macroarch.dgr import DGRWrapper

    # atomic_steps=False: CompensatedAdamW skips bad updates itself rather than raising, so DGR's per-step
    # copies of every group (for restoring after an exception) would only cost time.
    device = next(model.parameters()).device
    wrapper = DGRWrapper(model, group_size=group_size, mode="sync", atomic_steps=False,
                         example_inputs={"input_ids": example[0].to(device), "labels": example[1].to(device)})
    scaler = NormGradScaler()
    guard = LossSpikeGuard(threshold=spike_threshold, window=guard_window, action="lower_lr")
    factory = functools.partial(CompensatedAdamW, grad_scale=scaler, spike_guard=guard)
    opt = wrapper.optimizer(factory, lr=lr, weight_decay=options.get("weight_decay", 0.0))
    return Setup(wrapper, opt, scaler.scale, guard)


def mvas_stack(model: torch.nn.Module, example: Batch, lr: float, *, group_size: int = 2,
               target_reduction: float = 0.75, seed: int = 0, **options: Any) -> Setup:
    """MVAS + DGR: the weights packed by a budget plan (the tensors MVAS manages shrink by ``target_reduction``
    of their own bytes, the formats chosen by squared rounding error), ``DGRWrapper`` (sync) stepping
    ``MVASAdamW`` per group (stochastic rounding, fp8 moments). No loss scale (the weights compute in their own
    dtype) and no guard of its own (``MVASAdamW`` has no LR hook): the loop's detached guard counts what would
    have fired."""
    from macroarch import mvas
    from macroarch.dgr import DGRWrapper
    named = dict(model.named_parameters())
    eligible, kept = mvas.packable(named)  # the packable tensors shrink by target_reduction, the rest stay
    target = kept + (1 - target_reduction) * sum(p.numel() * p.element_size() for p in eligible.values())
    mvas.apply(model, mvas.plan_for_budget(named, target_bytes=int(target)))
    device = next(model.parameters()).device
    wrapper = DGRWrapper(model, group_size=group_size, mode="sync",
                         example_inputs={"input_ids": example[0].to(device), "labels": example[1].to(device)})
    opt = wrapper.optimizer(mvas.MVASAdamW, lr=lr, weight_decay=options.get("weight_decay", 0.0), seed=seed)
    return Setup(wrapper, opt, lambda loss: loss)


STACKS: dict[str, Callable[..., Setup]] = {"plain": plain_stack, "macro": macro_stack, "mvas": mvas_stack}


def recipe_run(model: torch.nn.Module, batches: Sequence[Batch], eval_set: Sequence[Batch], *, stack: str,
               base_lr: float, lr_multiplier: float, warmup_steps: int, warmup_extension: float,
               min_lr_ratio: float = 0.1, spike_threshold: float = 0.15, guard_window: int = 20,
               on_update: Callable[[int, float], None] | None = None, **stack_options: Any) -> RunResult:
    """Train ``model`` on ``batches`` (one update each) with ``STACKS[stack]`` and the recipe schedule.

    Metrics: ``spike_triggers`` (the guard's triggers; for a stack without a guard, those a detached guard
    with the same settings would have fired), ``min_lr_factor`` (the lowest LR factor the guard set).
    Series: ``lr`` of the first param group per update.
    """
    if stack not in STACKS:
        raise ValueError(f"stack={stack!r} must be one of {sorted(STACKS)}")
    setup = STACKS[stack](model, batches[0], base_lr, spike_threshold=spike_threshold, guard_window=guard_window,
                          **stack_options)
    guard = setup.guard or LossSpikeGuard(threshold=spike_threshold, window=guard_window)
    sched = recipe_scheduler(setup.optimizer, warmup_steps, len(batches), lr_multiplier=lr_multiplier,
                             warmup_extension=warmup_extension, min_lr_ratio=min_lr_ratio)
    losses, lrs, min_factor, diverged_at = [], [], 1.0, None
    start = time.perf_counter()
    for update, batch in enumerate(batches):
        loss = lm_loss(setup.module, batch)
        value = loss.item()
        guard.observe(value)  # before backward: DGR's groups step inside it
        min_factor = min(min_factor, guard.lr_factor)
        if not math.isfinite(value):
            diverged_at = update
            break
        lrs.append(setup.optimizer.param_groups[0]["lr"] * (guard.lr_factor if setup.guard is not None else 1.0))
        setup.scale_loss(loss).backward()
        setup.optimizer.step()
        setup.optimizer.zero_grad(set_to_none=True)
        sched.step()
        losses.append(value)
        if on_update is not None:
            on_update(update, value)
    seconds = time.perf_counter() - start
    eval_loss = math.nan if diverged_at is not None else evaluate(model, eval_set)
    metrics = {"spike_triggers": len(guard.triggers), "min_lr_factor": min_factor}
    return RunResult(losses, eval_loss, diverged_at, seconds, metrics, {"lr": lrs})


def fitted_optimum(multipliers: Sequence[float], losses: Sequence[float]) -> float:
    """The multiplier at the minimum of a parabola fitted to ``losses`` over ``log(multipliers)``, clipped to the
    grid's range; the grid's argmin when there are fewer than three points or the fit is not convex.

    A sweep's argmin jumps between neighbouring grid points with seed noise when the loss is flat near its
    minimum; the vertex of a least-squares parabola uses every point and moves smoothly.
    """
    if len(multipliers) != len(losses) or not multipliers:
        raise ValueError(f"multipliers ({len(multipliers)}) and losses ({len(losses)}) must be non-empty and match")
    best = min(zip(losses, multipliers))[1]
    if len(multipliers) < 3:
        return float(best)
    x = torch.tensor([math.log(m) for m in multipliers], dtype=torch.float64)
    y = torch.tensor(list(losses), dtype=torch.float64)
    design = torch.stack([x * x, x, torch.ones_like(x)], dim=1)  # (n, 3)
    a, b, _ = torch.linalg.lstsq(design, y[:, None]).solution[:, 0].tolist()
    if a <= 0:
        return float(best)
    vertex = -b / (2 * a)
    return float(math.exp(min(max(vertex, float(x.min())), float(x.max()))))


def optimum_ratio_interval(multipliers: Sequence[float], losses_a: Sequence[Sequence[float]],
                           losses_b: Sequence[Sequence[float]], *, samples: int = 1000, level: float = 0.9,
                           seed: int = 0) -> tuple[float, float]:
    """A paired bootstrap interval of ``optimum(b) / optimum(a)``.

    ``losses_a[i][j]`` is the loss of seed ``i`` at ``multipliers[j]`` (likewise ``losses_b``, same seeds). Each
    sample draws seeds with replacement (the same draw for a and b: the runs are paired by seed), takes the
    per-multiplier median over the drawn seeds and the ratio of the two :func:`fitted_optimum`. Returns the
    central ``level`` interval of the samples.
    """
    a = torch.as_tensor(losses_a, dtype=torch.float64)
    b = torch.as_tensor(losses_b, dtype=torch.float64)
    if a.shape != b.shape or a.ndim != 2 or a.shape[1] != len(multipliers):
        raise ValueError(f"losses_a {tuple(a.shape)} and losses_b {tuple(b.shape)} must both be (seeds, "
                         f"{len(multipliers)} multipliers)")
    if not 0 < level < 1:
        raise ValueError(f"level={level!r} must lie in (0, 1)")
    generator = torch.Generator().manual_seed(seed)
    ratios = []
    for _ in range(samples):
        draw = torch.randint(0, a.shape[0], (a.shape[0],), generator=generator)
        opt_a = fitted_optimum(multipliers, a[draw].median(dim=0).values.tolist())
        opt_b = fitted_optimum(multipliers, b[draw].median(dim=0).values.tolist())
        ratios.append(opt_b / opt_a)
    ratios = torch.tensor(ratios, dtype=torch.float64)
    tail = (1 - level) / 2
    return float(torch.quantile(ratios, tail)), float(torch.quantile(ratios, 1 - tail))
