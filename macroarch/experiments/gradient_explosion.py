"""Notebook 01's experiments: gradients through depth (C2), the cost of clipping (C3), HC vs mHC (R1).

Post section 2.1 (C2, C3) and the mHC reference point (R1). Each claim has a function that runs the
measurement and returns a small result, the metrics the grading rule reads (names kept stable: the
registry in ``macroarch.repro.claims`` grades them), a text table, a figure and the verdict's texts.

- **C2** :func:`stack_profiles`: ``sigma * orthogonal`` stacks (linear, and with tanh between the layers)
  in float64; the gradient norm reaching each layer's output, its fitted log-growth rate against depth
  counted from the output (``log(sigma)`` exactly for the linear stack), and for tanh the RMS log singular
  value of evenly spaced layer Jacobians along the real forward (:func:`jacobian_log_rate`).
  :func:`transformer_profiles`: the same rate in a pre-LN (GPT-2 style) and a post-LN (BERT) model at init.
- **C3** :func:`clipping_sweep`: a small BERT MLM trained with clipping at each threshold under
  ``macroarch.measure.clipping``'s probe (a shadow optimizer takes the unclipped step), and once without
  clipping through the project's one training loop (``experiments.loop.train_lm``), AdamW and SGD with
  BERT's warmup + linear decay; steps to the loss where the unclipped run ends. :func:`bert_large_probe`:
  the probe for a few steps at BERT-large's shape.
- **R1** :func:`residual_runs`: the same small decoder trained with residual, HC and mHC connections
  through ``train_lm``; gradient norm before each step, composite gain of the mixing matrices every
  ``gain_every`` steps, validation loss by ``evaluate_lm``.

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
from torch import nn
from tqdm.auto import tqdm

from macroarch._table import format_table
from macroarch.data import BYTE_VOCAB_SIZE, MLM_VOCAB_SIZE, PAD_ID, eval_batches, lm_batches, mlm_batches
from macroarch.experiments.loop import evaluate_lm, train_lm
from macroarch.measure.clipping import ClippingTrace, measure_clipping, steps_to_target
from macroarch.measure.gradients import (
    GradientNormRecorder,
    GrowthFit,
    controlled_stack,
    fit_growth_rate,
    layer_jacobian_singular_values,
)
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


def _key(sigma: float) -> str:
    return f"sigma{sigma:g}".replace(".", "p")  # metric names carry no dots


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
    """tanh stacks: mean log RMS singular value of the sampled layer Jacobians, per sigma."""

    def rel_error(self, kind: str) -> float:
        """Worst ``|rate - log(sigma)| / |log(sigma)|`` over the sigmas other than 1."""
        return max(abs(self.fits[kind, s].rate - math.log(s)) / abs(math.log(s)) for s in self.sigmas if s != 1.0)


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
    """One backward pass of ``(stack(x) * v).sum()`` through each controlled stack, float64."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, width, generator=g, dtype=torch.float64)
    v = torch.randn(batch, width, generator=g, dtype=torch.float64)  # the gradient at the stack's output
    norms, fits, jacobian_rate = {}, {}, {}
    for kind in ("linear", "mlp"):
        for sigma in tqdm(sigmas, desc=f"{kind} stacks", mininterval=5):
            stack = controlled_stack(depth, width, sigma, kind=kind, generator=seed, dtype=torch.float64)
            with GradientNormRecorder(stack) as rec:
                (stack(x) * v).sum().backward()
            norms[kind, sigma] = rec.output_grad_norms[0]
            fits[kind, sigma] = fit_growth_rate(_from_output(norms[kind, sigma]), norms[kind, sigma])
            if kind == "mlp":
                jacobian_rate[sigma] = jacobian_log_rate(stack, x[:JACOBIAN_SAMPLES], jacobian_layers)
    return StackProfiles(tuple(sigmas), depth, width, norms, fits, jacobian_rate)


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


def transformer_profiles(text, layers: int, width: int, seq_len: int, batch_size: int, n_batches: int,
                         seed: int) -> TransformerProfiles:
    """GPT-2-style (transformers ``GPT2LMHeadModel``) and BERT (``BertForMaskedLM``) models ``layers`` deep,
    no dropout, on ``n_batches`` corpus batches. Seeds the global RNG (the GPT-2 build draws from it)."""
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


def c2_metrics(stacks: StackProfiles, transformers: TransformerProfiles) -> dict[str, float]:
    m: dict[str, float] = {}
    for (kind, sigma), fit in stacks.fits.items():
        m[f"{kind}_rate_{_key(sigma)}"], m[f"{kind}_rate_stderr_{_key(sigma)}"] = fit.rate, fit.rate_stderr
    m["rate_rel_error"], m["mlp_rate_rel_error"] = stacks.rel_error("linear"), stacks.rel_error("mlp")
    m |= {f"mlp_jacobian_rate_{_key(s)}": r for s, r in stacks.jacobian_rate.items()}
    for name, norms in transformers.norms.items():
        key, fit = ("pre_ln" if name == PRE_LN else "post_ln"), transformers.fits[name]
        m |= {f"{key}_rate": fit.rate, f"{key}_rate_stderr": fit.rate_stderr,
              f"{key}_first_over_last": (norms[0] / norms[-1]).item()}
    return m


def c2_table(stacks: StackProfiles, transformers: TransformerProfiles) -> str:
    rows = [("stack", "sigma", "log(sigma)", "fitted rate", "stderr", "Jacobian RMS log-sv")]
    for (kind, sigma), fit in stacks.fits.items():
        jr = f"{stacks.jacobian_rate[sigma]:+.5f}" if kind == "mlp" else "-"
        rows.append((kind, sigma, f"{math.log(sigma):+.5f}", f"{fit.rate:+.5f}", f"{fit.rate_stderr:.1e}", jr))
    lines = [format_table(rows), ""]
    for name, norms in transformers.norms.items():
        fit = transformers.fits[name]
        lines.append(f"{name:<22} per-layer rate {fit.rate:+.5f} +- {fit.rate_stderr:.1e} (r2 {fit.r2:.2f}); "
                     f"first/last block gradient norm {(norms[0] / norms[-1]).item():.3f}")
    return "\n".join(lines)


def plot_c2(stacks: StackProfiles, transformers: TransformerProfiles) -> Figure:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, kind in zip(axes[:2], ("linear", "mlp")):
        for sigma in stacks.sigmas:
            norms = stacks.norms[kind, sigma].numpy()
            k = np.arange(len(norms) - 1, -1, -1)
            rate = stacks.fits[kind, sigma].rate
            ax.semilogy(k, norms, ".", ms=3, label=f"sigma={sigma}: measured, rate {rate:+.4f}")
            ax.semilogy(k, norms[-1] * sigma ** k.astype(float), "-", lw=0.8, color=ax.lines[-1].get_color(),
                        alpha=0.6, label=f"sigma={sigma}: weights' prediction sigma^k")
        ax.set_xlabel("layers between the block and the loss (k)")
        ax.set_ylabel("gradient norm at the block's output")
        ax.set_title(f"{'linear' if kind == 'linear' else 'tanh'} stack, depth {stacks.depth}, width {stacks.width}")
        ax.legend(fontsize=7)
    for name, norms in transformers.norms.items():
        axes[2].semilogy(np.arange(len(norms))[::-1], norms.numpy(), ".-", ms=3,
                         label=f"{name}: rate {transformers.fits[name].rate:+.4f}")
    axes[2].set_xlabel("blocks between the block and the loss")
    axes[2].set_title(f"residual transformers at init, {transformers.layers} layers, width {transformers.width}")
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    return fig


def c2_texts(stacks: StackProfiles, transformers: TransformerProfiles, corpus: str) -> dict[str, str]:
    """``scale``, ``measured_text`` and ``note`` for C2's verdict."""
    top = max(stacks.sigmas)
    linear, mlp = stacks.rel_error("linear"), stacks.rel_error("mlp")
    return dict(
        scale=(f"orthogonal x sigma stacks (depth {stacks.depth}, width {stacks.width}, float64); transformers "
               f"{transformers.layers} layers x {transformers.width} at init on the {corpus} corpus"),
        measured_text=(f"linear stacks: per-layer growth rate = log(sigma) to a relative error of {linear:.2g}; "
                       f"tanh stacks: rate off log(sigma) by up to {mlp:.0%} (relative error {mlp:.3f})"),
        note=(f"tanh stacks follow their Jacobians' RMS singular values, not the weights' sigma "
              f"(sigma {top:g}: rate {stacks.fits['mlp', top].rate:+.4f} vs log(sigma) {math.log(top):+.4f}, "
              f"Jacobian {stacks.jacobian_rate[top]:+.4f}); residual transformers: pre-LN rate "
              f"{transformers.fits[PRE_LN].rate:+.4f}, post-LN {transformers.fits[POST_LN].rate:+.4f} per layer"),
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


def clipping_sweep(text, *, steps: int, thresholds: list[float], hidden: int, layers: int, batch_size: int,
                   seq_len: int, adamw_lr: float, sgd_lr: float, warmup_fraction: float, seed: int) -> ClippingSweep:
    """Every threshold probed on a fresh model with the same initial weights, batches and dropout seed."""
    config = bert_small_config(MLM_VOCAB_SIZE, hidden=hidden, layers=layers, heads=4, max_len=seq_len,
                               pad_token_id=PAD_ID)
    batches = list(mlm_batches(text.train, batch_size, seq_len, seed=seed, steps=steps))  # one stream for every run
    val_batches = list(mlm_batches(text.val, batch_size, seq_len, seed=seed + 1, steps=8))
    schedule = bert_schedule(steps, max(1, int(warmup_fraction * steps)))
    traces, unclipped, val, target, reached = {}, {}, {}, {}, {}
    for name in OPTIMIZERS:
        make_opt = make_optimizer(name, adamw_lr, sgd_lr)
        for c in tqdm(thresholds, desc=f"{name}: clipped runs (probe)", mininterval=10):
            model = build_bert_mlm(config, seed=seed)
            traces[name, c] = measure_clipping(model, mlm_loss, batches, make_opt, c, steps, make_scheduler=schedule,
                                               seed=seed)
            val[name, c] = mlm_val_loss(model, val_batches)
        model = build_bert_mlm(config, seed=seed)
        unclipped[name] = train_unclipped(model, make_opt, batches, schedule, seed, desc=f"{name}: unclipped")
        val[name, None] = mlm_val_loss(model, val_batches)
        target[name] = float(np.mean(unclipped[name][-max(WINDOW, steps // 10):]))
        reached[name, None] = steps_to_target(unclipped[name], target[name], window=WINDOW)
        for c in thresholds:
            reached[name, c] = steps_to_target(traces[name, c].loss, target[name], window=WINDOW)
    return ClippingSweep(tuple(thresholds), steps, count_parameters(model), traces, unclipped, val, target, reached)


def c3_metrics(sweep: ClippingSweep) -> dict[str, float]:
    """Per optimizer and threshold, and the headline at AdamW, clip 1.0 (the threshold BERT uses)."""
    if 1.0 not in sweep.thresholds:
        raise ValueError(f"c3_thresholds={list(sweep.thresholds)} must include 1.0, the threshold C3 is graded at")
    m: dict[str, float] = {}
    for name in OPTIMIZERS:
        for c in sweep.thresholds:
            s = sweep.traces[name, c].summary()
            m |= {f"{name}_{_tag(c)}_{k}": s[k] for k in ("clip_fraction", "effective_lr_reduction",
                                                         "effective_lr_reduction_ratio_of_means", "mean_update_cosine")}
            m[f"{name}_{_tag(c)}_val_loss"] = sweep.val_loss[name, c]
        m[f"{name}_unclipped_val_loss"] = sweep.val_loss[name, None]
    ref, reached = sweep.steps_to_target["AdamW", None], sweep.steps_to_target["AdamW", 1.0]
    m |= dict(effective_lr_reduction=sweep.traces["AdamW", 1.0].summary()["effective_lr_reduction"],
              convergence_slowdown=sweep.slowdown("AdamW", 1.0), target_loss=sweep.target["AdamW"],
              steps_unclipped=ref or -1, steps_clipped=reached or -1)
    return m


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


def bert_large_probe(text, steps: int, batch_size: int, seq_len: int, seed: int, device: str) -> LargeProbe | None:
    """AdamW (lr 1e-4, weight decay 0.01) clipped at 1.0 for ``steps`` steps; None when ``steps`` is 0."""
    if steps == 0:
        return None
    model = build_bert_mlm(bert_large_config(MLM_VOCAB_SIZE, max_len=seq_len, pad_token_id=PAD_ID), seed=seed,
                           device=device)
    batches = ({k: v.to(device) for k, v in b.items()}
               for b in mlm_batches(text.train, batch_size, seq_len, seed=seed, steps=steps))
    trace = measure_clipping(model, mlm_loss, tqdm(batches, total=steps, desc="BERT-large probe", mininterval=10),
                             lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4, weight_decay=0.01), 1.0, steps)
    return LargeProbe(trace, count_parameters(model))


def plot_c3(sweep: ClippingSweep) -> Figure:
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    for name, ax in zip(OPTIMIZERS, axes[:2]):
        for c in sweep.thresholds:
            t = sweep.traces[name, c]
            smooth = np.convolve(t.update_ratio, np.ones(WINDOW) / WINDOW, mode="valid")
            ax.plot(np.arange(len(smooth)) + WINDOW - 1, smooth, lw=1,
                    label=f"clip {c}: {t.summary()['clip_fraction']:.0%} clipped, "
                          f"reduction {t.summary()['effective_lr_reduction']:+.0%}")
        ax.axhline(1, color="k", lw=0.6)
        ax.axhspan(1 - 0.35, 1 - 0.27, color="grey", alpha=0.2, label="post: 27-35% reduction")
        ax.set(title=f"{name}: ||clipped update|| / ||unclipped update|| ({WINDOW}-step mean)", xlabel="step")
        ax.legend(fontsize=7)
    for c in sweep.thresholds:
        axes[2].plot(sweep.traces["AdamW", c].loss, lw=0.7, label=f"AdamW, clip {c}")
    axes[2].plot(sweep.unclipped["AdamW"], lw=0.7, color="k", label="AdamW, no clipping")
    first = sweep.thresholds[0]
    axes[2].plot(sweep.traces["AdamW", first].grad_norm, lw=0.5, color="grey", alpha=0.6,
                 label=f"gradient norm (clip {first} run)")
    axes[2].set(title=f"MLM loss (target {sweep.target['AdamW']:.3f})", xlabel="step", yscale="log")
    axes[2].axhline(sweep.target["AdamW"], color="k", ls=":", lw=0.8)
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    return fig


def c3_texts(sweep: ClippingSweep, large: LargeProbe | None, *, layers: int, hidden: int, batch_size: int,
             seq_len: int, adamw_lr: float, corpus: str) -> dict[str, str]:
    """``scale``, ``measured_text`` and ``note`` for C3's verdict."""
    m = c3_metrics(sweep)
    large_note = ""
    if large is not None:
        large_note = (f"; BERT-large shape at init ({len(large.trace.step)} steps): gradient norm "
                      f"{large.trace.grad_norm.mean():.1f}, every step clipped, yet AdamW's update ratio "
                      f"{large.trace.update_ratio.mean():.3f}")
    return dict(
        scale=(f"BertForMaskedLM {layers} layers x {hidden} ({sweep.n_params / 1e6:.2f}M params), {sweep.steps} steps "
               f"of {batch_size}x{seq_len} bytes on the {corpus} corpus, AdamW lr {adamw_lr} with warmup and decay"),
        measured_text=(f"AdamW, clip 1.0: {m['AdamW_clip1_clip_fraction']:.0%} of steps clipped, effective LR "
                       f"reduction {m['effective_lr_reduction']:+.1%}, steps to target clipped/unclipped "
                       f"{m['convergence_slowdown']:.2f}"),
        note=(f"SGD+momentum at clip 1.0: reduction {m['SGD_clip1_effective_lr_reduction']:+.1%}; Adam is "
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


def residual_runs(text, **kwargs) -> dict[str, ResidualRun]:
    """:func:`train_residual` for residual, HC and mHC, same seed, data and optimizer."""
    return {kind: train_residual(kind, text, **kwargs) for kind in RESIDUAL_KINDS}


def r1_metrics(runs: dict[str, ResidualRun]) -> dict[str, float]:
    m: dict[str, float] = {}
    for kind, r in runs.items():
        m |= {f"{kind}_val_loss": r.val_loss, f"{kind}_peak_gain_over_training": r.peak_gain,
              f"{kind}_grad_spike_ratio": r.spike}
    hc, mhc = runs["hc"].peak_gain, runs["mhc"].peak_gain
    return m | dict(mhc_peak_gain=mhc, hc_peak_gain=hc, hc_over_mhc_gain=hc / mhc)


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


def plot_r1(runs: dict[str, ResidualRun]) -> Figure:
    colors = {"residual": "#4c72b0", "hc": "#c44e52", "mhc": "#55a868"}
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for kind, r in runs.items():
        steps = np.arange(len(r.losses))
        axes[0].plot(steps, r.losses, color=colors[kind], lw=0.8, label=f"{kind} (val {r.val_loss:.3f})")
        axes[1].semilogy(steps, r.grad_norms, color=colors[kind], lw=0.8, label=kind)
        s, v = zip(*r.gains)
        axes[2].semilogy(s, v, ".-", color=colors[kind], label=kind)
        depth = np.arange(1, len(r.final_gain.forward) + 1)
        axes[3].semilogy(depth, r.final_gain.forward.numpy(), "-", color=colors[kind], label=f"{kind} forward")
        axes[3].semilogy(depth, r.final_gain.backward.numpy(), "--", color=colors[kind], label=f"{kind} backward")
    axes[0].set(title="training loss", xlabel="step", ylabel="loss (nats/byte)")
    axes[1].set(title="gradient norm", xlabel="step")
    axes[2].set(title="peak composite gain over depth", xlabel="step")
    axes[3].set(title="composite gain vs depth, end of training", xlabel="sublayers")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def r1_texts(runs: dict[str, ResidualRun], *, layers: int, width: int, n_streams: int, steps: int, lr: float,
             corpus: str) -> dict[str, str]:
    """``scale``, ``measured_text`` and ``note`` for R1's verdict."""
    hc, mhc = runs["hc"], runs["mhc"]
    return dict(
        scale=(f"{hc.n_params / 1e6:.2f}M-parameter decoder ({layers} layers = {2 * layers} sublayers, width {width}, "
               f"n={n_streams} streams), {steps} AdamW steps at lr {lr} on the {corpus} corpus; published: 27B"),
        measured_text=(f"peak composite gain: HC {hc.peak_gain:.4g}, mHC {mhc.peak_gain:.4g} "
                       f"(ratio {hc.peak_gain / mhc.peak_gain:.3g})"),
        note=(f"val loss residual {runs['residual'].val_loss:.3f}, HC {hc.val_loss:.3f}, mHC {mhc.val_loss:.3f}; "
              f"max/median grad norm HC {hc.spike:.2f}, mHC {mhc.spike:.2f}"),
    )


__all__ = [
    "ClippingSweep", "LargeProbe", "ResidualRun", "StackProfiles", "TransformerProfiles", "bert_large_probe",
    "bert_schedule", "block_norm_profile", "c2_metrics", "c2_table", "c2_texts", "c3_metrics", "c3_table", "c3_texts",
    "clipping_sweep", "jacobian_log_rate", "make_optimizer", "mlm_val_loss", "plot_c2", "plot_c3", "plot_r1",
    "r1_metrics", "r1_series", "r1_table", "r1_texts", "residual_runs", "stack_profiles", "train_residual",
    "train_unclipped", "transformer_profiles",
]
