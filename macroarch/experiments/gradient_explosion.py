"""Notebook 01's experiments: gradients through depth (C2), the cost of clipping (C3), HC vs mHC (R1).

Post section 2.1 (C2, C3) and the mHC reference point (R1). Each claim has a function that runs the
measurement and returns a small result, the graded estimates (``macroarch.measure.stats``: each with its
interval and n over seeds, names kept stable for the registry in ``macroarch.repro.claims``), the other
metrics, per-seed rows (for leave-one-out regrading), a text table, a figure and the verdict's texts. Every
function takes the notebook's :class:`GradientExplosionSettings`.

- **C2** :func:`stack_seeds`: ``sigma * orthogonal`` stacks (linear, and with tanh between the layers)
  in float64, one set per seed (:func:`stack_profiles`); the gradient norm reaching each layer's output, its
  fitted log-growth rate against depth counted from the output (``log(sigma)`` exactly for the linear stack),
  and for tanh the RMS log singular value of evenly spaced layer Jacobians along the real forward
  (:func:`jacobian_log_rate`). Graded: the linear stacks' relative rate error, an identity (float64 rounding,
  its worst over the seeds, labelled so), and the tanh stacks' signed ``fitted rate / log(sigma)`` on each side of
  sigma = 1 (vanishing, growth), per seed, then a t interval over seeds (the ratio can be near 0 or negative).
  :func:`transformer_profiles`: the same rate in a pre-LN (GPT-2 style) and a post-LN (BERT) model at init
  (first seed; not graded).
- **C3** :func:`clipping_sweep`: a small BERT MLM trained with clipping at each threshold under
  ``macroarch.measure.clipping``'s probe (a shadow optimizer takes the unclipped step), and once without
  clipping through the project's one training loop (``experiments.loop.train_lm``), AdamW and SGD with
  BERT's warmup + linear decay; steps to the loss where the unclipped run ends. The sweep runs at the first
  seed; :func:`clipping_seeds` repeats the graded cell (AdamW, clip 1.0, clipped and unclipped sharing
  initialisation, batches and dropout seed) at every seed: the reduction a t interval over seeds, the slowdown (a
  ratio) a geometric mean with a t interval on the logs. :func:`bert_large_probe`: the probe for a few steps
  at BERT-large's shape.
- **R1** :func:`residual_seeds`: the same small decoder trained with HC and mHC connections (and residual at the
  first seed, the reference) through ``train_lm``, the kinds of one seed sharing initial draws and batches;
  gradient norm before each step, composite gain of the mixing matrices every ``gain_every`` steps, validation
  loss by ``evaluate_lm``. Graded per seed: mHC's peak gain (a t interval) and HC's over mHC's (a ratio: the
  geometric mean with a t interval on the logs).

Global RNG: :func:`transformer_profiles` and :func:`train_residual` seed it (as the notebook always did);
everything else draws from its own generators or inside ``fork_rng``, except the BERT-large probe's dropout,
which draws from the global RNG where the notebook's order leaves it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.figure import Figure
from matplotlib.ticker import LogFormatterSciNotation, MaxNLocator
from torch import nn

from macroarch._progress import tqdm
from macroarch._table import format_table
from macroarch.data import BYTE_VOCAB_SIZE, MLM_VOCAB_SIZE, PAD_ID, eval_batches, lm_batches, mlm_batches
from macroarch.experiments.loop import evaluate_lm, train_lm
from macroarch.experiments.settings import Settings
from macroarch.measure.clipping import ClippingTrace, measure_clipping, steps_to_target
from macroarch.measure.gradients import (
    GradientNormRecorder,
    GrowthFit,
    controlled_stack,
    fit_growth_rate,
    layer_jacobian_singular_values,
)
from macroarch.measure.stats import Estimate, Repeated, geomean_interval, mean_interval
from macroarch.models import (
    HCTransformerLM,
    bert_large_config,
    bert_small_config,
    build_bert_mlm,
    composite_gain,
    count_parameters,
    get_model_spec,
    mlm_loss,
)
from macroarch.models.hyperconnections import RESIDUAL_KINDS, CompositeGain

JACOBIAN_SAMPLES = 8
"""Inputs whose layer Jacobians are decomposed (dense per-sample Jacobians are slow)."""
WINDOW = 10
"""Steps in the moving average of the loss that ``steps_to_target`` compares with the target."""
OPTIMIZERS = ("AdamW", "SGD")
GRADED_CLIP = 1.0
"""The threshold C3 is graded at (the one BERT uses)."""


@dataclass(frozen=True)
class GradientExplosionSettings(Settings):
    """Notebook 01's settings: its parameters cell, less ``profile``
    (``GradientExplosionSettings.from_params(params)``). Seeds run ``seed, seed + 1, ...``."""

    stack_depth: int
    """Layers of each controlled stack."""
    jacobian_layers: int
    """tanh stacks of the first seed: Jacobian spectra at this many evenly spaced layers (dense Jacobians are slow)."""
    transformer_layers: int
    """Depth of the pre-LN (GPT-2 style) and post-LN (BERT) transformers."""
    transformer_batches: int
    """Batches averaged per transformer gradient-norm profile."""
    seq_len: int
    """Tokens per row, every model of the notebook."""
    batch_size: int
    """Rows per batch: C2's transformers and R1."""
    c3_steps: int
    """Training steps of every clipped and unclipped run."""
    c3_thresholds: tuple[float, ...]
    """Clipping thresholds (max_norm) of the first seed's sweep; must include 1.0, the one graded."""
    c3_hidden: int
    """Hidden size of the small BERT."""
    c3_layers: int
    """Layers of the small BERT."""
    c3_batch: int
    """Rows per batch of the small BERT."""
    bert_large_steps: int
    """Probe steps at BERT-large's shape (0 skips it)."""
    bert_large_batch: int
    """Rows per batch of the BERT-large probe."""
    device: str
    """Where BERT-large's probe runs."""
    r1_steps: int
    """Training steps per residual kind and seed."""
    r1_layers: int
    """Decoder layers (two sublayers each)."""
    r1_width: int
    """Decoder width."""
    r1_gain_every: int
    """The composite gain is measured every this many steps (and at the last)."""
    r1_eval_batches: int
    """Held-out batches of the validation loss."""
    r1_seeds: int
    """Seeds of the HC and mHC runs: the gains' n."""
    c3_seeds: int
    """Seeds of the graded cell (AdamW, clip 1.0, clipped vs unclipped): the reduction's and slowdown's n."""
    c2_seeds: int
    """Seeds of the controlled stacks (weights, inputs and output gradient): the graded numbers' n."""
    seed: int = 0
    """The first seed (weights, batches and dropout)."""
    corpus: str = "stdlib"
    """data/text/<corpus>."""
    threads: int = 1
    """Torch threads."""
    sigmas: tuple[float, ...] = (0.9, 1.0, 1.1)
    """Every singular value of every weight of a stack; at least one below 1 and one above 1 (C2's tanh stacks are
    graded on each side; the rates are divided by log(sigma))."""
    stack_width: int = 64
    """Width of the controlled stacks."""
    stack_batch: int = 32
    """Inputs pushed through each stack."""
    transformer_width: int = 64
    """Width of C2's transformers."""
    adamw_lr: float = 1e-3
    """AdamW's peak learning rate (weight decay 0.01)."""
    sgd_lr: float = 0.1
    """SGD's peak learning rate (momentum 0.9)."""
    warmup_fraction: float = 0.1
    """Share of the steps in linear warmup, then linear decay to 0."""
    r1_lr: float = 3e-3
    """AdamW learning rate of R1 (weight decay 0.01)."""
    n_streams: int = 4
    """Residual streams of HC and mHC."""

    def __post_init__(self) -> None:
        self._positive("stack_depth", "jacobian_layers", "transformer_layers", "transformer_batches", "seq_len",
                       "batch_size", "c3_steps", "c3_hidden", "c3_layers", "c3_batch", "bert_large_batch", "r1_steps",
                       "r1_layers", "r1_width", "r1_gain_every", "r1_eval_batches", "threads", "stack_width",
                       "stack_batch", "c2_seeds", "transformer_width", "c3_seeds", "adamw_lr", "sgd_lr", "r1_seeds",
                       "r1_lr", "n_streams")
        self._non_negative("bert_large_steps", "seed")
        self._fraction("warmup_fraction")
        self._device()
        self._non_empty("sigmas", "c3_thresholds")
        if any(not s > 0 for s in self.sigmas) or not all(_side(self.sigmas, side) for side in SIDES):
            self._fail("sigmas", "positive numbers, at least one below 1 and one above 1 (C2 grades both sides)")
        if GRADED_CLIP not in self.c3_thresholds:
            self._fail("c3_thresholds", f"a list that includes {GRADED_CLIP}, the threshold C3 is graded at")
        if self.jacobian_layers > self.stack_depth:
            self._fail("jacobian_layers", f"at most stack_depth ({self.stack_depth})")

    def seeds(self, n: int) -> list[int]:
        return list(range(self.seed, self.seed + n))


def _key(sigma: float) -> str:
    return f"sigma{sigma:g}".replace(".", "p")  # metric names carry no dots


SIDES = {"vanishing": "sigma < 1", "growth": "sigma > 1"}
"""C2's tanh stacks are graded per side of sigma = 1: ``mlp_<side>_rate_ratio``."""


def _side(sigmas, side: str) -> list[float]:
    if side not in SIDES:
        raise ValueError(f"side {side!r}: expected one of {list(SIDES)}")
    return [s for s in sigmas if (s < 1.0 if side == "vanishing" else s > 1.0)]


def _from_output(norms: torch.Tensor) -> torch.Tensor:
    """Depth counted from the output: layers between a block and the loss (the last block has 0)."""
    return torch.arange(len(norms) - 1, -1, -1, dtype=torch.float64)


# ----------------------------------------------------------------------------------------------------- C2
@dataclass(frozen=True)
class StackProfiles:
    """Controlled stacks: per-layer output-gradient norms (input side first) and their fits, per (kind, sigma)."""

    sigmas: tuple[float, ...]
    depth: int
    width: int
    norms: dict[tuple[str, float], torch.Tensor]
    fits: dict[tuple[str, float], GrowthFit]
    jacobian_rate: dict[float, float]
    """tanh stacks: mean log RMS singular value of the sampled layer Jacobians, per sigma (empty if not sampled)."""

    def rel_error(self, kind: str) -> float:
        """Worst ``|rate - log(sigma)| / |log(sigma)|`` over the sigmas other than 1."""
        return max(abs(self.fits[kind, s].rate - math.log(s)) / abs(math.log(s)) for s in self.sigmas if s != 1.0)

    def rate_ratio(self, kind: str, side: str) -> float:
        """Fitted per-layer rate / ``log(sigma)``, the mean over the sigmas on ``side`` of 1 (``"vanishing"``: below,
        ``"growth"``: above). Signed: 1 is the exponential law, 0 is norms flat in depth, below 0 the other way."""
        return float(np.mean([self.fits[kind, s].rate / math.log(s) for s in _side(self.sigmas, side)]))


def jacobian_log_rate(stack: nn.Sequential, x: torch.Tensor, n_layers: int) -> float:
    """Mean over ``n_layers`` evenly spaced (Linear, tanh) blocks of a tanh stack of ``log sqrt(mean sv**2)``,
    the RMS singular value of the block's Jacobian ``diag(tanh'(W h)) W``, at the inputs ``h`` the real
    forward from ``x`` reaches there."""
    blocks = [nn.Sequential(*list(stack)[i:i + 2]) for i in range(0, len(stack), 2)]
    picked = set(np.linspace(0, len(blocks) - 1, n_layers).round().astype(int).tolist())
    h, logs = x, []
    with torch.no_grad():
        for i, block in enumerate(blocks):
            if i in picked:
                sv = layer_jacobian_singular_values(block, h)
                logs.append(0.5 * torch.log((sv ** 2).mean()).item())
            h = block(h)
    return float(np.mean(logs))


def stack_profiles(sigmas: list[float], depth: int, width: int, batch: int, jacobian_layers: int,
                   seed: int) -> StackProfiles:
    """One backward pass of ``(stack(x) * v).sum()`` through each controlled stack, float64; the tanh stacks'
    Jacobian rates at ``jacobian_layers`` layers (none when 0)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, width, generator=g, dtype=torch.float64)
    v = torch.randn(batch, width, generator=g, dtype=torch.float64)  # the gradient at the stack's output
    norms, fits, jacobian_rate = {}, {}, {}
    for kind in ("linear", "mlp"):
        for sigma in sigmas:
            stack = controlled_stack(depth, width, sigma, kind=kind, generator=seed, dtype=torch.float64)
            with GradientNormRecorder(stack) as rec:
                (stack(x) * v).sum().backward()
            norms[kind, sigma] = rec.output_grad_norms[0]
            fits[kind, sigma] = fit_growth_rate(_from_output(norms[kind, sigma]), norms[kind, sigma])
            if kind == "mlp" and jacobian_layers:
                jacobian_rate[sigma] = jacobian_log_rate(stack, x[:JACOBIAN_SAMPLES], jacobian_layers)
    return StackProfiles(tuple(sigmas), depth, width, norms, fits, jacobian_rate)


@dataclass(frozen=True)
class StackSeeds:
    """The controlled stacks at each seed (weights, inputs and output gradient all drawn from it)."""

    seeds: tuple[int, ...]
    profiles: tuple[StackProfiles, ...]

    @property
    def first(self) -> StackProfiles:
        return self.profiles[0]

    def rel_errors(self, kind: str) -> list[float]:
        """Per seed, the worst relative error of the fitted rate over the sigmas (:meth:`StackProfiles.rel_error`)."""
        return [p.rel_error(kind) for p in self.profiles]

    def rate_ratios(self, side: str) -> list[float]:
        """Per seed, the tanh stacks' fitted rate / log(sigma) on ``side`` (:meth:`StackProfiles.rate_ratio`)."""
        return [p.rate_ratio("mlp", side) for p in self.profiles]

    def estimates(self) -> dict[str, Estimate]:
        """The graded numbers: the linear stacks' relative error (an identity: its worst over the seeds), and the
        tanh stacks' signed rate ratio on each side of sigma = 1 (t intervals over the seeds)."""
        return {key: r.estimate() for key, r in self.repeated().items()}

    def repeated(self) -> dict[str, Repeated]:
        """The graded estimates' per-seed values, for ``claims.regrade_leaving_out``."""
        return {"rate_rel_error": Repeated(identity_error, (self.rel_errors("linear"),)),
                **{f"mlp_{side}_rate_ratio": Repeated(mean_interval, (self.rate_ratios(side),),
                                                      options={"method": "t interval over seeds"})
                   for side in SIDES}}

    def rows(self) -> list[dict[str, float]]:
        """One row per seed: the graded numbers and each fitted rate."""
        return [{"seed": seed, "rate_rel_error": p.rel_error("linear"),
                 **{f"mlp_{side}_rate_ratio": p.rate_ratio("mlp", side) for side in SIDES},
                 **{f"{kind}_rate_{_key(sigma)}": fit.rate for (kind, sigma), fit in p.fits.items()}}
                for seed, p in zip(self.seeds, self.profiles)]


def identity_error(per_seed: list[float]) -> Estimate:
    """The linear stacks' relative rate error: not a sampled quantity but an identity (a linear stack's gradient is
    its weights' product, so the fitted rate is log(sigma) up to float64 rounding). Reported as the worst over the
    seeds, a point with a zero-width interval, and labelled as what it is."""
    worst = float(max(per_seed))
    return Estimate(worst, worst, worst, n=len(per_seed),
                    method="identity (a linear stack's gradient is its weights' product): float64 rounding, worst "
                           "over seeds")


def stack_seeds(settings: GradientExplosionSettings) -> StackSeeds:
    """:func:`stack_profiles` at each of ``c2_seeds`` seeds; the Jacobian spectra (slow, not graded) at the first."""
    s = settings
    seeds = s.seeds(s.c2_seeds)
    return StackSeeds(tuple(seeds), tuple(
        stack_profiles(list(s.sigmas), s.stack_depth, s.stack_width, s.stack_batch, s.jacobian_layers if i == 0 else 0,
                       seed) for i, seed in enumerate(tqdm(seeds, desc="controlled stacks (seeds)", mininterval=5))))


@dataclass(frozen=True)
class TransformerProfiles:
    """Mean per-block output-gradient norms at init of a pre-LN and a post-LN transformer, and their fits."""

    layers: int
    width: int
    norms: dict[str, torch.Tensor]
    fits: dict[str, GrowthFit]


PRE_LN, POST_LN = "pre-LN (GPT-2 style)", "post-LN (BERT)"


def block_norm_profile(model: nn.Module, batches: list, loss_fn: Callable[[nn.Module, object], torch.Tensor]):
    """Per-block output-gradient norm of ``model``, averaged over one backward pass per batch."""
    with GradientNormRecorder(model) as rec:
        for batch in batches:
            loss_fn(model, batch).backward()
            model.zero_grad(set_to_none=True)
    return rec.output_grad_norms.mean(0)


def transformer_profiles(text, settings: GradientExplosionSettings) -> TransformerProfiles:
    """GPT-2-style (transformers ``GPT2LMHeadModel``) and BERT (``BertForMaskedLM``) models ``transformer_layers``
    deep, no dropout, on ``transformer_batches`` corpus batches, at the first seed. Seeds the global RNG (the GPT-2
    build draws from it)."""
    s = settings
    layers, width, seq_len, batch_size, n_batches, seed = (s.transformer_layers, s.transformer_width, s.seq_len,
                                                           s.batch_size, s.transformer_batches, s.seed)
    torch.manual_seed(seed)
    pre_ln = get_model_spec("gpt3_tiny").scaled(n_layers=layers, d_model=width, d_ff=4 * width, dropout=0.0,
                                                max_seq_len=seq_len).build()
    post_ln = build_bert_mlm(bert_small_config(MLM_VOCAB_SIZE, hidden=width, layers=layers, heads=4, max_len=seq_len,
                                               dropout=0.0, pad_token_id=PAD_ID), seed=seed)
    lm = list(lm_batches(text.train, batch_size, seq_len, seed=seed, steps=n_batches))
    mlm = list(mlm_batches(text.train, batch_size, seq_len, seed=seed, steps=n_batches))
    norms = {PRE_LN: block_norm_profile(pre_ln, lm, lambda m, b: m(input_ids=b[0], labels=b[1]).loss),
             POST_LN: block_norm_profile(post_ln, mlm, mlm_loss)}
    fits = {name: fit_growth_rate(_from_output(n), n) for name, n in norms.items()}
    return TransformerProfiles(layers, width, norms, fits)


def c2_metrics(stacks: StackSeeds, transformers: TransformerProfiles) -> dict[str, float]:
    """The first seed's fitted rates and the transformers' (the graded errors are :meth:`StackSeeds.estimates`)."""
    m: dict[str, float] = {}
    first = stacks.first
    for (kind, sigma), fit in first.fits.items():
        m[f"{kind}_rate_{_key(sigma)}"], m[f"{kind}_rate_stderr_{_key(sigma)}"] = fit.rate, fit.rate_stderr
    m |= {f"mlp_jacobian_rate_{_key(s)}": r for s, r in first.jacobian_rate.items()}
    for name, norms in transformers.norms.items():
        key, fit = ("pre_ln" if name == PRE_LN else "post_ln"), transformers.fits[name]
        m |= {f"{key}_rate": fit.rate, f"{key}_rate_stderr": fit.rate_stderr,
              f"{key}_first_over_last": (norms[0] / norms[-1]).item()}
    return m | {"c2_seeds": len(stacks.seeds)}


def c2_table(stacks: StackSeeds, transformers: TransformerProfiles) -> str:
    first = stacks.first
    rows = [("stack", "sigma", "log(sigma)", "fitted rate (first seed)", "stderr", "rate / log(sigma)",
             "Jacobian RMS log-sv")]
    for (kind, sigma), fit in first.fits.items():
        jr = f"{first.jacobian_rate[sigma]:+.5f}" if kind == "mlp" and sigma in first.jacobian_rate else "-"
        ratio = f"{fit.rate / math.log(sigma):+.4f}" if sigma != 1.0 else "-"
        rows.append((kind, sigma, f"{math.log(sigma):+.5f}", f"{fit.rate:+.5f}", f"{fit.rate_stderr:.1e}", ratio, jr))
    e = stacks.estimates()
    lines = [format_table(rows), "",
             f"linear stacks, worst relative rate error over the sigmas and {len(stacks.seeds)} seeds: "
             f"{e['rate_rel_error'].describe(2)}",
             *(f"tanh stacks, {SIDES[side]}: fitted rate / log(sigma) {e[f'mlp_{side}_rate_ratio'].describe(3)}"
               for side in SIDES), ""]
    for name, norms in transformers.norms.items():
        fit = transformers.fits[name]
        lines.append(f"{name:<22} per-layer rate {fit.rate:+.5f} +- {fit.rate_stderr:.1e} (r2 {fit.r2:.2f}); "
                     f"first/last block gradient norm {(norms[0] / norms[-1]).item():.3f}")
    return "\n".join(lines)


def _interval_bar(ax, x: float, e: Estimate, **style) -> None:
    """The estimate as a point with its interval as an error bar (none drawn when it has no interval)."""
    err = None if not e.has_interval else [[e.value - e.low], [e.high - e.value]]
    ax.errorbar([x], [e.value], yerr=err, fmt="D", capsize=5, ms=6, zorder=3, **style)


def _per_seed(ax, x: float, values, label: str | None = None) -> None:
    ax.plot(np.full(len(values), x) + np.linspace(-0.12, 0.12, len(values)), values, "o", color="grey", ms=4,
            alpha=0.7, label=label)


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


def _below(ax, ncol: int = 1, pad: float = 0.2) -> None:
    """The axes' legend under its x label: it covers nothing."""
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -pad), ncol=ncol)


def plot_c2(stacks: StackSeeds, transformers: TransformerProfiles, claim) -> Figure:
    """Depth profiles of the first seed (linear, tanh, transformers) and the graded rate ratios per seed with their
    mean and 90% interval against the post's law (the linear stacks' identity beside them). ``claim`` is the
    registry's C2 (the notebook passes ``get_claim("C2")``): its targets are drawn as graded."""
    first = stacks.first
    fig, axes = plt.subplots(2, 2, figsize=(8, 8.4))
    for ax, kind in zip(axes[0], ("linear", "mlp")):
        for sigma in first.sigmas:
            norms = first.norms[kind, sigma].numpy()
            k = np.arange(len(norms) - 1, -1, -1)
            rate = first.fits[kind, sigma].rate
            dots, = ax.semilogy(k, norms, ".", ms=3, label=f"sigma {sigma:g}: {rate:+.4f} per layer")
            ax.semilogy(k, norms[-1] * sigma ** k.astype(float), "-", lw=0.8, color=dots.get_color(), alpha=0.6)
        ax.plot([], [], "-", color="grey", lw=0.8, label="lines: sigma^k (the law)")
        ax.set_xlabel("layers between block and loss (k)")
        ax.set_ylabel("gradient norm at block output")
        ax.set_title(f"{'linear' if kind == 'linear' else 'tanh'} stack, seed {stacks.seeds[0]}\n"
                     f"depth {first.depth}, width {first.width}", fontsize=10)
        _below(ax)
    ax = axes[1, 0]
    for name, norms in transformers.norms.items():
        ax.semilogy(np.arange(len(norms))[::-1], norms.numpy(), ".-", ms=3,
                    label=f"{name}: rate {transformers.fits[name].rate:+.4f}")
    _tidy_log(ax)
    ax.set_xlabel("blocks between block and loss")
    ax.set_ylabel("mean gradient norm at block output")
    ax.set_title(f"residual transformers at init\n{transformers.layers} layers, width {transformers.width}",
                 fontsize=10)
    _below(ax)
    ax = axes[1, 1]
    e = stacks.estimates()
    target = claim.target_for("mlp_growth_rate_ratio")
    ax.axhspan(target.lo, target.hi, color="C2", alpha=0.15, label=f"post's law: {target.lo:g}-{target.hi:g}")
    ax.axhspan(*target.no_effect, color="grey", alpha=0.25, label=f"no effect: {target.band_text()}")
    linear = [np.mean([p.fits["linear", s].rate / math.log(s) for s in p.sigmas if s != 1.0]) for p in stacks.profiles]
    _per_seed(ax, 0, linear, label=f"per seed ({len(stacks.seeds)})")
    for x, side in enumerate(SIDES, start=1):
        _per_seed(ax, x, stacks.rate_ratios(side))
        est = e[f"mlp_{side}_rate_ratio"]
        _interval_bar(ax, x, est, color="C3", label=f"mean, 90% t interval (n={est.n})" if x == 1 else None)
    ax.axhline(1, color="k", lw=0.6)
    ax.axhline(0, color="k", lw=0.6, ls=":")
    ax.plot([], [], " ", label=f"linear: relative error {e['rate_rel_error'].value:.1e} (identity)")
    ax.set_xticks([0, 1, 2], ["linear", *(f"tanh\n{SIDES[side]}" for side in SIDES)])
    ax.set_xlim(-0.5, 2.5)
    ax.set_xlabel("stack")
    ax.set_ylabel("fitted rate / log(sigma)")
    ax.set_title("graded: rate ratio over seeds", fontsize=10)
    _below(ax, pad=0.28)
    fig.tight_layout()
    return fig


def c2_texts(stacks: StackSeeds, transformers: TransformerProfiles, corpus: str) -> dict[str, str]:
    """``scale``, ``measured_text`` and ``note`` for C2's verdict."""
    first = stacks.first
    top = max(first.sigmas)
    e = stacks.estimates()
    jacobian = (f", Jacobian RMS log-sv {first.jacobian_rate[top]:+.4f}" if top in first.jacobian_rate else "")
    return dict(
        scale=(f"orthogonal x sigma stacks (depth {first.depth}, width {first.width}, float64, {len(stacks.seeds)} "
               f"seeds); transformers {transformers.layers} layers x {transformers.width} at init on the {corpus} "
               "corpus"),
        measured_text=(f"linear stacks: per-layer growth rate = log(sigma), an identity (the gradient is the weights' "
                       f"product), so its relative error is float64 rounding, not a sampled quantity: "
                       f"{e['rate_rel_error'].describe(2)}; tanh stacks, fitted rate / log(sigma): "
                       + "; ".join(f"{SIDES[side]} {e[f'mlp_{side}_rate_ratio'].describe(4)}" for side in SIDES)),
        note=(f"tanh stacks follow their Jacobians' RMS singular values, not the weights' sigma (sigma {top:g}, first "
              f"seed: rate {first.fits['mlp', top].rate:+.4f} vs log(sigma) {math.log(top):+.4f}{jacobian}): "
              f"tanh' <= 1 shrinks every layer's Jacobian below the weights' sigma; "
              f"residual transformers: pre-LN rate {transformers.fits[PRE_LN].rate:+.4f}, post-LN "
              f"{transformers.fits[POST_LN].rate:+.4f} per layer"),
    )


# ----------------------------------------------------------------------------------------------------- C3
def bert_schedule(steps: int, warmup: int) -> Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LambdaLR]:
    """BERT's learning-rate schedule: linear warmup over ``warmup`` steps, then linear decay to 0 at ``steps``."""
    return lambda opt: torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warmup, max(0.0, (steps - s) / max(1, steps - warmup))))


def make_optimizer(name: str, adamw_lr: float, sgd_lr: float) -> Callable[[nn.Module], torch.optim.Optimizer]:
    """AdamW as BERT trains (weight decay 0.01), or SGD with momentum 0.9 for contrast."""
    if name == "AdamW":
        return lambda m: torch.optim.AdamW(m.parameters(), lr=adamw_lr, weight_decay=0.01)
    if name == "SGD":
        return lambda m: torch.optim.SGD(m.parameters(), lr=sgd_lr, momentum=0.9)
    raise ValueError(f"optimizer {name!r}: expected one of {OPTIMIZERS}")


def train_unclipped(model: nn.Module, make_opt, batches: list[dict], make_scheduler, seed: int,
                    desc: str | None = None) -> np.ndarray:
    """Plain MLM training through ``train_lm`` (scheduler stepped after each step), dropout seeded by ``seed``
    inside ``fork_rng``; the loss per step. The batches' ``attention_mask`` is all ones (rows are never
    padded), so ``model(input_ids, labels)`` computes exactly ``mlm_loss``."""
    optimizer = make_opt(model)
    scheduler = make_scheduler(optimizer)
    pairs = [(b["input_ids"], b["labels"]) for b in batches]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        log = train_lm(model, optimizer, pairs, after_step=lambda step, loss: scheduler.step(), desc=desc)
    return np.array(log.losses)


def mlm_val_loss(model: nn.Module, batches: list[dict]) -> float:
    """Mean masked-LM loss over ``batches`` in eval mode (no dropout); the model is left in train mode."""
    model.eval()
    with torch.no_grad():
        out = float(np.mean([mlm_loss(model, b).item() for b in batches]))
    model.train()
    return out


def _tag(c: float) -> str:
    return f"clip{c:g}".replace(".", "p")


@dataclass(frozen=True)
class ClippingSweep:
    """Probed clipped runs and unclipped reference runs of one small BERT, per optimizer and threshold."""

    thresholds: tuple[float, ...]
    steps: int
    n_params: int
    traces: dict[tuple[str, float], ClippingTrace]
    unclipped: dict[str, np.ndarray]
    val_loss: dict[tuple[str, float | None], float]
    target: dict[str, float]
    """Where the unclipped run ends up: its mean loss over the last 10% of steps (at least ``WINDOW``)."""
    steps_to_target: dict[tuple[str, float | None], int | None]

    def slowdown(self, name: str, c: float) -> float:
        """Steps to target, clipped / unclipped; a run that never gets there counts as ``steps + 1`` (a bound)."""
        reached, ref = self.steps_to_target[name, c], self.steps_to_target[name, None]
        return (reached if reached is not None else self.steps + 1) / max(1, ref or self.steps)


def _c3_config(settings: GradientExplosionSettings):
    s = settings
    return bert_small_config(MLM_VOCAB_SIZE, hidden=s.c3_hidden, layers=s.c3_layers, heads=4, max_len=s.seq_len,
                             pad_token_id=PAD_ID)


def _c3_schedule(settings: GradientExplosionSettings):
    return bert_schedule(settings.c3_steps, max(1, int(settings.warmup_fraction * settings.c3_steps)))


def _target(unclipped: np.ndarray, steps: int) -> float:
    """Where an unclipped run ends up: its mean loss over the last 10% of steps (at least ``WINDOW``)."""
    return float(np.mean(unclipped[-max(WINDOW, steps // 10):]))


def clipping_sweep(text, settings: GradientExplosionSettings) -> ClippingSweep:
    """At the first seed, every threshold and both optimizers probed on a fresh model with the same initial weights,
    batches and dropout seed, and the unclipped reference of each optimizer."""
    s = settings
    seed, steps, config, schedule = s.seed, s.c3_steps, _c3_config(s), _c3_schedule(s)
    batches = list(mlm_batches(text.train, s.c3_batch, s.seq_len, seed=seed, steps=steps))  # one stream for every run
    val_batches = list(mlm_batches(text.val, s.c3_batch, s.seq_len, seed=seed + 1, steps=8))
    traces, unclipped, val, target, reached = {}, {}, {}, {}, {}
    for name in OPTIMIZERS:
        make_opt = make_optimizer(name, s.adamw_lr, s.sgd_lr)
        for c in tqdm(s.c3_thresholds, desc=f"{name}: clipped runs (probe)", mininterval=10):
            model = build_bert_mlm(config, seed=seed)
            traces[name, c] = measure_clipping(model, mlm_loss, batches, make_opt, c, steps, make_scheduler=schedule,
                                               seed=seed)
            val[name, c] = mlm_val_loss(model, val_batches)
        model = build_bert_mlm(config, seed=seed)
        unclipped[name] = train_unclipped(model, make_opt, batches, schedule, seed, desc=f"{name}: unclipped")
        val[name, None] = mlm_val_loss(model, val_batches)
        target[name] = _target(unclipped[name], steps)
        reached[name, None] = steps_to_target(unclipped[name], target[name], window=WINDOW)
        for c in s.c3_thresholds:
            reached[name, c] = steps_to_target(traces[name, c].loss, target[name], window=WINDOW)
    return ClippingSweep(tuple(s.c3_thresholds), steps, count_parameters(model), traces, unclipped, val, target,
                         reached)


@dataclass(frozen=True)
class ClippingSeed:
    """The graded cell (AdamW, clip 1.0) at one seed: the clipped run's trace and the unclipped run's losses,
    both from that seed's initial weights, batches and dropout seed."""

    seed: int
    trace: ClippingTrace
    unclipped: np.ndarray
    steps: int

    @property
    def target(self) -> float:
        return _target(self.unclipped, self.steps)

    @property
    def steps_unclipped(self) -> int | None:
        return steps_to_target(self.unclipped, self.target, window=WINDOW)

    @property
    def steps_clipped(self) -> int | None:
        return steps_to_target(self.trace.loss, self.target, window=WINDOW)

    @property
    def effective_lr_reduction(self) -> float:
        return self.trace.summary()["effective_lr_reduction"]

    @property
    def slowdown(self) -> float:
        """Steps to target, clipped / unclipped; a run that never gets there counts as ``steps + 1`` (a bound)."""
        reached, ref = self.steps_clipped, self.steps_unclipped
        return (reached if reached is not None else self.steps + 1) / max(1, ref or self.steps)


@dataclass(frozen=True)
class ClippingSeeds:
    """The graded cell at every seed; the graded numbers are over the per-seed values (:meth:`estimates`)."""

    runs: tuple[ClippingSeed, ...]

    @property
    def reductions(self) -> list[float]:
        return [r.effective_lr_reduction for r in self.runs]

    @property
    def slowdowns(self) -> list[float]:
        return [r.slowdown for r in self.runs]

    def estimates(self) -> dict[str, Estimate]:
        """The reduction (a difference: a linear t interval) and the slowdown (a ratio of step counts: the
        geometric mean with a t interval on the logs, which cannot reach below zero)."""
        return {key: r.estimate() for key, r in self.repeated().items()}

    def repeated(self) -> dict[str, Repeated]:
        """The graded estimates' per-seed values, for ``claims.regrade_leaving_out``."""
        return {"effective_lr_reduction": Repeated(mean_interval, (self.reductions,),
                                                   options={"method": "t interval over seeds"}),
                "convergence_slowdown": Repeated(geomean_interval, (self.slowdowns,),
                                                 options={"method": "t interval over seeds"})}

    def rows(self) -> list[dict[str, float]]:
        return [{"seed": r.seed, "effective_lr_reduction": r.effective_lr_reduction, "convergence_slowdown": r.slowdown,
                 "clip_fraction": r.trace.summary()["clip_fraction"], "target_loss": r.target,
                 "steps_unclipped": r.steps_unclipped if r.steps_unclipped is not None else -1,
                 "steps_clipped": r.steps_clipped if r.steps_clipped is not None else -1} for r in self.runs]


def clipping_seeds(text, settings: GradientExplosionSettings, sweep: ClippingSweep) -> ClippingSeeds:
    """The graded cell at each of ``c3_seeds`` seeds: the first from ``sweep`` (the same runs), the others trained
    here, each seed's clipped and unclipped runs sharing initial weights, batches and dropout seed."""
    s = settings
    runs = [ClippingSeed(s.seed, sweep.traces["AdamW", GRADED_CLIP], sweep.unclipped["AdamW"], s.c3_steps)]
    config, schedule, make_opt = _c3_config(s), _c3_schedule(s), make_optimizer("AdamW", s.adamw_lr, s.sgd_lr)
    for seed in tqdm(s.seeds(s.c3_seeds)[1:], desc="AdamW clip 1.0: seeds", mininterval=10):
        batches = list(mlm_batches(text.train, s.c3_batch, s.seq_len, seed=seed, steps=s.c3_steps))
        trace = measure_clipping(build_bert_mlm(config, seed=seed), mlm_loss, batches, make_opt, GRADED_CLIP,
                                 s.c3_steps, make_scheduler=schedule, seed=seed)
        unclipped = train_unclipped(build_bert_mlm(config, seed=seed), make_opt, batches, schedule, seed)
        runs.append(ClippingSeed(seed, trace, unclipped, s.c3_steps))
    return ClippingSeeds(tuple(runs))


def c3_metrics(sweep: ClippingSweep) -> dict[str, float]:
    """Per optimizer and threshold at the first seed (the graded numbers are :meth:`ClippingSeeds.estimates`)."""
    if GRADED_CLIP not in sweep.thresholds:
        raise ValueError(f"c3_thresholds={list(sweep.thresholds)} must include 1.0, the threshold C3 is graded at")
    m: dict[str, float] = {}
    for name in OPTIMIZERS:
        for c in sweep.thresholds:
            s = sweep.traces[name, c].summary()
            m |= {f"{name}_{_tag(c)}_{k}": s[k] for k in ("clip_fraction", "effective_lr_reduction",
                                                         "effective_lr_reduction_ratio_of_means", "mean_update_cosine")}
            m[f"{name}_{_tag(c)}_val_loss"] = sweep.val_loss[name, c]
            m[f"{name}_{_tag(c)}_slowdown"] = sweep.slowdown(name, c)
        m[f"{name}_unclipped_val_loss"] = sweep.val_loss[name, None]
    ref, reached = sweep.steps_to_target["AdamW", None], sweep.steps_to_target["AdamW", GRADED_CLIP]
    return m | dict(target_loss=sweep.target["AdamW"], steps_unclipped=ref or -1, steps_clipped=reached or -1)


def c3_table(sweep: ClippingSweep) -> str:
    rows = [("optimizer", "clip at", "clipped", "LR reduction", "(ratio of means)", "steps to target", "val loss")]
    never = lambda n: "never" if n is None else n  # noqa: E731
    for name in OPTIMIZERS:
        rows.append((name, "none", "-", "-", "-", never(sweep.steps_to_target[name, None]),
                     f"{sweep.val_loss[name, None]:.4f}"))
        for c in sweep.thresholds:
            s = sweep.traces[name, c].summary()
            rows.append((name, c, f"{s['clip_fraction']:.0%}", f"{s['effective_lr_reduction']:+.1%}",
                         f"{s['effective_lr_reduction_ratio_of_means']:+.1%}", never(sweep.steps_to_target[name, c]),
                         f"{sweep.val_loss[name, c]:.4f}"))
    return format_table(rows)


@dataclass(frozen=True)
class LargeProbe:
    """The clipping probe at BERT-large's shape for the first few steps at init."""

    trace: ClippingTrace
    n_params: int

    def metrics(self) -> dict[str, float]:
        s = self.trace.summary()
        return dict(bert_large_params=self.n_params, bert_large_mean_grad_norm=float(self.trace.grad_norm.mean()),
                    bert_large_effective_lr_reduction=s["effective_lr_reduction"],
                    bert_large_clip_fraction=s["clip_fraction"])

    def text(self) -> str:
        t = self.trace
        return "\n".join(f"step {int(s)}: grad norm {g:.2f}, clip coefficient {c:.3f}, "
                         f"||clipped update|| / ||unclipped update|| = {r:.4f}"
                         for s, g, c, r in zip(t.step, t.grad_norm, t.clip_coefficient, t.update_ratio))


def bert_large_probe(text, settings: GradientExplosionSettings) -> LargeProbe | None:
    """AdamW (lr 1e-4, weight decay 0.01) clipped at 1.0 for ``bert_large_steps`` steps at the first seed; None when
    that is 0."""
    s = settings
    steps, batch_size, seq_len, seed, device = s.bert_large_steps, s.bert_large_batch, s.seq_len, s.seed, s.device
    if steps == 0:
        return None
    model = build_bert_mlm(bert_large_config(MLM_VOCAB_SIZE, max_len=seq_len, pad_token_id=PAD_ID), seed=seed,
                           device=device)
    batches = ({k: v.to(device) for k, v in b.items()}
               for b in mlm_batches(text.train, batch_size, seq_len, seed=seed, steps=steps))
    trace = measure_clipping(model, mlm_loss, tqdm(batches, total=steps, desc="BERT-large probe", mininterval=10),
                             lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4, weight_decay=0.01), 1.0, steps)
    return LargeProbe(trace, count_parameters(model))


def plot_c3(sweep: ClippingSweep, seeds: ClippingSeeds, claim) -> Figure:
    """The first seed's update ratios (AdamW, SGD) and AdamW losses, and the graded reduction and slowdown per seed
    with their estimate and 90% interval against the post's targets (``claim``: the registry's C3, passed by the
    notebook)."""
    fig, axes = plt.subplot_mosaic([["AdamW", "AdamW", "SGD", "SGD"], ["loss", "loss", "reduction", "slowdown"]],
                                   figsize=(7.6, 9.4))
    reduction_t = claim.target_for("effective_lr_reduction")
    for name in OPTIMIZERS:
        ax = axes[name]
        for c in sweep.thresholds:
            t = sweep.traces[name, c]
            smooth = np.convolve(t.update_ratio, np.ones(WINDOW) / WINDOW, mode="valid")
            ax.plot(np.arange(len(smooth)) + WINDOW - 1, smooth, lw=1,
                    label=f"clip {c:g}: {t.summary()['clip_fraction']:.0%} clipped, "
                          f"reduction {t.summary()['effective_lr_reduction']:+.0%}")
        ax.axhline(1, color="k", lw=0.6)
        ax.axhspan(1 - reduction_t.hi, 1 - reduction_t.lo, color="grey", alpha=0.2,
                   label=f"post: {reduction_t.lo:.0%}-{reduction_t.hi:.0%} reduction")
        ax.set(title=f"{name}, seed {sweep_seed(seeds)}:\nupdate norm clipped / unclipped", xlabel="step",
               ylabel=f"update-norm ratio ({WINDOW}-step mean)")
        ax.title.set_fontsize(10)
        _below(ax, pad=0.16)
    ax = axes["loss"]
    for c in sweep.thresholds:
        ax.plot(sweep.traces["AdamW", c].loss, lw=0.7, label=f"AdamW, clip {c:g}")
    ax.plot(sweep.unclipped["AdamW"], lw=0.7, color="k", label="AdamW, no clipping")
    ax.axhline(sweep.target["AdamW"], color="k", ls=":", lw=0.8, label=f"target {sweep.target['AdamW']:.3f}")
    ax.set(title=f"MLM loss, seed {sweep_seed(seeds)}", xlabel="step", ylabel="MLM loss (nats/byte)")
    ax.title.set_fontsize(10)
    _below(ax, ncol=1, pad=0.16)
    e = seeds.estimates()
    slowdown_t = claim.target_for("convergence_slowdown")
    for key, values, t, what in (("effective_lr_reduction", seeds.reductions, reduction_t, "LR reduction"),
                                 ("convergence_slowdown", seeds.slowdowns, slowdown_t, "slowdown")):
        ax = axes["reduction" if key == "effective_lr_reduction" else "slowdown"]
        _per_seed(ax, 0, values, label=f"per seed ({len(values)})")
        _interval_bar(ax, 0, e[key], color="C3", label=f"estimate, 90% interval (n={e[key].n})")
        ax.axhspan(*t.no_effect, color="grey", alpha=0.25, label="no effect" if key == "convergence_slowdown" else None)
        if t.hi is None:
            ax.axhline(t.lo, color="C2", ls="--", lw=1.2, label=f"post: slowdown >= {t.lo:g}x")
        else:
            ax.axhspan(t.lo, t.hi, color="C2", alpha=0.2, label=f"post: {t.lo:.0%}-{t.hi:.0%} reduction")
        ax.set_xticks([0], [what])
        ax.set_xlim(-0.5, 0.5)
        ax.set_xlabel("AdamW, clip 1")
    axes["reduction"].set_ylabel("1 - mean update-norm ratio")
    axes["slowdown"].set_ylabel("steps to target, clipped / unclipped (x)")
    for key in ("reduction", "slowdown"):
        axes[key].set_title("graded", fontsize=10)
    handles, labels = [], []
    for key in ("reduction", "slowdown"):
        for h, lab in zip(*axes[key].get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.tight_layout(h_pad=1.5, rect=(0, 0.1, 1, 1))
    # under both graded panels, in figure coordinates (an axes legend this wide would squeeze them in the layout)
    renderer = fig.canvas.get_renderer()
    below = min(axes[k].get_tightbbox(renderer).transformed(fig.transFigure.inverted()).y0
                for k in ("reduction", "slowdown"))
    x = (axes["reduction"].get_position().x0 + axes["slowdown"].get_position().x1) / 2
    fig.legend(handles, labels, fontsize=8, loc="upper center", bbox_to_anchor=(x, below - 0.01), ncol=1)
    return fig


def sweep_seed(seeds: ClippingSeeds) -> int:
    """The seed of the threshold sweep (the first)."""
    return seeds.runs[0].seed


def c3_texts(sweep: ClippingSweep, seeds: ClippingSeeds, large: LargeProbe | None,
             settings: GradientExplosionSettings) -> dict[str, str]:
    """``scale``, ``measured_text`` and ``note`` for C3's verdict."""
    s = settings
    m, e = c3_metrics(sweep), seeds.estimates()
    clipped = np.mean([r.trace.summary()["clip_fraction"] for r in seeds.runs])
    large_note = ""
    if large is not None:
        large_note = (f"; BERT-large shape at init ({len(large.trace.step)} steps): gradient norm "
                      f"{large.trace.grad_norm.mean():.1f}, every step clipped, yet AdamW's update ratio "
                      f"{large.trace.update_ratio.mean():.3f}")
    return dict(
        scale=(f"BertForMaskedLM {s.c3_layers} layers x {s.c3_hidden} ({sweep.n_params / 1e6:.2f}M params), "
               f"{sweep.steps} steps of {s.c3_batch}x{s.seq_len} bytes on the {s.corpus} corpus, AdamW lr {s.adamw_lr} "
               f"with warmup and decay; {len(seeds.runs)} seeds, clipped and unclipped paired per seed"),
        measured_text=(f"AdamW, clip 1.0: {clipped:.0%} of steps clipped (mean over seeds), effective LR reduction "
                       f"{e['effective_lr_reduction'].describe(3)}, steps to target clipped/unclipped "
                       f"{e['convergence_slowdown'].describe(3)}"),
        note=(f"SGD+momentum at clip 1.0 (first seed): reduction {m['SGD_clip1_effective_lr_reduction']:+.1%}; Adam is "
              f"invariant to a constant gradient scale, so clipping only reweights steps against each other"
              + large_note),
    )


# ----------------------------------------------------------------------------------------------------- R1
@dataclass(frozen=True)
class ResidualRun:
    """One training run of the small decoder with one kind of residual connection."""

    kind: str
    losses: list[float]
    grad_norms: list[float]
    """Total gradient norm of each step, before the optimizer applied it."""
    gains: list[tuple[int, float]]
    """``(step, peak composite gain)`` every ``gain_every`` steps and at the last."""
    final_gain: CompositeGain
    val_loss: float
    n_params: int

    @property
    def peak_gain(self) -> float:
        return max(v for _, v in self.gains)

    @property
    def spike(self) -> float:
        """Largest over median gradient norm."""
        g = np.array(self.grad_norms)
        return float(g.max() / np.median(g))


def train_residual(kind: str, text, *, steps: int, lr: float, layers: int, width: int, n_streams: int, seq_len: int,
                   batch_size: int, gain_every: int, n_eval_batches: int, seed: int) -> ResidualRun:
    """``HCTransformerLM`` with ``kind`` connections, AdamW (weight decay 0.01) through ``train_lm``. Seeds the
    global RNG before building, so every kind starts from the same draws."""
    torch.manual_seed(seed)
    model = HCTransformerLM(BYTE_VOCAB_SIZE, width, layers, n_heads=4, max_seq_len=seq_len, residual=kind,
                            n_streams=n_streams)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    grad_norms, gains = [], []
    opt.register_step_pre_hook(lambda *_: grad_norms.append(
        torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]).item()))

    def record_gain(step: int, loss: float) -> None:
        if step % gain_every == 0 or step == steps - 1:
            gains.append((step, composite_gain(model).peak))

    log = train_lm(model, opt, lm_batches(text.train, batch_size, seq_len, seed=seed, steps=steps),
                   after_step=record_gain, desc=kind)
    val = evaluate_lm(model, eval_batches(text.val, batch_size, seq_len, max_batches=n_eval_batches)).loss
    # Dynamic connections report the mixing of their last forward: the last evaluation batch, as before.
    return ResidualRun(kind, log.losses, grad_norms, gains, composite_gain(model), val, count_parameters(model))


def _train_kind(kind: str, text, settings: GradientExplosionSettings, seed: int) -> ResidualRun:
    s = settings
    return train_residual(kind, text, steps=s.r1_steps, lr=s.r1_lr, layers=s.r1_layers, width=s.r1_width,
                          n_streams=s.n_streams, seq_len=s.seq_len, batch_size=s.batch_size, gain_every=s.r1_gain_every,
                          n_eval_batches=s.r1_eval_batches, seed=seed)


def residual_runs(text, settings: GradientExplosionSettings, seed: int | None = None,
                  kinds: tuple[str, ...] = RESIDUAL_KINDS) -> dict[str, ResidualRun]:
    """:func:`train_residual` for each of ``kinds`` at ``seed`` (default the first), same data and optimizer."""
    seed = settings.seed if seed is None else seed
    return {kind: _train_kind(kind, text, settings, seed) for kind in kinds}


def _gain_ratio(hc: list[float], mhc: list[float]) -> Estimate:
    """HC's peak gain over mHC's, taken per seed: the geometric mean of the per-seed ratios with a t interval on
    their logs (a ratio varies by factors; a linear interval reaches below zero)."""
    return geomean_interval(np.asarray(hc) / np.asarray(mhc), method="t interval over per-seed ratios")


@dataclass(frozen=True)
class ResidualSeeds:
    """HC and mHC at every seed (the kinds of one seed start from the same draws and see the same batches), and
    the first seed's residual run as the reference."""

    seeds: tuple[int, ...]
    runs: tuple[dict[str, ResidualRun], ...]

    @property
    def first(self) -> dict[str, ResidualRun]:
        return self.runs[0]

    def peaks(self, kind: str) -> list[float]:
        return [r[kind].peak_gain for r in self.runs]

    def estimates(self) -> dict[str, Estimate]:
        """mHC's peak gain (a bound near 1: a linear t interval), HC's (reported, not graded) and HC's over mHC's
        (gains that vary by factors: geometric means with t intervals on the logs)."""
        return {**{key: r.estimate() for key, r in self.repeated().items()},
                "hc_peak_gain": geomean_interval(self.peaks("hc"), method="t interval over seeds")}

    def repeated(self) -> dict[str, Repeated]:
        """The graded estimates' per-seed values, for ``claims.regrade_leaving_out``."""
        return {"mhc_peak_gain": Repeated(mean_interval, (self.peaks("mhc"),),
                                          options={"method": "t interval over seeds", "unit": "x"}),
                "hc_over_mhc_gain": Repeated(_gain_ratio, (self.peaks("hc"), self.peaks("mhc")))}

    def rows(self) -> list[dict[str, float]]:
        return [{"seed": seed, "hc_peak_gain": r["hc"].peak_gain, "mhc_peak_gain": r["mhc"].peak_gain,
                 "hc_over_mhc_gain": r["hc"].peak_gain / r["mhc"].peak_gain, "hc_val_loss": r["hc"].val_loss,
                 "mhc_val_loss": r["mhc"].val_loss} for seed, r in zip(self.seeds, self.runs)]


def residual_seeds(text, settings: GradientExplosionSettings) -> ResidualSeeds:
    """Residual, HC and mHC at the first seed; HC and mHC at each further seed of ``r1_seeds``."""
    seeds = settings.seeds(settings.r1_seeds)
    runs = [residual_runs(text, settings)]
    runs += [residual_runs(text, settings, seed, kinds=("hc", "mhc")) for seed in seeds[1:]]
    return ResidualSeeds(tuple(seeds), tuple(runs))


def r1_metrics(runs: dict[str, ResidualRun]) -> dict[str, float]:
    """The first seed's runs (the graded gains are :meth:`ResidualSeeds.estimates`)."""
    m: dict[str, float] = {}
    for kind, r in runs.items():
        m |= {f"{kind}_val_loss": r.val_loss, f"{kind}_peak_gain_over_training": r.peak_gain,
              f"{kind}_grad_spike_ratio": r.spike}
    return m


def r1_series(runs: dict[str, ResidualRun]) -> list[tuple[int, dict[str, float]]]:
    """``(step, {name: value})`` rows for ``run.log``: loss and gradient norm per step, the gain where measured."""
    rows = []
    for kind, r in runs.items():
        gains = dict(r.gains)
        for step, (loss, g) in enumerate(zip(r.losses, r.grad_norms)):
            row = {f"{kind}_loss": loss, f"{kind}_grad_norm": g}
            rows.append((step, row | ({f"{kind}_peak_gain": gains[step]} if step in gains else {})))
    return rows


def r1_table(runs: dict[str, ResidualRun]) -> str:
    return "\n".join(f"{kind:<9} val loss {r.val_loss:.4f}; peak composite gain over training {r.peak_gain:.4g}; "
                     f"max/median gradient norm {r.spike:.2f}" for kind, r in runs.items())


def plot_r1(seeds: ResidualSeeds, claim) -> Figure:
    """The first seed's training (loss, gradient norm, peak gain over training, gain against depth) and the gains
    per seed with their estimates and 90% intervals against the post's bounds (``claim``: the registry's R1, passed
    by the notebook)."""
    runs = seeds.first
    colors = {"residual": "#4c72b0", "hc": "#c44e52", "mhc": "#55a868"}
    fig, axes = plt.subplots(3, 2, figsize=(8, 10.5))
    (loss_ax, norm_ax), (peak_ax, depth_ax), (graded, key_ax) = axes
    for kind, r in runs.items():
        steps = np.arange(len(r.losses))
        loss_ax.plot(steps, r.losses, color=colors[kind], lw=0.8)
        norm_ax.semilogy(steps, r.grad_norms, color=colors[kind], lw=0.8)
        s, v = zip(*r.gains)
        peak_ax.semilogy(s, v, ".-", color=colors[kind])
        depth = np.arange(1, len(r.final_gain.forward) + 1)
        depth_ax.semilogy(depth, r.final_gain.forward.numpy(), "-", color=colors[kind])
        depth_ax.semilogy(depth, r.final_gain.backward.numpy(), "--", color=colors[kind])
    first = seeds.seeds[0]
    loss_ax.set(title=f"training loss, seed {first}", xlabel="step", ylabel="loss (nats/byte)")
    norm_ax.set(title=f"gradient norm, seed {first}", xlabel="step", ylabel="total gradient norm before step")
    peak_ax.set(title=f"peak composite gain over depth, seed {first}", xlabel="step", ylabel="peak composite gain (x)")
    depth_ax.set(title=f"composite gain at the end, seed {first}", xlabel="sublayers", ylabel="composite gain (x)")
    depth_ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    e = seeds.estimates()
    ratios = list(np.divide(seeds.peaks("hc"), seeds.peaks("mhc")))
    linear, logs = "mean,\n90% t interval", "geometric mean,\n90% t interval on logs"
    shown = (("mhc_peak_gain", seeds.peaks("mhc"), "mHC peak", "graded", "C3", linear),
             ("hc_peak_gain", seeds.peaks("hc"), "HC peak", "reported", "C0", logs),
             ("hc_over_mhc_gain", ratios, "HC / mHC", "graded", "C1", logs))
    for x, (key, values, name, _, color, how) in enumerate(shown):
        _per_seed(graded, x, values, label=f"per seed ({len(values)})" if x == 0 else None)
        _interval_bar(graded, x, e[key], color=color, label=f"{name}: {how} (n={e[key].n})")
    bound, ratio_t = claim.target_for("mhc_peak_gain"), claim.target_for("hc_over_mhc_gain")
    graded.plot([-0.35, 0.35], [bound.hi] * 2, "--", color="C2", lw=1.2, label=f"post: mHC <= {bound.hi:g}")
    graded.plot([1.65, 2.35], [ratio_t.lo] * 2, ":", color="C2", lw=1.6, label=f"post: HC / mHC >= {ratio_t.lo:g}")
    graded.fill_between([1.65, 2.35], *ratio_t.no_effect, color="grey", alpha=0.3,
                        label=f"no effect {ratio_t.band_text()}")
    graded.set_yscale("log")
    graded.set_xticks(range(len(shown)), [f"{name}\n({role})" for _, _, name, role, _, _ in shown])
    graded.set_xlim(-0.5, len(shown) - 0.5)
    graded.set(xlabel="over seeds", ylabel="gain (x)", title="graded gains")
    for ax in (norm_ax, peak_ax, depth_ax, graded):
        _tidy_log(ax)
    for ax in axes.flat[:5]:
        ax.title.set_fontsize(10)
    key_ax.axis("off")  # its slot holds the graded panel's legend
    key_ax.legend(*graded.get_legend_handles_labels(), fontsize=8, loc="center left", title="graded gains",
                  title_fontsize=8)
    kinds = [plt.Line2D([], [], color=colors[kind], label=f"{kind}: val loss {r.val_loss:.3f}")
             for kind, r in runs.items()]
    styles = [plt.Line2D([], [], color="grey", ls=ls, label=f"{what} gain (middle row, right)")
              for ls, what in (("-", "forward"), ("--", "backward"))]
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.legend(handles=kinds + styles, fontsize=8, loc="upper center", ncol=3, title=f"seed {first}",
               title_fontsize=8, bbox_to_anchor=(0.5, 1.0))
    return fig


def r1_texts(seeds: ResidualSeeds, settings: GradientExplosionSettings) -> dict[str, str]:
    """``scale``, ``measured_text`` and ``note`` for R1's verdict."""
    s = settings
    runs = seeds.first
    hc, mhc = runs["hc"], runs["mhc"]
    e = seeds.estimates()
    return dict(
        scale=(f"{hc.n_params / 1e6:.2f}M-parameter decoder ({s.r1_layers} layers = {2 * s.r1_layers} sublayers, "
               f"width {s.r1_width}, n={s.n_streams} streams), {s.r1_steps} AdamW steps at lr {s.r1_lr} on the "
               f"{s.corpus} corpus, {len(seeds.seeds)} seeds; published: 27B"),
        measured_text=(f"peak composite gain over training: mHC {e['mhc_peak_gain'].describe(3)}; HC / mHC per seed "
                       f"{e['hc_over_mhc_gain'].describe(3)}; HC (reported, not graded) "
                       f"{e['hc_peak_gain'].describe(3)}"),
        note=(f"first seed: val loss residual {runs['residual'].val_loss:.3f}, HC {hc.val_loss:.3f}, mHC "
              f"{mhc.val_loss:.3f}; max/median grad norm HC {hc.spike:.2f}, mHC {mhc.spike:.2f}"),
    )


__all__ = [
    "ClippingSeed", "ClippingSeeds", "ClippingSweep", "GRADED_CLIP", "GradientExplosionSettings", "LargeProbe",
    "ResidualRun", "ResidualSeeds", "SIDES", "StackProfiles", "StackSeeds", "TransformerProfiles", "bert_large_probe",
    "bert_schedule", "block_norm_profile", "c2_metrics", "c2_table", "c2_texts", "c3_metrics", "c3_table", "c3_texts",
    "clipping_seeds", "clipping_sweep", "identity_error", "jacobian_log_rate", "make_optimizer", "mlm_val_loss",
    "plot_c2", "plot_c3", "plot_r1", "r1_metrics", "r1_series", "r1_table", "r1_texts", "residual_runs",
    "residual_seeds", "stack_profiles", "stack_seeds", "train_residual", "train_unclipped", "transformer_profiles",
]
