"""Notebook 08's experiment (claim C10, post section 5.1): the LR multiplier, the longer warmup and the spike guard.

One small GPT-2-style decoder, the same batches and initial weights per seed, trained through the project's one
loop (``experiments.loop.train_lm``) with a linear warmup + cosine schedule (``macroarch.optim.recipe``) over a
grid of LR multipliers x warmup lengths x seeds, on the ``STACKS``:

- ``"plain"``: ``torch.optim.AdamW`` (``MasterWeightAdamW``, bf16 weights + fp32 master, when the compute dtype is
  bf16);
- ``"macro"``: ``DGRWrapper`` in sync mode stepping ``CompensatedAdamW`` per group, with the post's
  ``2^5 / max_grad_norm`` loss scale (``NormGradScaler``) and a ``LossSpikeGuard`` that lowers the LR. Built by
  hand: ``compose.apply`` has no loss scale or guard to attach;
- ``"mvas"``: MVAS + DGR + ``MVASAdamW`` through ``macroarch.compose.apply``, the weights packed by a budget plan
  (a quarter of their bytes).

Every stack's losses go through a guard, attached or not, so the plain stack reports how often the guard *would*
have fired. :func:`recipe_run` is one run; :func:`sweep` the grid; :func:`analyse` the statistics the verdict
reads: per stack and warmup the LR optimum of the seed-median held-out loss (:func:`fitted_optimum`, a parabola
in log LR), the graded ``best_lr_multiplier`` (macro stack with the post's warmup / plain AdamW with the usual
one) with a paired seed-bootstrap interval (:func:`optimum_ratio_interval`), paired warmup and recipe gains, spike
triggers. A diverged run is charged the untrained model's held-out loss.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.figure import Figure
from tqdm.auto import tqdm

from macroarch import compose, mvas
from macroarch.config import DGRConfig, MacroConfig, OptimConfig
from macroarch.data import ensure_corpus, eval_batches, lm_batches, load_corpus
from macroarch.experiments.hardware import describe, machine_info, torch_dtype
from macroarch.experiments.loop import Batch, RunResult, evaluate_lm, train_lm
from macroarch.experiments.settings import COMPUTE_DTYPES, Settings
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


# ---------------------------------------------------------------------------------------------- the notebook
@dataclass(frozen=True)
class RecipeSettings(Settings):
    """Notebook 08's settings: its parameters cell, less ``profile`` (``RecipeSettings.from_params(params)``)."""

    seeds: int
    """Seeds per grid point: ``seed``, ``seed + 1``, ..."""
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
    """The LR multipliers of the grid (the post's 1.2-1.5 and brackets around it)."""
    eval_batches: int
    """Held-out batches of the final loss."""
    device: str
    """cpu or cuda."""
    threads: int
    """Torch threads."""
    seed: int = 0
    """First seed (initial weights and batch order)."""
    corpus: str = "stdlib"
    """data/text/<corpus>."""
    warmup_factors: tuple[float, ...] = (1.0, 1.3)
    """Warmup lengths as factors of ``warmup_steps``; first: the usual warmup; last: the post's +30%."""
    stacks: tuple[str, ...] = ("plain", "macro", "mvas")
    """The stacks of :data:`STACKS` run (plain AdamW, DGR + CompensatedAdamW + guard, MVAS + DGR)."""
    group_size: int = 2
    """DGR: blocks per group."""
    spike_threshold: float = 0.15
    """The guard's trigger: the loss this share over the mean of the last 20."""
    compute_dtype: str = "float32"
    """float32 | bfloat16 (``auto`` resolved by ``resolve_parameters``)."""

    def __post_init__(self) -> None:
        self._positive("seeds", "n_layers", "width", "n_heads", "seq_len", "batch_size", "steps", "base_lr",
                       "eval_batches", "threads", "group_size", "spike_threshold")
        self._non_negative("warmup_steps")
        self._non_empty("lr_multipliers", "warmup_factors", "stacks")
        self._one_of("compute_dtype", COMPUTE_DTYPES)
        self._device()
        if self.width % self.n_heads:
            self._fail("n_heads", f"a divisor of width {self.width}")
        if any(not m > 0 for m in self.lr_multipliers):
            self._fail("lr_multipliers", "positive numbers")
        if any(not w > 0 for w in self.warmup_factors):
            self._fail("warmup_factors", "positive numbers")
        if any(stack not in STACKS for stack in self.stacks):
            self._fail("stacks", f"names from {', '.join(STACKS)}")


@dataclass
class Sweep:
    """Every run of the grid, keyed ``(stack, multiplier, warmup factor, seed)``."""

    settings: RecipeSettings
    seeds: list[int]
    n_params: int
    initial_loss: float
    results: dict[tuple[str, float, float, int], RunResult] = field(default_factory=dict)

    def losses(self, stack: str, warm: float, mult: float) -> np.ndarray:
        """Held-out loss of each seed; a diverged run is charged the untrained model's loss."""
        return np.array([self.initial_loss if self.results[stack, mult, warm, s].diverged
                         else self.results[stack, mult, warm, s].eval_loss for s in self.seeds])

    def table(self, stack: str, warm: float) -> np.ndarray:
        """(seeds, multipliers) held-out losses."""
        return np.stack([self.losses(stack, warm, m) for m in self.settings.lr_multipliers], axis=1)

    def rows(self) -> list[dict[str, Any]]:
        """One row per run, for a W&B table that can be re-plotted in the UI."""
        return [{"stack": stack, "lr_multiplier": mult, "warmup_factor": warm, "seed": seed,
                 "eval_loss": r.eval_loss, "final_train_loss": r.losses[-1] if r.losses else float("nan"),
                 "diverged_at": r.diverged_at, "seconds": r.seconds, **r.metrics}
                for (stack, mult, warm, seed), r in self.results.items()]

    def describe(self) -> str:
        p = self.settings
        runs = len(p.stacks) * len(p.lr_multipliers) * len(p.warmup_factors) * len(self.seeds)
        return (f"{p.n_layers}-layer decoder, width {p.width}: {self.n_params / 1e6:.3f}M parameters; "
                f"{p.steps} steps of {p.batch_size}x{p.seq_len} bytes in {p.compute_dtype}; {runs} runs")


def _spec(p: RecipeSettings):
    return get_model_spec("gpt3_tiny").scaled(n_layers=p.n_layers, d_model=p.width, n_heads=p.n_heads,
                                              n_kv_heads=p.n_heads, d_ff=4 * p.width, dropout=0.0,
                                              max_seq_len=p.seq_len)


def _build(p: RecipeSettings, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = _spec(p).build(device=p.device)
    dtype = torch_dtype(p.compute_dtype)
    return model if dtype == torch.float32 else model.to(dtype)


def sweep(settings: RecipeSettings) -> Sweep:
    """Threads, corpus, batches per seed, then every (stack, multiplier, warmup, seed) run (progress bar)."""
    p = settings
    torch.set_num_threads(p.threads)
    logging.getLogger("macroarch.optim").setLevel(logging.ERROR)  # triggers are counted, not printed one by one
    text = load_corpus(ensure_corpus(p.corpus))
    seeds = [p.seed + i for i in range(p.seeds)]
    train = {s: list(lm_batches(text.train, p.batch_size, p.seq_len, seed=s, steps=p.steps)) for s in seeds}
    held_out = list(eval_batches(text.val, p.batch_size, p.seq_len, max_batches=p.eval_batches))
    n_params = sum(t.numel() for t in _build(p, p.seed).parameters())
    out = Sweep(p, seeds, n_params, evaluate_lm(_build(p, p.seed), held_out).loss)
    grid = list(itertools.product(p.stacks, p.lr_multipliers, p.warmup_factors, seeds))
    for stack, mult, warm, s in tqdm(grid, desc="runs", mininterval=10):
        options = dict(group_size=p.group_size) if stack != "plain" else {}
        out.results[stack, mult, warm, s] = recipe_run(
            _build(p, s), train[s], held_out, stack=stack, base_lr=p.base_lr, lr_multiplier=mult,
            warmup_steps=p.warmup_steps, warmup_extension=warm - 1.0, spike_threshold=p.spike_threshold,
            **options)
    return out


def _key(stack: str, warm: float) -> str:
    return f"{stack}_w{warm:g}".replace(".", "p")


@dataclass
class Analysis:
    """What the verdict reads from a :class:`Sweep` (module docstring)."""

    medians: dict[tuple[str, float], list[float]]
    optimum: dict[tuple[str, float], float]
    graded_stack: str
    best_lr_multiplier: float
    interval: tuple[float, float]
    same_warmup_shift: float
    edges: list[str]
    warmup_gain: dict[str, float]
    near: float
    recipe_gain: float
    triggers: dict[str, list[float]]
    noise: float
    metrics: dict[str, float]


def analyse(sw: Sweep) -> Analysis:
    p, seeds = sw.settings, len(sw.seeds)
    mults, usual, recipe = p.lr_multipliers, p.warmup_factors[0], p.warmup_factors[-1]
    medians, optimum, sem, m = {}, {}, [], {}
    for stack in p.stacks:
        for warm in p.warmup_factors:
            medians[stack, warm] = [float(np.median(sw.losses(stack, warm, x))) for x in mults]
            sem += [float(sw.losses(stack, warm, x).std(ddof=1) / np.sqrt(seeds)) if seeds > 1 else 0.0
                    for x in mults]
            optimum[stack, warm] = fitted_optimum(mults, medians[stack, warm])
            for x, v in zip(mults, medians[stack, warm]):
                m[f"{_key(stack, warm)}_x{x:g}_eval_loss".replace(".", "p")] = v
            m[f"{_key(stack, warm)}_optimum_multiplier"] = optimum[stack, warm]
    macro = "macro" if "macro" in p.stacks else p.stacks[-1]
    best = optimum[macro, recipe] / optimum["plain", usual]
    same_warmup = optimum[macro, usual] / optimum["plain", usual]
    # How far seed noise alone moves the ratio: a paired bootstrap over seeds (90% interval).
    lo, hi = (optimum_ratio_interval(mults, sw.table("plain", usual), sw.table(macro, recipe)) if seeds > 1
              else (best, best))
    edges = [name for name, v in (("plain", optimum["plain", usual]), (macro, optimum[macro, recipe]))
             if v in (min(mults), max(mults))]
    warmup_gain = {stack: float(np.median([sw.losses(stack, usual, x) - sw.losses(stack, recipe, x) for x in mults]))
                   for stack in p.stacks}  # paired: same seed and LR
    near = min(mults, key=lambda x: abs(x - 1.35))
    recipe_gain = float(np.median(sw.losses(macro, usual, 1.0 if 1.0 in mults else mults[0])
                                  - sw.losses(macro, recipe, near)))
    triggers = {stack: [r.metrics["spike_triggers"] for k, r in sw.results.items() if k[0] == stack]
                for stack in p.stacks}
    noise = float(np.mean(sem))
    m.update(best_lr_multiplier=best, best_lr_multiplier_lo=lo, best_lr_multiplier_hi=hi,
             same_warmup_lr_shift=same_warmup, plain_optimum_multiplier=optimum["plain", usual],
             macro_optimum_multiplier=optimum[macro, recipe], recipe_loss_gain=recipe_gain,
             seed_standard_error=noise, optimum_at_grid_edge=len(edges),
             **{f"{stack}_warmup_extension_gain": warmup_gain[stack] for stack in p.stacks},
             **{f"{stack}_spike_triggers": int(sum(triggers[stack])) for stack in p.stacks},
             **{f"{stack}_runs_with_triggers": int(sum(t > 0 for t in triggers[stack])) for stack in p.stacks})
    return Analysis(medians, optimum, macro, best, (lo, hi), same_warmup, edges, warmup_gain, near, recipe_gain,
                    triggers, noise, m)


def best_curves(sw: Sweep, a: Analysis) -> dict[str, np.ndarray]:
    """Per stack and warmup: the seed-mean training loss at the grid's best multiplier (seed-median loss)."""
    curves = {}
    for (stack, warm), medians in a.medians.items():
        runs = [sw.results[stack, sw.settings.lr_multipliers[int(np.argmin(medians))], warm, s] for s in sw.seeds]
        n = min(len(r.losses) for r in runs)
        curves[_key(stack, warm)] = np.mean([r.losses[:n] for r in runs], axis=0)
    return curves


def log_curves(sw: Sweep, a: Analysis, run: Any, every: int = 5) -> None:
    for key, curve in best_curves(sw, a).items():
        for step in range(0, len(curve), every):
            run.log(step=step, **{f"{key}_best_loss": float(curve[step])})


def text(sw: Sweep, a: Analysis) -> str:
    """The median-loss grid with each optimum, the graded ratio, the gains and the spike triggers."""
    p, macro = sw.settings, a.graded_stack
    usual, recipe = p.warmup_factors[0], p.warmup_factors[-1]
    lines = [f"{'stack / warmup':<18}" + "".join(f"{x:>14g}x" for x in p.lr_multipliers) + f"{'optimum':>10}"]
    for (stack, warm), medians in a.medians.items():
        lines.append(f"{stack + ' / ' + format(warm, 'g'):<18}" + "".join(f"{v:>15.4f}" for v in medians)
                     + f"{a.optimum[stack, warm]:>10.3f}")
    lo, hi = a.interval
    lines.append(f"LR optimum: plain (usual warmup) {a.optimum['plain', usual]:.3f}x, {macro} "
                 f"(+{recipe - 1:.0%} warmup) {a.optimum[macro, recipe]:.3f}x -> best_lr_multiplier "
                 f"{a.best_lr_multiplier:.3f} (90% seed-bootstrap interval {lo:.3f}-{hi:.3f}) (same warmup: "
                 f"{a.same_warmup_shift:.3f}){'; optimum at the grid edge: ' + ', '.join(a.edges) if a.edges else ''}")
    lines.append("held-out loss gain of the longer warmup (median over multipliers and seeds): "
                 + ", ".join(f"{s} {g:+.4f}" for s, g in a.warmup_gain.items())
                 + f"; seed standard error {a.noise:.4f}")
    lines.append(f"post's recipe ({a.near:g}x, +{recipe - 1:.0%} warmup) vs usual (1x) on {macro}: "
                 f"{a.recipe_gain:+.4f}")
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


def plot(sw: Sweep, a: Analysis) -> Figure:
    """Final loss against the LR multiplier with each optimum; training curves near 1.35x; the spike guard at
    work in the macro run where it fired most."""
    p, seeds, macro = sw.settings, len(sw.seeds), a.graded_stack
    mults, usual, recipe = p.lr_multipliers, p.warmup_factors[0], p.warmup_factors[-1]
    fig, axes = plt.subplots(1, 3, figsize=(18, 4.4))
    ax = axes[0]
    for stack in p.stacks:
        for warm, style in zip(p.warmup_factors, ("o-", "s--", "^:")):
            errs = [sw.losses(stack, warm, x).std(ddof=1) / np.sqrt(seeds) if seeds > 1 else 0 for x in mults]
            line = ax.errorbar(mults, a.medians[stack, warm], yerr=errs, fmt=style, ms=4, capsize=2,
                               label=f"{stack}, warmup x{warm:g}: optimum {a.optimum[stack, warm]:.2f}x")
            ax.axvline(a.optimum[stack, warm], color=line[0].get_color(), lw=0.6, ls=":")
    ax.axvspan(1.2, 1.5, color="grey", alpha=0.12, label="the post's 1.2-1.5x")
    ax.set(xscale="log", xticks=mults, xticklabels=[f"{x:g}" for x in mults],
           xlabel=f"LR multiplier (1 = {p.base_lr:g})", ylabel=f"held-out loss (median of {seeds} seeds, s.e. bars)",
           title="final loss vs LR multiplier")
    ax = axes[1]
    for stack in p.stacks:
        for warm in (usual, recipe):
            runs = [sw.results[stack, a.near, warm, s] for s in sw.seeds]
            n = min(len(r.losses) for r in runs)
            curve = np.mean([r.losses[:n] for r in runs], axis=0)
            ax.plot(np.convolve(curve, np.ones(9) / 9, mode="valid"), lw=0.9,
                    label=f"{stack}, {a.near:g}x, warmup x{warm:g}")
    ax.set(xlabel="step", ylabel="training loss (9-step mean)", title="training curves")
    ax = axes[2]
    shown = max((k for k in sw.results if k[0] == macro), key=lambda k: sw.results[k].metrics["spike_triggers"])
    r = sw.results[shown]
    ax.plot(r.series["lr"], lw=0.9, label=f"{macro}, {shown[1]:g}x, warmup x{shown[2]:g}, seed {shown[3]}: LR applied")
    ax.set(xlabel="step", ylabel="learning rate", title=f"spike guard: {int(r.metrics['spike_triggers'])} triggers in "
           "this run")
    ax2 = ax.twinx()
    ax2.plot(r.losses, color="grey", lw=0.5, alpha=0.7)
    ax2.set_ylabel("training loss")
    for ax in axes[:2]:
        ax.legend(fontsize=7)
    axes[0].xaxis.set_minor_formatter(plt.NullFormatter())  # log axis: only the grid's own tick labels
    axes[2].legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    return fig


def verdict_texts(sw: Sweep, a: Analysis) -> dict[str, str]:
    """``scale``, ``measured_text`` and ``note`` for ``get_claim("C10").grade``."""
    p, m, macro = sw.settings, a.metrics, a.graded_stack
    usual, recipe = p.warmup_factors[0], p.warmup_factors[-1]
    lo, hi = a.interval
    baseline = "bf16 weights + fp32 master AdamW" if p.compute_dtype != "float32" else "fp32 AdamW"
    scale = (f"{p.n_layers}-layer GPT-2-style decoder, width {p.width} ({sw.n_params / 1e6:.3f}M params), "
             f"{p.steps} steps of {p.batch_size}x{p.seq_len} bytes, base LR {p.base_lr:g}, warmup "
             f"{p.warmup_steps}; LR x{list(p.lr_multipliers)}, warmup x{list(p.warmup_factors)}, {len(sw.seeds)} "
             f"seeds; stacks {list(p.stacks)} (plain: {baseline}); "
             f"{describe(machine_info(p.device), p.compute_dtype)}")
    measured = (f"LR optimum {macro} (+{recipe - 1:.0%} warmup) / plain (usual warmup) = {a.best_lr_multiplier:.3f} "
                f"(90% seed-bootstrap {lo:.2f}-{hi:.2f}) ({a.optimum[macro, recipe]:.3f}x vs "
                f"{a.optimum['plain', usual]:.3f}x of {p.base_lr:g}); longer warmup gain "
                f"{a.warmup_gain[macro]:+.4f} ({macro}), {a.warmup_gain['plain']:+.4f} (plain); "
                f"seed s.e. {a.noise:.4f}")
    n = len(sw.seeds)
    resamples = math.comb(2 * n - 1, n)  # distinct multisets of n seeds drawn with replacement
    note = (("the interval contains 1: no shift is distinguishable from seed noise; " if lo <= 1 <= hi else "")
            + (f"with {n} seeds the bootstrap has only {resamples} distinct resamples: read the interval as the "
               f"spread of those, not as a 90% interval, and the grade as resting on the point estimate; "
               if resamples < 20 else "")
            + (f"MVAS + DGR stack: optimum {a.optimum['mvas', recipe]:.3f}x with +30% warmup, "
               f"{a.optimum['mvas', usual]:.3f}x with the usual; " if "mvas" in p.stacks else "")
            + f"same-warmup shift {a.same_warmup_shift:.3f}; recipe ({a.near:g}x, +30% warmup) vs usual on {macro}: "
            f"{a.recipe_gain:+.4f}; spike guard fired in {int(m[macro + '_runs_with_triggers'])}/"
            f"{len(a.triggers[macro])} {macro} runs ({int(m[macro + '_spike_triggers'])} triggers); a detached "
            f"guard on plain would have fired {int(m['plain_spike_triggers'])} times"
            + (f"; optimum at the grid edge for {', '.join(a.edges)}: the true optimum may lie outside" if a.edges
               else ""))
    return {"scale": scale, "measured_text": measured, "note": note}
