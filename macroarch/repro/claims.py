"""The registry of the post's claims (docs/claims.md): what each says, what it targets, how it is graded.

Every claim has an id (C1-C15, R1) that the notebooks, the result files, W&B runs and the paper share.
A notebook measures numbers; :meth:`Claim.grade` turns them into a graded :class:`Verdict` with one rule
per claim, written here once so that no notebook grades by eye:

- ``reproduced``: every target is met within its tolerance;
- ``partially``: the effect points the way the post says, but its size is off (or only some targets hold);
- ``not reproduced``: no effect of note (less than ``noise`` of the claimed effect) or the claim's
  figure is off with nothing pointing the other way;
- ``contradicted``: the measured effect points the other way;
- ``not testable here``: the notebook says why and what would test it.

A target's *null* is what "no effect" would measure (a ratio of 1, a reduction of 0); it is what lets the
grader tell "too small" (partially) from "the other way" (contradicted).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from macroarch.config import ConfigError

REPRODUCED = "reproduced"
PARTIALLY = "partially"
NOT_REPRODUCED = "not reproduced"
CONTRADICTED = "contradicted"
NOT_TESTABLE = "not testable here"
GRADES = (REPRODUCED, PARTIALLY, NOT_REPRODUCED, CONTRADICTED, NOT_TESTABLE)

_KINDS = ("value", "range", "at_least", "at_most")


@dataclass(frozen=True)
class Target:
    """One number the post states, and how close a measurement must come to it.

    Attributes:
        metric: name of the measured metric the target applies to (a key of the notebook's metrics).
        kind: ``value`` (equal within ``rel_tol``), ``range`` (``lo <= x <= hi``, widened by ``rel_tol``),
            ``at_least`` / ``at_most`` (one-sided, with ``rel_tol`` of slack).
        value: the stated number for ``value``, ``at_least`` and ``at_most``.
        lo, hi: the stated range for ``range``.
        rel_tol: relative slack, as a fraction of the stated number.
        null: what "no effect" measures; ``None`` when the claim has no direction to get wrong.
        noise: an effect smaller than this fraction of the claimed effect counts as no effect.
        text: how the post says it, for tables.
    """

    metric: str
    kind: str
    value: float | None = None
    lo: float | None = None
    hi: float | None = None
    rel_tol: float = 0.05
    null: float | None = None
    noise: float = 0.1
    text: str = ""

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"Target {self.metric!r}: kind must be one of {_KINDS}, got {self.kind!r}")
        if self.kind == "range":
            if self.lo is None or self.hi is None or self.lo > self.hi:
                raise ValueError(f"Target {self.metric!r}: a range needs lo <= hi, got lo={self.lo}, hi={self.hi}")
        elif self.value is None:
            raise ValueError(f"Target {self.metric!r}: kind {self.kind!r} needs a value")
        if self.rel_tol < 0:
            raise ValueError(f"Target {self.metric!r}: rel_tol must be >= 0, got {self.rel_tol}")

    @property
    def center(self) -> float:
        return (self.lo + self.hi) / 2 if self.kind == "range" else self.value

    def met(self, x: float) -> bool:
        if self.kind == "range":
            return self.lo - self.rel_tol * abs(self.lo) <= x <= self.hi + self.rel_tol * abs(self.hi)
        slack = self.rel_tol * abs(self.value)
        if self.kind == "value":
            return abs(x - self.value) <= slack
        if self.kind == "at_least":
            return x >= self.value - slack
        return x <= self.value + slack

    def grade(self, x: float) -> str:
        """Grade one measurement against this target alone."""
        if x is None or not math.isfinite(x):
            raise ValueError(f"Target {self.metric!r}: measurement is not a finite number: {x!r}")
        if self.met(x):
            return REPRODUCED
        if self.null is None:
            return NOT_REPRODUCED
        claimed, measured = self.center - self.null, x - self.null
        if abs(measured) < self.noise * abs(claimed):
            return NOT_REPRODUCED
        return PARTIALLY if (measured > 0) == (claimed > 0) else CONTRADICTED

    def describe(self) -> str:
        if self.text:
            return self.text
        if self.kind == "range":
            return f"{self.metric} in [{self.lo:g}, {self.hi:g}]"
        sign = {"value": "=", "at_least": ">=", "at_most": "<="}[self.kind]
        return f"{self.metric} {sign} {self.value:g}"


@dataclass(frozen=True)
class Verdict:
    """A graded verdict, as it goes into result.json, W&B and the paper's table."""

    grade: str
    measured: str
    target: str
    scale: str
    note: str = ""

    def __post_init__(self) -> None:
        if self.grade not in GRADES:
            raise ValueError(f"unknown grade {self.grade!r}; expected one of {GRADES}")
        if not self.scale:
            raise ValueError("a verdict must state the scale it was measured at")

    def to_dict(self) -> dict[str, str]:
        return {"grade": self.grade, "measured": self.measured, "target": self.target,
                "scale": self.scale, "note": self.note}

    @classmethod
    def from_dict(cls, d: Mapping[str, str]) -> Verdict:
        return cls(**{k: d.get(k, "") for k in ("grade", "measured", "target", "scale", "note")})


def combine(grades: list[str]) -> str:
    """Overall grade of a claim with several targets: all met, or the mixture says which way it leans."""
    if not grades:
        raise ValueError("no grades to combine")
    if all(g == REPRODUCED for g in grades):
        return REPRODUCED
    if all(g == NOT_TESTABLE for g in grades):
        return NOT_TESTABLE
    graded = [g for g in grades if g != NOT_TESTABLE]
    if all(g == CONTRADICTED for g in graded):
        return CONTRADICTED
    if all(g in (NOT_REPRODUCED, CONTRADICTED) for g in graded):
        return NOT_REPRODUCED
    return PARTIALLY


Rule = Callable[["Claim", Mapping[str, float]], tuple[str, str]]


@dataclass(frozen=True)
class Claim:
    """One checkable statement of the post.

    ``rule`` replaces the generic grading (every target graded alone, then :func:`combine`) for claims
    whose verdict needs more than one number read together; it returns ``(grade, explanation)``.
    """

    id: str
    section: str
    statement: str
    notebook: str
    targets: tuple[Target, ...]
    measures: str
    rule: Rule | None = field(default=None, compare=False)

    @property
    def target_text(self) -> str:
        return "; ".join(t.describe() for t in self.targets)

    @property
    def grading_text(self) -> str:
        """How a measurement becomes a grade, in words (the rule's docstring, or the generic rule)."""
        if self.rule is not None and self.rule.__doc__:
            return " ".join(self.rule.__doc__.split())
        if len(self.targets) == 1:
            return "the target alone: met within its tolerance, reproduced; the right way but short, partially; " \
                   "within noise of no effect, not reproduced; the other way, contradicted"
        return "each target graded alone (met, partially, not reproduced, contradicted), then combined: all met, " \
               "reproduced; all the other way, contradicted; none met, not reproduced; a mixture, partially"

    def grade(self, measured: Mapping[str, float], *, scale: str, note: str = "",
              measured_text: str | None = None) -> Verdict:
        """Grade measured metrics (a mapping that holds every target's metric) into a :class:`Verdict`."""
        missing = [t.metric for t in self.targets if t.metric not in measured]
        if missing:
            needed = [t.metric for t in self.targets]
            raise KeyError(f"{self.id}: measurement lacks {missing}; the targets need {needed}")
        if self.rule is not None:
            grade, why = self.rule(self, measured)
        else:
            per_target = [(t, t.grade(float(measured[t.metric]))) for t in self.targets]
            grade = combine([g for _, g in per_target])
            why = "; ".join(f"{t.metric}: {g}" for t, g in per_target) if len(per_target) > 1 else ""
        if measured_text is None:
            measured_text = "; ".join(f"{t.metric.replace('_', ' ')} {_fmt(float(measured[t.metric]))}"
                                      for t in self.targets)
        return Verdict(grade=grade, measured=measured_text, target=self.target_text, scale=scale,
                       note="; ".join(s for s in (why, note) if s))

    def not_testable(self, *, why: str, scale: str, measured_text: str = "-") -> Verdict:
        return Verdict(grade=NOT_TESTABLE, measured=measured_text, target=self.target_text, scale=scale, note=why)


def _fmt(x: float) -> str:
    return f"{x:.4g}"


# --- claim-specific rules -------------------------------------------------------------------------------

_CARD_BYTES = 80e9  # one 80 GB card, the post's comparison


def _rule_c4(claim: Claim, m: Mapping[str, float]) -> tuple[str, str]:
    """C4 states an accounting (fp16 weights, grads and Adam m, v: 8 B/param) and a conclusion (far above
    one 80 GB card). The arithmetic is reproduced if our exact count of the real architecture under that
    accounting lands within tolerance of 1.4 TB; the verdict is only ``reproduced`` if the accounting that
    training actually needs (standard mixed precision, 16 B/param) lands there too."""
    post, mixed = claim.targets[0], claim.targets[1]
    post_bytes, mixed_bytes = float(m[post.metric]), float(m[mixed.metric])
    if mixed_bytes <= _CARD_BYTES:
        return CONTRADICTED, "the training state fits on one 80 GB card"
    if not post.met(post_bytes):
        return NOT_REPRODUCED, f"the post's own accounting gives {post_bytes / 1e12:.3f} TB, not 1.4 TB"
    if mixed.met(mixed_bytes):
        return REPRODUCED, "the post's accounting and standard mixed precision agree"
    return PARTIALLY, (f"the post's arithmetic holds ({post_bytes / 1e12:.3f} TB) but counts fp16 optimizer "
                       f"state and no fp32 master; standard mixed-precision Adam needs {mixed_bytes / 1e12:.3f} TB "
                       f"({mixed_bytes / post_bytes:.2f}x), before activations")


def _rule_c8(claim: Claim, m: Mapping[str, float]) -> tuple[str, str]:
    """C8 is two pieces of advice. Master copy: its held-out loss gain at >= 4 accumulation steps against the
    rounding noise (spread of master-copy runs over k): reproduced if the gain clears 2x noise and the gain below 4
    is under half of it (4 is where it starts to matter); partially if it helps as much below 4; not reproduced
    within noise; contradicted if it hurts. The scale rule: its own target."""
    gain, below = float(m["master_copy_loss_gain"]), float(m["master_copy_loss_gain_below_4"])
    noise = 2.0 * float(m["master_copy_noise"])
    if gain < -noise:
        master = CONTRADICTED
    elif gain <= noise:
        master = NOT_REPRODUCED
    else:
        master = REPRODUCED if below < 0.5 * gain else PARTIALLY
    rule = claim.targets[1]
    scale = rule.grade(float(m[rule.metric]))
    return combine([master, scale]), (f"master copy {master}: gain {gain:+.4g} at k >= 4, {below:+.4g} below 4 "
                                      f"(noise {noise / 2:.2g}); scale rule {scale}")


def _rule_c10(claim: Claim, m: Mapping[str, float]) -> tuple[str, str]:
    """best_lr_multiplier within 1.2-1.5: reproduced. Otherwise the seed-bootstrap interval decides: containing 1,
    no shift is distinguishable from noise (not reproduced); wholly below 1, contradicted; above 1, partially."""
    t = claim.targets[0]
    x = float(m[t.metric])
    lo, hi = float(m.get("best_lr_multiplier_lo", x)), float(m.get("best_lr_multiplier_hi", x))
    if t.met(x):
        return REPRODUCED, ""
    if lo <= 1.0 <= hi:
        return NOT_REPRODUCED, f"90% interval {lo:.2f}-{hi:.2f} contains 1: no LR shift beyond seed noise"
    if hi < 1.0:
        return CONTRADICTED, "the optimum moves down"
    return PARTIALLY, "the optimum moves up, by another amount"


def _rule_c11(claim: Claim, m: Mapping[str, float]) -> tuple[str, str]:
    """C11: each card's theoretical and achieved speedup, predicted by a step-time model whose error (relative, on
    the speed ratio, measured where the model can be checked) is ``model_ratio_error``. A prediction meets the
    post's figure if the figure lies within that error of it (or the target's tolerance); otherwise the direction
    decides: an interval holding 1 is no effect (not reproduced), one wholly below 1 contradicts a speedup, one
    above 1 but short of (or past) the figure is partially. The ECC advice is its own target."""
    err = float(m.get("model_ratio_error", 0.0))
    grades, why = [], []
    for t in claim.targets:
        x = float(m[t.metric])
        if t.metric.startswith("ecc"):
            g = t.grade(x)
            why.append(f"ECC advice {g} (disabling it {x:.3f}x as the cards ship)")
        else:
            lo, hi = x * (1 - err), x * (1 + err)
            if t.met(x) or lo <= t.value <= hi:
                g = REPRODUCED
            elif lo <= 1.0 <= hi:
                g = NOT_REPRODUCED
            else:
                g = CONTRADICTED if hi < 1.0 else PARTIALLY
            why.append(f"{t.text} -> {x:.2f}x: {g}")
        grades.append(g)
    return combine(grades), "; ".join(why)


def _rule_c12(claim: Claim, m: Mapping[str, float]) -> tuple[str, str]:
    """C12: the peak-memory reduction of MVAS + DGR at the stated crop (``memory_reduction``) against 55%, graded by
    the target; the reductions at the other crops measured (``memory_reduction_<crop>``) go in the explanation."""
    t = claim.targets[0]
    x = float(m[t.metric])
    crops = sorted(int(k.rsplit("_", 1)[1]) for k in m if k.startswith("memory_reduction_") and k[17:].isdigit())
    per_crop = ", ".join(f"{c}: {float(m[f'memory_reduction_{c}']):.0%}" for c in crops)
    return t.grade(x), (f"reduction by crop {per_crop}" if per_crop else "")


def _per_budget(m: Mapping[str, float], prefix: str) -> list[tuple[str, float]]:
    """``(budget, value)`` of every metric ``<prefix><budget>gb``, in increasing budget."""
    found = [(k[len(prefix):-2], float(v)) for k, v in m.items() if k.startswith(prefix) and k.endswith("gb")]
    return sorted(found, key=lambda kv: float(kv[0]))


def _rule_c13(claim: Claim, m: Mapping[str, float]) -> tuple[str, str]:
    """C13: the batch growth (largest batch with MVAS + DGR over the largest without) at every budget measured
    (``batch_growth_<N>gb``), each graded by the 4x target (at least 3.8x; under 1.3x counts as no effect, below
    1x contradicts), combined; ``batch_growth`` alone when no budget is broken out."""
    t = claim.targets[0]
    cells = _per_budget(m, "batch_growth_") or [("", float(m[t.metric]))]
    grades = [t.grade(x) for _, x in cells]
    return combine(grades), "; ".join(f"{b} GB: {x:.2f}x {g}" if b else f"{x:.2f}x {g}"
                                      for (b, x), g in zip(cells, grades))


def _rule_c14(claim: Claim, m: Mapping[str, float]) -> tuple[str, str]:
    """C14: per model and budget, the longest clip with the techniques (``max_frames_<model>_<N>gb``) against 128
    frames and against the baseline's (``baseline_frames_<model>_<N>gb``): reaching 128 is reproduced (the note
    says when the baseline reaches it too, i.e. the techniques are not what makes it fit); short of 128 but longer
    than the baseline's is partially; no longer is not reproduced; shorter is contradicted. Combined over cells;
    ``max_frames`` alone when no cell is broken out."""
    t = claim.targets[0]
    cells = sorted(k[len("max_frames_"):] for k in m if k.startswith("max_frames_") and k.endswith("gb"))
    if not cells:
        return t.grade(float(m[t.metric])), ""
    grades, why = [], []
    for cell in cells:
        x, base = float(m[f"max_frames_{cell}"]), float(m.get(f"baseline_frames_{cell}", 0.0))
        if t.met(x):
            g = REPRODUCED
        else:
            g = PARTIALLY if x > base else (CONTRADICTED if x < base else NOT_REPRODUCED)
        grades.append(g)
        why.append(f"{cell}: {x:.0f} frames (baseline {base:.0f}){' - baseline also >= 128' if t.met(base) else ''}")
    return combine(grades), "; ".join(why)


def _rule_c15(claim: Claim, m: Mapping[str, float]) -> tuple[str, str]:
    """C15: memory is the reduction at the batch where the standard mixed-precision baseline holds 48 GB (mean over
    the open_clip models measured), graded by the -40% target; quality is kept unless the held-out recall@1 gap's
    seed interval (``retrieval_gap_lo``) lies wholly above the tolerance. Both: reproduced; memory as claimed with
    quality lost: partially; otherwise the memory grade."""
    memory, quality = claim.targets
    grade = memory.grade(float(m[memory.metric]))
    lo = float(m.get("retrieval_gap_lo", m[quality.metric]))
    kept = lo <= quality.value
    why = (f"memory {grade}; held-out recall@1 gap {float(m[quality.metric]) * 100:+.1f} points "
           f"({'within' if kept else 'beyond'} {quality.value * 100:g} points over the seed interval)")
    if grade == REPRODUCED and not kept:
        return PARTIALLY, why
    return grade, why


# --- the registry ---------------------------------------------------------------------------------------

def _c(id, section, statement, notebook, measures, *targets, rule=None) -> Claim:
    return Claim(id=id, section=section, statement=statement, notebook=notebook, measures=measures,
                 targets=tuple(targets), rule=rule)


CLAIMS: dict[str, Claim] = {c.id: c for c in (
    _c("C1", "1", "The full macro-architecture (MVAS + DGR) cuts the training memory of a ~10B model by more "
       "than 40% without losing quality.", "05_mvas_llama",
       "exact training-state + activation bytes of a ~10B config with and without MVAS+DGR (fake tensors); "
       "quality gap at small scale",
       Target("memory_reduction", "at_least", 0.40, rel_tol=0.0, null=0.0, text="memory reduction > 40%"),
       Target("quality_gap", "at_most", 0.005, rel_tol=0.0, text="quality unchanged (gap <= 0.5 points)")),
    _c("C2", "2.1", "Backpropagated gradients grow exponentially with depth when weight singular values exceed 1 "
       "and vanish exponentially when they are below 1.", "01_gradient_explosion",
       "per-layer gradient norms vs depth for controlled spectra; fitted log-growth rate vs log(sigma)",
       Target("rate_rel_error", "at_most", 0.10, rel_tol=0.0,
              text="linear stacks: per-layer growth rate = log(sigma) (relative error <= 10%)"),
       Target("mlp_rate_rel_error", "at_most", 0.25, rel_tol=0.0,
              text="nonlinear (tanh) stacks: growth rate follows the weights' log(sigma) (relative error <= 25%)")),
    _c("C3", "2.1", "Frequent gradient clipping in BERT-large training lowers the effective learning rate by "
       "27-35% and slows convergence.", "01_gradient_explosion",
       "1 - mean ||clipped update|| / ||unclipped update|| on identical gradient streams; steps to a target loss",
       Target("effective_lr_reduction", "range", lo=0.27, hi=0.35, rel_tol=0.0, null=0.0,
              text="effective LR reduction 27-35% (AdamW, clip at 1.0)"),
       Target("convergence_slowdown", "at_least", 1.1, rel_tol=0.0, null=1.0,
              text="slower convergence (steps to target, clipped / unclipped >= 1.1)")),
    _c("C4", "2.2", "GPT-3 175B needs 350 GB of fp16 weights + 350 GB of gradients + 700 GB of Adam state = 1.4 TB, "
       "far beyond one 80 GB card.", "02_memory_wall",
       "exact bytes of the real 175B architecture under the post's accounting and under standard mixed "
       "precision (16 B/param), plus activations; analytic and measured (fake tensors)",
       Target("post_accounting_bytes", "value", 1.4e12, rel_tol=0.05, text="1.4 TB (post's fp16 accounting)"),
       Target("mixed_precision_bytes", "value", 1.4e12, rel_tol=0.05,
              text="1.4 TB for what training needs (mixed precision)"),
       rule=_rule_c4),
    _c("C5", "2.2", "Under ZeRO-3, once communication latency exceeds 200 us, parameter synchronisation takes "
       "over 38% of each training step.", "03_zero3_communication",
       "share of a step spent in ZeRO-3 gathers/reduce-scatters vs latency, alpha-beta model calibrated on "
       "real collectives",
       Target("sync_share_at_200us", "at_least", 0.38, rel_tol=0.05, null=0.0, text="sync share > 38% at 200 us")),
    _c("C6", "3.1", "DGR (topology-aware groups, interleaved asynchronous group updates, delay compensation) cuts "
       "gradient variance to 1/8 of conventional training on a 256-layer Transformer.", "04_dgr_variance",
       "gradient variance across mini-batches and across layers, DGR vs plain, same data and seeds",
       Target("variance_reduction_factor", "at_least", 8.0, rel_tol=0.1, null=1.0,
              text="variance reduced 8x (to 1/8)")),
    _c("C7", "3.2", "MVAS (Hessian-diagonal importance, fp16 for important and fp8/fp4 for the rest, re-planned "
       "by phase) takes Llama-65B from 320 GB to 192 GB at 0.92x speed and 78.2% -> 77.9% accuracy.",
       "05_mvas_llama",
       "exact memory of the real 65B architecture per policy (fake tensors); speed ratio and quality gap of a "
       "small Llama trained for real",
       Target("memory_reduction", "at_least", 0.40, rel_tol=0.1, null=0.0, text="320 -> 192 GB (-40%)"),
       Target("speed_ratio", "at_least", 0.92, rel_tol=0.02, null=1.0, text="0.92x speed"),
       Target("accuracy_gap", "at_most", 0.003, rel_tol=0.0, text="78.2% -> 77.9% (gap 0.3 points)")),
    _c("C8", "4.1", "With >= 4 gradient-accumulation steps keep an fp32 master copy; scale gradients by "
       "2^5 / max_grad_norm.", "06_mixed_precision",
       "loss and precision with and without the master copy across accumulation steps; the scale rule vs "
       "torch.amp.GradScaler",
       Target("master_copy_loss_gain", "at_least", 0.0, rel_tol=0.0,
              text="master copy helps from accumulation >= 4 (and not below)"),
       Target("scale_rule_vs_gradscaler", "at_least", 1.0, rel_tol=0.05, null=1.0,
              text="scale rule no worse than GradScaler"),
       rule=_rule_c8),
    _c("C9", "4.2", "On 8xA100: batch all-reduces into 200 ms windows, set NCCL_ASYNC_ERROR_HANDLING=0, and make "
       "gradient buckets a multiple of 8 MB.", "07_comm_bucketing",
       "bucketed all-reduce vs DDP's default buckets on torch.distributed: throughput, collectives, correctness",
       Target("bucket_speedup_vs_ddp", "at_least", 1.0, rel_tol=0.02, null=1.0,
              text="8 MB-multiple buckets at least as fast as DDP's 25 MB default"),
       Target("aligned_throughput_ratio", "at_least", 1.05, rel_tol=0.0, null=1.0, noise=5.0,
              text="buffers on the 8 MB grid all-reduce >= 5% faster per byte")),
    _c("C10", "5.1", "Start the learning rate at 1.2-1.5x the usual value, lengthen warmup by 30%, and trigger "
       "automatic scaling when the loss moves by more than 15%.", "08_convergence_recipe",
       "sweep of LR multiplier and warmup with and without the macro-architecture; loss-spike guard",
       Target("best_lr_multiplier", "range", lo=1.2, hi=1.5, rel_tol=0.0, null=1.0,
              text="macro-stack LR optimum 1.2-1.5x plain's"),
       rule=_rule_c10),
    _c("C11", "5.2", "Speedups A100 3.2x theoretical / 2.8x achieved, V100 2.1x / 1.7x, RTX 3090 1.8x / 1.3x; "
       "consumer cards should disable ECC.", "09_hardware_speedups",
       "a step-time model from each card's published specs, validated against measured step times where it can "
       "run; what ECC costs on each card",
       Target("a100_theoretical_speedup", "value", 3.2, rel_tol=0.1, null=1.0, text="A100 3.2x theoretical"),
       Target("a100_achieved_speedup", "value", 2.8, rel_tol=0.1, null=1.0, text="A100 2.8x achieved"),
       Target("v100_theoretical_speedup", "value", 2.1, rel_tol=0.1, null=1.0, text="V100 2.1x theoretical"),
       Target("v100_achieved_speedup", "value", 1.7, rel_tol=0.1, null=1.0, text="V100 1.7x achieved"),
       Target("rtx3090_theoretical_speedup", "value", 1.8, rel_tol=0.1, null=1.0, text="RTX 3090 1.8x theoretical"),
       Target("rtx3090_achieved_speedup", "value", 1.3, rel_tol=0.1, null=1.0, text="RTX 3090 1.3x achieved"),
       Target("ecc_disable_speedup", "at_least", 1.01, rel_tol=0.0, null=1.0, noise=0.5,
              text="disabling ECC speeds consumer cards up"),
       rule=_rule_c11),
    _c("C12", "6", "AlphaFold2-style models need 55% less memory.", "10_applications",
       "memory of an Evoformer-style block stack with and without the techniques",
       Target("memory_reduction", "value", 0.55, rel_tol=0.1, null=0.0, text="memory -55%"),
       rule=_rule_c12),
    _c("C13", "6", "PointNet can train with a 4x larger batch.", "10_applications",
       "largest batch under a fixed memory budget, with and without",
       Target("batch_growth", "at_least", 4.0, rel_tol=0.05, null=1.0, text="batch 4x"),
       rule=_rule_c13),
    _c("C14", "6", "Video understanding models reach 128 frames of temporal context.", "10_applications",
       "longest clip under a fixed memory budget for a space-time transformer, with and without",
       Target("max_frames", "at_least", 128.0, rel_tol=0.0, text="128 frames"),
       rule=_rule_c14),
    _c("C15", "6", "Joint CLIP image+text training drops from 48 GB to 29 GB with group_size 6, text fp16 and "
       "image fp8 (shallow) / fp16 (deep).", "11_clip",
       "exact memory of a real open_clip model under that policy; quality gap of a small CLIP trained for real",
       Target("memory_reduction", "value", 1 - 29 / 48, rel_tol=0.1, null=0.0, text="48 -> 29 GB (-40%)"),
       Target("retrieval_gap", "at_most", 0.02, rel_tol=0.0,
              text="retrieval unchanged (held-out recall@1 gap <= 2 points)"),
       rule=_rule_c15),
    _c("R1", "(added)", "mHC: projecting Hyper-Connection mixing onto doubly stochastic matrices keeps the composite "
       "signal gain bounded (about 1.6) where unconstrained HC explodes (about 3000 at 27B).",
       "01_gradient_explosion",
       "composite gain of residual, HC and mHC mixing vs depth; gradient norms and training stability",
       Target("mhc_peak_gain", "at_most", 2.0, rel_tol=0.0, null=None, text="mHC peak gain ~1.6 (<= 2)"),
       Target("hc_over_mhc_gain", "at_least", 10.0, rel_tol=0.0, null=1.0, text="HC gain >> mHC gain")),
)}


def get_claim(claim_id: str) -> Claim:
    """The claim with that id; a :class:`ConfigError` that lists the known ids otherwise."""
    try:
        return CLAIMS[claim_id]
    except KeyError:
        raise ConfigError(f"unknown claim id {claim_id!r}; known ids: {', '.join(CLAIMS)}") from None


def parse_claim_ids(text: str) -> list[str]:
    """``"C4,C7"`` -> ``["C4", "C7"]``, rejecting unknown ids by name."""
    ids = [s.strip().upper() for s in text.split(",") if s.strip()]
    if not ids:
        raise ConfigError("no claim ids given")
    for i in ids:
        get_claim(i)
    return ids
