"""Notebook 08's experiment (claim C10, post section 5.1): the LR multiplier, the longer warmup and the spike guard.

One small GPT-2-style decoder trained through the project's one loop (``experiments.loop.train_lm``) with a linear
warmup + cosine schedule (``macroarch.optim.recipe``) on the ``STACKS``:

- ``"plain"``: ``torch.optim.AdamW`` (``MasterWeightAdamW``, bf16 weights + fp32 master, when the compute dtype is
  bf16);
- ``"macro"``: ``DGRWrapper`` in sync mode stepping ``CompensatedAdamW`` per group, with the post's
  ``2^5 / max_grad_norm`` loss scale (``NormGradScaler``) and a ``LossSpikeGuard`` that lowers the LR. Built by
  hand: ``compose.apply`` has no loss scale or guard to attach;
- ``"mvas"``: MVAS + DGR + ``MVASAdamW`` through ``macroarch.compose.apply``, the weights packed by a budget plan
  (a quarter of their bytes).

Seeds are paired: seed i gives every stack, multiplier and warmup the same initial weights and batch order, and
every run is evaluated on the same held-out batches. :func:`recipe_run` is one run; :func:`sweep` the grid (every
stack over the LR multipliers at one warmup, the post's +30%; the usual warmup at a few multipliers), grown past an
edge where a graded stack's optimum lies there; :func:`analyse` the estimates the verdict reads:

- ``best_lr_multiplier``: macro's LR optimum over plain's at the same warmup. Each optimum is that of the
  seed-mean held-out loss curve (:func:`curve_optimum`: a parabola in log LR through the lowest grid point and its
  neighbours), the interval a paired bootstrap over seeds (:func:`shift_estimate`). An optimum at the grid's first
  or last point is at the edge (by index), and ``optimum_at_grid_edge`` counts the graded stacks where it is;
- the paired warmup and recipe gains (``measure.stats.paired_difference`` over seeds) and the spike guard's
  triggers.

A diverged run is charged the untrained model's held-out loss.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.figure import Figure

from macroarch import compose, mvas
from macroarch._progress import tqdm
from macroarch.config import DGRConfig, MacroConfig, OptimConfig
from macroarch.data import ensure_corpus, eval_batches, lm_batches, load_corpus
from macroarch.experiments.loop import Batch, RunResult, evaluate_lm, mvas_kernels, train_lm
from macroarch.experiments.settings import COMPUTE_DTYPES, Settings
from macroarch.measure.machine import describe, machine_info, torch_dtype
from macroarch.measure.stats import Estimate, Repeated, bootstrap, paired_difference
from macroarch.measure.workload import lm_loss
from macroarch.models import get_model_spec
from macroarch.optim import CompensatedAdamW, LossSpikeGuard, MasterWeightAdamW, NormGradScaler, recipe_scheduler


# ------------------------------------------------------------------------------------------------ stacks
@dataclass
class Setup:
    """What a stack hands the training loop: the module to call, its optimizer, how to scale the loss before
    backward, and the guard that acts on spikes (None: the stack has none; the loop still watches)."""

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scale_loss: Callable[[torch.Tensor], torch.Tensor]
    guard: LossSpikeGuard | None = None
    store: Any = None
    """The ``MVASStore`` of a stack that packs weights."""


def _low_precision(model: torch.nn.Module) -> bool:
    return next(model.parameters()).dtype in (torch.bfloat16, torch.float16)


def plain_stack(model: torch.nn.Module, example: Batch, lr: float, **options: Any) -> Setup:
    """``torch.optim.AdamW`` on the model as it is (16-bit weights: ``MasterWeightAdamW``, fp32 master)."""
    cls = MasterWeightAdamW if _low_precision(model) else torch.optim.AdamW
    return Setup(model, cls(model.parameters(), lr=lr, weight_decay=options.get("weight_decay", 0.0)),
                 lambda loss: loss)


def _example(model: torch.nn.Module, example: Batch) -> dict[str, torch.Tensor]:
    device = next(model.parameters()).device
    return {"input_ids": example[0].to(device), "labels": example[1].to(device)}


def macro_stack(model: torch.nn.Module, example: Batch, lr: float, *, group_size: int = 2,
                spike_threshold: float = 0.15, guard_window: int = 20, **options: Any) -> Setup:
    """``DGRWrapper`` (sync) over ``model``, each group stepped by ``CompensatedAdamW`` with one shared
    ``NormGradScaler`` and one shared ``LossSpikeGuard`` (action ``"lower_lr"``); fp32 master copies when the
    weights are 16-bit."""
    from macroarch.dgr import DGRWrapper

    # atomic_steps=False: CompensatedAdamW skips bad updates itself rather than raising, so DGR's per-step
    # copies of every group (for restoring after an exception) would only cost time.
    wrapper = DGRWrapper(model, group_size=group_size, mode="sync", atomic_steps=False,
                         example_inputs=_example(model, example))
    scaler = NormGradScaler()
    guard = LossSpikeGuard(threshold=spike_threshold, window=guard_window, action="lower_lr")
    factory = functools.partial(CompensatedAdamW, grad_scale=scaler, spike_guard=guard,
                                **({"master_weights": True} if _low_precision(model) else {}))
    opt = wrapper.optimizer(factory, lr=lr, weight_decay=options.get("weight_decay", 0.0))
    return Setup(wrapper, opt, scaler.scale, guard)


def mvas_stack(model: torch.nn.Module, example: Batch, lr: float, *, group_size: int = 2,
               target_reduction: float = 0.75, seed: int = 0, **options: Any) -> Setup:
    """MVAS + DGR through ``compose.apply``: the weights packed by a budget plan (the tensors MVAS manages shrink
    by ``target_reduction`` of their own bytes, the formats chosen by squared rounding error), ``DGRWrapper``
    (sync) stepping ``MVASAdamW`` per group (stochastic rounding, fp8 moments). No loss scale (the weights
    compute in their own dtype) and no guard of its own (``MVASAdamW`` has no LR hook): the loop's detached
    guard counts what would have fired."""
    named = dict(model.named_parameters())
    eligible, kept = mvas.packable(named)  # the packable tensors shrink by target_reduction, the rest stay
    target = kept + (1 - target_reduction) * sum(p.numel() * p.element_size() for p in eligible.values())
    plan = mvas.plan_for_budget(named, target_bytes=int(target))
    config = MacroConfig(optim=OptimConfig(lr=lr, weight_decay=options.get("weight_decay", 0.0)),
                         dgr=DGRConfig(group_size=group_size))
    stack = compose.apply(model, config, plan=plan, example_inputs=_example(model, example), seed=seed)
    return Setup(stack.model, stack.optimizer, lambda loss: loss, store=stack.store)


STACKS: dict[str, Callable[..., Setup]] = {"plain": plain_stack, "macro": macro_stack, "mvas": mvas_stack}


def recipe_run(model: torch.nn.Module, batches: Sequence[Batch], eval_set: Sequence[Batch], *, stack: str,
               base_lr: float, lr_multiplier: float, warmup_steps: int, warmup_extension: float,
               min_lr_ratio: float = 0.1, spike_threshold: float = 0.15, guard_window: int = 20,
               on_update: Callable[[int, float], None] | None = None, **stack_options: Any) -> RunResult:
    """Train ``model`` on ``batches`` (one update each) with ``STACKS[stack]`` and the recipe schedule.

    Each step: forward, the guard observes the loss (before backward: DGR's groups step inside it), backward of
    the scaled loss, the optimizer, the scheduler. Metrics: ``spike_triggers`` (the guard's triggers; for a
    stack without a guard, those a detached guard with the same settings would have fired, a non-finite loss
    included), ``min_lr_factor`` (the lowest LR factor the guard set). Series: ``lr`` applied per step.
    """
    if stack not in STACKS:
        raise ValueError(f"stack={stack!r} must be one of {sorted(STACKS)}")
    setup = STACKS[stack](model, batches[0], base_lr, spike_threshold=spike_threshold, guard_window=guard_window,
                          **stack_options)
    guard = setup.guard or LossSpikeGuard(threshold=spike_threshold, window=guard_window)
    sched = recipe_scheduler(setup.optimizer, warmup_steps, len(batches), lr_multiplier=lr_multiplier,
                             warmup_extension=warmup_extension, min_lr_ratio=min_lr_ratio)
    lrs: list[float] = []
    min_factor = [1.0]

    def step(module: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Batch) -> float:
        loss = lm_loss(module, batch)
        value = loss.item()
        guard.observe(value)  # before backward: DGR's groups step inside it
        min_factor[0] = min(min_factor[0], guard.lr_factor)
        if not math.isfinite(value):
            return value  # the loop stops here
        lrs.append(optimizer.param_groups[0]["lr"] * (guard.lr_factor if setup.guard is not None else 1.0))
        setup.scale_loss(loss).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sched.step()
        return value

    log = train_lm(setup.module, setup.optimizer, batches, step=step, after_step=on_update, on_nonfinite="stop")
    eval_loss = math.nan if log.diverged else evaluate_lm(model, eval_set).loss
    metrics = {"spike_triggers": len(guard.triggers), "min_lr_factor": min_factor[0]}
    return RunResult(log.losses, eval_loss, log.diverged_at, log.wall_seconds, metrics, {"lr": lrs})


# ---------------------------------------------------------------------------------------------- statistics
def curve_optimum(multipliers: Sequence[float], losses: Sequence[float]) -> tuple[float, int]:
    """The LR multiplier at the minimum of one loss curve, and the grid index of its lowest point.

    ``multipliers`` must increase. Around the lowest point (index ``i``) a parabola in log(multiplier) through
    points ``i - 1, i, i + 1`` gives the vertex, kept within those neighbours: it moves smoothly with the losses
    where the argmin would jump between grid points. A lowest point at either end of the grid (``i`` is 0 or
    ``len - 1``) has no neighbour on one side: the optimum is that grid point, and the caller reports it as at the
    grid's edge (:func:`at_edge`). Equal losses at the lowest point give its first grid point.
    """
    x = np.log(np.asarray(multipliers, dtype=float))
    y = np.asarray(losses, dtype=float)
    if x.ndim != 1 or x.shape != y.shape or x.size == 0:
        raise ValueError(f"multipliers ({x.size}) and losses ({y.size}) must be non-empty and match")
    if np.any(np.diff(x) <= 0):
        raise ValueError(f"multipliers must increase, got {list(multipliers)}")
    i = int(np.argmin(y))
    if at_edge(i, x.size):
        return float(np.exp(x[i])), i
    (x0, x1, x2), (y0, y1, y2) = x[i - 1:i + 2], y[i - 1:i + 2]
    # Vertex of the parabola through three points (divided differences); y1 is the lowest, so it opens upward
    # unless all three are equal.
    d1, d2 = (y1 - y0) / (x1 - x0), (y2 - y1) / (x2 - x1)
    curvature = (d2 - d1) / (x2 - x0)
    if curvature <= 0:
        return float(np.exp(x1)), i
    vertex = (x0 + x1) / 2 - d1 / (2 * curvature)
    return float(np.exp(min(max(vertex, x0), x2))), i


def at_edge(index: int, size: int) -> bool:
    """Whether grid index ``index`` is the first or last of ``size`` points (by index, not by value)."""
    return index in (0, size - 1)


def mean_curve_optimum(multipliers: Sequence[float], table: np.ndarray) -> tuple[float, int]:
    """:func:`curve_optimum` of the seed-mean curve of ``table`` (seeds, multipliers)."""
    return curve_optimum(multipliers, np.asarray(table, dtype=float).mean(axis=0))


def _log_shift(*columns: np.ndarray, multipliers: Sequence[float]) -> float:
    """log(optimum of b / optimum of a) from ``columns``: a's per-multiplier columns of per-seed losses, then b's."""
    m = len(multipliers)
    a, b = np.stack(columns[:m], axis=1), np.stack(columns[m:], axis=1)
    return math.log(mean_curve_optimum(multipliers, b)[0] / mean_curve_optimum(multipliers, a)[0])


def _log_optimum(*columns: np.ndarray, multipliers: Sequence[float]) -> float:
    return math.log(mean_curve_optimum(multipliers, np.stack(columns, axis=1))[0])


def _exp(e: Estimate, method: str) -> Estimate:
    """An estimate made on logs, back on the ratio scale (interval endpoints exponentiated)."""
    low, high = (None, None) if not e.has_interval else (math.exp(e.low), math.exp(e.high))
    return Estimate(math.exp(e.value), low, high, confidence=e.confidence, n=e.n, method=method, unit="x",
                    log_scale=True)


SHIFT_METHOD = ("optimum ratio of the seed-mean loss curves (3-point parabola in log LR at the lowest grid point), "
                "percentile bootstrap over paired seeds, on log ratios")


def shift_estimate(*columns: Sequence[float], multipliers: Sequence[float], seed: int = 0) -> Estimate:
    """How many times b's LR optimum is a's: optimum of b's seed-mean curve / optimum of a's, with a paired
    bootstrap over seeds (``measure.stats.bootstrap``; seed i's runs of a and b resampled together).

    ``columns``: for each multiplier, the per-seed held-out losses of a, then the same for b (``2 x
    len(multipliers)`` sequences, element i from seed i). Percentile intervals, not BCa: the statistic moves in
    jumps where the lowest grid point of a resample changes, and BCa's jackknife acceleration assumes a smooth one.
    Fewer than ``stats.MIN_BOOTSTRAP_N`` seeds: no interval (the grade is then inconclusive). The shape of a
    :class:`~macroarch.measure.stats.Repeated` build, for leaving a seed out.
    """
    if len(columns) != 2 * len(multipliers):
        raise ValueError(f"shift_estimate: {len(columns)} columns for {len(multipliers)} multipliers; need "
                         f"{2 * len(multipliers)} (a's, then b's)")
    e = bootstrap(tuple(columns), functools.partial(_log_shift, multipliers=tuple(multipliers)), method="percentile",
                  seed=seed, label=SHIFT_METHOD)
    return _exp(e, e.method)


def optimum_estimate(*columns: Sequence[float], multipliers: Sequence[float], seed: int = 0) -> Estimate:
    """One stack's LR optimum (multiplier of the base LR) from its seed-mean curve, bootstrapped over seeds
    like :func:`shift_estimate` (``columns``: one per multiplier, element i from seed i)."""
    e = bootstrap(tuple(columns), functools.partial(_log_optimum, multipliers=tuple(multipliers)),
                  method="percentile", seed=seed,
                  label="optimum of the seed-mean loss curve (3-point parabola in log LR), percentile bootstrap "
                        "over seeds, on logs")
    return _exp(e, e.method)


def _extension(multipliers: Sequence[float], side: int) -> float:
    """The next grid point past the lower (``side`` -1) or upper (+1) edge: the edge spacing again, in log LR."""
    m = sorted(multipliers)
    nxt = m[0] * m[0] / m[1] if side < 0 else m[-1] * m[-1] / m[-2]
    return float(f"{nxt:.3g}")


# ---------------------------------------------------------------------------------------------- the notebook
@dataclass(frozen=True)
class RecipeSettings(Settings):
    """Notebook 08's settings: its parameters cell, less ``profile`` (``RecipeSettings.from_params(params)``)."""

    seeds: int
    """Paired seeds (``seed``, ``seed + 1``, ...): each seed's initial weights, batch order and held-out batches are
    the same for every stack, multiplier and warmup. The bootstrap interval needs ``stats.MIN_BOOTSTRAP_N``."""
    n_layers: int
    """Decoder layers (GPT-2 style)."""
    width: int
    """Decoder width (feed-forward: 4 x width)."""
    n_heads: int
    """Attention heads; must divide ``width``."""
    seq_len: int
    """Bytes per sequence."""
    batch_size: int
    """Sequences per step."""
    steps: int
    """Steps per run: long enough that every run is past the early loss plateau."""
    base_lr: float
    """The usual LR (multiplier 1.0), near plain AdamW's best for this model."""
    warmup_steps: int
    """The usual warmup (factor 1.0), about 10% of the steps."""
    lr_multipliers: tuple[float, ...]
    """The starting grid of LR multipliers (increasing, at least 3, holding 1.0 and ``recipe_multiplier``), run at
    the graded warmup for every stack; extended past an edge where a graded stack's optimum lies there."""
    eval_batches: int
    """Held-out batches of the final loss."""
    device: str
    """cpu or cuda."""
    threads: int
    """Torch threads."""
    seed: int = 0
    """First seed."""
    corpus: str = "stdlib"
    """data/text/<corpus>."""
    warmup_factors: tuple[float, ...] = (1.0, 1.3)
    """Warmup lengths as factors of ``warmup_steps``; first: the usual warmup; last: the post's +30%, at which both
    graded stacks sweep the LR (the graded shift compares them at this one, equal, warmup)."""
    warmup_multipliers: tuple[float, ...] = (1.0,)
    """The LR multipliers at which the other warmup factors run (the paired warmup gain); each in the grid."""
    recipe_multiplier: float = 1.35
    """The post's recipe point (the centre of 1.2-1.5x), a grid point: macro at it with +30% warmup against macro at
    1x with the usual warmup."""
    max_grid_points: int = 9
    """The grid grows by one point past an edge where a graded stack's optimum lies, until it holds this many."""
    stacks: tuple[str, ...] = ("plain", "macro", "mvas")
    """The stacks of :data:`STACKS` run; ``plain`` and ``macro`` are graded, ``mvas`` is reported."""
    group_size: int = 2
    """DGR: blocks per group."""
    spike_threshold: float = 0.15
    """The guard's trigger: the loss this share over the mean of the last 20."""
    compute_dtype: str = "float32"
    """float32 | bfloat16 (``auto`` resolved by ``resolve_parameters``)."""
    compile_mvas: bool = False
    """MVAS kernels compiled by Inductor (pays on large tensors) or eager (tiny models: compiling costs more than
    it saves); sets ``mvas.COMPILE_ENV`` during the sweep."""

    def __post_init__(self) -> None:
        self._positive("seeds", "n_layers", "width", "n_heads", "seq_len", "batch_size", "steps", "base_lr",
                       "eval_batches", "threads", "group_size", "spike_threshold", "recipe_multiplier")
        self._non_negative("warmup_steps")
        self._positive("max_grid_points")
        self._non_empty("lr_multipliers", "warmup_factors", "stacks")
        self._one_of("compute_dtype", COMPUTE_DTYPES)
        self._device()
        if self.width % self.n_heads:
            self._fail("n_heads", f"a divisor of width {self.width}")
        m = self.lr_multipliers
        if len(m) < 3 or any(not x > 0 for x in m) or any(b <= a for a, b in zip(m, m[1:])):
            self._fail("lr_multipliers", "at least 3 increasing positive numbers")
        if self.max_grid_points < len(m):
            self._fail("max_grid_points", f"at least the {len(m)} points of lr_multipliers")
        if 1.0 not in m or self.recipe_multiplier not in m:
            self._fail("lr_multipliers", f"a grid holding 1.0 and recipe_multiplier {self.recipe_multiplier:g}")
        if any(x not in m for x in self.warmup_multipliers):
            self._fail("warmup_multipliers", f"multipliers of the grid {list(m)}")
        if len(self.warmup_factors) > 1 and 1.0 not in self.warmup_multipliers:
            self._fail("warmup_multipliers", "a list holding 1.0 (the usual settings of the recipe gain)")
        if any(not w > 0 for w in self.warmup_factors):
            self._fail("warmup_factors", "positive numbers")
        if any(stack not in STACKS for stack in self.stacks) or not {"plain", "macro"} <= set(self.stacks):
            self._fail("stacks", f"names from {', '.join(STACKS)}, holding plain and macro (the graded pair)")

    @property
    def graded_warmup(self) -> float:
        return self.warmup_factors[-1]


GRADED = ("plain", "macro")
"""The graded pair: ``best_lr_multiplier`` is macro's optimum over plain's at the same warmup."""


@dataclass
class Sweep:
    """Every run, keyed ``(stack, multiplier, warmup factor, seed)``: every stack at every grid multiplier with the
    graded warmup, and at ``warmup_multipliers`` with the other warmups."""

    settings: RecipeSettings
    seeds: list[int]
    n_params: int
    initial_loss: float
    multipliers: list[float] = field(default_factory=list)
    """The grid that ran at the graded warmup: the settings' grid and its extensions, increasing."""
    extensions: list[float] = field(default_factory=list)
    """Grid points added past an edge, in the order they ran."""
    results: dict[tuple[str, float, float, int], RunResult] = field(default_factory=dict)

    def losses(self, stack: str, warm: float, mult: float) -> np.ndarray:
        """Held-out loss of each seed; a diverged run is charged the untrained model's loss."""
        return np.array([self.initial_loss if self.results[stack, mult, warm, s].diverged
                         else self.results[stack, mult, warm, s].eval_loss for s in self.seeds])

    def diverged(self, stack: str, warm: float, mult: float) -> int:
        return sum(self.results[stack, mult, warm, s].diverged for s in self.seeds)

    def table(self, stack: str, warm: float | None = None) -> np.ndarray:
        """(seeds, multipliers) held-out losses over the grid (graded warmup unless ``warm``)."""
        warm = self.settings.graded_warmup if warm is None else warm
        return np.stack([self.losses(stack, warm, m) for m in self.multipliers], axis=1)

    def columns(self, *stacks: str) -> tuple[tuple[float, ...], ...]:
        """Per stack in turn, per grid multiplier: the per-seed losses at the graded warmup (the bootstraps' data)."""
        return tuple(tuple(self.table(stack)[:, j]) for stack in stacks for j in range(len(self.multipliers)))

    def rows(self) -> list[dict[str, Any]]:
        """One row per run (the raw per-seed data: a W&B table, and the seeds to leave out); a value a diverged run
        does not have (its held-out loss) is None."""
        rows = [{"stack": stack, "lr_multiplier": mult, "warmup_factor": warm, "seed": seed,
                 "eval_loss": r.eval_loss, "final_train_loss": r.losses[-1] if r.losses else None,
                 "diverged_at": r.diverged_at, "seconds": r.seconds, **r.metrics}
                for (stack, mult, warm, seed), r in self.results.items()]
        return [{k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
                for row in rows]

    def describe(self) -> str:
        p = self.settings
        grown = f" (extended by {', '.join(f'{x:g}' for x in self.extensions)})" if self.extensions else ""
        return (f"{p.n_layers}-layer decoder, width {p.width}: {self.n_params / 1e6:.3f}M parameters; "
                f"{p.steps} steps of {p.batch_size}x{p.seq_len} bytes in {p.compute_dtype}; {len(self.seeds)} paired "
                f"seeds; LR grid {', '.join(f'{x:g}' for x in self.multipliers)}{grown}; {len(self.results)} runs")


def _spec(p: RecipeSettings):
    return get_model_spec("gpt3_tiny").scaled(n_layers=p.n_layers, d_model=p.width, n_heads=p.n_heads,
                                              n_kv_heads=p.n_heads, d_ff=4 * p.width, dropout=0.0,
                                              max_seq_len=p.seq_len)


def _build(p: RecipeSettings, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = _spec(p).build(device=p.device)
    dtype = torch_dtype(p.compute_dtype)
    return model if dtype == torch.float32 else model.to(dtype)


def edge_sides(sw: Sweep) -> dict[str, int]:
    """Each graded stack whose seed-mean optimum is at the grid's first (-1) or last (+1) point."""
    out = {}
    for stack in GRADED:
        _, i = mean_curve_optimum(sw.multipliers, sw.table(stack))
        if at_edge(i, len(sw.multipliers)):
            out[stack] = -1 if i == 0 else 1
    return out


def sweep(settings: RecipeSettings) -> Sweep:
    """Threads, corpus, batches per seed, every run of the grid (progress bar), then more grid points, one at a
    time up to ``max_grid_points``, past an edge where a graded stack's optimum lies."""
    p = settings
    torch.set_num_threads(p.threads)
    logging.getLogger("macroarch.optim").setLevel(logging.ERROR)  # triggers are counted, not printed one by one
    text = load_corpus(ensure_corpus(p.corpus))
    seeds = [p.seed + i for i in range(p.seeds)]
    train = {s: list(lm_batches(text.train, p.batch_size, p.seq_len, seed=s, steps=p.steps)) for s in seeds}
    held_out = list(eval_batches(text.val, p.batch_size, p.seq_len, max_batches=p.eval_batches))  # every run's
    n_params = sum(t.numel() for t in _build(p, p.seed).parameters())
    out = Sweep(p, seeds, n_params, evaluate_lm(_build(p, p.seed), held_out).loss, multipliers=list(p.lr_multipliers))

    def run_all(grid: list[tuple[str, float, float, int]], desc: str) -> None:
        for stack, mult, warm, s in tqdm(grid, desc=desc, mininterval=10):
            options = dict(group_size=p.group_size) if stack != "plain" else {}
            out.results[stack, mult, warm, s] = recipe_run(
                _build(p, s), train[s], held_out, stack=stack, base_lr=p.base_lr, lr_multiplier=mult,
                warmup_steps=p.warmup_steps, warmup_extension=warm - 1.0, spike_threshold=p.spike_threshold,
                **options)

    with mvas_kernels(compiled=p.compile_mvas):
        grid = [(stack, mult, p.graded_warmup, s) for stack in p.stacks for mult in p.lr_multipliers for s in seeds]
        grid += [(stack, mult, warm, s) for stack in p.stacks for warm in p.warmup_factors[:-1]
                 for mult in p.warmup_multipliers for s in seeds]
        run_all(grid, "runs")
        for _ in range(p.max_grid_points - len(p.lr_multipliers)):
            sides = sorted(set(edge_sides(out).values()))
            if not sides:
                break
            new = [_extension(out.multipliers, side) for side in sides]
            out.extensions += new
            out.multipliers = sorted(out.multipliers + new)
            run_all([(stack, mult, p.graded_warmup, s) for stack in p.stacks for mult in new for s in seeds],
                    "grid extension")
    return out


def _key(stack: str, warm: float) -> str:
    return f"{stack}_w{warm:g}".replace(".", "p")


@dataclass
class Analysis:
    """What the verdict reads from a :class:`Sweep` (module docstring)."""

    means: dict[str, list[float]]
    """Per stack: the seed-mean held-out loss at each grid multiplier (graded warmup)."""
    errors: dict[str, list[float]]
    """Per stack: the standard error over seeds of each mean."""
    optimum: dict[str, float]
    """Per stack: the optimum of its seed-mean curve (:func:`curve_optimum`)."""
    edges: list[str]
    """Stacks (graded or not) whose optimum is at the grid's edge."""
    seed_shifts: list[float]
    """Per seed: macro's optimum / plain's on that seed's curves alone (shown, not graded: one curve is noisy)."""
    estimates: dict[str, Estimate]
    """``best_lr_multiplier`` (graded), each stack's ``{stack}_optimum_multiplier``, ``mvas_lr_shift``, the paired
    warmup gains and the recipe gain."""
    triggers: dict[str, list[float]]
    metrics: dict[str, float]


def analyse(sw: Sweep) -> Analysis:
    p, mults, n = sw.settings, sw.multipliers, len(sw.seeds)
    graded, first = p.graded_warmup, p.warmup_factors[0]
    means, errors, optimum, edges, est, m = {}, {}, {}, [], {}, {}
    for stack in p.stacks:
        table = sw.table(stack)
        means[stack] = table.mean(axis=0).tolist()
        errors[stack] = (table.std(axis=0, ddof=1) / math.sqrt(n) if n > 1 else np.zeros(len(mults))).tolist()
        optimum[stack], i = mean_curve_optimum(mults, table)
        if at_edge(i, len(mults)):
            edges.append(stack)
        est[f"{stack}_optimum_multiplier"] = optimum_estimate(*sw.columns(stack), multipliers=mults)
        for x, v in zip(mults, means[stack]):
            m[f"{_key(stack, graded)}_x{x:g}_eval_loss".replace(".", "p")] = v
    est["best_lr_multiplier"] = shift_estimate(*sw.columns("plain", "macro"), multipliers=mults)
    if "mvas" in p.stacks:
        est["mvas_lr_shift"] = shift_estimate(*sw.columns("plain", "mvas"), multipliers=mults)
    seed_shifts = [curve_optimum(mults, sw.table("macro")[i])[0] / curve_optimum(mults, sw.table("plain")[i])[0]
                   for i in range(n)]
    if len(p.warmup_factors) > 1:  # paired by seed and LR: loss with the usual warmup - loss with the post's
        for stack in p.stacks:
            usual = np.mean([sw.losses(stack, first, x) for x in p.warmup_multipliers], axis=0)
            longer = np.mean([sw.losses(stack, graded, x) for x in p.warmup_multipliers], axis=0)
            est[f"{stack}_warmup_extension_gain"] = paired_difference(longer, usual, unit="nats/byte")
        est["recipe_loss_gain"] = paired_difference(sw.losses("macro", graded, p.recipe_multiplier),
                                                    sw.losses("macro", first, 1.0), unit="nats/byte")
    triggers = {stack: [r.metrics["spike_triggers"] for k, r in sw.results.items() if k[0] == stack]
                for stack in p.stacks}
    m.update(optimum_at_grid_edge=sum(s in edges for s in GRADED), seeds=n, grid_points=len(mults),
             grid_extensions=len(sw.extensions),
             seed_standard_error=float(np.mean([np.mean(errors[s]) for s in GRADED])),
             diverged_runs=sum(r.diverged for r in sw.results.values()),
             **{f"{stack}_spike_triggers": int(sum(triggers[stack])) for stack in p.stacks},
             **{f"{stack}_runs_with_triggers": int(sum(t > 0 for t in triggers[stack])) for stack in p.stacks})
    return Analysis(means, errors, optimum, edges, seed_shifts, est, triggers, m)


def repeated(sw: Sweep) -> dict[str, Repeated]:
    """The graded ``best_lr_multiplier``'s raw per-seed data and its build, for ``claims.regrade_leaving_out``."""
    return {"best_lr_multiplier": Repeated(shift_estimate, sw.columns("plain", "macro"), "seeds",
                                           {"multipliers": tuple(sw.multipliers)})}


def mean_curves(sw: Sweep, mult: float = 1.0) -> dict[tuple[str, float], np.ndarray]:
    """Per (stack, warmup) run at ``mult``: the seed-mean training loss."""
    curves = {}
    for stack in sw.settings.stacks:
        for warm in sw.settings.warmup_factors:
            if (stack, mult, warm, sw.seeds[0]) not in sw.results:
                continue
            runs = [sw.results[stack, mult, warm, s] for s in sw.seeds]
            n = min(len(r.losses) for r in runs)
            curves[stack, warm] = np.mean([r.losses[:n] for r in runs], axis=0)
    return curves


def log_curves(sw: Sweep, run: Any, every: int = 5) -> None:
    for (stack, warm), curve in mean_curves(sw).items():
        for step in range(0, len(curve), every):
            run.log(step=step, **{f"{_key(stack, warm)}_x1_loss": float(curve[step])})


def text(sw: Sweep, a: Analysis) -> str:
    """The seed-mean loss grid with each optimum, the graded shift, the gains and the spike triggers."""
    p, e = sw.settings, a.estimates
    lines = [f"held-out loss, mean of {len(sw.seeds)} paired seeds, warmup x{p.graded_warmup:g}",
             f"{'stack':<8}" + "".join(f"{x:>9g}x" for x in sw.multipliers) + f"{'optimum':>10}"]
    for stack in p.stacks:
        lines.append(f"{stack:<8}" + "".join(f"{v:>10.4f}" for v in a.means[stack])
                     + f"{a.optimum[stack]:>9.3f}x" + (" (grid edge)" if stack in a.edges else ""))
    lines.append(f"best_lr_multiplier (macro / plain optimum, same warmup): {e['best_lr_multiplier'].describe()}")
    for stack in p.stacks:
        lines.append(f"{stack} optimum: {e[f'{stack}_optimum_multiplier'].describe()}")
    if "mvas_lr_shift" in e:
        lines.append(f"mvas / plain optimum: {e['mvas_lr_shift'].describe()}")
    if "recipe_loss_gain" in e:
        lines.append("held-out loss gain of the +30% warmup (paired, at x"
                     + ", ".join(f"{x:g}" for x in p.warmup_multipliers) + "): "
                     + "; ".join(f"{s} {e[f'{s}_warmup_extension_gain'].describe(3)}" for s in p.stacks))
        lines.append(f"post's recipe ({p.recipe_multiplier:g}x, +30% warmup) vs usual (1x) on macro: "
                     f"{e['recipe_loss_gain'].describe(3)}")
    lines.append("spike-guard triggers per run: " + ", ".join(
        f"{s} mean {np.mean(t):.2f} (runs with any: {sum(x > 0 for x in t)}/{len(t)})" for s, t in a.triggers.items()))
    lines.append(timing_text(sw))
    return "\n".join(lines)


def timing_text(sw: Sweep) -> str:
    """Median wall seconds per run of each stack (same steps and batches), with its ratio to plain's: where the
    stacks' cost shows (MVAS's kernels on a tiny model: per-call costs; ``macroarch.mvas._kernels``)."""
    per_stack: dict[str, list[float]] = {}
    for (stack, *_), r in sw.results.items():
        per_stack.setdefault(stack, []).append(r.seconds)
    medians = {stack: float(np.median(t)) for stack, t in per_stack.items()}
    base = medians.get("plain")
    return f"median seconds per run of {sw.settings.steps} steps: " + ", ".join(
        f"{stack} {t:.1f}" + (f" ({t / base:.2f}x plain)" if base and stack != "plain" else "")
        for stack, t in medians.items())


FONT = 8
"""The smallest text of the figure, in points: 8 pt prints at 6.7 pt in an 8 in figure scaled to the report's page."""


def _below(ax: plt.Axes, ncol: int = 1, offset: float = 0.16) -> None:
    ax.legend(fontsize=FONT, loc="upper center", bbox_to_anchor=(0.5, -offset), ncol=ncol, frameon=False)


def plot(sw: Sweep, a: Analysis, target: Any) -> Figure:
    """Four panels (2 x 2): held-out loss against the LR multiplier with each stack's optimum (an optimum at the
    grid's edge says so); the graded shift with its interval, the single seeds' shifts and the post's band
    (``target``: the registry's ``best_lr_multiplier`` target, passed in by the notebook; anything with its ``lo``,
    ``hi`` and ``no_effect``); training curves at 1x; the spike guard at work in the macro run where it fired most."""
    p, mults, n = sw.settings, sw.multipliers, len(sw.seeds)
    fig, axes = plt.subplots(2, 2, figsize=(7.8, 9.0), layout="constrained")
    ax = axes[0, 0]
    for k, stack in enumerate(p.stacks):
        line = ax.errorbar(mults, a.means[stack], yerr=a.errors[stack], fmt="o-", ms=4, capsize=2, color=f"C{k}",
                           label=f"{stack}: optimum {a.optimum[stack]:.2f}x" + (" (grid edge)" if stack in a.edges
                                                                                 else ""))
        ax.axvline(a.optimum[stack], color=line[0].get_color(), lw=0.8, ls=":")
        bad = [(x, y) for x, y in zip(mults, a.means[stack]) if sw.diverged(stack, p.graded_warmup, x)]
        if bad:
            ax.plot(*zip(*bad), "x", color=f"C{k}", ms=9, mew=2, ls="none",
                    label=f"{stack}: a seed diverged (charged the untrained loss)")
    for x in sw.extensions:
        ax.axvline(x, color="0.6", lw=0.5)
    ax.set(xscale="log", xticks=mults, xticklabels=[f"{x:g}" for x in mults],
           xlabel=f"LR multiplier (x of base LR {p.base_lr:g})",
           ylabel=f"held-out loss (nats/byte),\nmean of {n} seeds ±1 s.e.",
           title=f"final loss vs LR (warmup x{p.graded_warmup:g}, every stack)")
    ax.xaxis.set_minor_formatter(plt.NullFormatter())
    ax.tick_params(axis="x", labelsize=FONT)
    _below(ax)

    ax = axes[0, 1]
    shifts = [("macro / plain\n(graded)", a.estimates["best_lr_multiplier"], a.seed_shifts)]
    if "mvas_lr_shift" in a.estimates:
        shifts.append(("mvas / plain", a.estimates["mvas_lr_shift"], None))
    ax.axhspan(target.lo, target.hi, color="C2", alpha=0.15, label=f"post: {target.lo:g}-{target.hi:g}x (reproduced)")
    ax.axhspan(*target.no_effect, color="0.5", alpha=0.15,
               label=f"no effect: {target.no_effect[0]:g}-{target.no_effect[1]:g}x")
    ax.axhline(1.0, color="0.3", lw=0.6)
    rng = np.random.default_rng(0)
    span = [target.lo, target.hi, *target.no_effect]
    for j, (_, e, dots) in enumerate(shifts):
        if dots is not None:
            ax.scatter(j - 0.25 + rng.uniform(-0.06, 0.06, len(dots)), dots, s=14, color="C1", alpha=0.5, lw=0,
                       label=f"single seeds' curves (n={len(dots)})")
        lo, hi = (e.low, e.high) if e.has_interval else (e.value, e.value)
        span += [lo, hi, *(dots or [])]
        ax.errorbar([j], [e.value], yerr=[[e.value - lo], [hi - e.value]], fmt="D", color="k" if j == 0 else "0.45",
                    ms=6, capsize=6, lw=1.5, label=(f"seed-mean optimum ratio, {e.confidence:.0%} bootstrap "
                                                    f"(n={e.n})" if e.has_interval else
                                                    f"seed-mean optimum ratio (n={e.n}: no interval)") if j == 0
                    else None)
    pad = 0.08 * (max(span) - min(span))
    ax.set(xticks=range(len(shifts)), xticklabels=[s[0] for s in shifts], xlim=(-0.6, len(shifts) - 0.4),
           ylim=(min(span) - pad, max(span) + pad), xlabel="stacks compared (same warmup, paired seeds)",
           ylabel="LR optimum ratio (x)", title="graded: best_lr_multiplier")
    _below(ax, offset=0.2)  # below the two-line tick label and the axis label

    ax = axes[1, 0]
    for (stack, warm), curve in mean_curves(sw).items():
        ax.plot(np.convolve(curve, np.ones(9) / 9, mode="valid"), lw=0.9, color=f"C{p.stacks.index(stack)}",
                ls="-" if warm == p.graded_warmup else "--", label=f"{stack}, warmup x{warm:g}")
    ax.set(xlabel="step", ylabel="training loss (nats/byte, 9-step mean)",
           title=f"training curves at 1x, mean of {n} seeds")
    _below(ax, ncol=2)

    ax = axes[1, 1]
    shown = max((k for k in sw.results if k[0] == "macro"), key=lambda k: sw.results[k].metrics["spike_triggers"])
    r = sw.results[shown]
    ax.plot(r.series["lr"], lw=0.9, color="C1", label=f"LR applied (macro, {shown[1]:g}x, warmup x{shown[2]:g}, "
            f"seed {shown[3]})")
    ax.set(xlabel="step", ylabel="learning rate", title=f"spike guard: {int(r.metrics['spike_triggers'])} triggers "
           "in this run")
    twin = ax.twinx()
    twin.plot(r.losses, color="grey", lw=0.5, alpha=0.7, label="training loss")
    twin.set_ylabel("training loss (nats/byte)")
    handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], fontsize=FONT, loc="upper center",
              bbox_to_anchor=(0.5, -0.16), frameon=False)
    for ax in fig.axes:
        ax.title.set_fontsize(9)
    return fig


def verdict_texts(sw: Sweep, a: Analysis) -> dict[str, str]:
    """``scale``, ``measured_text`` and ``note`` for ``get_claim("C10").grade``."""
    p, m, e = sw.settings, a.metrics, a.estimates
    baseline = "bf16 weights + fp32 master AdamW" if p.compute_dtype != "float32" else "fp32 AdamW"
    scale = (f"{p.n_layers}-layer GPT-2-style decoder, width {p.width} ({sw.n_params / 1e6:.3f}M params), "
             f"{p.steps} steps of {p.batch_size}x{p.seq_len} bytes, base LR {p.base_lr:g}; both stacks over the LR "
             f"grid x{[float(f'{x:g}') for x in sw.multipliers]}"
             + (f" (extended by {sw.extensions})" if sw.extensions else "")
             + f" at warmup {p.warmup_steps} steps x{p.graded_warmup:g}"
             + (f", warmup x{list(p.warmup_factors[:-1])} at LR x{list(p.warmup_multipliers)}"
                if len(p.warmup_factors) > 1 else "")
             + f"; {len(sw.seeds)} paired seeds; stacks {list(p.stacks)} (plain: {baseline}); "
             f"{describe(machine_info(p.device), p.compute_dtype)}")
    measured = (f"LR optimum macro / plain at the same warmup (x{p.graded_warmup:g}) = "
                f"{e['best_lr_multiplier'].describe(3)} (optima {a.optimum['macro']:.3f}x and "
                f"{a.optimum['plain']:.3f}x of {p.base_lr:g})")
    parts = []
    if a.edges:
        parts.append(f"optimum at the grid edge for {', '.join(a.edges)} after {len(sw.extensions)} extension(s): "
                     "the true optimum may lie outside")
    if "mvas_lr_shift" in e:
        parts.append(f"MVAS + DGR optimum / plain {e['mvas_lr_shift'].describe(3)}")
    if "recipe_loss_gain" in e:
        parts.append(f"+30% warmup gain (macro) {e['macro_warmup_extension_gain'].describe(3)}, (plain) "
                     f"{e['plain_warmup_extension_gain'].describe(3)}; recipe ({p.recipe_multiplier:g}x, +30% warmup) "
                     f"vs usual on macro {e['recipe_loss_gain'].describe(3)}")
    parts.append(f"spike guard fired in {int(m['macro_runs_with_triggers'])}/{len(a.triggers['macro'])} macro runs "
                 f"({int(m['macro_spike_triggers'])} triggers); a detached guard on plain would have fired "
                 f"{int(m['plain_spike_triggers'])} times")
    return {"scale": scale, "measured_text": measured, "note": "; ".join(parts)}
