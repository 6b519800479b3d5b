"""Notebook 06's experiments (claim C8, post section 4.1): the fp32 master copy against accumulation steps, and
the ``2^5 / max_grad_norm`` gradient scale against ``torch.amp.GradScaler``.

Both train a small GPT-2-style decoder on the byte corpus through the project's one loop
(``experiments.loop.train_lm``, with a step of their own), with ``macroarch.optim.CompensatedAdamW``:

- :func:`accumulation_run`: one global batch per update, split into ``accumulation_steps`` micro-batches, so every
  accumulation count sees the same tokens per update and the same number of updates: in exact arithmetic all
  counts give the same trajectory, and any difference between them is precision. The optimizer has the master
  copy forced on or off and counts the updates that round to zero. :func:`accumulation_sweep` runs it for every
  (dtype, master, k) and an fp32 reference per seed; :func:`accumulation_estimates` makes the master copy's loss gain
  at k >= 4 and at k < 4 paired differences over seeds (no master minus master, per seed).
- :func:`loss_scaling_run`: fp32 weights, fp16 autocast (what ``GradScaler`` is made for), with no loss scale,
  GradScaler, or the post's rule (``NormGradScaler``). Overflows are skipped updates; underflow is probed every
  ``probe_every`` updates against an fp32 backward at the same weights and batch. :func:`scaling_sweep` runs the
  three per seed; :func:`scaling_estimates` the GradScaler / rule loss ratio per seed, its geometric mean with a t
  interval on the logs over seeds (a ratio's spread is multiplicative).

Seeds are paired: seed i gives every run the same initial weights (rounded to the run's dtype) and batch order, and
every run is evaluated on the same held-out batches.

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
from macroarch.experiments.loop import Batch, RunResult, evaluate_lm, train_lm
from macroarch.experiments.settings import Settings
from macroarch.measure.machine import describe, machine_info
from macroarch.measure.stats import Estimate, Repeated, geomean_interval, paired_difference
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
    seeds: int = 1
    """Paired seeds ``seed``, ``seed + 1``, ...: each seed's initial weights and batch order shared by every run."""
    seed: int = 0
    """First seed."""
    corpus: str = "stdlib"
    """data/text/<corpus>."""
    lr: float = 1e-3
    """AdamW learning rate, no weight decay."""
    dtypes: tuple[str, ...] = ("bf16", "fp16")
    """16-bit weight dtypes of the master-copy runs."""

    def __post_init__(self) -> None:
        self._positive("seeds", "n_layers", "width", "n_heads", "seq_len", "batch_size", "steps", "scaling_steps",
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
    train: dict[int, list[Batch]]
    """Per seed: its batches, in its order."""
    held_out: list[Batch]
    n_params: int
    initial_loss: float

    @property
    def seeds(self) -> list[int]:
        return [self.settings.seed + i for i in range(self.settings.seeds)]

    def build(self, dtype: str, seed: int | None = None) -> torch.nn.Module:
        """Seed ``seed``'s initial weights (the first seed's by default), rounded to the run's dtype."""
        torch.manual_seed(self.settings.seed if seed is None else seed)
        return self.spec.build().to(device=self.settings.device, dtype=DTYPES[dtype])

    def describe(self) -> str:
        p = self.settings
        return (f"{p.n_layers}-layer decoder, width {p.width}: {self.n_params / 1e6:.3f}M parameters; "
                f"{self.sizes.steps} updates of {p.batch_size}x{p.seq_len} bytes, {p.seeds} paired seeds; held-out "
                f"loss at init "
                f"{self.initial_loss:.3f}\n{self.sizes.describe()}")


def setup(settings: MixedPrecisionSettings, sizes: Sizes) -> Setup:
    """Threads, corpus, model spec, batches and the untrained model's held-out loss."""
    p = settings
    torch.set_num_threads(p.threads)
    text = load_corpus(ensure_corpus(p.corpus))
    spec = get_model_spec("gpt3_tiny").scaled(n_layers=p.n_layers, d_model=p.width, n_heads=p.n_heads,
                                              n_kv_heads=p.n_heads, d_ff=4 * p.width, dropout=0.0,
                                              max_seq_len=p.seq_len)
    s = Setup(p, sizes, spec, {}, [], 0, math.nan)
    s.n_params = sum(t.numel() for t in s.build("fp32").parameters())
    s.train = {seed: list(lm_batches(text.train, p.batch_size, p.seq_len, seed=seed,
                                     steps=max(sizes.steps, sizes.scaling_steps))) for seed in s.seeds}
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
    reference: dict[int, RunResult]
    """Per seed: the fp32 run."""
    results: dict[tuple[str, int], RunResult]
    """Keyed ``(run_name(dtype, master, k), seed)``."""


def accumulation_sweep(s: Setup, run: Any = None) -> AccumulationSweep:
    """Per seed: the fp32 reference, then every (dtype, master off/on, k); the first seed's losses logged to ``run``
    per update."""
    p, steps = s.settings, s.sizes.steps
    reference, results = {}, {}
    for seed in s.seeds:
        reference[seed] = accumulation_run(s.build("fp32", seed), s.train[seed][:steps], s.held_out, lr=p.lr,
                                           accumulation_steps=1, master_weights=False)
        for dtype in p.dtypes:
            for master in (False, True):
                for k in p.accumulation:
                    key = run_name(dtype, master, k)
                    log = None if run is None or seed != s.seeds[0] else (
                        lambda step, loss, key=key: run.log(step=step, **{f"{key}_loss": loss}))
                    results[key, seed] = accumulation_run(s.build(dtype, seed), s.train[seed][:steps], s.held_out,
                                                          lr=p.lr, accumulation_steps=k, master_weights=master,
                                                          on_update=log, desc=f"{key} seed {seed}")
    return AccumulationSweep(reference, results)


def losses(s: Setup, sweep: AccumulationSweep, dtype: str, master: bool, k: int) -> np.ndarray:
    """Per seed: the held-out loss of one configuration (diverged: the untrained model's)."""
    return np.array([charged(s, sweep.results[run_name(dtype, master, k), seed]) for seed in s.seeds])


def diverged(s: Setup, sweep: AccumulationSweep, dtype: str, master: bool, k: int) -> int:
    return sum(sweep.results[run_name(dtype, master, k), seed].diverged for seed in s.seeds)


def _mean_over_k(s: Setup, sweep: AccumulationSweep, dtype: str, master: bool, ks: Sequence[int]) -> np.ndarray:
    return np.mean([losses(s, sweep, dtype, master, k) for k in ks], axis=0)


def _split_k(accumulation: Sequence[int]) -> tuple[list[int], list[int]]:
    """The accumulation counts from the post's 4 on, and below it."""
    return ([k for k in accumulation if k >= AUTO_MASTER_MIN_ACCUMULATION],
            [k for k in accumulation if k < AUTO_MASTER_MIN_ACCUMULATION])


def gain(s: Setup, sweep: AccumulationSweep, dtype: str, ks: Sequence[int]) -> Estimate:
    """The master copy's held-out loss gain over ``ks``: per seed, the mean over ``ks`` of (loss without master) -
    (loss with master); a paired t interval over seeds."""
    return paired_difference(_mean_over_k(s, sweep, dtype, True, ks), _mean_over_k(s, sweep, dtype, False, ks),
                             unit="nats/byte")


def graded_dtype(dtypes: Sequence[str]) -> str:
    return "bf16" if "bf16" in dtypes else dtypes[0]  # bf16 has fp32's range: the gap is precision alone


def accumulation_estimates(s: Setup, sweep: AccumulationSweep) -> dict[str, Estimate]:
    """The graded ``master_copy_loss_gain`` (k >= 4) and ``master_copy_loss_gain_below_4`` of the graded dtype, and
    the same per dtype (``{dtype}_master_copy_loss_gain_at_4_plus``, ``{dtype}_master_copy_loss_gain_below_4``)."""
    high, low = _split_k(s.settings.accumulation)
    out: dict[str, Estimate] = {}
    for dtype in s.settings.dtypes:
        if high:
            out[f"{dtype}_master_copy_loss_gain_at_4_plus"] = gain(s, sweep, dtype, high)
        if low:
            out[f"{dtype}_master_copy_loss_gain_below_4"] = gain(s, sweep, dtype, low)
    graded = graded_dtype(s.settings.dtypes)
    if high:
        out["master_copy_loss_gain"] = out[f"{graded}_master_copy_loss_gain_at_4_plus"]
    if low:
        out["master_copy_loss_gain_below_4"] = out[f"{graded}_master_copy_loss_gain_below_4"]
    return out


def accumulation_metrics(s: Setup, sweep: AccumulationSweep) -> dict[str, float]:
    """Per configuration: the seed-mean held-out loss, the runs that diverged, the lost updates (mean over the seeds
    that did not diverge); per dtype the diverged runs; the fp32 reference."""
    p = s.settings
    m: dict[str, float] = {}
    for dtype in p.dtypes:
        for master in (False, True):
            for k in p.accumulation:
                key = run_name(dtype, master, k)
                runs = [sweep.results[key, seed] for seed in s.seeds]
                m[f"{key}_eval_loss"] = float(losses(s, sweep, dtype, master, k).mean())
                m[f"{key}_diverged"] = sum(r.diverged for r in runs)
                lost = [x for x in (r.metrics["lost_update_fraction"] for r in runs) if math.isfinite(x)]
                if lost:
                    m[f"{key}_lost_update_fraction"] = float(np.mean(lost))
        for master in (False, True):
            m[f"{dtype}_{'master' if master else 'nomaster'}_diverged_runs"] = sum(
                diverged(s, sweep, dtype, master, k) for k in p.accumulation)
    m.update(seeds=p.seeds, initial_eval_loss=s.initial_loss,
             fp32_reference_eval_loss=float(np.mean([sweep.reference[seed].eval_loss for seed in s.seeds])))
    return m


def log_gain_by_k(s: Setup, sweep: AccumulationSweep, run: Any) -> None:
    """The master copy's gain at each k (mean over seeds), as a series over k."""
    for dtype in s.settings.dtypes:
        for k in s.settings.accumulation:
            run.log(step=k, **{f"{dtype}_master_gain_by_k": gain(s, sweep, dtype, [k]).value})


def accumulation_table(s: Setup, sweep: AccumulationSweep) -> str:
    p = s.settings
    m = accumulation_metrics(s, sweep)
    lines = [f"fp32 reference: held-out loss {m['fp32_reference_eval_loss']:.4f}; means over {p.seeds} paired seeds",
             f"{'run':<22}{'held-out loss':>14}{'lost updates':>14}{'diverged':>10}"]
    for dtype in p.dtypes:
        for master in (False, True):
            for k in p.accumulation:
                key = run_name(dtype, master, k)
                lines.append(f"{key:<22}{m[f'{key}_eval_loss']:>14.4f}"
                             f"{m.get(f'{key}_lost_update_fraction', math.nan):>14.4f}"
                             f"{m[f'{key}_diverged']:>7d}/{p.seeds}")
    for dtype in p.dtypes:
        lines.append(f"{dtype}: master copy's loss gain by k: "
                     + "; ".join(f"k={k}: {gain(s, sweep, dtype, [k]).describe(3)}" for k in p.accumulation))
    est = accumulation_estimates(s, sweep)
    lines += [f"graded ({graded_dtype(p.dtypes)}): {name} {est[name].describe(3)}"
              for name in ("master_copy_loss_gain", "master_copy_loss_gain_below_4") if name in est]
    return "\n".join(lines)


def scaling_sweep(s: Setup, run: Any = None) -> dict[tuple[str, int], RunResult]:
    """Per seed, the three loss-scaling methods from that seed's fp32 weights on its batches, keyed ``(method,
    seed)``; the first seed's losses (every update) and scales (every ``probe_every``-th) logged to ``run``."""
    p, out = s.settings, {}
    for seed in s.seeds:
        for method in SCALING_METHODS:
            first = run is not None and seed == s.seeds[0]
            log = None if not first else (lambda step, loss, method=method:
                                          run.log(step=step, **{f"scaling_{method}_loss": loss}))
            out[method, seed] = loss_scaling_run(s.build("fp32", seed), s.train[seed][:s.sizes.scaling_steps],
                                                 s.held_out, method=method, lr=p.lr, probe_every=p.probe_every,
                                                 on_update=log, desc=f"{method} seed {seed}")
            if first:
                for step, scale in enumerate(out[method, seed].series["scale"]):
                    if step % p.probe_every == 0:
                        run.log(step=step, **{f"scaling_{method}_scale": scale})
    return out


def scale_ratios(s: Setup, scaling: Mapping[tuple[str, int], RunResult]) -> np.ndarray:
    """Per seed: GradScaler's held-out loss / the rule's (above 1: the rule ends lower)."""
    return np.array([charged(s, scaling["gradscaler", seed]) / charged(s, scaling["norm_rule", seed])
                     for seed in s.seeds])


def scale_repeated(s: Setup, scaling: Mapping[tuple[str, int], RunResult]) -> Repeated:
    """The per-seed loss ratios (:func:`scale_ratios`) and the build of the graded estimate from them: their geometric
    mean, a t interval on their logs over seeds (``stats.geomean_interval``)."""
    return Repeated(geomean_interval, (tuple(scale_ratios(s, scaling)),), "seeds",
                    {"unit": "x", "method": "t interval over paired seeds"})


def scaling_estimates(s: Setup, scaling: Mapping[tuple[str, int], RunResult]) -> dict[str, Estimate]:
    """``scale_rule_vs_gradscaler``: GradScaler's loss / the rule's, per seed; geometric mean, t interval on logs."""
    return {"scale_rule_vs_gradscaler": scale_repeated(s, scaling).estimate()}


def scaling_metrics(s: Setup, scaling: Mapping[tuple[str, int], RunResult]) -> dict[str, float]:
    """Per method, means over seeds: held-out loss, overflow steps, underflow, gradient error, final scale."""
    m: dict[str, float] = {}
    for method in SCALING_METHODS:
        runs = [scaling[method, seed] for seed in s.seeds]
        m[f"{method}_eval_loss"] = float(np.mean([charged(s, r) for r in runs]))
        for name in ("overflow_steps", "underflow_fraction", "grad_rel_error", "final_scale"):
            m[f"{method}_{name}"] = float(np.mean([r.metrics[name] for r in runs]))
    return m


def scaling_table(s: Setup, scaling: Mapping[tuple[str, int], RunResult]) -> str:
    m = scaling_metrics(s, scaling)
    lines = [f"means over {s.settings.seeds} paired seeds",
             f"{'method':<12}{'held-out loss':>14}{'overflow steps':>16}{'underflow':>12}{'grad rel. error':>17}"
             f"{'scale':>10}"]
    for method in SCALING_METHODS:
        lines.append(f"{method:<12}{m[f'{method}_eval_loss']:>14.4f}{m[f'{method}_overflow_steps']:>16.1f}"
                     f"{m[f'{method}_underflow_fraction']:>12.2e}{m[f'{method}_grad_rel_error']:>17.2e}"
                     f"{m[f'{method}_final_scale']:>10.4g}")
    ratio = scaling_estimates(s, scaling)["scale_rule_vs_gradscaler"]
    lines.append(f"GradScaler loss / rule loss = {ratio.describe()} (> 1: the rule ends lower)")
    return "\n".join(lines)


def repeated(s: Setup, sweep: AccumulationSweep, scaling: Mapping[tuple[str, int], RunResult]) -> dict[str, Repeated]:
    """The graded estimates' raw per-seed data and builds, for ``claims.regrade_leaving_out``."""
    high, low = _split_k(s.settings.accumulation)
    graded = graded_dtype(s.settings.dtypes)
    out = {"scale_rule_vs_gradscaler": scale_repeated(s, scaling)}
    for name, ks in (("master_copy_loss_gain", high), ("master_copy_loss_gain_below_4", low)):
        if ks:
            out[name] = Repeated(paired_difference, (tuple(_mean_over_k(s, sweep, graded, True, ks)),
                                                     tuple(_mean_over_k(s, sweep, graded, False, ks))), "seeds",
                                 {"unit": "nats/byte"})
    return out


def rows(s: Setup, sweep: AccumulationSweep, scaling: Mapping[tuple[str, int], RunResult]) -> list[dict[str, Any]]:
    """One row per run and seed (the raw per-seed data behind the estimates, for a table and for leaving a seed
    out); a value a diverged run does not have (its held-out loss) is None."""
    out = [dict(experiment="accumulation", run=key, seed=seed, eval_loss=r.eval_loss, charged_loss=charged(s, r),
                diverged_at=r.diverged_at, lost_update_fraction=r.metrics["lost_update_fraction"])
           for (key, seed), r in sweep.results.items()]
    out += [dict(experiment="reference", run="fp32_k1", seed=seed, eval_loss=r.eval_loss, charged_loss=charged(s, r),
                 diverged_at=r.diverged_at) for seed, r in sweep.reference.items()]
    out += [dict(experiment="scaling", run=method, seed=seed, eval_loss=r.eval_loss, charged_loss=charged(s, r),
                 diverged_at=r.diverged_at, overflow_steps=r.metrics["overflow_steps"],
                 underflow_fraction=r.metrics["underflow_fraction"]) for (method, seed), r in scaling.items()]
    return [{k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()} for row in out]


FONT = 8
"""The smallest text of the figure, in points: 8 pt prints at 6.7 pt in an 8 in figure scaled to the report's page."""


def _below(ax: plt.Axes, ncol: int = 1, offset: float = 0.2) -> None:
    ax.legend(fontsize=FONT, loc="upper center", bbox_to_anchor=(0.5, -offset), ncol=ncol, frameon=False)


def _mark_diverged(ax: plt.Axes, bad: Mapping[tuple[str, str], Sequence[int]], y: float, marker: str) -> None:
    """A marker at height ``y`` (inside the axes) at each k of ``bad[(colour, label)]``, in the colour of the
    series it stands for, named in the legend once."""
    for (color, label), ks in bad.items():
        if ks:
            ax.plot(ks, [y] * len(ks), marker, color=color, ms=8, mew=2, ls="none", label=label)


def _room_above(values: Sequence[float], strip: bool) -> tuple[float, float, float]:
    """``(bottom, top, y)``: limits that hold ``values`` with a margin, and, where ``strip``, a strip above them for
    the diverged runs' markers, whose height ``y`` is returned (the data never reach it)."""
    low, high = min(values), max(values)
    pad = 0.15 * ((high - low) or 0.01)
    bottom, top = low - pad, high + pad
    if not strip:
        return bottom, top, top
    strip_height = 0.25 * (top - bottom)
    return bottom, top + strip_height, top + strip_height / 2


def plot(s: Setup, sweep: AccumulationSweep, scaling: Mapping[tuple[str, int], RunResult], *, gain_target: Any,
         below_4_target: Any, scale_target: Any) -> Figure:
    """C8 in five panels (2 columns): the graded master-copy gain against k with its intervals and the post's
    targets (a configuration whose runs diverged is marked in a strip at the top, not plotted as a gain); the graded
    GradScaler / rule loss ratio per seed with its interval and the post's margin; held-out loss and lost updates
    against k (diverged runs marked, not charged); the loss scale over training. The targets are the registry's,
    passed in by the notebook (``gain_target``: ``master_copy_loss_gain``, ``below_4_target``:
    ``master_copy_loss_gain_below_4``, ``scale_target``: ``scale_rule_vs_gradscaler``; anything with their
    ``lo``, ``hi`` and ``no_effect``)."""
    p, seeds = s.settings, s.seeds
    accumulation, n = p.accumulation, len(seeds)
    color = {dtype: f"C{j}" for j, dtype in enumerate(p.dtypes)}
    fig = plt.figure(figsize=(7.8, 10.5), layout="constrained")
    grid = fig.add_gridspec(3, 2, height_ratios=(1, 1, 0.7))
    gain_ax, ratio_ax = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1])
    loss_ax, lost_ax = fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[1, 1])
    scale_ax = fig.add_subplot(grid[2, :])
    kmin, kmax = min(accumulation) / 1.5, max(accumulation) * 1.5

    ax = gain_ax
    finite = [gain_target.lo, below_4_target.lo, below_4_target.hi, 0.0]
    off_scale: dict[tuple[str, str], list[int]] = {}
    for j, dtype in enumerate(p.dtypes):
        xs, values, lows, highs = [], [], [], []
        bad = off_scale.setdefault((color[dtype], f"{dtype}: runs diverged (no gain to plot)"), [])
        for k in accumulation:
            if diverged(s, sweep, dtype, False, k) or diverged(s, sweep, dtype, True, k):
                bad.append(k)
                continue
            e = gain(s, sweep, dtype, [k])
            lo, hi = (e.low, e.high) if e.has_interval else (e.value, e.value)
            xs.append(k * (1 + 0.06 * j))
            values.append(e.value)
            lows.append(e.value - lo)
            highs.append(hi - e.value)
            finite += [lo, hi]
        if xs:
            ax.errorbar(xs, values, yerr=[lows, highs], fmt="o-", ms=5, capsize=3, color=color[dtype],
                        label=f"{dtype}: gain, {n} paired seeds, 90% t interval")
    bottom, top, marker_y = _room_above(finite, any(off_scale.values()))
    ax.fill_between([AUTO_MASTER_MIN_ACCUMULATION, kmax], gain_target.lo, top, color="C2", alpha=0.1,
                    label=f"post, k >= 4: gain >= {gain_target.lo:g} nats")
    ax.fill_between([kmin, AUTO_MASTER_MIN_ACCUMULATION], below_4_target.lo, below_4_target.hi, color="C2",
                    alpha=0.2, label=f"post, k < 4: gain within ±{below_4_target.hi:g} nats")
    ax.axhline(0, color="0.3", lw=0.6)
    ax.axvline(AUTO_MASTER_MIN_ACCUMULATION, color="grey", lw=0.6)
    _mark_diverged(ax, off_scale, marker_y, "^")
    ax.set(xscale="log", xticks=accumulation, xticklabels=accumulation, xlim=(kmin, kmax), ylim=(bottom, top),
           xlabel="accumulation steps k (same tokens/update)", ylabel="master copy's loss gain (nats/byte)",
           title="graded: loss without - with master")
    _below(ax)

    ax = ratio_ax
    e, ratios = scaling_estimates(s, scaling)["scale_rule_vs_gradscaler"], scale_ratios(s, scaling)
    rng = np.random.default_rng(0)
    ax.scatter(rng.uniform(-0.12, 0.12, n), ratios, s=20, color="C3", alpha=0.5, lw=0, label=f"per seed (n={n})")
    lo, hi = (e.low, e.high) if e.has_interval else (e.value, e.value)
    ax.errorbar([0.35], [e.value], yerr=[[e.value - lo], [hi - e.value]], fmt="D", color="k", ms=6, capsize=6,
                label="geometric mean, 90% t interval" if e.has_interval else "geometric mean (no interval)")
    band = scale_target.no_effect
    span = [*ratios, lo, hi, *band]
    pad = 0.15 * (max(span) - min(span))
    ax.axhspan(*band, color="0.5", alpha=0.15, label=f"no effect: {band[0]:g}-{band[1]:g}")
    ax.axhspan(scale_target.lo, max(span) + pad, color="C2", alpha=0.08,
               label=f"post: >= {scale_target.lo:g} (no worse than GradScaler)")
    ax.set(xlim=(-0.5, 0.8), ylim=(min(span) - pad, max(span) + pad), xticks=[],
           xlabel="paired seeds (jittered), estimate", ylabel="held-out loss, GradScaler / rule (x)",
           title="graded: scale rule vs GradScaler")
    _below(ax, offset=0.1)

    ax = loss_ax
    shown: list[float] = []
    bad_runs: dict[tuple[str, str], list[int]] = {}
    for dtype in p.dtypes:
        for master, style in ((False, "o--"), (True, "s-")):
            name = f"{dtype}, master {'on' if master else 'off'}"
            bad_runs[color[dtype], f"{name}: diverged"] = [k for k in accumulation
                                                           if diverged(s, sweep, dtype, master, k)]
            values = [np.nan if diverged(s, sweep, dtype, master, k) else float(np.mean(
                [sweep.results[run_name(dtype, master, k), seed].eval_loss for seed in seeds])) for k in accumulation]
            shown += [v for v in values if math.isfinite(v)]
            if any(math.isfinite(v) for v in values):  # every run diverged: only the markers
                ax.plot(accumulation, values, style, ms=4, color=color[dtype], alpha=1.0 if master else 0.6,
                        label=name)
    ref = float(np.mean([sweep.reference[seed].eval_loss for seed in seeds]))
    ax.axhline(ref, color="k", lw=0.8, ls=":", label="fp32 reference")
    bottom, top, marker_y = _room_above([*shown, ref], any(bad_runs.values()))
    _mark_diverged(ax, bad_runs, marker_y, "x")
    ax.set(xscale="log", xticks=accumulation, xticklabels=accumulation, xlim=(kmin, kmax), ylim=(bottom, top),
           xlabel="accumulation steps k", ylabel=f"held-out loss (nats/byte), mean of {n} seeds",
           title="final loss (diverged: marked, not charged)")
    _below(ax)

    ax = lost_ax
    for dtype in p.dtypes:
        for master, style in ((False, "o--"), (True, "s-")):
            values = [np.nan if diverged(s, sweep, dtype, master, k) else float(np.mean(
                [sweep.results[run_name(dtype, master, k), seed].metrics["lost_update_fraction"] for seed in seeds]))
                for k in accumulation]
            if any(math.isfinite(v) for v in values):
                ax.plot(accumulation, values, style, ms=4, color=color[dtype], alpha=1.0 if master else 0.6,
                        label=f"{dtype}, master {'on' if master else 'off'}")
    ax.set(xscale="log", xticks=accumulation, xticklabels=accumulation, xlim=(kmin, kmax),
           xlabel="accumulation steps k", ylabel="share of due updates lost",
           title="updates that rounded to zero (diverged: gap)")
    _below(ax)

    ax = scale_ax
    for method in SCALING_METHODS:
        r = scaling[method, seeds[0]]
        ax.semilogy(r.series["scale"], lw=0.9, label=f"{method}: {r.metrics['overflow_steps']} overflows, "
                    f"underflow {r.metrics['underflow_fraction']:.1e}")
    ax.set(xlabel="update", ylabel="loss scale", title=f"fp16 autocast: loss scale over training (seed {seeds[0]})")
    _below(ax, ncol=2, offset=0.3)
    for ax in (gain_ax, loss_ax, lost_ax):
        ax.xaxis.set_minor_formatter(plt.NullFormatter())  # log axes: only the grid's own tick labels
    for ax in fig.axes:
        ax.title.set_fontsize(9)
    return fig


def verdict_texts(s: Setup, sweep: AccumulationSweep, scaling: Mapping[tuple[str, int], RunResult],
                  metrics: Mapping[str, float]) -> dict[str, str]:
    """``scale``, ``measured_text`` and ``note`` for ``get_claim("C8").grade``."""
    p, m = s.settings, metrics
    graded = graded_dtype(p.dtypes)
    est = {**accumulation_estimates(s, sweep), **scaling_estimates(s, scaling)}
    fp16_note = ""
    if "fp16" in p.dtypes:
        runs = len(p.accumulation) * p.seeds
        fp16_note = (f"fp16 without master: {int(m['fp16_nomaster_diverged_runs'])}/{runs} runs diverged (charged the "
                     f"untrained loss)")
    lost = [sweep.results[run_name(graded, False, k), seed].metrics["lost_update_fraction"]
            for k in p.accumulation for seed in s.seeds]
    scale = (f"{p.n_layers}-layer GPT-2-style decoder, width {p.width} ({s.n_params / 1e6:.3f}M params), "
             f"{s.sizes.steps} AdamW updates of {p.batch_size}x{p.seq_len} bytes at lr {p.lr:g}, "
             f"accumulation {list(p.accumulation)}, weights in {' and '.join(p.dtypes)}, {p.seeds} paired seeds; "
             f"loss scaling: fp16 autocast, {s.sizes.scaling_steps} updates; {s.sizes.machine}"
             + (f" (shrunk from {p.steps} and {p.scaling_steps} updates: emulated_steps)" if s.sizes.shrunk
                else ""))
    parts = [f"{graded} master-copy loss gain {est[name].describe(3)} {where}"
             for name, where in (("master_copy_loss_gain", "at k >= 4"), ("master_copy_loss_gain_below_4",
                                                                          "at k < 4")) if name in est]
    measured = "; ".join(parts + [f"lost updates without master {np.nanmean(lost):.1%}",
                                  f"GradScaler/rule loss ratio {est['scale_rule_vs_gradscaler'].describe(4)}"])
    return {"scale": scale, "measured_text": measured, "note": fp16_note}
