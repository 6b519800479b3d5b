"""Notebook 05's experiments: MVAS on Llama (claim C7, post section 3.2) and MVAS + DGR on a ~10B model (C1).

1. **Quality and speed, trained for real** (:func:`small_llama`, :func:`first_plan`, :func:`train_variants`): a
   small Llama on the byte corpus, the same batches and initial weights for three variants trained in lock step
   (``experiments.loop.train_round_robin``): the baseline AdamW, MVAS, and MVAS + DGR. The first MVAS plan comes
   from the Fisher diagonal at initialisation (``mvas.importance_plan`` under a ``weight_bytes`` budget); the
   MVAS variants are stacked by ``macroarch.compose.apply`` with that plan (store, ``MVASSchedule`` re-planning
   every ``replan_every`` steps, DGR in sync mode with one group per layer, ``MVASAdamW``). Every variant
   computes in ``compute_dtype``; the fair baseline follows it: bf16 weights with an fp32 master copy
   (``MasterWeightAdamW``) under bf16, ``torch.optim.AdamW`` under fp32. MVAS stores its packed formats either
   way. Then each variant's held-out loss and next-token accuracy (``evaluate_lm``), median step time, and the
   bytes of its training state over one more step (``measure_step``).
2. **Memory at full size** (:func:`measure_memory`): the real architecture (Llama-65B for C7, ~10B for C1) under
   fake tensors, in bf16 whatever the CPU (the dtype the claim is about): the standard mixed-precision baseline
   against MVAS with the small model's plan carried over by tensor role (``mvas.transfer_plan``), stacked by
   ``compose.apply`` (with DGR for C1). Measured at full width at a few depths and extrapolated to full depth
   (bytes are affine in the number of identical layers; three depths check it; optionally the baseline at full
   depth too). :func:`accountings` lists the byte counts that could give the post's 320 GB.

Deviation: the post's accuracy is a downstream benchmark of Llama-65B; here it is next-token accuracy of a small
Llama on bytes, so only the gap between variants is comparable.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.figure import Figure

from macroarch import compose, mvas
from macroarch.config import DGRConfig, MacroConfig, MVASConfig, OptimConfig
from macroarch.data import ensure_corpus, eval_batches, lm_batches, load_corpus
from macroarch.experiments.hardware import describe, machine_info, torch_dtype
from macroarch.experiments.loop import Batch, TrainLog, evaluate_lm, train_round_robin
from macroarch.experiments.settings import COMPUTE_DTYPES, Settings
from macroarch.measure.memory import (
    PRECISIONS,
    STATE_CATEGORIES,
    extrapolate_by_depth,
    measure_step,
    measure_training_step,
    parameter_count,
    training_bytes,
    training_state_bytes,
)
from macroarch.measure.workload import lm_loss
from macroarch.models import get_model_spec
from macroarch.optim import MasterWeightAdamW

GB = 1e9
POST_BASELINE_GB, POST_MVAS_GB = 320, 192
MEMORY_CATEGORIES = (*STATE_CATEGORIES, "activations")
BIG_PRECISION = "bf16_mixed"
"""The full-size measurements' baseline: bf16 weights and gradients, fp32 master and moments (the claim's dtype)."""


def baseline_name(compute_dtype: str) -> str:
    """The fair AdamW baseline for a compute dtype (module docstring)."""
    return "AdamW fp32" if compute_dtype == "float32" else f"AdamW {_short(compute_dtype)} + fp32 master"


def _short(dtype: str) -> str:
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[dtype]


# ------------------------------------------------------------------------------------------ settings
@dataclass(frozen=True)
class MVASLlamaSettings(Settings):
    """Notebook 05's settings: its parameters cell, less ``profile`` (``MVASLlamaSettings.from_params(params)``)."""

    layers: int
    """Decoder layers of the small Llama."""
    width: int
    """Its model width (feed-forward: 8/3 x width, rounded down to a multiple of 32)."""
    heads: int
    """Its attention heads (as many key/value heads); must divide ``width``."""
    seq_len: int
    """Bytes per row."""
    batch_size: int
    """Rows per step."""
    steps: int
    """Training steps of every variant."""
    importance_batches: int
    """Batches of the Fisher diagonal at initialisation, for the first plan (at most ``steps``)."""
    replan_every: int
    """MVASSchedule: re-plan every K steps (the first after K)."""
    n_eval_batches: int
    """Held-out batches of the eval loss and next-token accuracy."""
    compute_dtype: str
    """float32 | bfloat16 | float16 (``auto`` resolved by ``resolve_parameters``): the small Llama computes in it."""
    device: str
    """The small Llama's device (the full-size measurements are fake CPU tensors)."""
    big_model: str
    """C7's model (Llama-65B; ci: a tiny stand-in on the same code paths)."""
    c1_model: str
    """C1's ~10B model."""
    big_seq_len: int
    """Tokens per row of the full-size step."""
    seed: int = 0
    """Initial weights, batch order, MVASAdamW's stochastic rounding."""
    corpus: str = "stdlib"
    """data/text/<corpus>."""
    lr: float = 2e-3
    """Learning rate of every variant, no weight decay."""
    weight_bytes: float = 0.9
    """MVAS budget: mean bytes per managed weight element (bf16: 2)."""
    threads: int = 1
    """Torch threads."""
    big_batch: int = 1
    """Rows of the measured full-size step."""
    depths: tuple[int, ...] = (1, 2, 3)
    """Full-width depths measured; bytes extrapolated (affine in depth) to full depth. At least two."""
    check_full_depth: bool = True
    """Also measure the baseline at full depth: the extrapolation must match it."""

    def __post_init__(self) -> None:
        self._positive("layers", "width", "heads", "seq_len", "batch_size", "steps", "importance_batches",
                       "replan_every", "n_eval_batches", "big_seq_len", "lr", "weight_bytes", "threads", "big_batch")
        self._one_of("compute_dtype", COMPUTE_DTYPES)
        self._device()
        if self.width % self.heads:
            self._fail("heads", f"a divisor of width {self.width}")
        if self.importance_batches > self.steps:
            self._fail("importance_batches", f"at most steps ({self.steps}): the plan reads the training batches")
        if len(set(self.depths)) < 2 or any(isinstance(d, bool) or not isinstance(d, int) or d < 1
                                            for d in self.depths):
            self._fail("depths", "two or more distinct positive layer counts")


# ------------------------------------------------------------------------------------------ the small Llama
@dataclass
class SmallLlama:
    """The small Llama's initial weights (in the compute dtype) and the batches every variant shares."""

    settings: MVASLlamaSettings
    initial: torch.nn.Module
    train: list[Batch]
    held_out: list[Batch]

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.initial.parameters())

    @property
    def baseline(self) -> str:
        return baseline_name(self.settings.compute_dtype)

    def describe(self) -> str:
        s = self.settings
        return (f"small Llama: {s.layers} layers x {s.width}, {self.n_params / 1e6:.2f}M parameters, "
                f"{s.compute_dtype} compute; {s.steps} steps of {s.batch_size}x{s.seq_len} bytes; eval on "
                f"{sum(len(b[0]) for b in self.held_out)} held-out windows\n"
                f"{describe(machine_info(s.device), s.compute_dtype)}")


def small_llama(settings: MVASLlamaSettings) -> SmallLlama:
    """Threads, corpus, the seeded initial model (cast to ``compute_dtype``) and the batches, on ``device``."""
    s = settings
    torch.set_num_threads(s.threads)
    text = load_corpus(ensure_corpus(s.corpus))
    spec = get_model_spec("llama_65b_tiny").scaled(n_layers=s.layers, d_model=s.width, n_heads=s.heads,
                                                    n_kv_heads=s.heads, d_ff=int(8 * s.width / 3) // 32 * 32,
                                                    max_seq_len=s.seq_len)
    torch.manual_seed(s.seed)
    initial = spec.build().to(device=s.device, dtype=torch_dtype(s.compute_dtype))

    def to_device(batches):
        return [tuple(t.to(s.device) for t in b) for b in batches]

    train = to_device(lm_batches(text.train, s.batch_size, s.seq_len, seed=s.seed, steps=s.steps))
    held_out = to_device(eval_batches(text.val, s.batch_size, s.seq_len, max_batches=s.n_eval_batches))
    return SmallLlama(s, initial, train, held_out)


def first_plan(small: SmallLlama) -> mvas.PrecisionPlan:
    """The plan at initialisation: Fisher diagonal (in fp32) over ``importance_batches`` batches, HAWQ
    sensitivity, formats by knapsack at ``weight_bytes`` per managed element."""
    s = small.settings
    probe = copy.deepcopy(small.initial).float()  # importance in fp32
    fisher = mvas.fisher_diagonal(probe, lm_loss, small.train[:s.importance_batches])
    return mvas.importance_plan(dict(small.initial.named_parameters()), fisher, weight_bytes=s.weight_bytes)


def mvas_config(settings: MVASLlamaSettings, dgr: bool) -> MacroConfig:
    """MVAS (re-planned every ``replan_every`` steps), optionally DGR (sync, one group per layer), MVASAdamW at
    the run's LR without weight decay; the plan itself is passed to ``compose.apply``."""
    return MacroConfig(optim=OptimConfig(lr=settings.lr, weight_decay=0.0),
                       mvas=MVASConfig(replan_every=settings.replan_every),
                       dgr=DGRConfig(group_size=1 if dgr else None))


@dataclass
class Training:
    """The three variants after training: their stacks, loss logs, and measured results."""

    baseline: str
    n_params: int
    steps: int
    stacks: dict[str, compose.Stack]
    logs: dict[str, TrainLog]
    results: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def metrics(self) -> dict[str, float]:
        base, mv, md = self.results[self.baseline], self.results["MVAS"], self.results["MVAS + DGR"]
        return dict(speed_ratio=base["step_s"] / mv["step_s"], accuracy_gap=base["accuracy"] - mv["accuracy"],
                    baseline_accuracy=base["accuracy"], mvas_accuracy=mv["accuracy"],
                    baseline_eval_loss=base["eval_loss"], mvas_eval_loss=mv["eval_loss"],
                    mvas_dgr_eval_loss=md["eval_loss"], mvas_dgr_accuracy=md["accuracy"],
                    mvas_dgr_speed_ratio=base["step_s"] / md["step_s"],
                    small_state_reduction=1 - mv["state_bytes"] / base["state_bytes"],
                    small_dgr_state_reduction=1 - md["state_bytes"] / base["state_bytes"],
                    replan_moves=len(self.stacks["MVAS"].schedule.history))

    def text(self) -> str:
        base = self.results[self.baseline]
        lines = [f"{'variant':<26}{'eval loss':>10}{'next-token acc':>16}{'step ms':>9}{'speed':>7}"
                 f"{'state B/param':>15}"]
        for name, r in self.results.items():
            lines.append(f"{name:<26}{r['eval_loss']:>10.4f}{r['accuracy']:>16.2%}{r['step_s'] * 1e3:>9.1f}"
                         f"{base['step_s'] / r['step_s']:>6.2f}x{r['state_bytes'] / self.n_params:>15.2f}")
        for name in ("MVAS", "MVAS + DGR"):
            changes = self.stacks[name].schedule.history
            lines.append(f"{name}: {len(changes)} tier moves in {self.steps} steps"
                         + (f", e.g. step {changes[0].step}: {changes[0].name} {changes[0].old} -> {changes[0].new}"
                            if changes else ""))
            lines.append(self.stacks[name].store.plan.describe().splitlines()[-1])
        return "\n".join(lines)


def _baseline_stack(small: SmallLlama) -> compose.Stack:
    model = copy.deepcopy(small.initial)
    lr = small.settings.lr
    if small.settings.compute_dtype == "float32":
        return compose.Stack(model, model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0))
    return compose.Stack(model, model, MasterWeightAdamW(model.parameters(), lr=lr, weight_decay=0.0))


def train_variants(small: SmallLlama, plan: mvas.PrecisionPlan, run: Any = None) -> Training:
    """Baseline, MVAS and MVAS + DGR from the same weights, trained in lock step on the same batches (progress
    bar); the MVAS schedules log their tier moves to ``run`` and every loss is logged per step. Then each
    variant's held-out loss and accuracy, median step time (warm-up of 5 steps left out) and state bytes."""
    s, example = small.settings, dict(input_ids=small.train[0][0], labels=small.train[0][1])
    stacks = {small.baseline: _baseline_stack(small)}
    for name, dgr in (("MVAS", False), ("MVAS + DGR", True)):
        stacks[name] = compose.apply(copy.deepcopy(small.initial), mvas_config(s, dgr), plan=plan,
                                     example_inputs=example if dgr else None, seed=s.seed, run=run)
    logs = train_round_robin({n: (s.model, s.optimizer) for n, s in stacks.items()}, small.train,
                             after_step={n: (lambda step, loss, s=s: s.after_step()) for n, s in stacks.items()
                                         if s.schedule is not None},
                             desc="training (one step of each in turn)", mininterval=10)
    if run is not None:
        for name, log in logs.items():
            for step, loss in enumerate(log.losses):
                run.log(step=step, **{f"{name.replace(' ', '_').replace('+', 'and')}_loss": loss})
    training = Training(small.baseline, small.n_params, s.steps, stacks, logs)
    for name, stack in stacks.items():
        ev = evaluate_lm(stack.module, small.held_out)

        def one_step(stack: compose.Stack = stack) -> None:
            lm_loss(stack.model, small.train[0]).backward()
            stack.optimizer.step()
            stack.optimizer.zero_grad(set_to_none=True)

        mem = measure_step(one_step, stack.module, stack.optimizer, *small.train[0])
        state = {k: mem.max_by_category[k] for k in STATE_CATEGORIES}
        training.results[name] = dict(eval_loss=ev.loss, accuracy=ev.accuracy, step_s=logs[name].step_time(skip=5),
                                      state_bytes=sum(state.values()), **{f"{k}_bytes": v for k, v in state.items()})
    return training


def plot_training(training: Training) -> Figure:
    """Training loss (10-step mean) of the variants; their training state in bytes per parameter."""
    fig, axes = plt.subplots(1, 2, figsize=(13, 4))
    for name, log in training.logs.items():
        axes[0].plot(np.convolve(log.losses, np.ones(10) / 10, mode="valid"), lw=1, label=name,
                     ls="--" if "DGR" in name else "-")
    axes[0].set(title="training loss (10-step mean)", xlabel="step", ylabel="loss (nats/byte)")
    axes[0].legend()
    names = list(training.results)
    bottom = np.zeros(len(names))
    for k, color in zip(STATE_CATEGORIES, ("C0", "C1", "C2", "C3")):
        vals = np.array([training.results[n][f"{k}_bytes"] / training.n_params for n in names])
        axes[1].bar(names, vals, bottom=bottom, color=color, label=k.replace("_", " "))
        bottom += vals
    axes[1].set(title=f"training state, measured (small Llama, {training.n_params / 1e6:.1f}M params)",
                ylabel="bytes per parameter")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------------------ full-size memory
@dataclass
class BigMemory:
    """Bytes by category of one training step of a full-size model: the baseline and the MVAS stack."""

    model: str
    n_params: int
    n_layers: int
    batch: int
    seq_len: int
    baseline: dict[str, int]
    mvas: dict[str, int]
    dgr: bool
    full_depth_checked: bool

    @property
    def reduction(self) -> float:
        return 1 - sum(self.mvas.values()) / sum(self.baseline.values())

    @property
    def variant(self) -> str:
        return "MVAS + DGR" if self.dgr else "MVAS"

    def text(self) -> str:
        lines = [f"baseline measured at full depth ({self.n_layers} layers) = extrapolated, to the byte"
                 ] if self.full_depth_checked else []
        lines.append(f"{self.model}: {self.n_params / 1e9:.2f}B parameters; activations of a {self.batch}x"
                     f"{self.seq_len} step: {self.baseline['activations'] / GB:.1f} GB")
        lines.append(f"{'category':<18}{'baseline GB':>12}{self.variant + ' GB':>14}")
        for k in self.baseline:
            lines.append(f"{k:<18}{self.baseline[k] / GB:>12.2f}{self.mvas[k] / GB:>14.2f}")
        lines.append(f"{'total':<18}{sum(self.baseline.values()) / GB:>12.2f}{sum(self.mvas.values()) / GB:>14.2f}"
                     f"  ({-self.reduction:+.1%})")
        return "\n".join(lines)


def mvas_prepare(plan: mvas.PrecisionPlan, dgr: bool, seed: int) -> Callable[[torch.nn.Module], tuple]:
    """``measure_training_step``'s ``prepare``: the plan carried over to the full-size model by role (each role's
    most common format, the same in every layer), stacked by ``compose.apply`` (MVASAdamW with its default LR
    and weight decay; with DGR, sync and one group per layer)."""
    def prepare(net: torch.nn.Module) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        transferred = mvas.transfer_plan(plan, net, depth="uniform")
        if not dgr:
            stack = compose.apply(net, MacroConfig(), plan=transferred, seed=seed)
        else:
            ids = torch.randint(0, 100, (1, 8))
            stack = compose.apply(net, MacroConfig(dgr=DGRConfig(group_size=1)), plan=transferred,
                                  example_inputs=dict(input_ids=ids, labels=ids), seed=seed)
        return stack.model, stack.optimizer

    prepare.__name__ = "mvas_dgr" if dgr else "mvas"
    return prepare


def measure_memory(settings: MVASLlamaSettings, plan: mvas.PrecisionPlan, model: str, *, dgr: bool = False,
                   check_full_depth: bool = False) -> BigMemory:
    """Baseline (``bf16_mixed``) and MVAS (+ DGR) bytes of one ``big_batch x big_seq_len`` step of ``model``,
    fake tensors, extrapolated from ``depths``; ``check_full_depth``: the baseline measured at full depth too
    (AssertionError if the extrapolation misses it by a byte)."""
    s = settings
    spec = get_model_spec(model)
    n_layers = spec.shape.n_layers

    def measure(prepare=None, constant=()):
        reports = {d: measure_training_step(spec.scaled(n_layers=d), s.big_batch, s.big_seq_len, BIG_PRECISION,
                                            fake=True, device="cpu", prepare=prepare) for d in s.depths}
        return extrapolate_by_depth(reports, n_layers, constant=constant)

    baseline = measure()
    if check_full_depth:
        full = training_bytes(measure_training_step(spec, s.big_batch, s.big_seq_len, BIG_PRECISION, fake=True,
                                                    device="cpu"))
        assert full == baseline, f"extrapolation {baseline} != full-depth measurement {full}"
    # with DGR the gradients are the largest group's: the same at every depth, not growing per layer
    packed = measure(mvas_prepare(plan, dgr, s.seed), constant=("gradients",) if dgr else ())
    return BigMemory(model, parameter_count(spec.shape), n_layers, s.big_batch, s.big_seq_len, baseline, packed,
                     dgr, check_full_depth)


@dataclass
class Accountings:
    """Byte counts of the full-size model that could be the post's 320 GB, and the closest."""

    bytes: dict[str, float]
    closest: str

    @property
    def match(self) -> bool:
        """Whether the closest comes within 5% of 320 GB."""
        return abs(self.bytes[self.closest] / (POST_BASELINE_GB * GB) - 1) <= 0.05

    def text(self) -> str:
        target = POST_BASELINE_GB * GB
        lines = [f"{'accounting':<46}{'GB':>9}{'vs 320 GB':>11}"]
        for name, b in self.bytes.items():
            lines.append(f"{name:<46}{b / GB:>9.1f}{b / target - 1:>+11.0%}"
                         f"{'   <- closest' if name == self.closest else ''}")
        lines.append(f"{'an accounting matches' if self.match else 'no accounting comes within 5% of'} the post's "
                     f"320 GB: the closest is '{self.closest}', {self.bytes[self.closest] / GB:.0f} GB")
        return "\n".join(lines)


def accountings(big: BigMemory) -> Accountings:
    """fp16 weights (+ grads, + activations, + 8-bit Adam), every precision policy's training state, and the
    measured baseline and MVAS totals; the closest to 320 GB among those that are not MVAS."""
    n, spec = big.n_params, get_model_spec(big.model)
    counts: dict[str, float] = {
        "weights fp16": 2 * n,
        "weights + grads fp16": 4 * n,
        "weights + grads fp16 + activations": 4 * n + big.baseline["activations"],
        "weights + grads fp16 + 8-bit Adam": 6 * n,
    }
    for name in PRECISIONS:
        counts[f"{name} training state"] = training_state_bytes(spec.shape, name)["total"]
    counts["bf16_mixed state + activations (baseline)"] = sum(big.baseline.values())
    counts["MVAS state + activations (measured)"] = sum(big.mvas.values())
    closest = min((k for k in counts if "MVAS" not in k), key=lambda k: abs(counts[k] - POST_BASELINE_GB * GB))
    return Accountings(counts, closest)


def memory_metrics(big: BigMemory, prefix: str) -> dict[str, float]:
    """``memory_reduction``, ``baseline_bytes``, ``<prefix>_bytes`` and each category of both."""
    return dict(memory_reduction=big.reduction, baseline_bytes=sum(big.baseline.values()),
                **{f"{prefix}_bytes": sum(big.mvas.values())},
                **{f"baseline_{k}_bytes": v for k, v in big.baseline.items()},
                **{f"{prefix}_{k}_bytes": v for k, v in big.mvas.items()})


def c7_memory_metrics(big: BigMemory, acc: Accountings) -> dict[str, float]:
    return dict(memory_metrics(big, "mvas"), closest_to_320_bytes=acc.bytes[acc.closest])


def c1_metrics(big: BigMemory, training: Training) -> dict[str, float]:
    base, md = training.results[training.baseline], training.results["MVAS + DGR"]
    return dict(memory_metrics(big, "mvas_dgr"), quality_gap=base["accuracy"] - md["accuracy"],
                eval_loss_gap=md["eval_loss"] - base["eval_loss"])


def plot_c7_memory(big: BigMemory) -> Figure:
    """Stacked bars of the baseline and MVAS step, with the post's 320 and 192 GB marked (labels placed on
    either side of their lines, so they never overlap)."""
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, b in enumerate((big.baseline, big.mvas)):
        left = 0.0
        for k, color in zip(MEMORY_CATEGORIES, ("C0", "C1", "C2", "C3", "C7")):
            ax.barh(i, b[k] / GB, left=left, color=color, label=k.replace("_", " ") if i == 0 else None)
            left += b[k] / GB
    for x, ha in ((POST_MVAS_GB, "right"), (POST_BASELINE_GB, "left")):
        ax.axvline(x, color="k", ls=":", lw=1)
        ax.annotate(f"post: {x} GB", (x, 1.45), xytext=(-3 if ha == "right" else 3, 0), textcoords="offset points",
                    fontsize=8, ha=ha, va="center")
    ax.set_yticks([0, 1], ["baseline", big.variant])
    ax.set(xlabel="GB", title=f"{big.model} training step ({big.n_params / 1e9:.1f}B params, {big.batch}x"
                              f"{big.seq_len}), fake tensors")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


def plot_c1_memory(big: BigMemory) -> Figure:
    """Baseline against MVAS + DGR, category by category."""
    fig, ax = plt.subplots(figsize=(7, 3.8))
    x = np.arange(len(MEMORY_CATEGORIES))
    ax.bar(x - 0.2, [big.baseline[k] / GB for k in MEMORY_CATEGORIES], 0.4, label="baseline")
    ax.bar(x + 0.2, [big.mvas[k] / GB for k in MEMORY_CATEGORIES], 0.4, label=big.variant)
    ax.set_xticks(x, [k.replace("_", "\n") for k in MEMORY_CATEGORIES])
    ax.set(ylabel="GB", title=f"{big.model} ({big.n_params / 1e9:.1f}B params): one {big.batch}x{big.seq_len} step, "
                              "fake tensors")
    ax.legend()
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------------------ verdicts
def _speed_basis(small: SmallLlama) -> str:
    info = machine_info(small.settings.device)
    return f"vs {small.baseline}, {info.get('gpu') or info['cpu_capability']}"


def c7_texts(small: SmallLlama, training: Training, big: BigMemory, acc: Accountings) -> dict[str, str]:
    """``scale``, ``measured_text`` and ``note`` for ``get_claim("C7").grade``."""
    s, m = small.settings, training.metrics
    base, mv = training.results[training.baseline], training.results["MVAS"]
    scale = (f"memory: real {big.model} architecture ({big.n_params / 1e9:.1f}B params) under fake tensors, "
             f"{BIG_PRECISION}, one {big.batch}x{big.seq_len} step; speed and accuracy: {s.layers}-layer Llama "
             f"({small.n_params / 1e6:.1f}M params), {s.steps} steps on the {s.corpus} byte corpus; "
             f"{describe(machine_info(s.device), s.compute_dtype)}")
    measured = (f"{sum(big.baseline.values()) / GB:.0f} -> {sum(big.mvas.values()) / GB:.0f} GB "
                f"({-big.reduction:+.1%}); speed {m['speed_ratio']:.2f}x ({_speed_basis(small)}); next-token "
                f"accuracy {base['accuracy']:.2%} -> {mv['accuracy']:.2%}")
    note = (f"memory baseline = bf16 weights and grads with fp32 master and Adam moments (16 B/param) plus "
            f"activations; speed and accuracy baseline = {training.baseline}; "
            f"{'the' if acc.match else 'no'} accounting of the 65B model gives the post's 320 GB (closest: "
            f"'{acc.closest}', {acc.bytes[acc.closest] / GB:.0f} GB). MVAS moves {m['replan_moves']} tensors between "
            f"tiers in {s.steps} steps; eval loss {base['eval_loss']:.4f} -> {mv['eval_loss']:.4f}; the speed "
            f"ratio depends on the hardware (a baseline in emulated bf16 is slow, so MVAS looks faster beside it)")
    return {"scale": scale, "measured_text": measured, "note": note}


def c1_texts(small: SmallLlama, training: Training, big: BigMemory) -> dict[str, str]:
    """``scale``, ``measured_text`` and ``note`` for ``get_claim("C1").grade``."""
    s = small.settings
    base, md = training.results[training.baseline], training.results["MVAS + DGR"]
    scale = (f"memory: {big.model} ({big.n_params / 1e9:.1f}B params) under fake tensors, {BIG_PRECISION}, one "
             f"{big.batch}x{big.seq_len} step; quality: {s.layers}-layer Llama ({small.n_params / 1e6:.1f}M "
             f"params), {s.steps} steps, baseline {training.baseline}; "
             f"{describe(machine_info(s.device), s.compute_dtype)}")
    measured = (f"{sum(big.baseline.values()) / GB:.0f} -> {sum(big.mvas.values()) / GB:.0f} GB "
                f"({-big.reduction:+.1%}); next-token accuracy {base['accuracy']:.2%} -> {md['accuracy']:.2%}")
    note = (f"DGR frees gradients per layer ({big.baseline['gradients'] / GB:.1f} -> {big.mvas['gradients'] / GB:.1f} "
            f"GB); most of the saving is the optimizer state (fp32 master + moments -> fp8 moments, no master)")
    return {"scale": scale, "measured_text": measured, "note": note}
