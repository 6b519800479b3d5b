"""Notebook 02's experiment: the memory wall of GPT-3 175B (claim C4, post section 2.2).

The bytes of the real architecture counted two ways, side by side (``macroarch.measure.memory``):

- :func:`analytic_accounting`: the exact parameter count times each precision policy's bytes per parameter,
  and the activations one forward pass saves for backward, with GPU kernels and with this device's kernels
  (the CPU keeps dropout masks in the activation dtype and LayerNorm statistics in bf16), beside
  Korthikanti et al.'s per-layer formula;
- :func:`measure_steps`: peak live bytes by category over one real training step under MemTracker with fake
  tensors, at the full depth or (``measured_layers > 0``) at that many layers of full width, where every
  per-layer count is the same, so the analytic count of the full model stands for it once the two agree.

:func:`headline` gives what the grading rule reads: the post's accounting (fp16 everything, 8 B/param) and
standard mixed precision (16 B/param, fp32 master, m and v), with the activations a GPU run would hold.
:func:`c1_baseline` records claim C1's ~10B baseline (mixed precision, same batch) that notebook 05 compares
against.
"""

from __future__ import annotations

from dataclasses import dataclass

import matplotlib.pyplot as plt
import torch
from matplotlib.figure import Figure
from tqdm.auto import tqdm

from macroarch._table import format_table
from macroarch.measure.memory import (
    ACTIVATION_TOLERANCE,
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
from macroarch.models import ModelSpec

COLORS = {"parameters": "#4c72b0", "gradients": "#55a868", "optimizer_state": "#c44e52", "master_weights": "#8172b2",
          "activations": "#ccb974", "temporaries": "#dd8452", "other": "#999999"}
DISPLAY_NAMES = {"gpt3_175b": "GPT-3 175B"}
POLICY_LABELS = {"post": "post's accounting\n(fp16 everything)", "bf16_mixed": "mixed precision\n(fp32 master, m, v)"}


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


def analytic_accounting(spec: ModelSpec, precisions: list[str], batch_size: int, seq_len: int,
                        device: str) -> Accounting:
    return Accounting(
        spec, device, parameter_count(spec), {p: training_state_bytes(spec, p) for p in precisions},
        {p: activation_bytes(spec, batch_size, seq_len, p, device_type="cuda")["total"] for p in precisions},
        {p: activation_bytes(spec, batch_size, seq_len, p, device_type=torch.device(device).type)["total"]
         for p in precisions},
        korthikanti_activation_bytes(spec, batch_size, seq_len),
    )


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
            rows = [("category", "analytic", "measured", "difference")]
            rows += [(k, format_bytes(self.analytic_state[p][k]), format_bytes(r.max_by_category[k]),
                      f"{r.max_by_category[k] - self.analytic_state[p][k]:,d}") for k in STATE_CATEGORIES]
            rows.append(("activations", format_bytes(self.analytic_activations[p]), format_bytes(r.activation_bytes),
                         f"{self.activation_rel_error(p):+.2%}"))
            out += [f"{p}: peak {format_bytes(r.peak_bytes)} in {r.seconds:.1f} s (phase peaks: {phases})",
                    format_table(rows), ""]
        out.append(f"training state: analytic == measured to the byte: {self.state_exact}; activations within "
                   f"{self.worst_activation_error:.3%} (tolerance {ACTIVATION_TOLERANCE:.0%})")
        return "\n".join(out)


def measure_steps(spec: ModelSpec, precisions: list[str], batch_size: int, seq_len: int, device: str) -> Measured:
    """One steady-state training step (optimizer state in place) of ``spec`` per policy, fake tensors."""
    reports = {p: measure_training_step(spec, batch_size, seq_len, p, fake=True, device=device)
               for p in tqdm(precisions, desc="fake-tensor training steps", mininterval=5)}
    return Measured(spec, reports, {p: training_state_bytes(spec, p) for p in precisions},
                    {p: activation_bytes(spec, batch_size, seq_len, p, device_type=torch.device(device).type)["total"]
                     for p in precisions})


def full_size_state(accounting: Accounting, measured: Measured) -> dict[str, dict[str, int]]:
    """Each policy's state categories at full size: measured when the whole model was, else the analytic
    count, which :meth:`Measured.check` has shown equal to the measurement at the measured depth."""
    whole = measured.spec.shape.n_layers == accounting.spec.shape.n_layers
    return {p: {k: (measured.reports[p].max_by_category[k] if whole else accounting.state[p][k])
                for k in STATE_CATEGORIES} for p in accounting.state}


def headline(accounting: Accounting, measured: Measured, card_gb: int) -> dict[str, float]:
    """The graded numbers: the post's accounting, mixed precision, and the cards state + activations need."""
    state = {p: sum(s.values()) for p, s in full_size_state(accounting, measured).items()}
    mixed, act = state["bf16_mixed"], accounting.activations_gpu["bf16_mixed"]
    return dict(post_accounting_bytes=state["post"], mixed_precision_bytes=mixed,
                mixed_with_activations_bytes=mixed + act, cards_needed=-(-(mixed + act) // (card_gb * 10**9)))


def plot_bytes_by_category(accounting: Accounting, measured: Measured, batch_size: int, seq_len: int,
                           card_gb: int) -> Figure:
    state = full_size_state(accounting, measured)
    whole = measured.spec.shape.n_layers == accounting.spec.shape.n_layers
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (p, parts) in enumerate(state.items()):
        bottom = 0
        for k, v in (parts | {"activations": accounting.activations_gpu[p]}).items():
            ax.bar(i, v / 1e12, bottom=bottom / 1e12, color=COLORS[k], label=k.replace("_", " ") if i == 0 else None)
            bottom += v
        ax.text(i, bottom / 1e12, f"{sum(parts.values()) / 1e12:.2f} TB state\n"
                f"+{accounting.activations_gpu[p] / 1e12:.2f} TB act.", ha="center", va="bottom", fontsize=9)
    ax.axhline(card_gb / 1e3, color="k", ls="--", lw=1)
    ax.text(0.5, card_gb / 1e3, f"one {card_gb} GB card", va="bottom", ha="center", fontsize=9)
    ax.axhline(1.4, color="grey", ls=":", lw=1)
    ax.text(-0.45, 1.4, "post: 1.4 TB", va="bottom", fontsize=9, color="grey")
    ax.set_xticks(range(len(state)), [POLICY_LABELS.get(p, p) for p in state])
    ax.set_ylabel("TB (1e12 bytes)")
    how = "measured, fake tensors" if whole else "analytic"
    ax.set_title(f"{_display(accounting.spec)} training memory by category ({how}; activations at "
                 f"{batch_size}x{seq_len} tokens, GPU kernels)", fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_ylim(0, max(sum(s.values()) + accounting.activations_gpu[p] for p, s in state.items()) / 1e12 * 1.25)
    return fig


def plot_phase_peaks(measured: Measured, precision: str = "bf16_mixed") -> Figure:
    """Live bytes by category at each phase's peak of one measured step."""
    r = measured.reports[precision]
    cats = [c for c in COLORS if any(ph.by_category.get(c, 0) for ph in r.phases.values())]
    fig, ax = plt.subplots(figsize=(7, 4))
    for j, peak in enumerate(r.phases.values()):
        bottom = 0
        for c in cats:
            v = peak.by_category.get(c, 0)
            ax.bar(j, v / 1e9, bottom=bottom / 1e9, color=COLORS[c], label=c.replace("_", " ") if j == 0 else None)
            bottom += v
    ax.set_xticks(range(len(r.phases)), list(r.phases))
    ax.set_ylabel("GB at the phase's peak")
    ax.set_title(f"{measured.spec.name} ({measured.spec.shape.n_layers} layers), {precision}: live bytes at each "
                 "phase's peak (measured, fake tensors)", fontsize=9)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
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
                    c1_baseline_total_bytes=self.state_bytes + self.activation_bytes,
                    c1_baseline_measured_peak_bytes=self.measured.peak_bytes,
                    c1_baseline_state_exact=int(self.state_exact))

    def text(self) -> str:
        return (f"{self.spec.name}: {parameter_count(self.spec):,} parameters; mixed-precision state "
                f"{format_bytes(self.state_bytes)} + activations {format_bytes(self.activation_bytes)} (GPU kernels) = "
                f"{format_bytes(self.state_bytes + self.activation_bytes)}\nmeasured "
                f"({self.measured_spec.shape.n_layers} layers, fake tensors): peak of one step "
                f"{format_bytes(self.measured.peak_bytes)}; state analytic == measured: {self.state_exact}")

    def check(self) -> None:
        if not self.state_exact:
            raise AssertionError(f"analytic and measured training state of {self.spec.name} disagree")


def c1_baseline(spec: ModelSpec, measured_layers: int, batch_size: int, seq_len: int, device: str) -> C1Baseline:
    small = measured_spec(spec, measured_layers)
    measured = measure_training_step(small, batch_size, seq_len, "bf16_mixed", fake=True, device=device)
    analytic = training_state_bytes(small, "bf16_mixed")
    return C1Baseline(spec, training_state_bytes(spec, "bf16_mixed")["total"],
                      activation_bytes(spec, batch_size, seq_len, "bf16_mixed", device_type="cuda")["total"], measured,
                      small, all(measured.max_by_category[k] == analytic[k] for k in STATE_CATEGORIES))


def c4_texts(accounting: Accounting, measured: Measured, metrics: dict[str, float], batch_size: int, seq_len: int,
             card_gb: int) -> dict[str, str]:
    """``scale``, ``measured_text`` and ``note`` for C4's verdict."""
    layers = measured.spec.shape.n_layers
    how = ("measured (fake tensors, full model)" if layers == accounting.spec.shape.n_layers
           else f"analytic (measured at {layers} layers)")
    post, mixed = metrics["post_accounting_bytes"], metrics["mixed_precision_bytes"]
    act = metrics["mixed_with_activations_bytes"] - mixed
    return dict(
        scale=(f"{_display(accounting.spec)} architecture ({accounting.n_params / 1e9:.1f}B params), {how}; "
               f"activations at {batch_size}x{seq_len} tokens"),
        measured_text=(f"post's accounting {post / 1e12:.3f} TB; mixed precision {mixed / 1e12:.3f} TB "
                       f"+ {act / 1e12:.3f} TB activations"),
        note=f"{metrics['cards_needed']} x {card_gb} GB cards for state + activations",
    )


__all__ = ["Accounting", "C1Baseline", "Measured", "analytic_accounting", "c1_baseline", "c4_texts",
           "full_size_state", "headline", "measure_steps", "measured_spec", "plot_bytes_by_category",
           "plot_phase_peaks"]
