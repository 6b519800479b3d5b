"""Notebook 02's experiment: the memory wall of GPT-3 175B (claim C4, post section 2.2).

The bytes of the real architecture counted two ways, side by side (``macroarch.measure.memory``):

- :func:`analytic_accounting`: the exact parameter count times each precision policy's bytes per parameter,
  and the activations one forward pass saves for backward, with GPU kernels and with this device's kernels
  (the CPU keeps dropout masks in the activation dtype and LayerNorm statistics in bf16), beside
  Korthikanti et al.'s per-layer formula;
- :func:`measure_steps`: live bytes over one real training step under MemTracker with fake tensors, at the full
  depth or (``measured_layers > 0``) at that many layers of full width, where every per-layer count is the
  same, so the analytic count of the other layers completes it once the two agree at the measured depth.

:func:`headline` gives what is reported and graded. The graded numbers are the training state under the post's
accounting (fp16 everything, 8 B/param) and under standard mixed precision (16 B/param, fp32 master, m and v):
exact counts (points). Beside them, what a step really holds: the activations as MEASURED (fake tensors, this
device's kernels), the analytic counts as cross-checks, and the step's total as its MEASURED PEAK (the largest
sum of live bytes), with the categories at that moment as its breakdown; a sum of each category's own maximum is
never called a total (the categories peak at different moments). :func:`c1_baseline` records claim C1's ~10B
baseline (mixed precision, same batch) that notebook 05 compares against.
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
    MemoryReport,
    activation_bytes,
    format_bytes,
    get_precision,
    korthikanti_activation_bytes,
    measure_training_step,
    parameter_count,
    training_state_bytes,
)
from macroarch.measure.stats import Estimate, exact
from macroarch.models import ModelSpec, get_model_spec

COLORS = {"parameters": "#4c72b0", "gradients": "#55a868", "optimizer_state": "#c44e52", "master_weights": "#8172b2",
          "activations": "#ccb974", "temporaries": "#dd8452", "other": "#999999"}
DISPLAY_NAMES = {"gpt3_175b": "GPT-3 175B"}
POLICY_LABELS = {"post": "post's accounting\n(fp16 everything)", "bf16_mixed": "mixed precision\n(fp32 master, m, v)"}


@dataclass(frozen=True)
class MemoryWallSettings(Settings):
    """Notebook 02's settings: its parameters cell, less ``profile`` (``MemoryWallSettings.from_params(params)``)."""

    measured_layers: int
    """0: measure the full model; n > 0: n layers at full width (the other layers' bytes from the analytic count)."""
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

    @property
    def measured_spec(self) -> ModelSpec:
        """The model measured: the whole of ``spec`` when ``measured_layers`` is 0, else that many of its layers."""
        return measured_spec(self.spec, self.measured_layers)


def _display(spec: ModelSpec) -> str:
    return DISPLAY_NAMES.get(spec.name, spec.name)


def measured_spec(spec: ModelSpec, measured_layers: int) -> ModelSpec:
    """The model measured: the whole of ``spec`` when ``measured_layers`` is 0, else that many of its layers."""
    return spec if measured_layers == 0 else spec.scaled(n_layers=measured_layers)


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

    def metrics(self) -> dict[str, float]:
        return ({"n_params": self.n_params, "korthikanti_activation_bytes": self.korthikanti}
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
                + format_bytes(self.korthikanti))


def _analytic(spec: ModelSpec, precisions, batch_size: int, seq_len: int, device: str) -> Accounting:
    return Accounting(
        spec, device, parameter_count(spec), {p: training_state_bytes(spec, p) for p in precisions},
        {p: activation_bytes(spec, batch_size, seq_len, p, device_type="cuda")["total"] for p in precisions},
        {p: activation_bytes(spec, batch_size, seq_len, p, device_type=torch.device(device).type)["total"]
         for p in precisions},
        korthikanti_activation_bytes(spec, batch_size, seq_len),
    )


def analytic_accounting(settings: MemoryWallSettings) -> Accounting:
    """The analytic count of the full model, per policy."""
    s = settings
    return _analytic(s.spec, s.precisions, s.batch_size, s.seq_len, s.device)


@dataclass(frozen=True)
class Measured:
    """One fake-tensor training step per policy, beside the analytic count of the same (measured) model."""

    spec: ModelSpec
    reports: dict[str, MemoryReport]
    analytic_state: dict[str, dict[str, int]]
    analytic_activations: dict[str, int]
    """Activations with the kernels of the device measured."""

    @property
    def state_exact(self) -> bool:
        """Every state category measured equals the analytic count to the byte, for every policy."""
        return all(r.max_by_category[k] == self.analytic_state[p][k]
                   for p, r in self.reports.items() for k in STATE_CATEGORIES)

    def activation_rel_error(self, p: str) -> float:
        return self.reports[p].activation_bytes / self.analytic_activations[p] - 1

    @property
    def worst_activation_error(self) -> float:
        return max(abs(self.activation_rel_error(p)) for p in self.reports)

    def metrics(self) -> dict[str, float]:
        m: dict[str, float] = {}
        for p, r in self.reports.items():
            m |= {f"measured_{p}_{k}_bytes": r.max_by_category[k] for k in STATE_CATEGORIES}
            m |= {f"measured_{p}_{k}_at_peak_bytes": v for k, v in r.by_category.items()}
            m |= {f"measured_{p}_activation_bytes": r.activation_bytes, f"measured_{p}_peak_bytes": r.peak_bytes,
                  f"measured_{p}_seconds": r.seconds}
        return m | {"state_analytic_equals_measured": int(self.state_exact),
                    "activation_rel_error": self.worst_activation_error}

    def check(self) -> None:
        """Raise if the analytic and measured accountings disagree (state to the byte, activations within
        ``ACTIVATION_TOLERANCE``): the headline numbers would then rest on a count that is wrong."""
        if not (self.state_exact and self.worst_activation_error <= ACTIVATION_TOLERANCE):
            raise AssertionError(f"analytic and measured accounting disagree: state exact {self.state_exact}, "
                                 f"activations off by {self.worst_activation_error:.3%}")

    def table(self) -> str:
        out = []
        for p, r in self.reports.items():
            phases = ", ".join(f"{k} {format_bytes(v.peak_bytes)}" for k, v in r.phases.items())
            at_peak = ", ".join(f"{k} {format_bytes(v)}" for k, v in r.by_category.items() if v)
            rows = [("category", "analytic", "measured (own maximum)", "difference")]
            rows += [(k, format_bytes(self.analytic_state[p][k]), format_bytes(r.max_by_category[k]),
                      f"{r.max_by_category[k] - self.analytic_state[p][k]:,d}") for k in STATE_CATEGORIES]
            rows.append(("activations", format_bytes(self.analytic_activations[p]), format_bytes(r.activation_bytes),
                         f"{self.activation_rel_error(p):+.2%}"))
            out += [f"{p}: measured peak {format_bytes(r.peak_bytes)} in {r.seconds:.1f} s, made of {at_peak} "
                    f"(phase peaks: {phases})", format_table(rows), ""]
        out.append(f"training state: analytic == measured to the byte: {self.state_exact}; activations within "
                   f"{self.worst_activation_error:.3%} (tolerance {ACTIVATION_TOLERANCE:.0%})")
        return "\n".join(out)


def _measure(spec: ModelSpec, precisions, batch_size: int, seq_len: int, device: str) -> Measured:
    reports = {p: measure_training_step(spec, batch_size, seq_len, p, fake=True, device=device)
               for p in tqdm(precisions, desc="fake-tensor training steps", mininterval=5)}
    return Measured(spec, reports, {p: training_state_bytes(spec, p) for p in precisions},
                    {p: activation_bytes(spec, batch_size, seq_len, p, device_type=torch.device(device).type)["total"]
                     for p in precisions})


def measure_steps(settings: MemoryWallSettings) -> Measured:
    """One steady-state training step (optimizer state in place) of the measured model per policy, fake tensors."""
    s = settings
    return _measure(s.measured_spec, s.precisions, s.batch_size, s.seq_len, s.device)


@dataclass(frozen=True)
class FullSize:
    """One policy's bytes at the full model: the state (exact), the activations and the step's peak (measured)."""

    state: dict[str, int]
    """State categories: measured when the whole model was, else the analytic count (equal at the measured depth)."""
    activations: int
    """Saved for backward, measured (fake tensors, the device's kernels); at a measured depth below the full one,
    the measurement plus the analytic bytes of the layers not measured."""
    peak: int
    """The step's largest sum of live bytes, measured. Below the full depth, the measured peak plus the other layers'
    state and activations: a bound from above (backward frees later layers' activations before the peak of a
    deeper model), said so wherever it is shown."""
    at_peak: dict[str, int]
    """The categories at the moment of the peak (they sum to ``peak``)."""
    whole: bool
    """The whole model was measured (else ``measured_layers`` of it, completed analytically)."""


def full_size(accounting: Accounting, measured: Measured) -> dict[str, FullSize]:
    """Each policy at full size (see :class:`FullSize`). Below the full depth every per-layer count is the same,
    so the layers not measured add exactly their analytic state and activation bytes; the peak so completed is a
    bound from above."""
    whole = measured.spec.shape.n_layers == accounting.spec.shape.n_layers
    out = {}
    for p, r in measured.reports.items():
        if whole:
            state = {k: r.max_by_category[k] for k in STATE_CATEGORIES}
            out[p] = FullSize(state, r.activation_bytes, r.peak_bytes, dict(r.by_category), True)
            continue
        state = {k: accounting.state[p][k] for k in STATE_CATEGORIES}
        extra = {k: accounting.state[p][k] - measured.analytic_state[p][k] for k in STATE_CATEGORIES}
        extra["activations"] = accounting.activations_here[p] - measured.analytic_activations[p]
        at_peak = {k: v + extra.get(k, 0) for k, v in r.by_category.items()}
        out[p] = FullSize(state, r.activation_bytes + extra["activations"], sum(at_peak.values()), at_peak, False)
    return out


def headline(accounting: Accounting, measured: Measured, card_gb: int) -> tuple[dict[str, Estimate],
                                                                                   dict[str, float]]:
    """``(estimates, metrics)``. Graded: the post's accounting and mixed precision, exact counts of the training
    state. Reported: the activations as measured and the step's measured peak (mixed precision), the analytic
    activation counts beside them, and the cards the measured peak needs."""
    full = full_size(accounting, measured)
    mixed = full["bf16_mixed"]
    estimates = {"post_accounting_bytes": exact(sum(full["post"].state.values()), "B"),
                 "mixed_precision_bytes": exact(sum(mixed.state.values()), "B")}
    metrics = dict(activation_bytes=mixed.activations,
                   analytic_activation_bytes_gpu=accounting.activations_gpu["bf16_mixed"],
                   analytic_activation_bytes_here=accounting.activations_here["bf16_mixed"],
                   mixed_precision_peak_bytes=mixed.peak, peak_measured_whole_model=int(mixed.whole),
                   cards_needed=-(-mixed.peak // (card_gb * 10**9)))
    metrics |= {f"mixed_precision_peak_{k}_bytes": v for k, v in mixed.at_peak.items()}
    return estimates, metrics


_WIDTH = 8.2  # inches: the report scales every figure to 6.69 in, so 8-pt text prints at 6.5 pt or more
_BELOW = dict(loc="upper center", fontsize=8, frameon=False)  # legends under their axes, never over the data


def plot_bytes_by_category(accounting: Accounting, measured: Measured, settings: MemoryWallSettings) -> Figure:
    """Left: per policy, the step's measured peak as a stack of the categories live at that moment (peak and exact
    state in the tick labels), the post's 1.4 TB and one card drawn. Right: the activations saved for backward as
    measured, with the analytic counts (this device's kernels, GPU kernels, Korthikanti et al.) beside them as
    cross-checks. Values sit in the tick labels and the lines are named in the legends below, so nothing is
    written over a bar or a line."""
    full = full_size(accounting, measured)
    whole = next(iter(full.values())).whole
    fig, (ax, act) = plt.subplots(1, 2, figsize=(_WIDTH, 5.4), layout="constrained",
                                  gridspec_kw=dict(width_ratios=[1.25, 1]))
    seen: set[str] = set()
    for i, f in enumerate(full.values()):
        bottom = 0
        for k in COLORS:
            v = f.at_peak.get(k, 0)
            if v:
                label = None if k in seen else k.replace("_", " ")
                seen.add(k)
                ax.bar(i, v / 1e12, bottom=bottom / 1e12, width=0.55, color=COLORS[k], label=label)
                bottom += v
    card_tb = settings.card_gb / 1e3
    ax.axhline(1.4, color="grey", ls=":", lw=1.2, label="the post: 1.4 TB")
    ax.axhline(card_tb, color="k", ls="--", lw=1, label=f"one {settings.card_gb} GB card")
    ax.set_xticks(range(len(full)), [f"{POLICY_LABELS.get(p, p)}\npeak {'' if f.whole else '<= '}"
                                     f"{f.peak / 1e12:.3f} TB\nstate {sum(f.state.values()) / 1e12:.3f} TB "
                                     "(exact)" for p, f in full.items()], fontsize=8)
    ax.set_xlim(-0.6, len(full) - 0.4)
    ax.set_ylim(0, max(max(f.peak for f in full.values()) / 1e12, 1.4) * 1.12)  # no bar flush with the frame
    ax.set(xlabel="precision policy", ylabel="live bytes at the step's peak (TB, 1e12 B)")
    how = ("measured peak of one step (fake tensors, whole model)" if whole else
           f"bound on the peak: measured at {measured.spec.shape.n_layers} of {accounting.spec.shape.n_layers}\n"
           "layers + the analytic bytes of the rest")
    ax.set_title(f"{_display(accounting.spec)}: {how}\ncategories live at the peak; {settings.batch_size}x"
                 f"{settings.seq_len} tokens, {accounting.device} kernels", fontsize=9)
    ax.legend(bbox_to_anchor=(0.5, -0.3), ncol=2, **_BELOW)
    mixed = full["bf16_mixed"]
    refs = [(f"analytic,\n{accounting.device} kernels", accounting.activations_here["bf16_mixed"]),
            ("analytic,\nGPU kernels", accounting.activations_gpu["bf16_mixed"]),
            ("Korthikanti\net al.", accounting.korthikanti)]
    act.bar(0, mixed.activations / 1e9, width=0.6, color=COLORS["activations"],
            label=f"measured ({accounting.device} kernels, fake tensors)")
    act.plot(range(1, len(refs) + 1), [v / 1e9 for _, v in refs], "o", mfc="none", color="k", ms=8, ls="none",
             label="analytic cross-checks")
    act.set_xticks(range(len(refs) + 1), [f"measured\n{mixed.activations / 1e9:.1f} GB",
                                          *(f"{n}\n{v / 1e9:.1f} GB" for n, v in refs)], fontsize=8)
    act.set_xlim(-0.6, len(refs) + 0.6)
    act.set_ylim(0, max([mixed.activations] + [v for _, v in refs]) / 1e9 * 1.15)
    act.set(xlabel="how the activations are counted", ylabel="activations saved for backward (GB, 1e9 B)")
    act.set_title(f"activations of one forward\n({'whole model' if whole else 'completed analytically'}), mixed "
                  "precision", fontsize=9)
    act.legend(bbox_to_anchor=(0.5, -0.3), ncol=1, **_BELOW)
    return fig


def plot_phase_peaks(measured: Measured, precision: str = "bf16_mixed") -> Figure:
    """Live bytes by category at each phase's peak of one measured step (legend below, headroom above)."""
    r = measured.reports[precision]
    cats = [c for c in COLORS if any(ph.by_category.get(c, 0) for ph in r.phases.values())]
    fig, ax = plt.subplots(figsize=(7.5, 4.6), layout="constrained")
    top = 0.0
    for j, peak in enumerate(r.phases.values()):
        bottom = 0
        for c in cats:
            v = peak.by_category.get(c, 0)
            ax.bar(j, v / 1e9, bottom=bottom / 1e9, color=COLORS[c], label=c.replace("_", " ") if j == 0 else None)
            bottom += v
        top = max(top, bottom / 1e9)
    ax.set_ylim(0, top * 1.12)  # no bar flush with the frame
    ax.set_xticks(range(len(r.phases)), list(r.phases))
    ax.set_xlabel("phase of the step")
    ax.set_ylabel("live bytes at the phase's peak (GB, 1e9 B)")
    ax.set_title(f"{_display(measured.spec)} ({measured.spec.shape.n_layers} layers), {precision}: live bytes at "
                 "each phase's peak\n(measured, fake tensors)", fontsize=9)
    ax.legend(bbox_to_anchor=(0.5, -0.15), ncol=4, **_BELOW)
    return fig


@dataclass(frozen=True)
class C1Baseline:
    """Claim C1's ~10B model under mixed precision: analytic state and activations, one measured step."""

    spec: ModelSpec
    state_bytes: int
    activation_bytes: int
    measured: MemoryReport
    measured_spec: ModelSpec
    state_exact: bool

    def metrics(self) -> dict[str, float]:
        return dict(c1_baseline_params=parameter_count(self.spec), c1_baseline_state_bytes=self.state_bytes,
                    c1_baseline_activation_bytes=self.activation_bytes,
                    c1_baseline_measured_peak_bytes=self.measured.peak_bytes,
                    c1_baseline_measured_layers=self.measured_spec.shape.n_layers,
                    c1_baseline_state_exact=int(self.state_exact))

    def text(self) -> str:
        return (f"{self.spec.name}: {parameter_count(self.spec):,} parameters; mixed-precision state "
                f"{format_bytes(self.state_bytes)}, activations {format_bytes(self.activation_bytes)} (analytic, GPU "
                f"kernels)\nmeasured ({self.measured_spec.shape.n_layers} layers, fake tensors): peak of one step "
                f"{format_bytes(self.measured.peak_bytes)}; state analytic == measured: {self.state_exact}")

    def check(self) -> None:
        if not self.state_exact:
            raise AssertionError(f"analytic and measured training state of {self.spec.name} disagree")


def c1_baseline(settings: MemoryWallSettings) -> C1Baseline:
    s = settings
    spec = get_model_spec(s.c1_model)
    small = measured_spec(spec, s.measured_layers)
    measured = measure_training_step(small, s.batch_size, s.seq_len, "bf16_mixed", fake=True, device=s.device)
    analytic = training_state_bytes(small, "bf16_mixed")
    return C1Baseline(spec, training_state_bytes(spec, "bf16_mixed")["total"],
                      activation_bytes(spec, s.batch_size, s.seq_len, "bf16_mixed", device_type="cuda")["total"],
                      measured, small, all(measured.max_by_category[k] == analytic[k] for k in STATE_CATEGORIES))


def c4_texts(accounting: Accounting, measured: Measured, metrics: dict[str, float],
             settings: MemoryWallSettings) -> dict[str, str]:
    """``scale``, ``measured_text`` and ``note`` for C4's verdict."""
    layers = measured.spec.shape.n_layers
    whole = layers == accounting.spec.shape.n_layers
    how = ("measured (fake tensors, full model)" if whole
           else f"measured at {layers} layers, the other layers from the analytic count")
    post, mixed = float(metrics["post_accounting_bytes"]), float(metrics["mixed_precision_bytes"])
    peak, act = metrics["mixed_precision_peak_bytes"], metrics["activation_bytes"]
    where = "" if whole else f" at {layers} layers + the rest"
    return dict(
        scale=(f"{_display(accounting.spec)} architecture ({accounting.n_params / 1e9:.1f}B params), {how}; "
               f"activations at {settings.batch_size}x{settings.seq_len} tokens, {accounting.device} kernels"),
        measured_text=(f"training state (exact counts): post's accounting {post / 1e12:.3f} TB; mixed precision "
                       f"{mixed / 1e12:.3f} TB; one mixed-precision step peaks at {'' if whole else 'at most '}"
                       f"{peak / 1e12:.3f} TB (measured{where})"),
        note=(f"activations {act / 1e12:.3f} TB measured ({accounting.device} kernels; analytic cross-check "
              f"{metrics['analytic_activation_bytes_here'] / 1e12:.3f} TB, "
              f"{metrics['analytic_activation_bytes_gpu'] / 1e12:.3f} TB with GPU kernels); the measured peak needs "
              f"{metrics['cards_needed']} x {settings.card_gb} GB cards"),
    )


__all__ = ["Accounting", "C1Baseline", "FullSize", "Measured", "MemoryWallSettings", "analytic_accounting",
           "c1_baseline", "c4_texts", "full_size", "headline", "measure_steps", "measured_spec",
           "plot_bytes_by_category", "plot_phase_peaks"]
