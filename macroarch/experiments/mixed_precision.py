"""Notebook 06's experiments (claim C8, post section 4.1): the fp32 master copy against accumulation steps, and
the ``2^5 / max_grad_norm`` gradient scale against ``torch.amp.GradScaler``.

Both train a small GPT-2-style decoder on the byte corpus through the project's one loop
(``experiments.loop.train_lm``, with a step of their own), with ``macroarch.optim.CompensatedAdamW``:

- :func:`accumulation_run`: one global batch per update, split into ``accumulation_steps`` micro-batches, so every
  accumulation count sees the same tokens per update and the same number of updates: in exact arithmetic all
  counts give the same trajectory, and any difference between them is precision. The optimizer has the master
  copy forced on or off and counts the updates that round to zero. :func:`accumulation_sweep` runs it for every
  (dtype, master, k) and an fp32 reference; :func:`accumulation_metrics` grades the master copy's loss gain at
  k >= 4 against k < 4 and the rounding noise (spread of the master-copy runs over k).
- :func:`loss_scaling_run`: fp32 weights, fp16 autocast (what ``GradScaler`` is made for), with no loss scale,
  GradScaler, or the post's rule (``NormGradScaler``). Overflows are skipped updates; underflow is probed every
  ``probe_every`` updates against an fp32 backward at the same weights and batch. :func:`scaling_sweep` runs the
  three.

A run whose loss turns non-finite stops there; the comparisons charge it the untrained model's held-out loss.

The precision experiments keep their dtypes on every machine (bf16 and fp16 are the question). Where this CPU
emulates bf16 matmuls (no AVX-512 BF16 / AMX: about 20-30x slower than fp32), :func:`run_sizes` shrinks the runs
to the profile's ``emulated_steps`` so that the notebook still finishes; the sizes that ran are recorded in the
run's config and named in the verdict.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.figure import Figure

from macroarch.data import ensure_corpus, eval_batches, lm_batches, load_corpus
from macroarch.experiments.hardware import describe, machine_info
from macroarch.experiments.loop import Batch, RunResult, evaluate_lm, train_lm
from macroarch.experiments.settings import Settings
from macroarch.measure.workload import lm_loss
from macroarch.models import get_model_spec
from macroarch.optim import AUTO_MASTER_MIN_ACCUMULATION, CompensatedAdamW

SCALING_METHODS = ("none", "gradscaler", "norm_rule")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class MixedPrecisionSettings(Settings):
    """Notebook 06's settings: its parameters cell, less ``profile`` (``MixedPrecisionSettings.from_params``)."""

    n_layers: int
    """Decoder layers (GPT-2 style)."""
    width: int
    """Decoder width (feed-forward: 4 x width)."""
    n_heads: int
    """Attention heads; must divide ``width``."""
    seq_len: int
    """Bytes per sequence."""
    batch_size: int
    """Sequences per update, split into ``batch_size / k`` micro-batches (every k must divide it)."""
    steps: int
    """Updates per accumulation run (the same for every accumulation count k)."""
    accumulation: tuple[int, ...]
    """Accumulation counts k."""
    scaling_steps: int
    """Updates per loss-scaling run (fp32 weights, fp16 autocast)."""
    emulated_steps: int
    """Where this CPU emulates bf16: ``steps`` and ``scaling_steps`` capped at this (:func:`run_sizes`)."""
    probe_every: int
    """Underflow probe: one fp32 backward every ``probe_every`` updates."""
    eval_batches: int
    """Held-out batches of the final loss."""
    device: str
    """cpu or cuda."""
    threads: int
    """Torch threads."""
    seed: int = 0
    """Initial weights and batch order."""
    corpus: str = "stdlib"
    """data/text/<corpus>."""
    lr: float = 1e-3
    """AdamW learning rate, no weight decay."""
    dtypes: tuple[str, ...] = ("bf16", "fp16")
    """16-bit weight dtypes of the master-copy runs."""

    def __post_init__(self) -> None:
        self._positive("n_layers", "width", "n_heads", "seq_len", "batch_size", "steps", "scaling_steps",
                       "emulated_steps", "probe_every", "eval_batches", "threads", "lr")
        self._non_empty("accumulation", "dtypes")
        self._device()
        if self.width % self.n_heads:
            self._fail("n_heads", f"a divisor of width {self.width}")
        if any(isinstance(k, bool) or not isinstance(k, int) or k < 1 or self.batch_size % k
               for k in self.accumulation):
            self._fail("accumulation", f"positive divisors of batch_size {self.batch_size}")
        if any(d not in ("bf16", "fp16") for d in self.dtypes):
            self._fail("dtypes", "a list of 'bf16' and 'fp16'")


def _split(batch: Batch, parts: int) -> list[Batch]:
    rows = len(batch[0])
    if rows % parts:
        raise ValueError(f"accumulation_steps={parts} must divide the batch's {rows} rows")
    return list(zip(batch[0].chunk(parts), batch[1].chunk(parts)))


def _eval_loss(model: torch.nn.Module, eval_set: Sequence[Batch], autocast_dtype: torch.dtype | None = None) -> float:
    return evaluate_lm(model, eval_set, autocast_dtype=autocast_dtype).loss


# --------------------------------------------------------------------------------------------- accumulation
def accumulation_run(model: torch.nn.Module, batches: Sequence[Batch], eval_set: Sequence[Batch], *, lr: float,
                     accumulation_steps: int, master_weights: bool, weight_decay: float = 0.0,
                     on_update: Callable[[int, float], None] | None = None, desc: str | None = None) -> RunResult:
    """Train ``model`` (in its own dtype) one update per batch, the batch split into ``accumulation_steps``
    micro-batches; ``CompensatedAdamW`` with the master copy forced on or off, counting lost updates.

    Metrics: ``lost_update_fraction`` (due updates that left the stored weight unchanged: the master when
    there is one), ``stalled_fraction`` (due updates that left the model's own weight unchanged).
    """
    opt = CompensatedAdamW(model.parameters(), lr=lr, weight_decay=weight_decay, master_weights=master_weights,
                           accumulation_steps=accumulation_steps, count_lost_updates=True)

    def step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: Batch) -> float:
        micro_losses = []
        for micro in _split(batch, accumulation_steps):
            loss = lm_loss(model, micro)
            loss.backward()
            opt.step()  # CompensatedAdamW accumulates until the k-th micro-batch, then updates
            opt.zero_grad(set_to_none=True)
            micro_losses.append(loss.item())
        return sum(micro_losses) / len(micro_losses)

    log = train_lm(model, opt, batches, step=step, after_step=on_update, on_nonfinite="stop", desc=desc,
                   mininterval=10)
    diverged_at = log.diverged_at
    eval_loss = math.nan if diverged_at is not None else _eval_loss(model, eval_set)
    if not math.isfinite(eval_loss):
        diverged_at = len(log.losses) if diverged_at is None else diverged_at
    due = opt.stats["due_elements"]
    metrics = {"lost_update_fraction": opt.stats["lost_elements"] / due if due else math.nan,
               "stalled_fraction": opt.stats["stalled_elements"] / due if due else math.nan,
               "master_copies": sum(opt.master_weight(p) is not None for p in model.parameters())}
    return RunResult(log.losses, eval_loss, diverged_at, log.wall_seconds, metrics)


# ------------------------------------------------------------------------------------------- loss scaling
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
                     weight_decay: float = 0.0, on_update: Callable[[int, float], None] | None = None,
                     desc: str | None = None) -> RunResult:
    """Train fp32 ``model`` under fp16 autocast with loss scaling ``method`` (``"none"``, ``"gradscaler"``,
    ``"norm_rule"``); AdamW update in every case (``CompensatedAdamW``, which is AdamW without options).

    Metrics: ``overflow_steps`` (updates skipped for non-finite gradients), ``underflow_fraction`` and
    ``grad_rel_error`` (means over the probes), ``final_scale``. Series: ``scale`` per update.
    """
    if method not in SCALING_METHODS:
        raise ValueError(f"method={method!r} must be one of {SCALING_METHODS}")
    if isinstance(probe_every, bool) or not isinstance(probe_every, int) or probe_every < 1:
        raise ValueError(f"probe_every={probe_every!r} must be an int >= 1")
    device_type = next(model.parameters()).device.type
    opt = CompensatedAdamW(model.parameters(), lr=lr, weight_decay=weight_decay,
                           grad_scale="norm" if method == "norm_rule" else None)
    amp_scaler = torch.amp.GradScaler(device_type) if method == "gradscaler" else None
    scales: list[float] = []
    probes: list[tuple[float, float]] = []
    overflows = 0

    def step(model: torch.nn.Module, opt: CompensatedAdamW, batch: Batch) -> float:
        nonlocal overflows
        with torch.autocast(device_type, dtype=autocast_dtype):
            loss = lm_loss(model, batch)
        value = loss.item()
        if not math.isfinite(value):
            return value  # the loop stops here: no backward, no update
        if amp_scaler is not None:
            scale = amp_scaler.get_scale()
            amp_scaler.scale(loss).backward()
        else:
            scale = 1.0 if opt.grad_scaler is None else opt.grad_scaler.get_scale()
            opt.scale_loss(loss).backward()
        if len(scales) % probe_every == 0:
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
        scales.append(scale)
        return value

    log = train_lm(model, opt, batches, step=step, after_step=on_update, on_nonfinite="stop", desc=desc,
                   mininterval=10)
    if opt.grad_scaler is not None:
        overflows = opt.grad_scaler.overflows
    eval_loss = math.nan if log.diverged else _eval_loss(model, eval_set, autocast_dtype)
    metrics = {"overflow_steps": overflows,
               "underflow_fraction": sum(p[0] for p in probes) / len(probes) if probes else math.nan,
               "grad_rel_error": sum(p[1] for p in probes) / len(probes) if probes else math.nan,
               "probes": len(probes), "final_scale": scales[-1] if scales else math.nan}
    return RunResult(log.losses, eval_loss, log.diverged_at, log.wall_seconds, metrics, {"scale": scales})


# ------------------------------------------------------------------------------------------- the notebook
@dataclass(frozen=True)
class Sizes:
    """The updates each run takes here: the profile's, or ``emulated_steps`` where this CPU emulates bf16."""

    steps: int
    scaling_steps: int
    emulated: bool
    machine: str

    def config(self) -> dict[str, Any]:
        """What the run's config records beside the parameters."""
        return {"steps_run": self.steps, "scaling_steps_run": self.scaling_steps, "bf16_emulated": self.emulated}

    requested: tuple[int, int] = (0, 0)
    """The profile's ``(steps, scaling_steps)``."""

    @property
    def shrunk(self) -> bool:
        return (self.steps, self.scaling_steps) != self.requested

    def describe(self) -> str:
        if not self.shrunk:
            return f"{self.machine}: the profile's sizes"
        return (f"bf16 emulated on this CPU ({self.machine}): runs shrunk to {self.steps} accumulation and "
                f"{self.scaling_steps} loss-scaling updates (emulated_steps) to finish in the notebook's budget")


def run_sizes(settings: MixedPrecisionSettings, info: Mapping[str, Any] | None = None) -> Sizes:
    """The profile's ``steps`` and ``scaling_steps``, each capped at ``emulated_steps`` where the runs' CPU has
    no native bf16 (``info``: ``hardware.machine_info()``; a CUDA device is never shrunk)."""
    info = machine_info(settings.device) if info is None else info
    emulated = not str(settings.device).startswith("cuda") and not info["native_bf16"]
    cap = settings.emulated_steps if emulated else None
    steps, scaling = settings.steps, settings.scaling_steps
    if cap is not None:
        steps, scaling = min(steps, cap), min(scaling, cap)
    return Sizes(steps, scaling, emulated, describe(dict(info)), (settings.steps, settings.scaling_steps))


@dataclass
class Setup:
    """The model, its initial weights per dtype, and the batches every run of the notebook shares."""

    settings: MixedPrecisionSettings
    sizes: Sizes
    spec: Any
    train: list[Batch]
    held_out: list[Batch]
    n_params: int
    initial_loss: float

    def build(self, dtype: str) -> torch.nn.Module:
        """The same initial weights for every run (seeded), rounded to the run's dtype."""
        torch.manual_seed(self.settings.seed)
        return self.spec.build().to(device=self.settings.device, dtype=DTYPES[dtype])

    def describe(self) -> str:
        p = self.settings
        return (f"{p.n_layers}-layer decoder, width {p.width}: {self.n_params / 1e6:.3f}M parameters; "
                f"{self.sizes.steps} updates of {p.batch_size}x{p.seq_len} bytes; held-out loss at init "
                f"{self.initial_loss:.3f}\n{self.sizes.describe()}")


def setup(settings: MixedPrecisionSettings, sizes: Sizes) -> Setup:
    """Threads, corpus, model spec, batches and the untrained model's held-out loss."""
    p = settings
    torch.set_num_threads(p.threads)
    text = load_corpus(ensure_corpus(p.corpus))
    spec = get_model_spec("gpt3_tiny").scaled(n_layers=p.n_layers, d_model=p.width, n_heads=p.n_heads,
                                              n_kv_heads=p.n_heads, d_ff=4 * p.width, dropout=0.0,
                                              max_seq_len=p.seq_len)
    s = Setup(p, sizes, spec, [], [], 0, math.nan)
    s.n_params = sum(t.numel() for t in s.build("fp32").parameters())
    s.train = list(lm_batches(text.train, p.batch_size, p.seq_len, seed=p.seed,
                              steps=max(sizes.steps, sizes.scaling_steps)))
    s.held_out = list(eval_batches(text.val, p.batch_size, p.seq_len, max_batches=p.eval_batches))
    s.initial_loss = _eval_loss(s.build("fp32"), s.held_out)
    return s


def run_name(dtype: str, master: bool, k: int) -> str:
    return f"{dtype}_{'master' if master else 'nomaster'}_k{k}"


def charged(setup: Setup, result: RunResult) -> float:
    """The held-out loss, or the untrained model's where the run diverged (it learned nothing usable)."""
    return setup.initial_loss if result.diverged else result.eval_loss


@dataclass
class AccumulationSweep:
    reference: RunResult
    results: dict[str, RunResult]


def accumulation_sweep(s: Setup, run: Any = None) -> AccumulationSweep:
    """The fp32 reference, then every (dtype, master off/on, k); losses logged to ``run`` per update."""
    p, steps = s.settings, s.sizes.steps
    reference = accumulation_run(s.build("fp32"), s.train[:steps], s.held_out, lr=p.lr, accumulation_steps=1,
                                 master_weights=False)
    results = {}
    for dtype in p.dtypes:
        for master in (False, True):
            for k in p.accumulation:
                key = run_name(dtype, master, k)
                log = None if run is None else (lambda step, loss, key=key: run.log(step=step, **{f"{key}_loss": loss}))
                results[key] = accumulation_run(s.build(dtype), s.train[:steps], s.held_out, lr=p.lr,
                                                accumulation_steps=k, master_weights=master, on_update=log, desc=key)
    return AccumulationSweep(reference, results)


def _gain(s: Setup, sweep: AccumulationSweep, dtype: str, ks: Sequence[int]) -> float:
    """Mean over ``ks`` of (loss without master) - (loss with master)."""
    return float(np.mean([charged(s, sweep.results[run_name(dtype, False, k)])
                          - charged(s, sweep.results[run_name(dtype, True, k)]) for k in ks]))


def graded_dtype(dtypes: Sequence[str]) -> str:
    return "bf16" if "bf16" in dtypes else dtypes[0]  # bf16 has fp32's range: the gap is precision alone


def accumulation_metrics(s: Setup, sweep: AccumulationSweep) -> dict[str, float]:
    """Per-run losses and lost updates, the master copy's gain per dtype at k >= 4 and below, the noise."""
    dtypes, accumulation = s.settings.dtypes, s.settings.accumulation
    m: dict[str, float] = {}
    for key, r in sweep.results.items():
        m[f"{key}_eval_loss"] = charged(s, r)
        m[f"{key}_diverged"] = int(r.diverged)
        if math.isfinite(r.metrics["lost_update_fraction"]):
            m[f"{key}_lost_update_fraction"] = r.metrics["lost_update_fraction"]
    high = [k for k in accumulation if k >= AUTO_MASTER_MIN_ACCUMULATION]
    low = [k for k in accumulation if k < AUTO_MASTER_MIN_ACCUMULATION]
    graded = graded_dtype(dtypes)
    # Noise: with master on, every k runs the same fp32 optimizer on the same tokens, so their spread is the
    # run-to-run scatter that rounding alone causes.
    noise = (float(np.std([charged(s, sweep.results[run_name(graded, True, k)]) for k in accumulation], ddof=1))
             if len(accumulation) > 1 else 0.0)
    for dtype in dtypes:
        m[f"{dtype}_master_copy_loss_gain_at_4_plus"] = _gain(s, sweep, dtype, high) if high else 0.0
        m[f"{dtype}_master_copy_loss_gain_below_4"] = _gain(s, sweep, dtype, low) if low else 0.0
        m[f"{dtype}_nomaster_diverged_runs"] = sum(sweep.results[run_name(dtype, False, k)].diverged
                                                   for k in accumulation)
        m[f"{dtype}_master_diverged_runs"] = sum(sweep.results[run_name(dtype, True, k)].diverged
                                                 for k in accumulation)
    m.update(master_copy_loss_gain=_gain(s, sweep, graded, high) if high else 0.0,
             master_copy_loss_gain_below_4=_gain(s, sweep, graded, low) if low else 0.0, master_copy_noise=noise,
             fp32_reference_eval_loss=sweep.reference.eval_loss, initial_eval_loss=s.initial_loss)
    return m


def log_gain_by_k(s: Setup, sweep: AccumulationSweep, run: Any) -> None:
    """The master copy's gain at each k, as a series over k."""
    for dtype in s.settings.dtypes:
        for k in s.settings.accumulation:
            run.log(step=k, **{f"{dtype}_master_gain_by_k": _gain(s, sweep, dtype, [k])})


def accumulation_table(s: Setup, sweep: AccumulationSweep) -> str:
    lines = [f"fp32 reference: held-out loss {sweep.reference.eval_loss:.4f}",
             f"{'run':<22}{'held-out loss':>14}{'lost updates':>14}{'16-bit stalled':>16}{'diverged at':>13}{'s':>7}"]
    for key, r in sweep.results.items():
        lines.append(f"{key:<22}{r.eval_loss:>14.4f}{r.metrics['lost_update_fraction']:>14.4f}"
                     f"{r.metrics['stalled_fraction']:>16.4f}{str(r.diverged_at):>13}{r.seconds:>7.1f}")
    for dtype in s.settings.dtypes:
        lines.append(f"{dtype}: loss gain of the master copy by k: "
                     + ", ".join(f"k={k}: {_gain(s, sweep, dtype, [k]):+.4f}" for k in s.settings.accumulation))
    m = accumulation_metrics(s, sweep)
    lines.append(f"graded ({graded_dtype(s.settings.dtypes)}): gain at k >= 4 {m['master_copy_loss_gain']:+.4f}, "
                 f"at k < 4 {m['master_copy_loss_gain_below_4']:+.4f}; rounding noise {m['master_copy_noise']:.4f}")
    return "\n".join(lines)


def scaling_sweep(s: Setup, run: Any = None) -> dict[str, RunResult]:
    """The three loss-scaling methods from the same fp32 weights on the same batches; losses (every update) and
    scales (every ``probe_every``-th) logged to ``run``."""
    p, out = s.settings, {}
    for method in SCALING_METHODS:
        log = None if run is None else (lambda step, loss, method=method:
                                        run.log(step=step, **{f"scaling_{method}_loss": loss}))
        out[method] = loss_scaling_run(s.build("fp32"), s.train[:s.sizes.scaling_steps], s.held_out, method=method,
                                       lr=p.lr, probe_every=p.probe_every, on_update=log, desc=method)
        if run is not None:
            for step, scale in enumerate(out[method].series["scale"]):
                if step % p.probe_every == 0:
                    run.log(step=step, **{f"scaling_{method}_scale": scale})
    return out


def scaling_metrics(s: Setup, scaling: Mapping[str, RunResult]) -> dict[str, float]:
    m: dict[str, float] = {}
    for method, r in scaling.items():
        x = r.metrics
        m.update({f"{method}_eval_loss": charged(s, r), f"{method}_overflow_steps": x["overflow_steps"],
                  f"{method}_underflow_fraction": x["underflow_fraction"],
                  f"{method}_grad_rel_error": x["grad_rel_error"], f"{method}_final_scale": x["final_scale"]})
    m["scale_rule_vs_gradscaler"] = charged(s, scaling["gradscaler"]) / charged(s, scaling["norm_rule"])
    return m


def scaling_table(s: Setup, scaling: Mapping[str, RunResult]) -> str:
    lines = [f"{'method':<12}{'held-out loss':>14}{'overflow steps':>16}{'underflow':>12}{'grad rel. error':>17}"
             f"{'scale':>10}"]
    for method, r in scaling.items():
        m = r.metrics
        lines.append(f"{method:<12}{charged(s, r):>14.4f}{m['overflow_steps']:>16d}{m['underflow_fraction']:>12.2e}"
                     f"{m['grad_rel_error']:>17.2e}{m['final_scale']:>10.4g}")
    ratio = charged(s, scaling["gradscaler"]) / charged(s, scaling["norm_rule"])
    lines.append(f"GradScaler loss / rule loss = {ratio:.4f} (> 1: the rule ends lower)")
    return "\n".join(lines)


def plot(s: Setup, sweep: AccumulationSweep, scaling: Mapping[str, RunResult]) -> Figure:
    """Final loss and lost updates against k; the loss-scaling runs' losses and scales."""
    dtypes, accumulation = s.settings.dtypes, s.settings.accumulation
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.2))
    ax = axes[0]
    for dtype in dtypes:
        for master, style in ((False, "o--"), (True, "s-")):
            ax.plot(accumulation, [charged(s, sweep.results[run_name(dtype, master, k)]) for k in accumulation],
                    style, ms=4, label=f"{dtype}, master {'on' if master else 'off'}")
    ax.axhline(sweep.reference.eval_loss, color="k", lw=0.8, ls=":", label="fp32 reference")
    ax.axvline(AUTO_MASTER_MIN_ACCUMULATION, color="grey", lw=0.6)
    ax.set(xscale="log", xticks=accumulation, xticklabels=accumulation,
           xlabel="accumulation steps (same tokens/update)", ylabel="held-out loss (diverged: loss at init)",
           title="final loss vs accumulation")
    ax = axes[1]
    for dtype in dtypes:
        for master, style in ((False, "o--"), (True, "s-")):
            runs = [sweep.results[run_name(dtype, master, k)] for k in accumulation]
            values = [np.nan if r.diverged else r.metrics["lost_update_fraction"] for r in runs]  # gap: diverged
            ax.plot(accumulation, values, style, ms=4, label=f"{dtype}, master {'on' if master else 'off'}")
    ax.set(xscale="log", xticks=accumulation, xticklabels=accumulation, xlabel="accumulation steps",
           ylabel="fraction of due updates lost", title="updates that rounded to zero")
    ax = axes[2]
    for method, r in scaling.items():
        ax.plot(np.convolve(r.losses, np.ones(5) / 5, mode="valid"), lw=0.9, label=method)
    ax.set(xlabel="update", ylabel="training loss (5-step mean)", title="fp16 autocast: loss")
    ax = axes[3]
    for method, r in scaling.items():
        ax.semilogy(r.series["scale"], lw=0.9, label=f"{method}: {r.metrics['overflow_steps']} overflows, "
                    f"underflow {r.metrics['underflow_fraction']:.1e}")
    ax.set(xlabel="update", ylabel="loss scale", title="scale over training")
    for ax in axes:
        ax.legend(fontsize=7)
        ax.xaxis.set_minor_formatter(plt.NullFormatter())  # log axes: only the grid's own tick labels
    fig.tight_layout()
    return fig


def verdict_texts(s: Setup, sweep: AccumulationSweep, scaling: Mapping[str, RunResult],
                  metrics: Mapping[str, float]) -> dict[str, str]:
    """``scale``, ``measured_text`` and ``note`` for ``get_claim("C8").grade``."""
    p, m = s.settings, metrics
    graded = graded_dtype(p.dtypes)
    gain_high, gain_low, noise = m["master_copy_loss_gain"], m["master_copy_loss_gain_below_4"], m["master_copy_noise"]
    if gain_high <= noise:
        threshold = "the master copy does not measurably help at k >= 4"
    elif gain_low >= 0.5 * gain_high:
        threshold = ("the master copy helps about as much below 4 accumulation steps as from 4 on: 4 is not where it "
                     "starts to matter")
    else:
        threshold = "the master copy's benefit appears from 4 accumulation steps on, as the post says"
    fp16_note = ""
    if "fp16" in p.dtypes:
        fp16_note = (f"fp16 without master: {int(m['fp16_nomaster_diverged_runs'])}/{len(p.accumulation)} runs "
                     f"diverged; fp16 gain at k >= 4 {m['fp16_master_copy_loss_gain_at_4_plus']:+.3f}, "
                     f"below 4 {m['fp16_master_copy_loss_gain_below_4']:+.3f}")
    lost = np.mean([sweep.results[run_name(graded, False, k)].metrics["lost_update_fraction"]
                    for k in p.accumulation])
    gs, rule = scaling["gradscaler"].metrics, scaling["norm_rule"].metrics
    scale = (f"{p.n_layers}-layer GPT-2-style decoder, width {p.width} ({s.n_params / 1e6:.3f}M params), "
             f"{s.sizes.steps} AdamW updates of {p.batch_size}x{p.seq_len} bytes at lr {p.lr:g}, "
             f"accumulation {list(p.accumulation)}, weights in {' and '.join(p.dtypes)}; loss scaling: fp16 "
             f"autocast, {s.sizes.scaling_steps} updates; {s.sizes.machine}"
             + (f" (shrunk from {p.steps} and {p.scaling_steps} updates: emulated_steps)" if s.sizes.shrunk
                else ""))
    measured = (f"{graded} master-copy loss gain {gain_high:+.4f} at k >= 4 vs {gain_low:+.4f} at k < 4 "
                f"(noise {noise:.4f}); lost updates without master {lost:.1%}; GradScaler/rule loss ratio "
                f"{m['scale_rule_vs_gradscaler']:.4f} (overflows {gs['overflow_steps']} vs {rule['overflow_steps']}, "
                f"underflow {gs['underflow_fraction']:.1e} vs {rule['underflow_fraction']:.1e})")
    return {"scale": scale, "measured_text": measured, "note": "; ".join(x for x in (threshold, fp16_note) if x)}
