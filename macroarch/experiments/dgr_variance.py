"""Notebook 04's experiment: does DGR cut gradient variance to 1/8 on a 256-layer Transformer (claim C6, 3.1)?

The same deep pre-LN decoder (transformers GPT-2 style, small width) is trained four ways from the same initial
weights on the same batches, each through the project's training loop (``experiments.loop.train_lm``): plain
AdamW, DGR-sync (per-group steps during backward), DGR-interleaved with DC-ASGD compensation (the post's full
DGR) and DGR-interleaved without it (``macroarch.dgr``). At step 0, every ``measure_every`` steps and at the end,
with the weights fixed (DGR's in-backward stepping suspended), on one held-out set of mini-batches:

- the trace of the covariance of the mini-batch gradient (``minibatch_gradient_variance``): its ratio plain /
  DGR, averaged over the measurements after step 0, is the "variance reduction factor" graded against 8;
- the spread across layers: the standard deviation of the log of the per-block gradient norms.

:func:`gradient_memory` measures one more step of plain AdamW and of DGR-sync under MemTracker: DGR frees each
group's gradients once the group has stepped. DGR-sync is the same computation as plain training, so its weights
(and all its numbers) come out identical to plain's; :func:`plot_variance` draws every run in its own style and
says in the legend which runs coincide (exactly, or within 1% everywhere), so that two lines on top of each other
are not read as one run.
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
from torch import nn

from macroarch._table import format_table
from macroarch.data import lm_batches
from macroarch.dgr import DGRWrapper, GradientCompensator
from macroarch.experiments.loop import train_lm
from macroarch.measure.gradients import GradientNormRecorder, layer_norm_spread, minibatch_gradient_variance
from macroarch.measure.memory import StepMemory, format_bytes, measure_step
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
STYLES = {
    "plain": dict(color="#4c72b0", ls="-", lw=2.6, marker="o", ms=8, mfc="none", alpha=0.6),
    "DGR sync": dict(color="#dd8452", ls="--", lw=1.2, marker="x", ms=6),
    "DGR interleaved + DC-ASGD": dict(color="#55a868", ls="-", lw=2.6, marker="s", ms=8, mfc="none", alpha=0.6),
    "DGR interleaved, no compensation": dict(color="#c44e52", ls=":", lw=1.4, marker="+", ms=7),
}
"""Wide hollow markers under thin ones: a run drawn exactly over another stays visible."""
COINCIDE = 0.01
"""Runs closer than this (relative, at every point) overlap on the figure; the legend says so."""


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


def setup(text, *, n_layers: int, width: int, n_heads: int, seq_len: int, batch_size: int, steps: int,
          variance_batches: int, seed: int) -> Setup:
    """A GPT-2-style decoder ``n_layers`` deep (d_ff = 4 x width, no dropout), built after seeding the global RNG."""
    spec = get_model_spec("gpt3_tiny").scaled(n_layers=n_layers, d_model=width, n_heads=n_heads, n_kv_heads=n_heads,
                                              d_ff=4 * width, dropout=0.0, max_seq_len=seq_len)
    torch.manual_seed(seed)
    initial = spec.build()
    return Setup(spec, initial, list(lm_batches(text.train, batch_size, seq_len, seed=seed, steps=steps)),
                 list(lm_batches(text.val, batch_size, seq_len, seed=seed + 1, steps=variance_batches)))


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
    runs: dict[str, VariantRun]

    @property
    def sync_weights_identical(self) -> bool:
        """DGR-sync's weights equal plain's bit for bit after training."""
        return all(torch.equal(a, b) for a, b in zip(self.runs["DGR sync"].model.parameters(),
                                                     self.runs["plain"].model.parameters()))

    def factor(self, variant: str, column: str) -> float:
        """plain / variant of ``column`` at every measurement after step 0 (all runs start from the same
        weights), then the mean."""
        a = np.array([getattr(h, column) for h in self.runs["plain"].history[1:]])
        b = np.array([getattr(h, column) for h in self.runs[variant].history[1:]])
        return float(np.mean(a / b))

    def final_loss(self, variant: str) -> float:
        return float(np.mean(self.runs[variant].losses[-5:]))

    def _values(self, variant: str) -> np.ndarray:
        run = self.runs[variant]
        return np.array(run.losses + [v for h in run.history for v in (h.trace, h.layer_log_std)])

    def coincides_with(self, variant: str) -> tuple[str, float] | None:
        """The first run before ``variant`` that the figure draws on top of it, and the largest relative difference
        between the two over every loss and measurement: 0.0 when identical, else at most ``COINCIDE``."""
        mine = self._values(variant)
        for name in self.runs:
            if name == variant:
                return None
            other = self._values(name)
            if len(other) == len(mine):
                rel = float(np.max(np.abs(mine - other) / np.maximum(np.maximum(np.abs(mine), np.abs(other)), 1e-300)))
                if rel <= COINCIDE:
                    return name, rel
        return None

    def metrics(self) -> dict[str, float]:
        m: dict[str, float] = {}
        for variant in self.runs:
            if variant != "plain":
                key = variant_key(variant)
                m |= {f"{key}_trace_factor": self.factor(variant, "trace"),
                      f"{key}_layer_spread_factor": self.factor(variant, "layer_log_std"),
                      f"{key}_final_loss": self.final_loss(variant)}
        return m | dict(plain_final_loss=self.final_loss("plain"),
                        sync_weights_identical=int(self.sync_weights_identical),
                        variance_reduction_factor=self.factor(GRADED, "trace"))

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
        return (format_table(rows) + f"\nDGR-sync weights identical to plain after {len(self.runs['plain'].losses)} "
                f"steps: {self.sync_weights_identical}")


def train_variants(s: Setup, *, group_size: int, lr: float, measure_every: int) -> Comparison:
    return Comparison({v: train_variant(v, s, group_size=group_size, lr=lr, measure_every=measure_every)
                       for v in VARIANTS})


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, batch) -> None:
    lm_loss(model, batch).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@dataclass(frozen=True)
class GradientMemory:
    plain: StepMemory
    dgr_sync: StepMemory

    @property
    def grad_ratio(self) -> float:
        return self.plain.max_by_category["gradients"] / self.dgr_sync.max_by_category["gradients"]

    def metrics(self) -> dict[str, float]:
        return dict(plain_peak_grad_bytes=self.plain.max_by_category["gradients"],
                    dgr_sync_peak_grad_bytes=self.dgr_sync.max_by_category["gradients"],
                    plain_step_peak_bytes=self.plain.peak_bytes, dgr_sync_step_peak_bytes=self.dgr_sync.peak_bytes)

    def text(self) -> str:
        g_plain, g_dgr = self.plain.max_by_category["gradients"], self.dgr_sync.max_by_category["gradients"]
        return (f"peak gradient bytes: plain {format_bytes(g_plain, 'MB', 2)}, DGR-sync {format_bytes(g_dgr, 'MB', 2)} "
                f"({self.grad_ratio:.1f}x less); step peak: plain {format_bytes(self.plain.peak_bytes, 'MB', 1)}, "
                f"DGR-sync {format_bytes(self.dgr_sync.peak_bytes, 'MB', 1)}")


def gradient_memory(s: Setup, group_size: int, lr: float) -> GradientMemory:
    """One step each of plain AdamW and DGR-sync under MemTracker, after a first step that puts the optimizer
    state in place (as in every step after the first)."""
    batch = s.train[0]
    plain_model = copy.deepcopy(s.initial)
    plain_opt = torch.optim.AdamW(plain_model.parameters(), lr=lr)
    dgr_model, _, dgr_opt = make_variant("DGR sync", s, group_size, lr)
    plain_step = functools.partial(_step, plain_model, plain_opt, batch)
    dgr_step = functools.partial(_step, dgr_model, dgr_opt, batch)
    plain_step()
    dgr_step()
    return GradientMemory(measure_step(plain_step, plain_model, plain_opt, *batch),
                          measure_step(dgr_step, dgr_model, dgr_opt, *batch))


def plot_variance(comparison: Comparison) -> Figure:
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    for variant, run in comparison.runs.items():
        label = variant
        if same := comparison.coincides_with(variant):
            label += (f" (identical to {same[0]}: drawn on top of it)" if same[1] == 0
                      else f" (within {same[1]:.2%} of {same[0]})")
        style = STYLES.get(variant, {})
        lines = {k: v for k, v in style.items() if k not in ("marker", "ms", "mfc")}
        steps = [h.step for h in run.history]
        axes[0].plot(np.convolve(run.losses, np.ones(5) / 5, mode="valid"), label=label, **lines)
        axes[1].semilogy(steps, [h.trace for h in run.history], label=label, **style)
        axes[2].plot(steps, [h.layer_log_std for h in run.history], label=label, **style)
    plain = comparison.runs["plain"].history
    axes[1].semilogy([h.step for h in plain], [h.trace / 8 for h in plain], "k:", lw=1, label="plain / 8 (the post)")
    axes[0].set(title="training loss (5-step mean)", xlabel="step", ylabel="loss (nats/byte)")
    axes[1].set(title="gradient variance across mini-batches: trace(Cov)", xlabel="step")
    axes[2].set(title="spread across layers: std of log per-block grad norm", xlabel="step")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def c6_texts(s: Setup, comparison: Comparison, memory: GradientMemory, metrics: dict[str, float], *,
             group_size: int, steps: int) -> dict[str, str]:
    """``scale``, ``measured_text`` and ``note`` for C6's verdict, from the run's metrics."""
    shape, first = s.spec.shape, s.train[0][0]
    return dict(
        scale=(f"{shape.n_layers}-layer GPT-2-style decoder, width {shape.d_model} ({s.n_params / 1e6:.2f}M params), "
               f"{steps} AdamW steps of {first.shape[0]}x{first.shape[1]} bytes, group_size {group_size}, "
               f"variance over {len(s.held_out)} held-out batches"),
        measured_text=(f"trace(Cov) plain / DGR: interleaved + DC-ASGD {metrics['variance_reduction_factor']:.3f}x, "
                       f"sync {metrics['DGR_sync_trace_factor']:.3f}x (weights identical to plain: "
                       f"{bool(metrics['sync_weights_identical'])})"),
        note=(f"gradient memory {memory.grad_ratio:.1f}x lower with DGR-sync; sync DGR is the same computation as "
              f"plain training, so it cannot change the variance; only staleness (interleaved) can"),
    )


__all__ = ["GRADED", "VARIANTS", "Comparison", "GradientMemory", "Measurement", "Setup", "VariantRun", "c6_texts",
           "gradient_memory", "make_variant", "measure_variance", "plot_variance", "setup", "train_variant",
           "train_variants", "variant_key"]
