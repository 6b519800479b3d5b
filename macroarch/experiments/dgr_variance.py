"""Notebook 04's experiment: does DGR cut gradient variance to 1/8 on a 256-layer Transformer (claim C6, 3.1)?

The same deep pre-LN decoder (transformers GPT-2 style, small width) is trained from the same initial weights on
the same batches, each run through the project's training loop (``experiments.loop.train_lm``): plain AdamW and
DGR-interleaved with DC-ASGD compensation (the post's full DGR) at every seed, and DGR-interleaved without it at
the first seed, for contrast (``macroarch.dgr``). At step 0, every ``measure_every`` steps and at the end, with the
weights fixed (DGR's in-backward stepping suspended), on one held-out set of mini-batches per seed:

- the trace of the covariance of the mini-batch gradient (``minibatch_gradient_variance``): its ratio plain /
  DGR, averaged over the measurements after step 0, is one seed's "variance reduction factor"; the graded factor
  is the geometric mean over ``seeds`` seeds (each its own initial weights, batches and held-out set) with a t
  interval on the logs (a ratio of variances varies by factors);
- the spread across layers: the standard deviation of the log of the per-block gradient norms; its ratio plain /
  DGR, the same way, is reported beside the graded factor with its interval (not graded: the post names no
  number for it).

DGR-sync (per-group steps during backward, no delay) is the same computation as plain training, so its variance
factor is 1 by construction: it is no measurement and is not trained here. :func:`gradient_memory` steps plain
AdamW and DGR-sync twice under MemTracker (DGR frees each group's gradients once the group has stepped) and checks
that identity on the way: their weights after those steps are equal bit for bit.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import re
from dataclasses import dataclass

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.figure import Figure
from matplotlib.ticker import LogFormatterSciNotation, MaxNLocator
from torch import nn

from macroarch._table import format_table
from macroarch.data import lm_batches
from macroarch.dgr import DGRWrapper, GradientCompensator
from macroarch.experiments.loop import train_lm
from macroarch.experiments.settings import Settings
from macroarch.measure.gradients import GradientNormRecorder, layer_norm_spread, minibatch_gradient_variance
from macroarch.measure.memory import StepMemory, format_bytes, measure_step
from macroarch.measure.stats import Estimate, Repeated, geomean_interval
from macroarch.measure.workload import lm_loss
from macroarch.models import ModelSpec, get_model_spec

VARIANTS: dict[str, dict | None] = {
    "plain": None,
    "DGR sync": dict(mode="sync"),
    "DGR interleaved + DC-ASGD": dict(mode="interleaved", compensator="adaptive"),
    "DGR interleaved, no compensation": dict(mode="interleaved", compensator=None),
}
"""Training schemes: None is plain AdamW, else the ``DGRWrapper`` options."""
GRADED = "DGR interleaved + DC-ASGD"
CONTRAST = "DGR interleaved, no compensation"
TRAINED = ("plain", GRADED, CONTRAST)
"""The variants trained for the variance (DGR sync is plain's computation: see the module docstring)."""
STYLES = {
    "plain": dict(color="#4c72b0", ls="-", lw=2.0, marker="o", ms=6, mfc="none"),
    "DGR interleaved + DC-ASGD": dict(color="#55a868", ls="-", lw=1.4, marker="s", ms=5),
    "DGR interleaved, no compensation": dict(color="#c44e52", ls=":", lw=1.4, marker="+", ms=7),
}
COINCIDE = 0.01
"""Runs whose traces agree this closely (relative, at every measurement) overlap on the figure; the legend says so."""
POST_FACTOR = 8.0
"""The post's claim: variance cut to 1/8."""


@dataclass(frozen=True)
class DGRVarianceSettings(Settings):
    """Notebook 04's settings: its parameters cell, less ``profile`` (``DGRVarianceSettings.from_params(params)``).
    Seeds run ``seed, seed + 1, ...``."""

    n_layers: int
    """Decoder depth (the post's: 256)."""
    width: int
    """d_model; d_ff is 4 x width."""
    seq_len: int
    """Bytes per sequence."""
    batch_size: int
    """Sequences per batch."""
    steps: int
    """Training steps per variant and seed."""
    group_size: int
    """Blocks per DGR parameter group."""
    measure_every: int
    """The variance is measured at steps 0, measure_every, ..., steps."""
    variance_batches: int
    """K held-out mini-batches at fixed weights for the covariance trace (at least 2)."""
    threads: int
    """Torch threads."""
    seeds: int
    """Seeds of plain and DGR + DC-ASGD (initial weights, batches, held-out set): the graded factor's n."""
    seed: int = 0
    """The first seed."""
    n_heads: int = 4
    """Attention heads; must divide ``width``."""
    lr: float = 1e-3
    """AdamW learning rate."""
    corpus: str = "stdlib"
    """data/text/<corpus>."""

    def __post_init__(self) -> None:
        self._positive("n_layers", "width", "seq_len", "batch_size", "steps", "group_size", "measure_every",
                       "variance_batches", "threads", "seeds", "n_heads", "lr")
        self._non_negative("seed")
        if self.width % self.n_heads:
            self._fail("n_heads", f"a divisor of width {self.width}")
        if self.variance_batches < 2:
            self._fail("variance_batches", "at least 2 (a covariance needs two mini-batches)")
        if self.measure_every > self.steps:
            self._fail("measure_every", f"at most steps ({self.steps}): the factor needs a measurement after step 0")
        if self.group_size > self.n_layers:
            self._fail("group_size", f"at most n_layers ({self.n_layers})")


def variant_key(variant: str) -> str:
    """Metric-name form: ``"DGR interleaved + DC-ASGD"`` -> ``"DGR_interleaved_DC_ASGD"``."""
    return re.sub(r"[^A-Za-z0-9]+", "_", variant).strip("_")


@dataclass(frozen=True)
class Setup:
    """The model every variant starts from and the batches they all see."""

    spec: ModelSpec
    initial: nn.Module
    train: list
    held_out: list
    """The mini-batches the variance is measured on, the same at every measurement."""

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.initial.parameters())


def setup(text, settings: DGRVarianceSettings, seed: int | None = None) -> Setup:
    """A GPT-2-style decoder ``n_layers`` deep (d_ff = 4 x width, no dropout), built after seeding the global RNG
    with ``seed`` (default the first), its training batches and held-out set drawn from it."""
    s = settings
    seed = s.seed if seed is None else seed
    spec = get_model_spec("gpt3_tiny").scaled(n_layers=s.n_layers, d_model=s.width, n_heads=s.n_heads,
                                              n_kv_heads=s.n_heads, d_ff=4 * s.width, dropout=0.0,
                                              max_seq_len=s.seq_len)
    torch.manual_seed(seed)
    initial = spec.build()
    # the held-out stream of seed i is offset past every training seed's, so no two seeds share held-out batches
    return Setup(spec, initial, list(lm_batches(text.train, s.batch_size, s.seq_len, seed=seed, steps=s.steps)),
                 list(lm_batches(text.val, s.batch_size, s.seq_len, seed=seed + 10_000, steps=s.variance_batches)))


def make_variant(variant: str, s: Setup, group_size: int, lr: float):
    """``(model to train, inner model, optimizer)``, from a copy of the initial weights."""
    model = copy.deepcopy(s.initial)
    if VARIANTS[variant] is None:
        return model, model, torch.optim.AdamW(model.parameters(), lr=lr)
    options = dict(VARIANTS[variant])
    if options.get("compensator") == "adaptive":
        options["compensator"] = GradientCompensator(adaptive=True)
    wrapper = DGRWrapper(model, group_size=group_size,
                         example_inputs=dict(input_ids=s.train[0][0], labels=s.train[0][1]), **options)
    return wrapper, model, wrapper.optimizer(torch.optim.AdamW, lr=lr)


@dataclass(frozen=True)
class Measurement:
    step: int
    trace: float
    """Trace of the covariance of the mini-batch gradient."""
    mean_grad_sq_norm: float
    layer_log_std: float
    """Std of the log of the per-block parameter-gradient norms (mean over two held-out batches)."""


def measure_variance(inner: nn.Module, optimizer: torch.optim.Optimizer, held_out: list, step: int) -> Measurement:
    """At fixed weights: nothing may be updated, so DGR's in-backward stepping is suspended meanwhile."""
    with optimizer.suspended() if hasattr(optimizer, "suspended") else contextlib.nullcontext():
        var = minibatch_gradient_variance(inner, lm_loss, held_out)
        with GradientNormRecorder(inner) as rec:
            for batch in held_out[:2]:
                lm_loss(inner, batch).backward()
        inner.zero_grad(set_to_none=True)
    spread = layer_norm_spread(rec.param_grad_norms.mean(0)).log_std
    return Measurement(step, var.trace, var.mean_grad_sq_norm, spread)


@dataclass(frozen=True)
class VariantRun:
    variant: str
    losses: list[float]
    history: list[Measurement]
    groups: int | None
    """DGR's parameter groups (None for plain)."""
    model: nn.Module
    """The trained inner model."""


def train_variant(variant: str, s: Setup, *, group_size: int, lr: float, measure_every: int) -> VariantRun:
    """Train on every batch of ``s.train``; measure at step 0, every ``measure_every`` steps and at the end."""
    model, inner, opt = make_variant(variant, s, group_size, lr)
    steps = len(s.train)
    history = [measure_variance(inner, opt, s.held_out, 0)]

    def measure_after(step: int, loss: float) -> None:
        done = step + 1
        if done % measure_every == 0 and done < steps:
            history.append(measure_variance(inner, opt, s.held_out, done))

    log = train_lm(model, opt, s.train, after_step=measure_after, desc=variant)
    history.append(measure_variance(inner, opt, s.held_out, steps))
    return VariantRun(variant, log.losses, history, None if model is inner else len(model.grouping.groups), inner)


@dataclass(frozen=True)
class Comparison:
    """The variants trained at one seed from one :class:`Setup`."""

    runs: dict[str, VariantRun]

    def factor(self, variant: str, column: str) -> float:
        """plain / variant of ``column`` at every measurement after step 0 (all runs start from the same
        weights), then the mean."""
        a = np.array([getattr(h, column) for h in self.runs["plain"].history[1:]])
        b = np.array([getattr(h, column) for h in self.runs[variant].history[1:]])
        return float(np.mean(a / b))

    def final_loss(self, variant: str) -> float:
        return float(np.mean(self.runs[variant].losses[-5:]))

    def metrics(self) -> dict[str, float]:
        m: dict[str, float] = {}
        for variant in self.runs:
            if variant != "plain":
                key = variant_key(variant)
                m |= {f"{key}_trace_factor": self.factor(variant, "trace"),
                      f"{key}_layer_spread_factor": self.factor(variant, "layer_log_std"),
                      f"{key}_final_loss": self.final_loss(variant)}
        return m | dict(plain_final_loss=self.final_loss("plain"))

    def series(self) -> list[tuple[int, dict[str, float]]]:
        """``(step, values)`` rows for ``run.log``: every step's loss, the measurements where taken."""
        rows = []
        for variant, run in self.runs.items():
            key = variant_key(variant)
            rows += [(step, {f"{key}_loss": loss}) for step, loss in enumerate(run.losses)]
            rows += [(h.step, {f"{key}_variance_trace": h.trace, f"{key}_layer_log_std": h.layer_log_std})
                     for h in run.history]
        return rows

    def table(self) -> str:
        rows = [("variant", "trace(Cov) plain/variant", "layer log-std plain/variant", "final loss", "groups")]
        rows += [(v, f"{self.factor(v, 'trace'):.4f}", f"{self.factor(v, 'layer_log_std'):.4f}",
                  f"{self.final_loss(v):.4f}", r.groups) for v, r in self.runs.items() if v != "plain"]
        return format_table(rows)


def train_variants(s: Setup, *, group_size: int, lr: float, measure_every: int,
                   variants: tuple[str, ...] = TRAINED) -> Comparison:
    return Comparison({v: train_variant(v, s, group_size=group_size, lr=lr, measure_every=measure_every)
                       for v in variants})


def _factor_estimate(factors) -> Estimate:
    """Per-seed factors (ratios of variances) to their geometric mean with a t interval on the logs: a ratio varies
    by factors, and a linear interval can reach below zero."""
    return geomean_interval(factors, method="t interval over seeds")


@dataclass(frozen=True)
class SeedComparisons:
    """One :class:`Comparison` per seed: plain and the graded DGR at each, the contrast at the first."""

    seeds: tuple[int, ...]
    comparisons: tuple[Comparison, ...]
    setups: tuple[Setup, ...]

    @property
    def first(self) -> Comparison:
        return self.comparisons[0]

    @property
    def factors(self) -> list[float]:
        """Per seed, plain / DGR + DC-ASGD of trace(Cov), averaged over the measurements after step 0."""
        return [c.factor(GRADED, "trace") for c in self.comparisons]

    @property
    def layer_factors(self) -> list[float]:
        """Per seed, plain / DGR + DC-ASGD of the spread across layers (std of the log per-block gradient norms),
        averaged over the measurements after step 0."""
        return [c.factor(GRADED, "layer_log_std") for c in self.comparisons]

    def estimates(self) -> dict[str, Estimate]:
        """The graded ``variance_reduction_factor`` (across mini-batches) and, reported beside it but not graded,
        ``layer_spread_factor`` (across layers, the claim's other reading of "gradient variance"): geometric means
        over the seeds with t intervals on the logs."""
        return {"variance_reduction_factor": _factor_estimate(self.factors),
                "layer_spread_factor": _factor_estimate(self.layer_factors)}

    def repeated(self) -> dict[str, Repeated]:
        """The graded estimate's per-seed factors, for ``claims.regrade_leaving_out``."""
        return {"variance_reduction_factor": Repeated(_factor_estimate, (self.factors,))}

    def metrics(self) -> dict[str, float]:
        """The first seed's comparison (the contrast included); the estimates over seeds are :meth:`estimates`."""
        return self.first.metrics() | {"seeds": len(self.seeds)}

    def rows(self) -> list[dict[str, float]]:
        return [{"seed": seed, "variance_reduction_factor": c.factor(GRADED, "trace"),
                 "layer_spread_factor": c.factor(GRADED, "layer_log_std"), "plain_final_loss": c.final_loss("plain"),
                 "dgr_final_loss": c.final_loss(GRADED)} for seed, c in zip(self.seeds, self.comparisons)]

    def table(self) -> str:
        e = self.estimates()
        return "\n".join([
            f"first seed ({self.seeds[0]}):", self.first.table(), "",
            "trace(Cov) plain / DGR + DC-ASGD per seed: " + ", ".join(f"{f:.3f}" for f in self.factors),
            f"variance reduction factor (graded): {e['variance_reduction_factor'].describe(4)}",
            "layer log-std plain / DGR + DC-ASGD per seed: " + ", ".join(f"{f:.3f}" for f in self.layer_factors),
            f"spread across layers (not graded): {e['layer_spread_factor'].describe(4)}"])


def train_seeds(text, settings: DGRVarianceSettings) -> SeedComparisons:
    """Plain and DGR + DC-ASGD at each of ``seeds`` seeds, and the uncompensated contrast at the first."""
    s = settings
    seeds = list(range(s.seed, s.seed + s.seeds))
    setups, comparisons = [], []
    for i, seed in enumerate(seeds):
        su = setup(text, s, seed)
        setups.append(su)
        comparisons.append(train_variants(su, group_size=s.group_size, lr=s.lr, measure_every=s.measure_every,
                                          variants=TRAINED if i == 0 else ("plain", GRADED)))
    return SeedComparisons(tuple(seeds), tuple(comparisons), tuple(setups))


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, batch) -> None:
    lm_loss(model, batch).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@dataclass(frozen=True)
class GradientMemory:
    plain: StepMemory
    dgr_sync: StepMemory
    sync_identical: bool
    """DGR-sync's weights equal plain's bit for bit after the two steps: the identity, checked (not a measurement)."""

    @property
    def grad_ratio(self) -> float:
        return self.plain.max_by_category["gradients"] / self.dgr_sync.max_by_category["gradients"]

    def metrics(self) -> dict[str, float]:
        return dict(plain_peak_grad_bytes=self.plain.max_by_category["gradients"],
                    dgr_sync_peak_grad_bytes=self.dgr_sync.max_by_category["gradients"],
                    plain_step_peak_bytes=self.plain.peak_bytes, dgr_sync_step_peak_bytes=self.dgr_sync.peak_bytes,
                    sync_weights_identical=int(self.sync_identical))

    def text(self) -> str:
        g_plain, g_dgr = self.plain.max_by_category["gradients"], self.dgr_sync.max_by_category["gradients"]
        return (f"peak gradient bytes: plain {format_bytes(g_plain, 'MB', 2)}, DGR-sync {format_bytes(g_dgr, 'MB', 2)} "
                f"({self.grad_ratio:.1f}x less); step peak (measured): plain "
                f"{format_bytes(self.plain.peak_bytes, 'MB', 1)}, "
                f"DGR-sync {format_bytes(self.dgr_sync.peak_bytes, 'MB', 1)}; DGR-sync weights identical to plain's "
                f"after both steps: {self.sync_identical}")


def gradient_memory(s: Setup, group_size: int, lr: float) -> GradientMemory:
    """One step each of plain AdamW and DGR-sync under MemTracker, after a first step that puts the optimizer
    state in place (as in every step after the first); then their weights compared bit for bit."""
    batch = s.train[0]
    plain_model = copy.deepcopy(s.initial)
    plain_opt = torch.optim.AdamW(plain_model.parameters(), lr=lr)
    dgr_model, dgr_inner, dgr_opt = make_variant("DGR sync", s, group_size, lr)
    plain_step = functools.partial(_step, plain_model, plain_opt, batch)
    dgr_step = functools.partial(_step, dgr_model, dgr_opt, batch)
    plain_step()
    dgr_step()
    plain, dgr = (measure_step(plain_step, plain_model, plain_opt, *batch),
                  measure_step(dgr_step, dgr_model, dgr_opt, *batch))
    identical = all(torch.equal(a, b) for a, b in zip(dgr_inner.parameters(), plain_model.parameters()))
    return GradientMemory(plain, dgr, identical)


class _PlainLogLabels(LogFormatterSciNotation):
    """Log-axis tick labels as plain numbers (``0.4``, ``2``), where matplotlib would write ``4 x 10^-1``."""

    def __call__(self, x, pos=None):
        return f"{x:g}" if super().__call__(x, pos) else ""


def _tidy_log(ax) -> None:
    """A log y axis that spans under a decade reads better linear; up to two decades, with plain-number labels
    (matplotlib then labels the minor ticks in scientific notation, which crowds the axis)."""
    lo, hi = ax.get_ylim()
    if hi < 10 * lo:
        ax.set_yscale("linear")
    elif hi < 100 * lo:
        ax.yaxis.set_major_formatter(_PlainLogLabels())
        ax.yaxis.set_minor_formatter(_PlainLogLabels(labelOnlyBase=False))


def plot_variance(seeds: SeedComparisons, claim) -> Figure:
    """Over training: the first seed's loss per variant, trace(Cov) and the spread across layers of every seed,
    and plain / DGR of trace(Cov) at each measurement of every seed (what the factor averages); the graded factor
    per seed with its estimate and 90% interval against the post's 8x, and the across-layer factor beside it (not
    graded). Legends sit outside the axes, never on them. ``claim`` is the registry's C6 (the notebook passes
    ``get_claim("C6")``), whose target is drawn."""
    first, target = seeds.first, claim.target_for("variance_reduction_factor")
    fig, axes = plt.subplots(3, 2, figsize=(7.8, 10.8))
    (loss_ax, trace_ax), (ratio_ax, layer_ax), (graded, key_ax) = axes
    window = min(5, len(first.runs["plain"].losses))
    for variant, run in first.runs.items():
        lines = {k: v for k, v in STYLES[variant].items() if k not in ("marker", "ms", "mfc")}
        loss_ax.plot(np.arange(window - 1, len(run.losses)),
                     np.convolve(run.losses, np.ones(window) / window, mode="valid"), **lines)
    per_measurement: list[float] = []
    for i, c in enumerate(seeds.comparisons):
        for variant, run in c.runs.items():
            style = dict(STYLES[variant], lw=1.4 if i == 0 else 0.7, alpha=1.0 if i == 0 else 0.5)
            steps = [h.step for h in run.history]
            trace_ax.semilogy(steps, [h.trace for h in run.history], **style)
            layer_ax.plot(steps, [h.layer_log_std for h in run.history], **style)
        plain, dgr = c.runs["plain"].history[1:], c.runs[GRADED].history[1:]
        ratios = [a.trace / b.trace for a, b in zip(plain, dgr)]
        ratio_ax.plot([h.step for h in plain], ratios, "o-", ms=4, lw=0.8, color="0.4", alpha=1.0 if i == 0 else 0.6)
        per_measurement += ratios
    ratio_ax.axhline(POST_FACTOR, color="C2", ls="--", lw=1.2)
    ratio_ax.axhspan(*target.no_effect, color="grey", alpha=0.3)
    ratio_ax.set_yscale("log")
    n = len(seeds.seeds)
    loss_ax.set(title=f"training loss ({window}-step mean), seed {seeds.seeds[0]}", xlabel="step",
                ylabel="loss (nats/byte)")
    trace_ax.set(title=f"variance across mini-batches, {n} seeds", xlabel="step",
                 ylabel="trace of gradient covariance")
    ratio_ax.set(title=f"plain / DGR + DC-ASGD per measurement, {n} seeds", xlabel="step",
                 ylabel="trace(Cov) plain / DGR (x)")
    layer_ax.set(title=f"spread across layers, {n} seeds", xlabel="step",
                 ylabel="std of log per-block gradient norm")
    e = seeds.estimates()
    for x, (key, values, color) in enumerate((("variance_reduction_factor", seeds.factors, "C3"),
                                              ("layer_spread_factor", seeds.layer_factors, "C0"))):
        graded.plot(x + np.linspace(-0.1, 0.1, len(values)), values, "o", color="grey", ms=5, alpha=0.7,
                    label=f"per seed ({len(values)})" if x == 0 else None)
        est = e[key]
        err = None if not est.has_interval else [[est.value - est.low], [est.high - est.value]]
        graded.errorbar([x], [est.value], yerr=err, fmt="D", color=color, capsize=6, ms=7, zorder=3,
                        label=f"{'graded' if x == 0 else 'not graded'}: geometric mean,\n90% t interval on logs "
                              f"(n={est.n})")
    graded.plot([-0.35, 0.35], [POST_FACTOR] * 2, "--", color="C2", lw=1.2,
                label=f"post: {POST_FACTOR:g}x (graded at >= {target.lo:g}x)")
    graded.axhspan(*target.no_effect, color="grey", alpha=0.3, label=f"no effect {target.band_text()}")
    graded.set_yscale("log")
    shown = [*seeds.factors, *seeds.layer_factors, *(v for est in e.values() for v in (est.low, est.high)
                                                       if v is not None)]
    graded.set_ylim(min(0.5, min(shown) * 0.8), max(12.0, max(shown) * 1.3))
    graded.set_xlim(-0.5, 1.5)
    graded.set_xticks([0, 1], ["across\nmini-batches", "across\nlayers"])
    graded.set(xlabel="gradient variance, plain / DGR + DC-ASGD", ylabel="reduction factor (x), mean over "
               "measurements", title="graded: variance reduction factor")
    ratio_ax.set_ylim(min(0.5, min(per_measurement) * 0.8), max(12.0, max(per_measurement) * 1.3))
    for ax in (trace_ax, ratio_ax, graded):
        _tidy_log(ax)
    for ax in (loss_ax, trace_ax, ratio_ax, layer_ax):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in axes.flat[:5]:
        ax.title.set_fontsize(10)
    variants = [plt.Line2D([], [], **STYLES[v], label=_legend_label(first, v, seeds.seeds[0]))
                for v in first.runs]
    seeds_key = [plt.Line2D([], [], color="0.4", lw=1.4, label=f"seed {seeds.seeds[0]} (bold)"),
                 plt.Line2D([], [], color="0.4", lw=0.7, alpha=0.5, label="other seeds (thin)"),
                 plt.Line2D([], [], color="C2", ls="--", lw=1.2, label=f"the post: {POST_FACTOR:g}x less variance")]
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    slot = key_ax.get_position()  # the empty slot holds the graded panel's legend, a figure legend (checked)
    fig.delaxes(key_ax)
    fig.legend(*graded.get_legend_handles_labels(), fontsize=8, loc="center left", title="graded panel (left)",
               title_fontsize=8, bbox_to_anchor=slot)
    fig.legend(handles=variants + seeds_key, fontsize=8, loc="upper center", title="over training", title_fontsize=8,
               ncol=2, bbox_to_anchor=(0.5, 1.0))
    return fig


def _legend_label(first: Comparison, variant: str, seed: int) -> str:
    """A variant's legend entry; the uncompensated contrast says so when it lies on top of the graded DGR."""
    if variant == CONTRAST:
        graded = np.array([h.trace for h in first.runs[GRADED].history])
        if np.allclose([h.trace for h in first.runs[CONTRAST].history], graded, rtol=COINCIDE, atol=0):
            return f"{variant}\n(seed {seed}; within {COINCIDE:.0%} of DC-ASGD, drawn over it)"
        return f"{variant} (seed {seed})"
    return variant


def c6_texts(seeds: SeedComparisons, memory: GradientMemory, settings: DGRVarianceSettings) -> dict[str, str]:
    """``scale``, ``measured_text`` and ``note`` for C6's verdict."""
    s, su = settings, seeds.setups[0]
    shape = su.spec.shape
    e = seeds.estimates()
    contrast = seeds.first.factor(CONTRAST, "trace")
    return dict(
        scale=(f"{shape.n_layers}-layer GPT-2-style decoder, width {shape.d_model} ({su.n_params / 1e6:.2f}M params), "
               f"{s.steps} AdamW steps of {s.batch_size}x{s.seq_len} bytes, group_size {s.group_size}, variance over "
               f"{s.variance_batches} held-out batches, {len(seeds.seeds)} seeds"),
        measured_text=(f"gradient variance across mini-batches, trace(Cov) plain / DGR interleaved + DC-ASGD "
                       f"(graded): {e['variance_reduction_factor'].describe(3)}; across layers, std of log per-block "
                       f"gradient norm plain / DGR (reported, not graded): {e['layer_spread_factor'].describe(3)}"),
        note=(f"without compensation (first seed) {contrast:.3f}x; DGR-sync is plain's computation (weights identical "
              f"to plain's: {memory.sync_identical}), so its factor is 1 by construction and is not measured; "
              f"gradient memory {memory.grad_ratio:.1f}x lower with DGR-sync"),
    )


__all__ = ["CONTRAST", "GRADED", "POST_FACTOR", "TRAINED", "VARIANTS", "Comparison", "DGRVarianceSettings",
           "GradientMemory", "Measurement", "SeedComparisons", "Setup", "VariantRun", "c6_texts", "gradient_memory",
           "make_variant", "measure_variance", "plot_variance", "setup", "train_seeds", "train_variant",
           "train_variants", "variant_key"]
