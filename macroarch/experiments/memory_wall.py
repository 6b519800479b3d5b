"""Notebook 02's experiment: the memory wall of GPT-3 175B (claim C4, post section 2.2).

The bytes of the real architecture counted two ways, side by side:

- :func:`analytic_accounting`: the exact parameter count times each precision policy's bytes per parameter,
  and the activations one forward pass saves for backward, with GPU kernels and with this device's kernels
  (the CPU keeps dropout masks in the activation dtype and LayerNorm statistics in bf16), beside
  Korthikanti et al.'s per-layer formula (``macroarch.measure.memory``);
- :func:`measure_steps`: one real training step per policy under fake tensors, through the planner
  (``macroarch.planner.plan``, the plain step with the policy as its dtype recipe): MemTracker's live bytes by
  category, at the full depth or (``measured_layers > 0``) at that many layers of full width and the two next
  depths, each phase of the step extrapolated in depth on its own and checked on the third depth to the byte.

:func:`headline` gives what is reported and graded. The graded numbers are the training state under the post's
accounting (fp16 everything, 8 B/param) and under standard mixed precision (16 B/param, fp32 master, m and v):
exact counts (points). Beside them, what a step really holds: the activations as MEASURED (the category's largest
over the step, fake tensors, this device's kernels), the analytic counts as cross-checks, and the step's total as
its MEASURED PEAK (the largest sum of live bytes), with the categories at that moment as its breakdown; a sum of
each category's own maximum is never called a total (the categories peak at different moments).
:func:`c1_baseline` records claim C1's ~10B baseline (mixed precision, same batch) that notebook 05 compares
against.
"""

from __future__ import annotations

from dataclasses import dataclass

import matplotlib.pyplot as plt
import torch
from matplotlib.figure import Figure

from macroarch._progress import tqdm
from macroarch._table import format_table
from macroarch.experiments.settings import Settings
from macroarch.measure.memory import (
    ACTIVATION_TOLERANCE,
    PRECISIONS,
    STATE_CATEGORIES,
    activation_bytes,
    format_bytes,
    get_precision,
    korthikanti_activation_bytes,
    loss_temporary_bytes,
    parameter_count,
    training_state_bytes,
)
from macroarch.measure.stats import Estimate, exact
from macroarch.models import ModelSpec, get_model_spec
from macroarch.planner.core import Combination
from macroarch.planner.run import Bytes

COLORS = {"parameters": "#4c72b0", "gradients": "#55a868", "optimizer_state": "#c44e52", "master_weights": "#8172b2",
          "activations": "#ccb974", "temporaries": "#dd8452", "other": "#999999"}
DISPLAY_NAMES = {"gpt3_175b": "GPT-3 175B"}
POLICY_LABELS = {"post": "post's accounting\n(fp16 everything)", "bf16_mixed": "mixed precision\n(fp32 master, m, v)"}


_PLANNER = {"parameters": "weights", "gradients": "gradients", "optimizer_state": "optimizer",
            "master_weights": "master"}
"""The analytic state categories -> the planner's names (``macroarch.planner.run.CATEGORY_NAMES``)."""


@dataclass(frozen=True)
class MemoryWallSettings(Settings):
    """Notebook 02's settings: its parameters cell, less ``profile`` (``MemoryWallSettings.from_params(params)``)."""

    measured_layers: int
    """0: measure the full model; n > 0: n, n + 1 and n + 2 layers at full width (those the model has), each phase of
    the step extrapolated to the full depth and checked on the third depth to the byte."""
    device: str
    """Kernels whose saved tensors are measured (fake tensors need a real GPU for ``"cuda"``)."""
    model: str = "gpt3_175b"
    """The architecture of the claim."""
    batch_size: int = 1
    """Rows of the measured step: activations are at ``batch_size x seq_len`` tokens."""
    seq_len: int = 2048
    """Tokens per row (GPT-3's context)."""
    precisions: tuple[str, ...] = ("post", "bf16_mixed")
    """Precision policies: the post's accounting (8 B/param) and standard mixed precision (16 B/param); both graded."""
    c1_model: str = "llama_10b"
    """Claim C1's ~10B config: its baseline is recorded here."""
    card_gb: int = 80
    """The single card the post compares against, in GB (1e9 bytes)."""

    def __post_init__(self) -> None:
        self._positive("batch_size", "seq_len", "card_gb")
        self._non_negative("measured_layers")
        self._device()
        self._non_empty("precisions")
        for p in self.precisions:
            if p not in PRECISIONS:
                self._fail("precisions", f"a list of {', '.join(map(repr, PRECISIONS))}")
        for p in ("post", "bf16_mixed"):
            if p not in self.precisions:
                self._fail("precisions", f"a list that includes {p!r} (C4 is graded on it)")
        for name in ("model", "c1_model"):
            try:
                get_model_spec(getattr(self, name))
            except Exception:  # the registry's own error lists the names; say which field held the bad one
                self._fail(name, "a registered model name")
        n_layers = get_model_spec(self.model).shape.n_layers
        if self.measured_layers > n_layers:
            self._fail("measured_layers", f"at most the model's {n_layers} layers")

    @property
    def spec(self) -> ModelSpec:
        return get_model_spec(self.model)


def _display(spec: ModelSpec) -> str:
    return DISPLAY_NAMES.get(spec.name, spec.name)


def depths(spec: ModelSpec, measured_layers: int) -> tuple[int, ...]:
    """The layer counts measured (``plan``'s ``depths``): ``measured_layers`` and the two next, those the model has
    (two at least, else the whole model: ``()``)."""
    if measured_layers == 0:
        return ()
    picked = tuple(d for d in range(measured_layers, measured_layers + 3) if d <= spec.shape.n_layers)
    return picked if len(picked) >= 2 else ()


def _how(spec: ModelSpec, step: Combination) -> str:
    """How a step was measured, in a few words."""
    if not step.depths:
        return "the whole model"
    checked = f", checked at {', '.join(map(str, step.depths[2:]))} to the byte" if len(step.depths) > 2 else ""
    return f"{', '.join(map(str, step.depths[:2]))} of {spec.shape.n_layers} layers, extrapolated{checked}"


def plan_step(spec: ModelSpec, precision: str, batch_size: int, seq_len: int, device: str,
              measured_layers: int) -> Combination:
    """One steady-state training step (optimizer state in place) of ``spec`` with ``precision``'s dtype recipe and
    its AdamW, fake tensors, through the planner (eager attention, as ``ModelSpec.build``). Raises if the planner
    could not measure it or had to fall back from the depths asked for."""
    from macroarch.planner import plan
    from macroarch.planner.models import resolve

    asked = depths(spec, measured_layers)
    step = plan(resolve(spec.name, attention="eager"), batch_size, seq_len, dtype=precision, depths=asked,
                device=device, combinations=["plain"]).combination("plain")
    if step.error is not None or step.measured is None or step.depths != asked:
        raise AssertionError(f"{spec.name}, {precision}: the planner did not measure the step as asked "
                             f"({step.error or step.how})")
    return step


@dataclass(frozen=True)
class Accounting:
    """Analytic bytes of the full model per precision policy."""

    spec: ModelSpec
    device: str
    n_params: int
    state: dict[str, dict[str, int]]
    """Per policy: ``training_state_bytes`` (the state categories and their ``total``)."""
    activations_gpu: dict[str, int]
    activations_here: dict[str, int]
    """Activations saved for backward with ``device``'s kernels."""
    korthikanti: int
    loss_temporaries: int = 0
    """What the loss holds while it runs beyond what it keeps (``loss_temporary_bytes``: its fp32 copy of the
    logits): the activations' largest, the loss computing, is the end of forward plus this."""

    def metrics(self) -> dict[str, float]:
        return ({"n_params": self.n_params, "korthikanti_activation_bytes": self.korthikanti,
                 "analytic_loss_temporary_bytes": self.loss_temporaries}
                | {f"analytic_{p}_{k}_bytes": v for p, s in self.state.items() for k, v in s.items()}
                | {f"analytic_{p}_activation_bytes_gpu": v for p, v in self.activations_gpu.items()}
                | {f"analytic_{p}_activation_bytes_{self.device}": v for p, v in self.activations_here.items()})

    def table(self) -> str:
        rows = [("policy", "B/param", *STATE_CATEGORIES, "state total", "act. (GPU kernels)",
                 f"act. ({self.device} kernels)")]
        for p, s in self.state.items():
            values = [s[k] for k in STATE_CATEGORIES] + [s["total"], self.activations_gpu[p], self.activations_here[p]]
            rows.append((p, get_precision(p).bytes_per_param, *map(format_bytes, values)))
        return (format_table(rows) + "\nKorthikanti et al. activations (16-bit GPT layer): "
                + format_bytes(self.korthikanti) + "; the loss's temporaries (its fp32 copy of the logits): "
                + format_bytes(self.loss_temporaries))


def _analytic(spec: ModelSpec, precisions, batch_size: int, seq_len: int, device: str) -> Accounting:
    return Accounting(
        spec, device, parameter_count(spec), {p: training_state_bytes(spec, p) for p in precisions},
        {p: activation_bytes(spec, batch_size, seq_len, p, device_type="cuda")["total"] for p in precisions},
        {p: activation_bytes(spec, batch_size, seq_len, p, device_type=torch.device(device).type)["total"]
         for p in precisions},
        korthikanti_activation_bytes(spec, batch_size, seq_len), loss_temporary_bytes(spec, batch_size, seq_len),
    )


def analytic_accounting(settings: MemoryWallSettings) -> Accounting:
    """The analytic count of the full model, per policy."""
    s = settings
    return _analytic(s.spec, s.precisions, s.batch_size, s.seq_len, s.device)


@dataclass(frozen=True)
class Measured:
    """One fake-tensor training step per policy (the planner's plain step at full depth, as measured with the
    device's kernels), beside the analytic count of the same model."""

    spec: ModelSpec
    steps: dict[str, Combination]
    analytic_state: dict[str, dict[str, int]]
    analytic_activations: dict[str, int]
    """The activations' largest with the kernels of the device measured: the end of forward
    (``activation_bytes``) plus the loss's temporaries (``loss_temporary_bytes``)."""

    def bytes(self, p: str) -> Bytes:
        """Policy ``p``'s step as measured (the device's kernels; no GPU-kernel correction)."""
        return self.steps[p].measured

    @property
    def whole(self) -> bool:
        """The whole model was measured (else a few depths, extrapolated)."""
        return not any(s.depths for s in self.steps.values())

    @property
    def state_exact(self) -> bool:
        """Every state category measured equals the analytic count to the byte, for every policy."""
        return all(self.bytes(p).categories[_PLANNER[k]] == self.analytic_state[p][k]
                   for p in self.steps for k in STATE_CATEGORIES)

    def activations(self, p: str) -> int:
        """The activations' own maximum over the step (what the forward pass keeps for backward, and the loss's fp32
        copy of the logits while it is computed)."""
        return self.bytes(p).categories["activations"]

    def activation_rel_error(self, p: str) -> float:
        return self.activations(p) / self.analytic_activations[p] - 1

    @property
    def worst_activation_error(self) -> float:
        return max(abs(self.activation_rel_error(p)) for p in self.steps)

    def metrics(self) -> dict[str, float]:
        m: dict[str, float] = {}
        for p in self.steps:
            b = self.bytes(p)
            m |= {f"measured_{p}_{k}_bytes": b.categories[_PLANNER[k]] for k in STATE_CATEGORIES}
            m |= {f"measured_{p}_{k}_at_peak_bytes": v for k, v in b.at_peak.items()}
            m |= {f"measured_{p}_activation_bytes": self.activations(p), f"measured_{p}_peak_bytes": b.peak}
        return m | {"state_analytic_equals_measured": int(self.state_exact),
                    "activation_rel_error": self.worst_activation_error, "measured_whole_model": int(self.whole)}

    def check(self) -> None:
        """Raise if the analytic and measured accountings disagree (state to the byte, activations within
        ``ACTIVATION_TOLERANCE``): the headline numbers would then rest on a count that is wrong."""
        if not (self.state_exact and self.worst_activation_error <= ACTIVATION_TOLERANCE):
            raise AssertionError(f"analytic and measured accounting disagree: state exact {self.state_exact}, "
                                 f"activations off by {self.worst_activation_error:.3%}")

    def table(self) -> str:
        out = [f"measured: {_how(self.spec, next(iter(self.steps.values())))}"]
        for p in self.steps:
            b = self.bytes(p)
            phases = ", ".join(f"{k} {format_bytes(v.peak_bytes)}" for k, v in b.phases.items())
            at_peak = ", ".join(f"{k} {format_bytes(v)}" for k, v in b.at_peak.items() if v)
            rows = [("category", "analytic", "measured (own maximum)", "difference")]
            rows += [(k, format_bytes(self.analytic_state[p][k]), format_bytes(b.categories[_PLANNER[k]]),
                      f"{b.categories[_PLANNER[k]] - self.analytic_state[p][k]:,d}") for k in STATE_CATEGORIES]
            rows.append(("activations (largest)", format_bytes(self.analytic_activations[p]),
                         format_bytes(self.activations(p)), f"{self.activation_rel_error(p):+.2%}"))
            out += [f"{p}: measured peak {format_bytes(b.peak)} (in {b.phase}), made of {at_peak} (phase peaks: "
                    f"{phases})", format_table(rows), ""]
        out.append(f"training state: analytic == measured to the byte: {self.state_exact}; activations within "
                   f"{self.worst_activation_error:.3%} (tolerance {ACTIVATION_TOLERANCE:.0%}; their largest, the loss "
                   f"computing: the end of forward and the loss's fp32 copy of the logits)")
        return "\n".join(out)


def measure_steps(settings: MemoryWallSettings) -> Measured:
    """One steady-state training step (optimizer state in place) of the model per policy, fake tensors
    (:func:`plan_step`), beside the analytic count of the full model."""
    s = settings
    steps = {p: plan_step(s.spec, p, s.batch_size, s.seq_len, s.device, s.measured_layers)
             for p in tqdm(s.precisions, desc="fake-tensor training steps", mininterval=5)}
    kernels = torch.device(s.device).type
    loss = loss_temporary_bytes(s.spec, s.batch_size, s.seq_len)
    return Measured(s.spec, steps, {p: training_state_bytes(s.spec, p) for p in s.precisions},
                    {p: activation_bytes(s.spec, s.batch_size, s.seq_len, p, device_type=kernels)["total"] + loss
                     for p in s.precisions})


def headline(accounting: Accounting, measured: Measured, card_gb: int) -> tuple[dict[str, Estimate],
                                                                                   dict[str, float]]:
    """``(estimates, metrics)``. Graded: the post's accounting and mixed precision, exact counts of the training
    state (as measured: equal to the analytic count, ``Measured.check``). Reported: the activations as measured and
    the step's measured peak (mixed precision), the analytic activation counts beside them, and the cards the
    measured peak needs."""
    def state(p: str) -> int:
        return sum(measured.bytes(p).categories[_PLANNER[k]] for k in STATE_CATEGORIES)

    mixed = measured.bytes("bf16_mixed")
    estimates = {"post_accounting_bytes": exact(state("post"), "B"),
                 "mixed_precision_bytes": exact(state("bf16_mixed"), "B")}
    metrics = dict(activation_bytes=measured.activations("bf16_mixed"),
                   analytic_activation_bytes_gpu=accounting.activations_gpu["bf16_mixed"],
                   analytic_activation_bytes_here=accounting.activations_here["bf16_mixed"],
                   mixed_precision_peak_bytes=mixed.peak, peak_measured_whole_model=int(measured.whole),
                   cards_needed=-(-mixed.peak // (card_gb * 10**9)))
    metrics |= {f"mixed_precision_peak_{k}_bytes": v for k, v in mixed.at_peak.items()}
    return estimates, metrics


_WIDTH = 8.2  # inches: the report scales every figure to 6.69 in, so 8-pt text prints at 6.5 pt or more
_BELOW = dict(loc="upper center", fontsize=8, frameon=False)  # legends under their axes, never over the data


def plot_bytes_by_category(accounting: Accounting, measured: Measured, settings: MemoryWallSettings) -> Figure:
    """Left: per policy, the step's measured peak as a stack of the categories live at that moment (peak and exact
    state in the tick labels), the post's 1.4 TB and one card drawn. Right: the activations as measured (their
    largest over the step), with the analytic counts (this device's kernels, GPU kernels, Korthikanti et al.) beside
    them as cross-checks. Values sit in the tick labels and the lines are named in the legends below, so nothing is
    written over a bar or a line."""
    fig, (ax, act) = plt.subplots(1, 2, figsize=(_WIDTH, 5.4), layout="constrained",
                                  gridspec_kw=dict(width_ratios=[1.25, 1]))
    seen: set[str] = set()
    for i, p in enumerate(measured.steps):
        bottom = 0
        for k in COLORS:
            v = measured.bytes(p).at_peak.get(k, 0)
            if v:
                label = None if k in seen else k.replace("_", " ")
                seen.add(k)
                ax.bar(i, v / 1e12, bottom=bottom / 1e12, width=0.55, color=COLORS[k], label=label)
                bottom += v
    card_tb = settings.card_gb / 1e3
    ax.axhline(1.4, color="grey", ls=":", lw=1.2, label="the post: 1.4 TB")
    ax.axhline(card_tb, color="k", ls="--", lw=1, label=f"one {settings.card_gb} GB card")
    state = {p: sum(measured.bytes(p).categories[_PLANNER[k]] for k in STATE_CATEGORIES) for p in measured.steps}
    ax.set_xticks(range(len(measured.steps)), [f"{POLICY_LABELS.get(p, p)}\npeak {measured.bytes(p).peak / 1e12:.3f} "
                                               f"TB\nstate {state[p] / 1e12:.3f} TB (exact)" for p in measured.steps],
                  fontsize=8)
    ax.set_xlim(-0.6, len(measured.steps) - 0.4)
    top = max(measured.bytes(p).peak for p in measured.steps) / 1e12
    ax.set_ylim(0, max(top, 1.4) * 1.12)  # no bar flush with the frame
    ax.set(xlabel="precision policy", ylabel="live bytes at the step's peak (TB, 1e12 B)")
    step = measured.steps["bf16_mixed"]
    where = ("whole model" if not step.depths else
             f"extrapolated from {', '.join(map(str, step.depths[:2]))} of {measured.spec.shape.n_layers} layers")
    ax.set_title(f"{_display(accounting.spec)}: measured peak of one step\n(fake tensors, {where});\n"
                 f"categories live at the peak; {settings.batch_size}x{settings.seq_len} tokens,\n"
                 f"{accounting.device} kernels", fontsize=9)
    ax.legend(bbox_to_anchor=(0.5, -0.3), ncol=2, **_BELOW)
    mixed = measured.activations("bf16_mixed")
    loss = accounting.loss_temporaries  # the measured largest is the loss's: end of forward + its fp32 logits
    refs = [(f"analytic,\n{accounting.device} kernels", accounting.activations_here["bf16_mixed"] + loss),
            ("analytic,\nGPU kernels", accounting.activations_gpu["bf16_mixed"] + loss),
            ("Korthikanti\net al.", accounting.korthikanti)]
    act.bar(0, mixed / 1e9, width=0.6, color=COLORS["activations"],
            label=f"measured ({accounting.device} kernels, fake tensors)")
    act.plot(range(1, len(refs) + 1), [v / 1e9 for _, v in refs], "o", mfc="none", color="k", ms=8, ls="none",
             label="analytic cross-checks (the two counts: end of forward\n+ the loss's fp32 copy of the logits)")
    act.set_xticks(range(len(refs) + 1), [f"measured\n{mixed / 1e9:.1f} GB",
                                          *(f"{n}\n{v / 1e9:.1f} GB" for n, v in refs)], fontsize=8)
    act.set_xlim(-0.6, len(refs) + 0.6)
    act.set_ylim(0, max([mixed] + [v for _, v in refs]) / 1e9 * 1.15)
    act.set(xlabel="how the activations are counted", ylabel="activations, their largest over the step\n(GB, 1e9 B)")
    act.set_title(f"activations of one forward\n({'whole model' if measured.whole else 'extrapolated in depth'}), "
                  "mixed precision", fontsize=9)
    act.legend(bbox_to_anchor=(0.5, -0.3), ncol=1, **_BELOW)
    return fig


def plot_phase_peaks(measured: Measured, precision: str = "bf16_mixed") -> Figure:
    """Live bytes by category at each phase's peak of one measured step (legend below, headroom above); backward is
    split where the first block's backward begins (``macroarch.measure.fit.TrainingStep``)."""
    phases = measured.bytes(precision).phases
    cats = [c for c in COLORS if any(ph.by_category.get(c, 0) for ph in phases.values())]
    fig, ax = plt.subplots(figsize=(7.5, 4.6), layout="constrained")
    top = 0.0
    for j, peak in enumerate(phases.values()):
        bottom = 0
        for c in cats:
            v = peak.by_category.get(c, 0)
            ax.bar(j, v / 1e9, bottom=bottom / 1e9, color=COLORS[c], label=c.replace("_", " ") if j == 0 else None)
            bottom += v
        top = max(top, bottom / 1e9)
    ax.set_ylim(0, top * 1.12)  # no bar flush with the frame
    ax.set_xticks(range(len(phases)), [_PHASES.get(k, k) for k in phases])
    ax.set_xlabel("phase of the step")
    ax.set_ylabel("live bytes at the phase's peak (GB, 1e9 B)")
    ax.set_title(f"{_display(measured.spec)} ({measured.spec.shape.n_layers} layers), {precision}: live bytes at "
                 f"each phase's peak\n(measured, fake tensors{'' if measured.whole else ', extrapolated in depth'})",
                 fontsize=9)
    ax.legend(bbox_to_anchor=(0.5, -0.22), ncol=4, **_BELOW)
    return fig


_PHASES = {"backward": "backward\n(later blocks)", "backward_tail": "backward\n(first block on)"}


@dataclass(frozen=True)
class C1Baseline:
    """Claim C1's ~10B model under mixed precision: analytic state and activations, one measured step."""

    spec: ModelSpec
    state_bytes: int
    activation_bytes: int
    measured: Combination
    state_exact: bool

    def metrics(self) -> dict[str, float]:
        return dict(c1_baseline_params=parameter_count(self.spec), c1_baseline_state_bytes=self.state_bytes,
                    c1_baseline_activation_bytes=self.activation_bytes,
                    c1_baseline_measured_peak_bytes=self.measured.measured.peak,
                    c1_baseline_measured_whole_model=int(not self.measured.depths),
                    c1_baseline_state_exact=int(self.state_exact))

    def text(self) -> str:
        return (f"{self.spec.name}: {parameter_count(self.spec):,} parameters; mixed-precision state "
                f"{format_bytes(self.state_bytes)}, activations {format_bytes(self.activation_bytes)} (analytic, GPU "
                f"kernels)\nmeasured (fake tensors, {_how(self.spec, self.measured)}): peak of one step "
                f"{format_bytes(self.measured.measured.peak)}; state analytic == measured: {self.state_exact}")

    def check(self) -> None:
        if not self.state_exact:
            raise AssertionError(f"analytic and measured training state of {self.spec.name} disagree")


def c1_baseline(settings: MemoryWallSettings) -> C1Baseline:
    s = settings
    spec = get_model_spec(s.c1_model)
    step = plan_step(spec, "bf16_mixed", s.batch_size, s.seq_len, s.device, s.measured_layers)
    analytic = training_state_bytes(spec, "bf16_mixed")
    return C1Baseline(spec, analytic["total"],
                      activation_bytes(spec, s.batch_size, s.seq_len, "bf16_mixed", device_type="cuda")["total"],
                      step, all(step.measured.categories[_PLANNER[k]] == analytic[k] for k in STATE_CATEGORIES))


def c4_texts(accounting: Accounting, measured: Measured, metrics: dict[str, float],
             settings: MemoryWallSettings) -> dict[str, str]:
    """``scale``, ``measured_text`` and ``note`` for C4's verdict."""
    how = _how(accounting.spec, measured.steps["bf16_mixed"])
    post, mixed = float(metrics["post_accounting_bytes"]), float(metrics["mixed_precision_bytes"])
    peak, act = metrics["mixed_precision_peak_bytes"], metrics["activation_bytes"]
    return dict(
        scale=(f"{_display(accounting.spec)} architecture ({accounting.n_params / 1e9:.1f}B params), measured under "
               f"fake tensors ({how}); activations at {settings.batch_size}x{settings.seq_len} tokens, "
               f"{accounting.device} kernels"),
        measured_text=(f"training state (exact counts): post's accounting {post / 1e12:.3f} TB; mixed precision "
                       f"{mixed / 1e12:.3f} TB; one mixed-precision step peaks at {peak / 1e12:.3f} TB (measured"
                       f"{'' if measured.whole else ', extrapolated in depth'})"),
        note=(f"activations {act / 1e12:.3f} TB measured ({accounting.device} kernels; analytic cross-check "
              f"{metrics['analytic_activation_bytes_here'] / 1e12:.3f} TB, "
              f"{metrics['analytic_activation_bytes_gpu'] / 1e12:.3f} TB with GPU kernels); the measured peak needs "
              f"{metrics['cards_needed']} x {settings.card_gb} GB cards"),
    )


__all__ = ["Accounting", "C1Baseline", "Measured", "MemoryWallSettings", "analytic_accounting", "c1_baseline",
           "c4_texts", "depths", "headline", "measure_steps", "plan_step", "plot_bytes_by_category",
           "plot_phase_peaks"]
