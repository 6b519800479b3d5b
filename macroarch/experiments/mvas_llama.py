"""Notebook 05's experiments: MVAS on Llama (claim C7, post section 3.2) and MVAS + DGR on a ~10B model (C1).

1. **Quality and speed, trained for real, over paired seeds** (:func:`small_llama`, :func:`first_plan`,
   :func:`train_variants`, :func:`train_seeds`): a small Llama on the byte corpus; for each seed one initial model
   and one batch order shared by three variants trained in lock step: the baseline AdamW, MVAS, and MVAS + DGR.
   Every seed's first MVAS plan comes from the Fisher diagonal of its own initial weights
   (``mvas.importance_plan`` under a ``weight_bytes`` budget); the MVAS variants are stacked by
   ``macroarch.compose.apply`` with that plan (store, ``MVASSchedule`` re-planning every ``replan_every`` steps,
   DGR in sync mode with one group per layer, ``MVASAdamW``). Every variant computes in ``compute_dtype``; the
   fair baseline follows it: bf16 weights with an fp32 master copy (``MasterWeightAdamW``) under bf16,
   ``torch.optim.AdamW`` under fp32. MVAS stores its packed formats either way. Each variant's held-out loss and
   next-token accuracy (``evaluate_lm``) on the same held-out batches for every seed; the quality gaps are taken
   per seed (``measure.stats.paired_difference``: a t interval over seeds).
   **Speed** comes from the same steps: the variants take turns in mirrored order (baseline, MVAS + DGR, MVAS on
   even steps, the reverse on odd ones), so every pair of steps is an ABBA block for any two variants; a block's
   time is its two steps' (the MVAS schedule's re-planning included), and the ratio is taken per block
   (``measure.stats.ratio_from_blocks``, a t interval on the log ratios over every seed's blocks). The bytes of
   each variant's training state over one more step (``measure_step``) come from the first seed.
2. **Memory at full size** (:func:`measure_memory`): the real architecture (Llama-65B for C7, ~10B for C1) under
   fake tensors, in bf16 whatever the CPU (the dtype the claim is about), by the planner (``macroarch.planner``):
   the standard mixed-precision baseline against MVAS with the first seed's plan carried over by tensor role
   (``macroarch.planner.roles``, as ``mvas.transfer_plan(depth="uniform")``), stacked by ``compose.apply`` (with DGR
   for C1). The graded total is the step's **measured peak** (the largest sum of live bytes at one moment), with the
   categories at that moment beside it (they sum to it), never a sum of each category's own maximum. Measured at
   full width at a few depths and extrapolated to full depth (each phase's peak and its breakdown are affine in the
   number of identical layers, and the step's peak is the largest of them; a third depth checks it; optionally the
   baseline at full depth too). :func:`accountings` lists the byte counts that could give the post's 320 GB.

Deviation: the post's accuracy is a downstream benchmark of Llama-65B; here it is next-token accuracy of a small
Llama on bytes, so only the gap between variants is comparable.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.figure import Figure

from macroarch import compose, mvas
from macroarch._progress import tqdm
from macroarch.config import DGRConfig, MacroConfig, MVASConfig, OptimConfig
from macroarch.data import ensure_corpus, eval_batches, lm_batches, load_corpus
from macroarch.experiments.loop import Batch, TrainLog, evaluate_lm, lm_step, train_round_robin
from macroarch.experiments.settings import COMPUTE_DTYPES, Settings
from macroarch.measure.machine import describe, machine_info, torch_dtype
from macroarch.measure.memory import (
    CATEGORIES,
    PRECISIONS,
    STATE_CATEGORIES,
    measure_step,
    parameter_count,
    training_state_bytes,
)
from macroarch.measure.stats import Estimate, Repeated, exact, paired_difference, ratio_from_blocks
from macroarch.measure.workload import lm_loss
from macroarch.models import get_model_spec
from macroarch.optim import MasterWeightAdamW

GB = 1e9
POST_BASELINE_GB, POST_MVAS_GB = 320, 192
POST_SPEED = 0.92
"""The post's C7 speed: 0.92x of the baseline's."""
VARIANTS = ("MVAS", "MVAS + DGR")
"""The technique variants, beside the baseline (named by the compute dtype: :func:`baseline_name`)."""
BIG_PRECISION = "bf16_mixed"
"""The full-size measurements' baseline: bf16 weights and gradients, fp32 master and moments (the claim's dtype)."""
WARMUP_BLOCKS = 2
"""Timing blocks (pairs of steps) of each seed left out of the speed ratio: allocation, lazy state, first kernels."""
COLORS = {"parameters": "C0", "gradients": "C1", "optimizer_state": "C2", "master_weights": "C3",
          "activations": "C7", "temporaries": "C5", "other": "C8"}


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
    """Training steps of every variant and seed."""
    seeds: int
    """Paired seeds ``seed, seed + 1, ...``: each gives all three variants one initialisation and batch order."""
    importance_batches: int
    """Batches of the Fisher diagonal at initialisation, for the first plan (at most ``steps``)."""
    replan_every: int
    """MVASSchedule: re-plan every K steps (the first after K)."""
    n_eval_batches: int
    """Held-out batches of the eval loss and next-token accuracy (the same for every seed)."""
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
    """The first seed (initial weights, batch order, MVASAdamW's stochastic rounding)."""
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
    depths: tuple[int, ...] = (2, 3, 4)
    """Full-width depths measured (``macroarch.planner.plan``'s ``depths``): each phase's peak extrapolated (affine
    in depth) from the first two to full depth, checked on the others to the byte; a model no deeper is measured
    whole. From 2 layers on each phase's peak falls at the same point of the step (at 1 it does not)."""
    check_full_depth: bool = True
    """Also measure the baseline at full depth: the extrapolation must match it."""

    def __post_init__(self) -> None:
        self._positive("layers", "width", "heads", "seq_len", "batch_size", "steps", "seeds", "importance_batches",
                       "replan_every", "n_eval_batches", "big_seq_len", "lr", "weight_bytes", "threads", "big_batch")
        self._one_of("compute_dtype", COMPUTE_DTYPES)
        self._device()
        if self.width % self.heads:
            self._fail("heads", f"a divisor of width {self.width}")
        if self.importance_batches > self.steps:
            self._fail("importance_batches", f"at most steps ({self.steps}): the plan reads the training batches")
        if self.steps < 2 * (WARMUP_BLOCKS + 1):
            self._fail("steps", f"at least {2 * (WARMUP_BLOCKS + 1)}: pairs of steps are the timing blocks, and "
                                f"the first {WARMUP_BLOCKS} are warm-up")
        if (len(self.depths) < 2 or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in self.depths)
                or list(self.depths) != sorted(set(self.depths))):
            self._fail("depths", "two or more increasing positive layer counts")

    @property
    def seed_list(self) -> tuple[int, ...]:
        return tuple(range(self.seed, self.seed + self.seeds))


# ------------------------------------------------------------------------------------------ the small Llama
@dataclass
class SmallLlama:
    """One seed's initial weights (in the compute dtype) and the batches every variant shares."""

    settings: MVASLlamaSettings
    initial: torch.nn.Module
    train: list[Batch]
    held_out: list[Batch]
    seed: int = 0

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.initial.parameters())

    @property
    def baseline(self) -> str:
        return baseline_name(self.settings.compute_dtype)

    def describe(self) -> str:
        s = self.settings
        return (f"small Llama: {s.layers} layers x {s.width}, {self.n_params / 1e6:.2f}M parameters, "
                f"{s.compute_dtype} compute; {s.steps} steps of {s.batch_size}x{s.seq_len} bytes per seed, "
                f"{s.seeds} paired seeds ({s.seed}..{s.seed + s.seeds - 1}); eval on "
                f"{sum(len(b[0]) for b in self.held_out)} held-out windows (the same for every seed)\n"
                f"{describe(machine_info(s.device), s.compute_dtype)}")


def small_llama(settings: MVASLlamaSettings, seed: int | None = None) -> SmallLlama:
    """Threads, corpus, the initial model of ``seed`` (default ``settings.seed``; cast to ``compute_dtype``), its
    training batches (order from ``seed``) and the held-out batches (the same for every seed), on ``device``."""
    s = settings
    seed = s.seed if seed is None else seed
    torch.set_num_threads(s.threads)
    text = load_corpus(ensure_corpus(s.corpus))
    spec = get_model_spec("llama_65b_tiny").scaled(n_layers=s.layers, d_model=s.width, n_heads=s.heads,
                                                    n_kv_heads=s.heads, d_ff=int(8 * s.width / 3) // 32 * 32,
                                                    max_seq_len=s.seq_len)
    torch.manual_seed(seed)
    initial = spec.build().to(device=s.device, dtype=torch_dtype(s.compute_dtype))

    def to_device(batches):
        return [tuple(t.to(s.device) for t in b) for b in batches]

    train = to_device(lm_batches(text.train, s.batch_size, s.seq_len, seed=seed, steps=s.steps))
    held_out = to_device(eval_batches(text.val, s.batch_size, s.seq_len, max_batches=s.n_eval_batches))
    return SmallLlama(s, initial, train, held_out, seed)


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


# ------------------------------------------------------------------------------------------ training, per seed
@dataclass
class SeedRun:
    """One seed's three variants after training: their stacks, loss and step-time logs, and held-out results."""

    seed: int
    stacks: dict[str, compose.Stack]
    logs: dict[str, TrainLog]
    results: dict[str, dict[str, float]]
    """Per variant: ``eval_loss`` (nats/byte) and ``accuracy`` (next-token, a fraction) on the held-out batches."""

    def blocks(self, variant: str) -> np.ndarray:
        """Seconds of each timing block (two consecutive steps: one in each order), warm-up blocks left out."""
        t = np.asarray(self.logs[variant].seconds, dtype=float)
        pairs = t[:len(t) // 2 * 2].reshape(-1, 2).sum(axis=1)
        return pairs[WARMUP_BLOCKS:]


@dataclass
class Training:
    """Every seed's run of the three variants, the first seed's training-state bytes, and the graded estimates."""

    baseline: str
    n_params: int
    steps: int
    runs: list[SeedRun] = field(default_factory=list)
    state_bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    """The first seed's, per variant: bytes of each state category over one more step (each category's maximum)."""

    @property
    def names(self) -> tuple[str, ...]:
        return (self.baseline, *VARIANTS)

    @property
    def seeds(self) -> list[int]:
        return [r.seed for r in self.runs]

    def per_seed(self, variant: str, key: str) -> np.ndarray:
        """``results[variant][key]`` of every seed, in seed order."""
        return np.array([r.results[variant][key] for r in self.runs])

    def block_times(self, variant: str) -> np.ndarray:
        """Every seed's timing blocks of ``variant``, seed after seed (:meth:`SeedRun.blocks`)."""
        return np.concatenate([r.blocks(variant) for r in self.runs])

    def accuracy_repeated(self, variant: str) -> Repeated:
        """The per-seed accuracies of ``variant`` and the baseline, and the build of :meth:`accuracy_gap` from them
        (``claims.regrade_leaving_out`` leaves a seed out of both)."""
        return Repeated(paired_difference, (tuple(self.per_seed(variant, "accuracy")),
                                            tuple(self.per_seed(self.baseline, "accuracy"))), "seeds")

    def speed_repeated(self, variant: str) -> Repeated:
        """Every timing block's seconds of the baseline and of ``variant``, and the build of :meth:`speed_ratio`."""
        return Repeated(ratio_from_blocks, (tuple(self.block_times(self.baseline)), tuple(self.block_times(variant))),
                        "blocks")

    def accuracy_gap(self, variant: str) -> Estimate:
        """Next-token accuracy lost (baseline - ``variant``, a fraction), taken per seed: paired t over seeds."""
        return self.accuracy_repeated(variant).estimate()

    def eval_loss_gap(self, variant: str) -> Estimate:
        """Held-out loss gained (``variant`` - baseline, nats/byte), taken per seed: paired t over seeds."""
        return paired_difference(self.per_seed(self.baseline, "eval_loss"), self.per_seed(variant, "eval_loss"),
                                 unit="nats/byte")

    def speed_ratio(self, variant: str) -> Estimate:
        """Baseline seconds / ``variant`` seconds per timing block (above 1: the variant is faster), over every
        seed's blocks: geometric mean, t interval on the log ratios."""
        return self.speed_repeated(variant).estimate()

    def estimates(self) -> dict[str, Estimate]:
        """C7's graded ``accuracy_gap`` and ``speed_ratio`` (MVAS), its ``eval_loss_gap``, and the same three of
        MVAS + DGR (``mvas_dgr_*``; C1's quality gap is ``mvas_dgr_accuracy_gap``)."""
        out = {}
        for name, prefix in (("MVAS", ""), ("MVAS + DGR", "mvas_dgr_")):
            out |= {f"{prefix}accuracy_gap": self.accuracy_gap(name), f"{prefix}speed_ratio": self.speed_ratio(name),
                    f"{prefix}eval_loss_gap": self.eval_loss_gap(name)}
        return out

    @property
    def metrics(self) -> dict[str, float]:
        """Plain numbers beside the estimates: means over seeds, the first seed's state reductions, tier moves."""
        out: dict[str, float] = dict(seeds=len(self.runs), timing_blocks=len(self.block_times(self.baseline)))
        for name, key in zip(self.names, ("baseline", "mvas", "mvas_dgr")):
            out |= {f"{key}_accuracy": float(self.per_seed(name, "accuracy").mean()),
                    f"{key}_eval_loss": float(self.per_seed(name, "eval_loss").mean()),
                    f"{key}_step_s": float(np.median(self.block_times(name)) / 2)}
        if self.state_bytes:
            base = sum(self.state_bytes[self.baseline].values())
            out |= dict(small_state_reduction=1 - sum(self.state_bytes["MVAS"].values()) / base,
                        small_dgr_state_reduction=1 - sum(self.state_bytes["MVAS + DGR"].values()) / base)
        out["replan_moves"] = float(np.mean([len(r.stacks["MVAS"].schedule.history) for r in self.runs]))
        return out

    def seed_rows(self) -> list[dict[str, float]]:
        """One row per seed and variant: the raw pairs behind the quality gaps (for leaving a seed out)."""
        return [dict(seed=r.seed, variant=name, accuracy=r.results[name]["accuracy"],
                     eval_loss=r.results[name]["eval_loss"],
                     tier_moves=len(r.stacks[name].schedule.history) if r.stacks[name].schedule else 0)
                for r in self.runs for name in self.names]

    def block_rows(self) -> list[dict[str, float]]:
        """One row per timing block: its seed and each variant's seconds (the raw blocks behind the speed ratios)."""
        rows = []
        for r in self.runs:
            times = {name: r.blocks(name) for name in self.names}
            rows += [dict(seed=r.seed, block=WARMUP_BLOCKS + j, **{name: float(times[name][j]) for name in self.names})
                     for j in range(len(times[self.baseline]))]
        return rows

    def text(self) -> str:
        est, m = self.estimates(), self.metrics
        lines = [f"{len(self.runs)} paired seeds x {self.steps} steps; means over seeds, speed over "
                 f"{m['timing_blocks']} ABBA blocks",
                 f"{'variant':<26}{'eval loss':>10}{'next-token acc':>16}{'step ms':>9}{'state B/param':>15}"]
        for name, key in zip(self.names, ("baseline", "mvas", "mvas_dgr")):
            state = sum(self.state_bytes[name].values()) / self.n_params if self.state_bytes else float("nan")
            lines.append(f"{name:<26}{m[f'{key}_eval_loss']:>10.4f}{m[f'{key}_accuracy']:>16.2%}"
                         f"{m[f'{key}_step_s'] * 1e3:>9.1f}{state:>15.2f}")
        for name, prefix in (("MVAS", ""), ("MVAS + DGR", "mvas_dgr_")):
            lines.append(f"{name}: accuracy gap (baseline - it) {_gap(est[prefix + 'accuracy_gap'])}; speed "
                         f"{est[prefix + 'speed_ratio'].describe(3)}; eval loss gap "
                         f"{est[prefix + 'eval_loss_gap'].describe(3)}")
        first = self.runs[0]
        for name in VARIANTS:
            changes = first.stacks[name].schedule.history
            lines.append(f"{name} (seed {first.seed}): {len(changes)} tier moves in {self.steps} steps"
                         + (f", e.g. step {changes[0].step}: {changes[0].name} {changes[0].old} -> {changes[0].new}"
                            if changes else ""))
            lines.append(first.stacks[name].store.plan.describe().splitlines()[-1])
        return "\n".join(lines)


def _gap(e: Estimate) -> str:
    """An accuracy gap as graded (a fraction: :meth:`Estimate.describe`), then in percentage points."""
    points = f"{e.value * 100:+.2f}" + (f" [{e.low * 100:+.2f}, {e.high * 100:+.2f}]" if e.has_interval else "")
    return f"{e.describe(3)} = {points} points"


def _baseline_stack(small: SmallLlama) -> compose.Stack:
    model = copy.deepcopy(small.initial)
    lr = small.settings.lr
    if small.settings.compute_dtype == "float32":
        return compose.Stack(model, model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0))
    return compose.Stack(model, model, MasterWeightAdamW(model.parameters(), lr=lr, weight_decay=0.0))


def _train_mirrored(stacks: Mapping[str, compose.Stack], batches: Sequence[Batch], desc: str) -> dict[str, TrainLog]:
    """One step of each stack in turn on every batch (``train_round_robin``), in ``stacks`` order on even steps and
    reversed on odd ones, so each pair of steps is an ABBA block for any two stacks; each step's time includes the
    stack's ``after_step`` (the MVAS schedule and its re-planning are part of what MVAS costs)."""
    after = {id(s.model): s.after_step for s in stacks.values()}

    def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Batch) -> float:
        loss = lm_step(model, optimizer, batch)
        after[id(model)]()
        return loss

    names = list(stacks)
    logs = {name: TrainLog() for name in names}
    for i, batch in enumerate(tqdm(batches, desc=desc, mininterval=10)):
        order = names if i % 2 == 0 else names[::-1]
        one = train_round_robin({n: (stacks[n].model, stacks[n].optimizer) for n in order}, [batch], step=step)
        for name in names:
            logs[name].losses += one[name].losses
            logs[name].seconds += one[name].seconds
    return logs


def train_variants(small: SmallLlama, plan: mvas.PrecisionPlan, run: Any = None) -> SeedRun:
    """Baseline, MVAS and MVAS + DGR of one seed from the same weights, trained in mirrored lock step on the same
    batches (:func:`_train_mirrored`; a progress bar); the MVAS schedules log their tier moves to ``run`` and
    every loss is logged per step. Then each variant's held-out loss and accuracy."""
    s, example = small.settings, dict(input_ids=small.train[0][0], labels=small.train[0][1])
    stacks = {small.baseline: _baseline_stack(small)}
    for name, dgr in (("MVAS + DGR", True), ("MVAS", False)):  # baseline and MVAS (C7's pair) at the ends
        stacks[name] = compose.apply(copy.deepcopy(small.initial), mvas_config(s, dgr), plan=plan,
                                     example_inputs=example if dgr else None, seed=small.seed, run=run)
    logs = _train_mirrored(stacks, small.train, f"seed {small.seed}: the three variants in turn, mirrored")
    if run is not None:
        for name, log in logs.items():
            key = name.replace(" ", "_").replace("+", "and")
            for step, loss in enumerate(log.losses):
                run.log(step=step, **{f"seed{small.seed}_{key}_loss": loss})
    names = (small.baseline, *VARIANTS)
    results = {}
    for name in names:
        ev = evaluate_lm(stacks[name].module, small.held_out)
        results[name] = dict(eval_loss=ev.loss, accuracy=ev.accuracy)
    return SeedRun(small.seed, {n: stacks[n] for n in names}, {n: logs[n] for n in names}, results)


def state_bytes(small: SmallLlama, stack: compose.Stack) -> dict[str, int]:
    """Each training-state category's maximum over one more step of ``stack`` (``measure_step``)."""
    def one_step() -> None:
        lm_loss(stack.model, small.train[0]).backward()
        stack.optimizer.step()
        stack.optimizer.zero_grad(set_to_none=True)

    mem = measure_step(one_step, stack.module, stack.optimizer, *small.train[0])
    return {k: mem.max_by_category[k] for k in STATE_CATEGORIES}


def train_seeds(small: SmallLlama, plan: mvas.PrecisionPlan, run: Any = None, *,
                build: Callable[[int], SmallLlama] | None = None) -> Training:
    """:func:`train_variants` for every seed of ``small.settings`` (``small`` and ``plan`` are the first seed's;
    each further seed gets its own model and batches from ``build(seed)``, default :func:`small_llama`, and its own
    :func:`first_plan`), and the first seed's training-state bytes per variant."""
    s = small.settings
    build = build or (lambda seed: small_llama(s, seed))
    training = Training(small.baseline, small.n_params, s.steps)
    for seed in s.seed_list:
        seed_small = small if seed == small.seed else build(seed)
        seed_plan = plan if seed == small.seed else first_plan(seed_small)
        training.runs.append(train_variants(seed_small, seed_plan, run))
        if seed == small.seed:
            training.state_bytes = {n: state_bytes(small, st) for n, st in training.runs[-1].stacks.items()}
    return training


# ------------------------------------------------------------------------------------------ full-size memory
@dataclass
class BigMemory:
    """One training step of a full-size model, baseline against the MVAS stack: each one's measured peak (live
    bytes at the step's fullest moment) and the categories at that moment (they sum to it)."""

    model: str
    n_params: int
    n_layers: int
    batch: int
    seq_len: int
    baseline_peak: int
    mvas_peak: int
    baseline: dict[str, int]
    mvas: dict[str, int]
    dgr: bool
    full_depth_checked: bool
    depths: tuple[int, ...] = ()
    """The layer counts measured and extrapolated from (empty: the whole model was measured)."""

    @property
    def reduction(self) -> float:
        """1 - MVAS peak / baseline peak: an exact byte ratio."""
        return 1 - self.mvas_peak / self.baseline_peak

    @property
    def variant(self) -> str:
        return "MVAS + DGR" if self.dgr else "MVAS"

    @property
    def how(self) -> str:
        """How the peaks were measured, in a few words."""
        if not self.depths:
            return "the whole model"
        return (f"{', '.join(map(str, self.depths[:2]))} of {self.n_layers} layers, extrapolated (checked at "
                f"{', '.join(map(str, self.depths[2:]))})" if len(self.depths) > 2 else
                f"{', '.join(map(str, self.depths))} of {self.n_layers} layers, extrapolated")

    def text(self) -> str:
        lines = [f"baseline measured at full depth ({self.n_layers} layers) = extrapolated, peak and breakdown, to "
                 f"the byte"] if self.full_depth_checked else []
        lines.append(f"{self.model}: {self.n_params / 1e9:.2f}B parameters; one {self.batch}x{self.seq_len} step, "
                     f"fake tensors ({self.how}); GB at each one's measured peak, by category (they sum to it)")
        lines.append(f"{'category':<18}{'baseline GB':>12}{self.variant + ' GB':>14}")
        for k in CATEGORIES:
            lines.append(f"{k:<18}{self.baseline[k] / GB:>12.2f}{self.mvas[k] / GB:>14.2f}")
        lines.append(f"{'peak (graded)':<18}{self.baseline_peak / GB:>12.2f}{self.mvas_peak / GB:>14.2f}"
                     f"  ({-self.reduction:+.1%})")
        return "\n".join(lines)


def _measured(c: Any) -> Any:
    """A planned combination's bytes as measured (CPU kernels, no GPU-kernel correction); raises if it failed."""
    if c.error is not None or c.measured is None:
        raise RuntimeError(f"the planner could not measure {c.name}: {c.error or c.how}")
    return c.measured


def measure_memory(settings: MVASLlamaSettings, plan: mvas.PrecisionPlan, model: str, *, dgr: bool = False,
                   check_full_depth: bool = False) -> BigMemory:
    """Baseline (``bf16_mixed``: ``MasterWeightAdamW``) and MVAS (+ DGR, groups of one layer) peaks of one
    ``big_batch x big_seq_len`` step of ``model``, fake tensors, by the planner (``macroarch.planner.plan``, eager
    attention as ``ModelSpec.build``): ``plan`` carried over to the full-size model by role
    (``macroarch.planner.roles``: each role's most common format, the same in every layer), each measured at
    ``depths`` layers (under DGR shifted up to start at 2) and extrapolated, phase by phase, to the full depth (a
    third depth checks it to the byte); a model no deeper than the depths is measured whole. ``check_full_depth``:
    the baseline measured at full depth too (AssertionError if the extrapolation misses its peak or breakdown by a
    byte)."""
    from macroarch.planner import plan as plan_step
    from macroarch.planner.models import resolve
    from macroarch.planner.roles import rules_from_plan
    from macroarch.planner.run import StepCache

    s = settings
    spec = get_model_spec(model)
    n_layers = spec.shape.n_layers
    # with DGR from 2 layers: at 1 there is one group, nothing is freed before its update, the peak falls elsewhere
    shift = max(0, 2 - min(s.depths)) if dgr else 0
    depths = tuple(d + shift for d in s.depths)
    depths = depths if max(depths) < n_layers else ()
    m, cache = resolve(model, attention="eager"), StepCache()
    variant = "mvas+dgr" if dgr else "mvas"
    planned = plan_step(m, s.big_batch, s.big_seq_len, dtype=BIG_PRECISION, depths=depths, cache=cache,
                        combinations=[variant], policy={"mvas": {"precision_policy": rules_from_plan(plan)}},
                        group_size=1)
    base, packed = (planned.combination(n) for n in ("plain", variant))
    for c in (base, packed):
        _measured(c)
        if c.depths != depths:
            raise AssertionError(f"{model} {c.name}: the extrapolation from {depths} was refused ({c.how})")
    checked = check_full_depth and bool(depths)
    if checked:
        full = _measured(plan_step(m, s.big_batch, s.big_seq_len, dtype=BIG_PRECISION, depths=(), cache=cache,
                                   combinations=["plain"]).combination("plain"))
        got = base.measured
        assert (full.peak, full.at_peak) == (got.peak, got.at_peak), \
            f"extrapolation {got.peak} {got.at_peak} != full-depth measurement {full.peak} {full.at_peak}"
    return BigMemory(model, parameter_count(spec.shape), n_layers, s.big_batch, s.big_seq_len, base.measured.peak,
                     packed.measured.peak, dict(base.measured.at_peak), dict(packed.measured.at_peak), dgr, checked,
                     depths)


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
    """fp16 weights (+ grads, + the activations at the baseline's peak, + 8-bit Adam), every precision policy's
    training state, and the measured baseline and MVAS peaks; the closest to 320 GB among those not MVAS."""
    n, spec = big.n_params, get_model_spec(big.model)
    counts: dict[str, float] = {
        "weights fp16": 2 * n,
        "weights + grads fp16": 4 * n,
        "weights + grads fp16 + activations": 4 * n + big.baseline["activations"],
        "weights + grads fp16 + 8-bit Adam": 6 * n,
    }
    for name in PRECISIONS:
        counts[f"{name} training state"] = training_state_bytes(spec.shape, name)["total"]
    counts["bf16_mixed step peak (baseline, measured)"] = big.baseline_peak
    counts["MVAS step peak (measured)"] = big.mvas_peak
    closest = min((k for k in counts if "MVAS" not in k), key=lambda k: abs(counts[k] - POST_BASELINE_GB * GB))
    return Accountings(counts, closest)


def memory_metrics(big: BigMemory, prefix: str) -> dict[str, float]:
    """``baseline_bytes`` and ``<prefix>_bytes`` (the measured peaks) and each category at them."""
    return dict(baseline_bytes=big.baseline_peak, **{f"{prefix}_bytes": big.mvas_peak},
                **{f"baseline_{k}_bytes": v for k, v in big.baseline.items()},
                **{f"{prefix}_{k}_bytes": v for k, v in big.mvas.items()})


def c7_memory_metrics(big: BigMemory, acc: Accountings) -> dict[str, float]:
    return dict(memory_metrics(big, "mvas"), closest_to_320_bytes=acc.bytes[acc.closest])


def c7_estimates(training: Training, big: BigMemory) -> dict[str, Estimate]:
    """What C7 is graded on: ``memory_reduction`` (an exact byte ratio of measured peaks), ``speed_ratio`` and
    ``accuracy_gap`` (MVAS; paired seeds and ABBA blocks), with the eval-loss gap and MVAS + DGR's beside them."""
    return {"memory_reduction": exact(big.reduction), **training.estimates()}


def c1_estimates(training: Training, big: BigMemory) -> dict[str, Estimate]:
    """What C1 is graded on: ``memory_reduction`` of MVAS + DGR (exact, measured peaks) and ``quality_gap`` (the
    accuracy lost by MVAS + DGR, paired seeds), with its eval-loss gap and speed ratio beside them."""
    return {"memory_reduction": exact(big.reduction), "quality_gap": training.accuracy_gap("MVAS + DGR"),
            "eval_loss_gap": training.eval_loss_gap("MVAS + DGR"), "speed_ratio": training.speed_ratio("MVAS + DGR")}


def c7_repeated(training: Training) -> dict[str, Repeated]:
    """C7's graded numbers that rest on repetitions, as raw data and builds (``Run.leave_one_out``): the accuracy
    gap over seeds and the speed ratio over ABBA blocks (the memory reduction is an exact count: fixed)."""
    return {"accuracy_gap": training.accuracy_repeated("MVAS"), "speed_ratio": training.speed_repeated("MVAS")}


def c1_repeated(training: Training) -> dict[str, Repeated]:
    """C1's quality gap (MVAS + DGR) over seeds, as raw data and its build (the memory reduction is fixed)."""
    return {"quality_gap": training.accuracy_repeated("MVAS + DGR")}


# ------------------------------------------------------------------------------------------ figures
# Each figure is laid out for the report's page (the report's ``figure_problems`` check): at most 8 in wide with
# text of 8 pt or more, legends below their axes. The targets drawn are the registry's, passed in by the notebook
# (``get_claim("C7").target_for("speed_ratio")``: anything with the target's ``lo``, ``hi`` and ``no_effect``);
# harnesses do not import the grader.
FONT = 8
"""The smallest text of these figures, in points: 8 pt prints at 6.7 pt in an 8 in figure scaled to the page."""


def plot_estimate(ax: plt.Axes, samples: Sequence[float], est: Estimate, *, scale: float, color: str,
                  label: str, boundary: float, good_side: int, boundary_text: str, ylabel: str,
                  reference: float | None = None, xlabel: str = "") -> None:
    """One graded estimate on ``ax``: its repetitions' values (dots, jittered; times ``scale``, as the axis is
    labelled), the estimate with its interval (a diamond with caps), the target's ``boundary`` (dashed) with the
    side that grades reproduced shaded (``good_side`` +1: above it, -1: below), and an optional ``reference``
    line (no effect). The x axis has no ticks (the dots are jittered); ``xlabel`` names what they are. Notebook 11
    draws its recall gap with it too."""
    rng = np.random.default_rng(0)
    y = np.asarray(samples, dtype=float) * scale
    ax.scatter(rng.uniform(-0.12, 0.12, len(y)), y, s=10 if len(y) > 20 else 22, color=color, alpha=0.45,
               lw=0, label=f"{label} (n={len(y)})")
    lo, hi = (est.low, est.high) if est.has_interval else (est.value, est.value)
    ax.errorbar([0.35], [est.value * scale], yerr=[[(est.value - lo) * scale], [(hi - est.value) * scale]],
                fmt="D", color="k", ms=6, capsize=6, lw=1.5,
                label=f"estimate, {est.confidence:.0%} interval" if est.has_interval else "estimate (no interval)")
    span = [*y, lo * scale, hi * scale, boundary * scale] + ([reference * scale] if reference is not None else [])
    pad = 0.15 * (max(span) - min(span) or 1.0)
    bottom, top = min(span) - pad, max(span) + pad
    ax.axhline(boundary * scale, color="C2", ls="--", lw=1.2, label=boundary_text)
    ax.axhspan(*((boundary * scale, top) if good_side > 0 else (bottom, boundary * scale)), color="C2", alpha=0.08,
               label="graded side: reproduced")
    if reference is not None:
        ax.axhline(reference * scale, color="0.4", lw=0.8, ls=":", label="no effect")
    ax.set(xlim=(-0.5, 0.8), ylim=(bottom, top), xticks=[], ylabel=ylabel)
    if xlabel:
        ax.set_xlabel(xlabel)


def _legend_below(ax: plt.Axes, ncol: int = 1, offset: float = 0.04) -> None:
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -offset), ncol=ncol, fontsize=FONT, frameon=False)


def _wrap(name: str) -> str:
    """A variant's name on two lines where it is long (tick labels side by side)."""
    return name.replace(" + fp32", "\n+ fp32")


def plot_training(training: Training) -> Figure:
    """Training loss (10-step mean, mean over seeds) of the variants; their training state in bytes per parameter
    (the first seed's, measured), stacked by the categories that hold any bytes, each total written over its bar."""
    fig, axes = plt.subplots(1, 2, figsize=(7.5, 4.2), layout="constrained")
    window = min(10, max(1, training.steps // 4))
    for name in training.names:
        losses = np.mean([r.logs[name].losses for r in training.runs], axis=0)
        axes[0].plot(np.arange(window, len(losses) + 1), np.convolve(losses, np.ones(window) / window, "valid"),
                     lw=1, label=name, ls="--" if "DGR" in name else "-")
    axes[0].set(title=f"training loss, mean of {len(training.runs)} seeds", xlabel="step",
                ylabel=f"loss (nats/byte, {window}-step mean)")
    _legend_below(axes[0], offset=0.16)
    names = list(training.names)
    per_param = {k: np.array([training.state_bytes[n][k] / training.n_params for n in names])
                 for k in STATE_CATEGORIES}
    bottom = np.zeros(len(names))
    for k, vals in per_param.items():
        if vals.any():  # a category no variant holds (a master copy under fp32) gets no legend entry
            axes[1].bar([_wrap(n) for n in names], vals, bottom=bottom, color=COLORS[k], label=k.replace("_", " "))
            bottom += vals
    for i, total in enumerate(bottom):
        axes[1].annotate(f"{total:.2f}", (i, total), xytext=(0, 2), textcoords="offset points", ha="center",
                         va="bottom", fontsize=FONT)
    axes[1].set_ylim(0, bottom.max() * 1.18)  # room for the totals above the tallest bar
    axes[1].set(title=f"training state (seed {training.seeds[0]}, {training.n_params / 1e6:.2f}M params)",
                ylabel="bytes per parameter, measured", xlabel="variant")
    axes[1].tick_params(axis="x", labelsize=FONT)
    _legend_below(axes[1], ncol=2, offset=0.3)
    for ax in axes:
        ax.title.set_fontsize(9)
    return fig


def _accuracy_panel(ax: plt.Axes, training: Training, variant: str, claim: str, target: Any) -> None:
    """The accuracy gap of ``variant`` per paired seed, its estimate and interval, and ``target.hi`` (the post's
    margin; reproduced at or below it)."""
    gaps = training.per_seed(training.baseline, "accuracy") - training.per_seed(variant, "accuracy")
    plot_estimate(ax, gaps, training.accuracy_gap(variant), scale=100, color="C3" if "DGR" in variant else "C1",
                  label="paired seeds", boundary=target.hi, good_side=-1, reference=0.0,
                  boundary_text=f"post's margin: {target.hi * 100:g} points", xlabel="seeds (jittered), estimate",
                  ylabel="accuracy lost (percentage points)")
    ax.set_title(f"{claim}: next-token accuracy,\nbaseline - {variant}, per seed", fontsize=9)
    _legend_below(ax, offset=0.1)


def plot_c7_quality_speed(training: Training, accuracy_target: Any, speed_target: Any) -> Figure:
    """C7's graded quality and speed: the accuracy gap per paired seed with its interval against the post's margin
    (``accuracy_target``: the registry's ``accuracy_gap`` target); the speed ratio per ABBA block with its interval
    against the post's 0.92x less its tolerance (``speed_target``: ``speed_ratio``'s)."""
    fig, axes = plt.subplots(1, 2, figsize=(7.5, 5.4), layout="constrained")
    _accuracy_panel(axes[0], training, "MVAS", "C7", accuracy_target)
    ratios = training.block_times(training.baseline) / training.block_times("MVAS")
    plot_estimate(axes[1], ratios, training.speed_ratio("MVAS"), scale=1.0, color="C0", label="ABBA blocks",
                  boundary=speed_target.lo, good_side=1, reference=1.0, xlabel="blocks (jittered), estimate",
                  boundary_text=f"post's {POST_SPEED:g}x less {1 - speed_target.lo / POST_SPEED:.0%}: "
                                f"{speed_target.lo:.3f}x",
                  ylabel="speed ratio: baseline s / MVAS s (x)")
    axes[1].set_title("C7: speed per ABBA block\n(above 1: MVAS faster)", fontsize=9)
    _legend_below(axes[1], offset=0.1)
    return fig


def _memory_bars(ax: plt.Axes, big: BigMemory) -> None:
    """Horizontal bars of both peaks, stacked by category at the peak (categories that hold no bytes left out of the
    legend), each total in its row's label (text beside a bar would run into the lines drawn over the axis)."""
    for i, b in enumerate((big.baseline, big.mvas)):
        left = 0.0
        for k in CATEGORIES:
            ax.barh(i, b[k] / GB, left=left, color=COLORS[k], height=0.6,
                    label=k.replace("_", " ") if i == 0 and any(m[k] for m in (big.baseline, big.mvas)) else None)
            left += b[k] / GB
    ax.set_yticks([0, 1], [f"baseline\n(bf16 + fp32\nmaster, Adam)\npeak {big.baseline_peak / GB:.4g} GB",
                           f"{big.variant}\npeak {big.mvas_peak / GB:.4g} GB"])
    ax.set_xlim(0, big.baseline_peak / GB * 1.1)
    ax.set(xlabel="GB at the step's measured peak, by category", ylabel="training stack")


def _reduction_target(ax: plt.Axes, big: BigMemory, target: Any) -> None:
    """The peak at which ``target`` (a reduction of at least ``target.lo``) is reached: a dashed line, in the legend."""
    x = big.baseline_peak * (1 - target.lo) / GB
    ax.axvline(x, color="C2", ls="--", lw=1.2, label=f"graded: at least -{target.lo:.0%} = {x:.4g} GB")


def plot_c7_memory(big: BigMemory, memory_target: Any) -> Figure:
    """Both measured peaks, stacked by category at the peak; the post's 320 and 192 GB (where the model is at the
    post's scale, not a stand-in) and the graded reduction (``memory_target``: the registry's ``memory_reduction``) as
    lines named in the legend; the measured reduction in the title."""
    fig, ax = plt.subplots(figsize=(7.5, 4.4), layout="constrained")
    _memory_bars(ax, big)
    if big.baseline_peak >= POST_MVAS_GB * GB:  # a stand-in far below the post's scale: its lines would hide the bars
        ax.set_xlim(0, max(ax.get_xlim()[1], POST_BASELINE_GB * 1.15))  # both of the post's lines on the axis
        ax.axvline(POST_BASELINE_GB, color="k", ls=":", lw=1, label=f"post: baseline {POST_BASELINE_GB} GB")
        ax.axvline(POST_MVAS_GB, color="k", ls="-.", lw=1, label=f"post: MVAS {POST_MVAS_GB} GB")
    _reduction_target(ax, big, memory_target)
    ax.set_title(f"{big.model} training step ({big.n_params / 1e9:.1f}B params, {big.batch}x{big.seq_len}), fake "
                 f"tensors:\nmeasured peak {-big.reduction:+.1%} (exact; graded: at least -{memory_target.lo:.0%})",
                 fontsize=9)
    _legend_below(ax, ncol=3, offset=0.13)
    return fig


def plot_c1(big: BigMemory, training: Training, memory_target: Any, quality_target: Any) -> Figure:
    """C1's two graded numbers: both measured peaks of the ~10B step, stacked by category, with the post's
    reduction (``memory_target``) marked; and the accuracy gap of MVAS + DGR per paired seed with its interval
    against the post's margin (``quality_target``)."""
    fig, axes = plt.subplots(1, 2, figsize=(7.8, 5.0), layout="constrained", gridspec_kw=dict(width_ratios=(1.7, 1)))
    _memory_bars(axes[0], big)
    _reduction_target(axes[0], big, memory_target)
    axes[0].set_title(f"C1: {big.model} ({big.n_params / 1e9:.1f}B params), one\n{big.batch}x{big.seq_len} step, "
                      f"fake tensors: peak {-big.reduction:+.1%} (exact)", fontsize=9)
    _legend_below(axes[0], ncol=2, offset=0.13)
    _accuracy_panel(axes[1], training, "MVAS + DGR", "C1", quality_target)
    return fig


# ------------------------------------------------------------------------------------------ verdicts
def _speed_basis(small: SmallLlama) -> str:
    info = machine_info(small.settings.device)
    return f"vs {small.baseline}, {info.get('gpu') or info['cpu_capability']}"


def c7_texts(small: SmallLlama, training: Training, big: BigMemory, acc: Accountings) -> dict[str, str]:
    """``scale``, ``measured_text`` and ``note`` for ``get_claim("C7").grade``: each graded number as its
    :meth:`Estimate.describe` (value, interval, n, method, measured)."""
    s, m, est = small.settings, training.metrics, c7_estimates(training, big)
    scale = (f"memory: real {big.model} architecture ({big.n_params / 1e9:.1f}B params) under fake tensors, "
             f"{BIG_PRECISION}, one {big.batch}x{big.seq_len} step, measured peaks; speed and accuracy: "
             f"{s.layers}-layer Llama ({small.n_params / 1e6:.1f}M params), {s.steps} steps on the {s.corpus} byte "
             f"corpus, {len(training.runs)} paired seeds, {m['timing_blocks']} ABBA timing blocks in one process; "
             f"{describe(machine_info(s.device), s.compute_dtype)}")
    measured = (f"memory reduction {est['memory_reduction'].describe(4)} of the measured peaks "
                f"({big.baseline_peak / GB:.4g} -> {big.mvas_peak / GB:.4g} GB); speed ratio "
                f"{est['speed_ratio'].describe(3)} ({_speed_basis(small)}); accuracy gap "
                f"{_gap(est['accuracy_gap'])} (next-token accuracy {m['baseline_accuracy']:.2%} -> "
                f"{m['mvas_accuracy']:.2%}, seed means)")
    note = (f"memory: measured peaks (the largest live total of the step), the categories at the peak beside them; "
            f"baseline = bf16 weights and grads with fp32 master and Adam moments (16 B/param) plus activations; "
            f"speed and accuracy baseline = {training.baseline}; "
            f"{'the' if acc.match else 'no'} accounting of the 65B model gives the post's 320 GB (closest: "
            f"'{acc.closest}', {acc.bytes[acc.closest] / GB:.0f} GB). MVAS moves {m['replan_moves']:.0f} tensors "
            f"between tiers in {s.steps} steps (mean over seeds); eval loss gap {est['eval_loss_gap'].describe(3)}; "
            f"the speed ratio depends on the hardware (a baseline in emulated bf16 is slow, so MVAS looks faster "
            f"beside it)")
    return {"scale": scale, "measured_text": measured, "note": note}


def c1_texts(small: SmallLlama, training: Training, big: BigMemory) -> dict[str, str]:
    """``scale``, ``measured_text`` and ``note`` for ``get_claim("C1").grade``: each graded number as its
    :meth:`Estimate.describe`."""
    s, m = small.settings, training.metrics
    est = c1_estimates(training, big)
    scale = (f"memory: {big.model} ({big.n_params / 1e9:.1f}B params) under fake tensors, {BIG_PRECISION}, one "
             f"{big.batch}x{big.seq_len} step, measured peaks; quality: {s.layers}-layer Llama "
             f"({small.n_params / 1e6:.1f}M params), {s.steps} steps, {len(training.runs)} paired seeds, baseline "
             f"{training.baseline}; {describe(machine_info(s.device), s.compute_dtype)}")
    measured = (f"memory reduction {est['memory_reduction'].describe(4)} of the measured peaks "
                f"({big.baseline_peak / GB:.4g} -> {big.mvas_peak / GB:.4g} GB); quality gap (accuracy lost by MVAS + "
                f"DGR) {_gap(est['quality_gap'])} (next-token accuracy {m['baseline_accuracy']:.2%} -> "
                f"{m['mvas_dgr_accuracy']:.2%}, seed means)")

    def state(b: Mapping[str, int]) -> float:
        return (b["optimizer_state"] + b["master_weights"]) / GB

    note = (f"at the peak: gradients {big.baseline['gradients'] / GB:.1f} -> {big.mvas['gradients'] / GB:.1f} GB "
            f"(DGR frees them per layer), optimizer state + master {state(big.baseline):.1f} -> "
            f"{state(big.mvas):.1f} GB (fp32 master + moments -> fp8 moments, no master); eval loss gap "
            f"{est['eval_loss_gap'].describe(3)}; speed {est['speed_ratio'].describe(3)}")
    return {"scale": scale, "measured_text": measured, "note": note}
