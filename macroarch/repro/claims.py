"""The registry of the post's claims (docs/claims.md): what each says, what it targets, how it is graded.

Every claim has an id (C1-C15, R1) that the notebooks, the result files, W&B runs and the paper share.
A notebook measures numbers; :meth:`Claim.grade` turns them into a graded :class:`Verdict`, by rules written
here once, so that no notebook grades by eye.

Each :class:`Target` fixes, before any run grades it: the target region (what the post claims), a
*no-effect band* (practical equivalence: what counts as no effect, with the reason it is that wide), a
direction and the confidence level (90%). A graded number is an :class:`~macroarch.measure.stats.Estimate`
with an interval, and the grade is decided from the interval, never from the point:

- ``reproduced``: the interval lies inside the target region;
- ``partially``: the interval lies wholly on the claimed side of the no-effect band but outside the target
  (short of it; for a two-sided target, short of it or past it);
- ``not reproduced``: the interval lies inside the no-effect band (or, for a target without a band, wholly
  outside the target region);
- ``contradicted``: the interval lies wholly on the other side of the no-effect band;
- ``inconclusive``: the interval crosses a boundary between those regions; the verdict states the n that
  would decide it (:func:`macroarch.measure.stats.n_to_decide`: the run's own spread, Student's t);
- ``not testable here``: the number is modelled or looked up (or its model failed its own validation
  bound); the verdict says what measurement would test it.

Directions: ``at least`` (the target is ``x >= lo``: over-delivering is reproduced), ``at most`` (``x <= hi``),
``two-sided`` (``lo <= x <= hi``), ``no worse than`` (a non-inferiority claim: the region is the no-effect
band and everything on its better side, so the only grades are reproduced, contradicted and inconclusive).

What a claim's metrics may hold, under each target's metric key:

- an :class:`~macroarch.measure.stats.Estimate`, or its :meth:`~macroarch.measure.stats.Estimate.to_dict`
  form (``{"value", "low", "high", "confidence", "n", "method", "kind", "unit", "log_scale"}``; ``low`` and
  ``high`` ``None`` when there is no interval), e.g. ``metrics["aligned_throughput_ratio"] =
  ratio_from_blocks(a, b).to_dict()``;
- a bare number, read by the target's registry entry: for a metric marked ``exact`` (a deterministic count:
  bytes, byte ratios, a largest batch, a frame count) an exact point; for one marked ``modelled`` or
  ``looked up`` a number of that kind (not testable here); for any other a single draw (n = 1, no interval),
  which grades ``inconclusive``. Old keys ``<metric>_lo`` / ``<metric>_hi`` are not read: an interval must say
  its method and n.

Several targets of one claim are combined by :func:`combine` (or the claim's own rule); a target whose grade
is inconclusive stands for every grade its interval spans, and the claim's grade is decided only when every
such choice gives the same combined grade (:func:`settle`). A verdict records, for every graded number, its
estimate (value, interval, n, method, confidence, kind), its grade and the n that would decide it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from itertools import product

from macroarch.config import ConfigError
from macroarch.measure.stats import (
    DEFAULT_CONFIDENCE,
    EXACT,
    KINDS,
    LOOKED_UP,
    MEASURED,
    MODELLED,
    Estimate,
    as_estimate,
    exact,
    is_estimate_dict,
    modelled,
    n_to_decide,
)

REPRODUCED = "reproduced"
PARTIALLY = "partially"
NOT_REPRODUCED = "not reproduced"
CONTRADICTED = "contradicted"
INCONCLUSIVE = "inconclusive"
NOT_TESTABLE = "not testable here"
GRADES = (REPRODUCED, PARTIALLY, NOT_REPRODUCED, CONTRADICTED, INCONCLUSIVE, NOT_TESTABLE)

AT_LEAST, AT_MOST, TWO_SIDED, NO_WORSE = "at least", "at most", "two-sided", "no worse than"
DIRECTIONS = (AT_LEAST, AT_MOST, TWO_SIDED, NO_WORSE)


@dataclass(frozen=True)
class Target:
    """One number the post states, the region that reproduces it and the band that counts as no effect.

    Attributes:
        metric: the key of the notebook's metrics the target grades.
        direction: ``at least`` (``lo`` only), ``at most`` (``hi`` only), ``two-sided`` (both) or
            ``no worse than`` (``lo`` only: higher is better; or ``hi`` only: lower is better).
        lo, hi: the target region's edges (closed); the post's tolerance, where it has one, is folded in.
        no_effect: the practical-equivalence band ``(low, high)`` (closed): a number inside it is no effect.
            ``None`` where the claim has no direction to get wrong (an accounting, a bound on a gain).
        reason: why the band is that wide (or why there is none); required.
        confidence: the confidence an estimate's interval must have (at least) to be graded.
        exact: a bare number under ``metric`` is a deterministic count (an exact point).
        kind: what a bare number under ``metric`` is: ``measured``, ``modelled`` or ``looked up``.
        tested_by: what measurement would test the target where its number is modelled or looked up.
        text: how the post says it, for tables.
    """

    metric: str
    direction: str
    lo: float | None = None
    hi: float | None = None
    no_effect: tuple[float, float] | None = None
    reason: str = ""
    confidence: float = DEFAULT_CONFIDENCE
    exact: bool = False
    kind: str = MEASURED
    tested_by: str = ""
    text: str = ""

    def __post_init__(self) -> None:
        name = f"Target {self.metric!r}"
        if self.direction not in DIRECTIONS:
            raise ValueError(f"{name}: direction must be one of {DIRECTIONS}, got {self.direction!r}")
        lo, hi, band = self.lo, self.hi, self.no_effect
        need = {AT_LEAST: (True, False), AT_MOST: (False, True), TWO_SIDED: (True, True)}.get(self.direction)
        if need is not None and ((lo is not None, hi is not None) != need):
            raise ValueError(f"{name}: {self.direction!r} needs " +
                             {AT_LEAST: "lo only", AT_MOST: "hi only", TWO_SIDED: "lo and hi"}[self.direction] +
                             f", got lo={lo}, hi={hi}")
        if self.direction == NO_WORSE and (lo is None) == (hi is None):
            raise ValueError(f"{name}: 'no worse than' needs lo (higher is better) or hi (lower is better), "
                             f"not both or neither; got lo={lo}, hi={hi}")
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"{name}: a target region needs lo <= hi, got lo={lo}, hi={hi}")
        if band is not None:
            if len(band) != 2 or band[0] > band[1]:
                raise ValueError(f"{name}: no_effect must be (low, high) with low <= high, got {band}")
            object.__setattr__(self, "no_effect", (float(band[0]), float(band[1])))
            band = self.no_effect
            ok = {AT_LEAST: lambda: band[1] <= lo, AT_MOST: lambda: band[0] >= hi,
                  TWO_SIDED: lambda: band[1] <= lo or band[0] >= hi,
                  NO_WORSE: lambda: (band[0] >= lo) if lo is not None else (band[1] <= hi)}[self.direction]()
            if not ok:
                raise ValueError(f"{name}: the no-effect band {band} overlaps the target region "
                                 f"[{lo}, {hi}] the wrong way for {self.direction!r}")
        elif self.direction == NO_WORSE:
            raise ValueError(f"{name}: 'no worse than' needs a no-effect band (its margin)")
        if not self.reason:
            raise ValueError(f"{name}: give the reason for the no-effect band (or for having none)")
        if not 0 < self.confidence < 1:
            raise ValueError(f"{name}: confidence must be in (0, 1), got {self.confidence}")
        if self.kind not in KINDS:
            raise ValueError(f"{name}: kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind != MEASURED and not self.tested_by:
            raise ValueError(f"{name}: a {self.kind} number needs tested_by (what measurement would test it)")
        if self.exact and self.kind != MEASURED:
            raise ValueError(f"{name}: only a measured number can be an exact count")

    # --- the regions ------------------------------------------------------------------------------------

    @property
    def claimed_side(self) -> int:
        """+1 where the claim lies above the no-effect band, -1 below (0: no band)."""
        if self.no_effect is None:
            return 0
        if self.direction == AT_LEAST or (self.direction == NO_WORSE and self.lo is not None):
            return 1
        if self.direction in (AT_MOST, NO_WORSE):
            return -1
        return 1 if self.lo >= self.no_effect[1] else -1

    @property
    def boundaries(self) -> tuple[float, ...]:
        """Every finite edge between regions, sorted."""
        edges = {x for x in (self.lo, self.hi) if x is not None} | set(self.no_effect or ())
        return tuple(sorted(edges))

    def in_target(self, x: float) -> bool:
        return (self.lo is None or x >= self.lo) and (self.hi is None or x <= self.hi)

    def region(self, x: float) -> str:
        """The grade a point ``x`` would get."""
        if self.in_target(x):
            return REPRODUCED
        band = self.no_effect
        if band is None:
            return NOT_REPRODUCED
        if band[0] <= x <= band[1]:
            return NOT_REPRODUCED
        return PARTIALLY if (1 if x > band[1] else -1) == self.claimed_side else CONTRADICTED

    def regions_over(self, low: float, high: float) -> frozenset[str]:
        """The grades of every point of ``[low, high]`` (regions are intervals: probe edges and gaps)."""
        pts = sorted({low, high, *(b for b in self.boundaries if low < b < high)})
        probes = pts + [(a + b) / 2 for a, b in zip(pts, pts[1:])]
        return frozenset(self.region(p) for p in probes)

    @property
    def reachable(self) -> frozenset[str]:
        """Every grade a number could get against this target."""
        b = self.boundaries
        span = (b[-1] - b[0]) or abs(b[0]) or 1.0
        return self.regions_over(b[0] - span, b[-1] + span)

    # --- grading ----------------------------------------------------------------------------------------

    def estimate_of(self, x: object) -> Estimate:
        """What the metrics hold under this target's key, as an Estimate (see the module docstring)."""
        if isinstance(x, Estimate):
            return x
        if is_estimate_dict(x):
            return as_estimate(x)
        if hasattr(x, "item") and callable(x.item):
            x = x.item()
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
            raise ValueError(f"Target {self.metric!r}: measurement is not a finite number or an Estimate: {x!r}")
        if self.kind == MODELLED:
            return Estimate(x, n=1, method="model output (no validation error given)", kind=MODELLED)
        if self.kind == LOOKED_UP:
            return Estimate(x, n=1, method="looked up", kind=LOOKED_UP)
        if self.exact:
            return exact(x)
        return Estimate(x, n=1, method="single value")

    def grade(self, x: object, metric: str | None = None) -> Graded:
        """Grade one number (an Estimate, its dict, or a bare number read by the registry) against this target.
        ``metric`` names it when it is a cell of this target (``batch_growth_24gb`` of ``batch_growth``)."""
        metric = metric or self.metric
        est = self.estimate_of(x)
        if est.kind != MEASURED:
            return Graded(metric, self, est, NOT_TESTABLE, frozenset({NOT_TESTABLE}),
                          f"{est.kind} ({est.method}): not testable here; {self.tested_by or 'needs a measurement'} "
                          f"would test it")
        if est.has_interval and est.confidence + 1e-9 < self.confidence:
            raise ValueError(f"{metric}: the interval is at {est.confidence:.0%} confidence; the target grades at "
                             f"{self.confidence:.0%} or more")
        if not est.has_interval:
            return Graded(metric, self, est, INCONCLUSIVE, self.reachable,
                          f"n={est.n}: no interval" + ("" if est.method == "single value" else f" ({est.method})") +
                          "; repeat it (paired seeds or interleaved timing blocks) to decide")
        possible = self.regions_over(est.low, est.high)
        if len(possible) == 1:
            return Graded(metric, self, est, next(iter(possible)), possible, "")
        crossed = [b for b in self.boundaries if est.low <= b <= est.high]
        needs = [n_to_decide(est, b) for b in crossed]
        n = None if any(k is None for k in needs) else max(max(needs), est.n + 1)
        why = (f"the {est.confidence:.0%} interval [{est.low:.4g}, {est.high:.4g}] crosses "
               f"{', '.join(f'{b:g}' for b in crossed)} (spans {', '.join(sorted(possible))}); " +
               (f"n = {n} would decide it (Student's t from this run's spread)" if n is not None else
                "no n decides it (the estimate sits on a boundary)"))
        return Graded(metric, self, est, INCONCLUSIVE, possible, why, n)

    # --- text ----------------------------------------------------------------------------------------

    def region_text(self) -> str:
        if self.direction == TWO_SIDED:
            return f"[{self.lo:g}, {self.hi:g}]"
        if self.lo is not None:
            return f">= {self.lo:g}"
        return f"<= {self.hi:g}"

    def band_text(self) -> str:
        return "none" if self.no_effect is None else f"[{self.no_effect[0]:g}, {self.no_effect[1]:g}]"

    def bare_number_text(self) -> str:
        """What a bare number under this metric is taken for."""
        if self.kind != MEASURED:
            return f"{self.kind} (not testable here; tested by {self.tested_by})"
        return "an exact count" if self.exact else "a single draw (inconclusive: needs an interval)"

    def describe(self) -> str:
        return self.text or f"{self.metric} {self.region_text()}"


@dataclass(frozen=True)
class Graded:
    """One number graded against one target: the estimate, its grade, the grades its interval spans and, for
    an inconclusive one, why and the n that would decide it."""

    metric: str
    target: Target
    estimate: Estimate
    grade: str
    possible: frozenset[str]
    why: str = ""
    n_to_decide: int | None = None

    def record(self) -> dict:
        """What a verdict stores for this number (JSON-ready)."""
        t = self.target
        return {**self.estimate.to_dict(), "grade": self.grade, "n_to_decide": self.n_to_decide,
                "direction": t.direction, "target": [t.lo, t.hi],
                "no_effect": list(t.no_effect) if t.no_effect else None, "target_confidence": t.confidence}

    def text(self) -> str:
        return f"{self.metric}: {self.grade}" + (f" ({self.why})" if self.why else "")


@dataclass(frozen=True)
class Verdict:
    """A graded verdict, as it goes into result.json, W&B and the paper's table.

    ``estimates`` maps each graded number's key to :meth:`Graded.record` (value, interval, n, method,
    confidence, kind, grade, n to decide); verdicts written before it existed have none.
    """

    grade: str
    measured: str
    target: str
    scale: str
    note: str = ""
    estimates: Mapping[str, Mapping] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.grade not in GRADES:
            raise ValueError(f"unknown grade {self.grade!r}; expected one of {GRADES}")
        if not self.scale:
            raise ValueError("a verdict must state the scale it was measured at")

    def to_dict(self) -> dict:
        return {"grade": self.grade, "measured": self.measured, "target": self.target,
                "scale": self.scale, "note": self.note, "estimates": {k: dict(v) for k, v in self.estimates.items()}}

    @classmethod
    def from_dict(cls, d: Mapping) -> Verdict:
        return cls(**{k: d.get(k, "") for k in ("grade", "measured", "target", "scale", "note")},
                   estimates=dict(d.get("estimates") or {}))


def combine(grades: Iterable[str]) -> str:
    """Overall grade of decided per-target grades: all met, reproduced; all the other way, contradicted; none
    met, not reproduced; a mixture, partially. Not-testable targets do not count unless all are."""
    grades = list(grades)
    if not grades:
        raise ValueError("no grades to combine")
    if INCONCLUSIVE in grades:
        raise ValueError("combine() takes decided grades; use settle() for inconclusive ones")
    if all(g == NOT_TESTABLE for g in grades):
        return NOT_TESTABLE
    graded = [g for g in grades if g != NOT_TESTABLE]
    if all(g == REPRODUCED for g in graded):
        return REPRODUCED
    if all(g == CONTRADICTED for g in graded):
        return CONTRADICTED
    if all(g in (NOT_REPRODUCED, CONTRADICTED) for g in graded):
        return NOT_REPRODUCED
    return PARTIALLY


def settle(rule: Callable[[Mapping[str, str]], str], graded: Mapping[str, Graded]) -> str:
    """``rule`` (decided grades by key -> grade) applied to every choice of grade the graded numbers' intervals
    allow: the grade if all choices agree, ``inconclusive`` otherwise."""
    keys = list(graded)
    outcomes = {rule(dict(zip(keys, combo))) for combo in product(*(sorted(graded[k].possible) for k in keys))}
    return outcomes.pop() if len(outcomes) == 1 else INCONCLUSIVE


def settle_combined(graded: Mapping[str, Graded]) -> str:
    return settle(lambda g: combine(g.values()), graded)


Rule = Callable[["Claim", Mapping[str, object], dict[str, Graded]], tuple[str, str]]


@dataclass(frozen=True)
class Claim:
    """One checkable statement of the post.

    ``rule`` replaces the generic grading (every target graded alone, then settled by :func:`combine`) for
    claims whose verdict needs more than the targets' grades read together. It gets the metrics and the graded
    targets (``{metric: Graded}``), may add graded cells to that dict (they are recorded in the verdict), and
    returns ``(grade, explanation)``.
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
        """How the targets' grades become the claim's grade, in words (the rule's docstring, or the generic)."""
        if self.rule is not None and self.rule.__doc__:
            return " ".join(self.rule.__doc__.split())
        if len(self.targets) == 1:
            return "the target alone, from its interval"
        return ("each target from its interval, then combined: all met, reproduced; all the other way, "
                "contradicted; none met, not reproduced; a mixture, partially")

    def target_for(self, metric: str) -> Target:
        for t in self.targets:
            if t.metric == metric:
                return t
        raise KeyError(f"{self.id} has no target {metric!r}")

    def grade(self, measured: Mapping[str, object], *, scale: str, note: str = "",
              measured_text: str | None = None) -> Verdict:
        """Grade measured metrics (a mapping that holds every target's metric) into a :class:`Verdict`."""
        missing = [t.metric for t in self.targets if t.metric not in measured]
        if missing:
            needed = [t.metric for t in self.targets]
            raise KeyError(f"{self.id}: measurement lacks {missing}; the targets need {needed}")
        graded = {t.metric: t.grade(measured[t.metric]) for t in self.targets}
        if self.rule is not None:
            grade, why = self.rule(self, measured, graded)
        else:
            grade = settle_combined(graded)
            why = "; ".join(g.text() for g in graded.values())
        undecided = "; ".join(g.text() for g in graded.values() if g.grade == INCONCLUSIVE and g.text() not in why)
        if measured_text is None:
            measured_text = "; ".join(f"{g.metric.replace('_', ' ')} {g.estimate.describe()}"
                                      for g in graded.values())
        return Verdict(grade=grade, measured=measured_text, target=self.target_text, scale=scale,
                       note="; ".join(s for s in (why, undecided, note) if s),
                       estimates={k: g.record() for k, g in graded.items()})

    def not_testable(self, *, why: str, scale: str, measured_text: str = "-") -> Verdict:
        return Verdict(grade=NOT_TESTABLE, measured=measured_text, target=self.target_text, scale=scale, note=why)


def _fmt(x: float) -> str:
    return f"{x:.4g}"


# --- claim-specific rules -------------------------------------------------------------------------------

_CARD_BYTES = 80e9  # one 80 GB card, the post's comparison


def _rule_c4(claim: Claim, m: Mapping[str, object], g: dict[str, Graded]) -> tuple[str, str]:
    """C4 states an accounting (fp16 weights, grads and Adam m, v: 8 B/param) and a conclusion (far above
    one 80 GB card). The arithmetic is reproduced if our exact count of the real architecture under that
    accounting lands within tolerance of 1.4 TB; the verdict is only ``reproduced`` if the accounting that
    training actually needs (standard mixed precision, 16 B/param) lands there too; training state that fits
    one 80 GB card contradicts it."""
    post, mixed = (g[t.metric] for t in claim.targets)
    e = mixed.estimate
    if not e.has_interval:
        return INCONCLUSIVE, "the mixed-precision bytes have no interval"
    if e.high <= _CARD_BYTES:
        return CONTRADICTED, "the training state fits on one 80 GB card"
    if e.low <= _CARD_BYTES:
        return INCONCLUSIVE, "the training state's interval spans one 80 GB card"

    def rule(x: Mapping[str, str]) -> str:
        if x[post.metric] == NOT_REPRODUCED:
            return NOT_REPRODUCED
        return REPRODUCED if x[mixed.metric] == REPRODUCED else PARTIALLY

    grade = settle(rule, {post.metric: post, mixed.metric: mixed})
    p, q = post.estimate.value, e.value
    if grade == NOT_REPRODUCED:
        return grade, f"the post's own accounting gives {p / 1e12:.3f} TB, not 1.4 TB"
    if grade == REPRODUCED:
        return grade, "the post's accounting and standard mixed precision agree"
    if grade == PARTIALLY:
        return grade, (f"the post's arithmetic holds ({p / 1e12:.3f} TB) but counts fp16 optimizer state and no "
                       f"fp32 master; standard mixed-precision Adam needs {q / 1e12:.3f} TB ({q / p:.2f}x), before "
                       f"activations")
    return grade, "; ".join(x.text() for x in (post, mixed))


def _rule_c8(claim: Claim, m: Mapping[str, object], g: dict[str, Graded]) -> tuple[str, str]:
    """C8 is two pieces of advice. Master copy: its held-out loss gain at >= 4 accumulation steps must clear the
    no-effect band (reproduced if the gain below 4 lies within the band: 4 is where it starts to matter;
    partially if it helps below 4 as well); a gain within the band is not reproduced, a loss contradicts it.
    The scale rule (held-out loss with GradScaler over with the rule): no worse than GradScaler. Combined."""
    gain, below, rule_ = (g[t.metric] for t in claim.targets)

    def master(x: Mapping[str, str]) -> str:
        if x[gain.metric] in (CONTRADICTED, NOT_REPRODUCED):
            return x[gain.metric]
        if x[gain.metric] == PARTIALLY:
            return PARTIALLY
        return REPRODUCED if x[below.metric] == REPRODUCED else PARTIALLY

    pair = {gain.metric: gain, below.metric: below}
    grade = settle(lambda x: combine([master(x), x[rule_.metric]]), {**pair, rule_.metric: rule_})
    return grade, (f"master copy {settle(master, pair)}: gain {gain.estimate.describe()} at k >= 4, "
                   f"{below.estimate.describe()} below 4; scale rule {rule_.grade}")


def _rule_c10(claim: Claim, m: Mapping[str, object], g: dict[str, Graded]) -> tuple[str, str]:
    """The macro stack's LR optimum over plain's (``best_lr_multiplier``) from its interval against 1.2-1.5x,
    with no shift within the no-effect band; an optimum at the edge of the sweep grid (``optimum_at_grid_edge``
    non-zero) is inconclusive: the grid has to bracket the optimum before it can be read."""
    (x,) = g.values()
    if float(m.get("optimum_at_grid_edge", 0) or 0):
        return INCONCLUSIVE, "an optimum lies at the edge of the sweep grid: extend the grid past it"
    return x.grade, x.text()


#: the error on step times the step-time model promises where it is validated (C11's model)
STEP_TIME_MODEL_BOUND = 0.60


def _rule_c11(claim: Claim, m: Mapping[str, object], g: dict[str, Graded]) -> tuple[str, str]:
    """C11: each card's speedup is a prediction of the step-time model (its relative error on speed ratios,
    ``model_ratio_error``, is its interval; its step-time error ``model_step_error`` is checked against the
    model's own bound), and the ECC effect is read from the cards' data sheets: neither is a measurement, so
    both grade not testable here, saying what would test them. A speedup passed in as a measured estimate (on
    the card) is graded from its interval like any other."""
    err = float(m.get("model_ratio_error", 0.0))
    step_err = m.get("model_step_error")
    check = "" if step_err is None else (
        f"; step-time error {float(step_err):.0%} " +
        ("over its" if float(step_err) > STEP_TIME_MODEL_BOUND else "within its") +
        f" {STEP_TIME_MODEL_BOUND:.0%} bound" + (": failed validation" if float(step_err) > STEP_TIME_MODEL_BOUND
                                                 else ""))
    for t in claim.targets:
        raw = m[t.metric]
        if t.kind == MODELLED and not isinstance(raw, Estimate) and not is_estimate_dict(raw):
            g[t.metric] = t.grade(modelled(float(raw), err, model=f"step-time model{check}", unit="x"))
    why = [f"{t.text} -> {g[t.metric].estimate.value:.2f}x: {g[t.metric].grade}" for t in claim.targets]
    untestable = [t for t in claim.targets if g[t.metric].grade == NOT_TESTABLE]
    if untestable:
        why.append("tested by: " + "; ".join(dict.fromkeys(t.tested_by for t in untestable)))
    if check:
        why.append(f"step-time model{check}")
    return settle_combined(g), "; ".join(why)


def _held_out_target() -> Target:
    """C12-C14's quality target: the small model trained with MVAS + DGR against the same model trained without,
    from the same initial weights on the same batches, per training seed (paired seeds: the relative held-out
    loss change is taken per seed, and the interval is over seeds)."""
    return Target("held_out_loss_change", NO_WORSE, hi=0.05, no_effect=(-0.05, 0.05),
                  reason="fixed before the runs: a held-out loss within 5% of the baseline's is what these short "
                         "small-model runs can call unchanged; more than 5% worse is quality lost, which the memory "
                         "saving does not make up for",
                  text="quality kept: held-out loss at most 5% above the baseline's (small model trained with and "
                       "without, paired seeds)")


def _quality_capped(memory_grade: str, quality_grade: str) -> str:
    """The memory grade, lowered to partially where the enabling run lost quality (as C15's rule)."""
    if memory_grade == REPRODUCED and quality_grade == CONTRADICTED:
        return PARTIALLY
    return memory_grade


def _quality_cells(claim: Claim, m: Mapping[str, object], g: dict[str, Graded]) -> dict[str, Graded]:
    """The quality target graded per model (``held_out_loss_change_<model>``), or the one number where the run
    holds no per-model ones."""
    t = next(t for t in claim.targets if t.metric == "held_out_loss_change")
    cells = {k: t.grade(m[k], metric=k) for k in sorted(m) if k.startswith("held_out_loss_change_")}
    if not cells:
        return {t.metric: g[t.metric]}
    g.update(cells)
    return cells


def _quality_text(cells: Mapping[str, Graded]) -> str:
    kept = {REPRODUCED: "kept", CONTRADICTED: "lost"}
    return "; ".join(f"{k.removeprefix('held_out_loss_change_').replace('held_out_loss_change', 'small run')} "
                     f"held-out loss {x.estimate.describe(3)}: {kept.get(x.grade, x.grade)}" for k, x in cells.items())


def _rule_c12(claim: Claim, m: Mapping[str, object], g: dict[str, Graded]) -> tuple[str, str]:
    """C12: the peak-memory reduction of MVAS + DGR at the stated crop against the plain baseline
    (``memory_reduction``) and against the activation-checkpointed one (``memory_reduction_vs_checkpoint``, the
    way AlphaFold2-style models are trained), both exact byte ratios against at least 55% (less 10%): both met,
    reproduced; one, partially; combined by :func:`combine`. The small trunk trained with MVAS + DGR must keep
    its held-out loss (within 5%), else a reproduced memory grade is partially. The reductions at the other crops
    go in the explanation."""
    plain, vs_ckpt = g["memory_reduction"], g["memory_reduction_vs_checkpoint"]
    quality = _quality_cells(claim, m, g)

    def rule(x: Mapping[str, str]) -> str:
        memory = combine([x[plain.metric], x[vs_ckpt.metric]])
        return _quality_capped(memory, combine([x[k] for k in quality]))

    grade = settle(rule, {plain.metric: plain, vs_ckpt.metric: vs_ckpt, **quality})
    crops = sorted(int(k.rsplit("_", 1)[1]) for k in m if k.startswith("memory_reduction_") and k[17:].isdigit())
    per_crop = ", ".join(f"{c}: {float(m[f'memory_reduction_{c}']):.0%}" for c in crops)
    per_ckpt = ", ".join(f"{c}: {float(m[k]):.0%}" for c in crops if (k := f"stack_over_checkpoint_reduction_{c}") in m)
    parts = [f"against the plain baseline {plain.grade}, against the checkpointed one {vs_ckpt.grade}",
             f"reduction by crop {per_crop}" if per_crop else "",
             f"against the checkpointed baseline by crop {per_ckpt}" if per_ckpt else "", _quality_text(quality)]
    return grade, "; ".join(p for p in parts if p)


def _per_budget(m: Mapping[str, object], prefix: str) -> list[tuple[str, str]]:
    """``(budget, key)`` of every metric ``<prefix><budget>gb``, in increasing budget."""
    found = [(k[len(prefix):-2], k) for k in m if k.startswith(prefix) and k.endswith("gb")]
    return sorted(found, key=lambda kv: float(kv[0]))


def _rule_c13(claim: Claim, m: Mapping[str, object], g: dict[str, Graded]) -> tuple[str, str]:
    """C13: the batch growth (largest batch with MVAS + DGR over the largest without, an exact count) at every
    budget measured (``batch_growth_<N>gb``), each graded by the 4x target (at least 3.8x; within the no-effect
    band, no effect; below it, contradicted), combined; ``batch_growth`` alone when no budget is broken out. The
    small PointNet trained with MVAS + DGR must keep its held-out loss (within 5%), else a reproduced batch grade
    is partially."""
    t = claim.targets[0]
    cells = _per_budget(m, "batch_growth_")
    graded = {key: t.grade(m[key], metric=key) for _, key in cells} or {t.metric: g[t.metric]}
    g.update(graded)
    quality = _quality_cells(claim, m, g)

    def rule(x: Mapping[str, str]) -> str:
        return _quality_capped(combine([x[k] for k in graded]), combine([x[k] for k in quality]))

    grade = settle(rule, {**graded, **quality})
    why = "; ".join(f"{b} GB: {graded[k].estimate.value:.2f}x {graded[k].grade}" for b, k in cells)
    return grade, "; ".join(p for p in (why, _quality_text(quality)) if p)


def _rule_c14(claim: Claim, m: Mapping[str, object], g: dict[str, Graded]) -> tuple[str, str]:
    """C14: per model and budget, the longest clip with the techniques (``max_frames_<model>_<N>gb``, an exact
    count) against 128 frames and against the baseline's in the same cell (``baseline_frames_<model>_<N>gb``).
    The claim is that the techniques bring the models to 128 frames, so a cell is reproduced only where they
    reach 128 and the baseline does not; where the baseline reaches 128 as well, nothing is attributable to the
    techniques there and the cell is not reproduced (its note gives both clips); short of 128 but longer than the
    baseline's is partially; no longer, not reproduced; shorter, contradicted. Combined over cells (``max_frames``
    alone when no cell is broken out); every small video model trained with MVAS + DGR must keep its held-out
    loss (within 5%), else a reproduced grade is partially."""
    t = claim.targets[0]
    cells = sorted(k[len("max_frames_"):] for k in m if k.startswith("max_frames_") and k.endswith("gb"))
    quality = _quality_cells(claim, m, g)
    if not cells:
        grade = settle(lambda x: _quality_capped(x[t.metric], combine([x[k] for k in quality])),
                       {t.metric: g[t.metric], **quality})
        return grade, _quality_text(quality)
    grades, why = [], []
    for cell in cells:
        x = t.estimate_of(m[f"max_frames_{cell}"]).value
        base = t.estimate_of(m.get(f"baseline_frames_{cell}", 0.0)).value
        if t.in_target(x) and not t.in_target(base):
            grade = REPRODUCED
        elif t.in_target(x):
            grade = NOT_REPRODUCED  # both reach it: the budget, not the techniques, makes 128 fit
        else:
            grade = PARTIALLY if x > base else (CONTRADICTED if x < base else NOT_REPRODUCED)
        grades.append(grade)
        g[f"max_frames_{cell}"] = Graded(f"max_frames_{cell}", t, exact(x), grade, frozenset({grade}))
        why.append(f"{cell}: {x:.0f} frames (baseline {base:.0f}"
                   f"{', which reaches 128 without the techniques' if t.in_target(base) else ''})")
    frames = combine(grades)
    grade = settle(lambda q: _quality_capped(frames, combine(q.values())), quality)
    return grade, "; ".join([*why, _quality_text(quality)])


def _rule_c15(claim: Claim, m: Mapping[str, object], g: dict[str, Graded]) -> tuple[str, str]:
    """C15: memory is the reduction at the batch where the standard mixed-precision baseline holds 48 GB (an
    exact byte ratio), graded by the target; quality is the held-out recall@1 gap from paired seeds, no worse
    than 2 points. Both: reproduced; memory as claimed with quality lost: partially; otherwise the memory
    grade."""
    memory, quality = (g[t.metric] for t in claim.targets)

    def rule(x: Mapping[str, str]) -> str:
        if x[memory.metric] == REPRODUCED and x[quality.metric] == CONTRADICTED:
            return PARTIALLY
        return x[memory.metric]

    grade = settle(rule, {memory.metric: memory, quality.metric: quality})
    kept = {REPRODUCED: "kept", CONTRADICTED: "lost"}.get(quality.grade, quality.grade)
    return grade, f"memory {memory.grade}; held-out recall@1 gap {quality.estimate.describe()}: {kept}"


# --- the registry ---------------------------------------------------------------------------------------

def _c(id, section, statement, notebook, measures, *targets, rule=None) -> Claim:
    return Claim(id=id, section=section, statement=statement, notebook=notebook, measures=measures,
                 targets=tuple(targets), rule=rule)


# Reasons shared by several targets: why each no-effect band is as wide as it is.
_MEMORY_BAND = ("a peak-memory change within 2% of the baseline is what allocator rounding and buffer layout "
                "move without any technique; it frees no batch size or model size worth having")
_SPEED_BAND = ("a step-time ratio within 2% of 1 is below what a user would pick a configuration for (thread "
               "placement and library versions move more)")
_QUALITY_BAND = ("the claim's own tolerance: the post calls a gap this small unchanged quality, so within it "
                 "the technique costs nothing")
_RATIO_BAND = ("a factor within 1.25x either way (symmetric on a log scale) moves the gradient noise scale by "
               "under 12%: no step-size or batch-size choice changes for it")
_CARD_NOTE = ("step times of the baseline and MVAS + DGR measured on that card (ABBA-interleaved blocks, a "
              "1.3B-33B model)")

CLAIMS: dict[str, Claim] = {c.id: c for c in (
    _c("C1", "1", "The full macro-architecture (MVAS + DGR) cuts the training memory of a ~10B model by more "
       "than 40% without losing quality.", "05_mvas_llama",
       "exact training-state + activation bytes of a ~10B config with and without MVAS+DGR (fake tensors); "
       "quality gap at small scale",
       Target("memory_reduction", AT_LEAST, lo=0.40, no_effect=(-0.02, 0.02), reason=_MEMORY_BAND, exact=True,
              text="memory reduction > 40%"),
       Target("quality_gap", NO_WORSE, hi=0.005, no_effect=(-0.005, 0.005), reason=_QUALITY_BAND,
              text="quality unchanged (accuracy gap <= 0.5 points, paired seeds)")),
    _c("C2", "2.1", "Backpropagated gradients grow exponentially with depth when weight singular values exceed 1 "
       "and vanish exponentially when they are below 1.", "01_gradient_explosion",
       "per-layer gradient norms vs depth for controlled spectra; fitted log-growth rate vs log(sigma)",
       Target("rate_rel_error", AT_MOST, hi=0.10, no_effect=(0.9, 1.1),
              reason="a relative error of 1 is what a fitted rate of 0 gives (gradient norms flat in depth: no "
                     "exponential law); within 10% of 1 the fit shows no depth dependence, and past it the rate "
                     "is off by more than its own size (the other way)",
              text="linear stacks: per-layer growth rate = log(sigma) (relative error <= 10%)"),
       Target("mlp_vanishing_rate_ratio", TWO_SIDED, lo=0.75, hi=1.25, no_effect=(-0.1, 0.1),
              reason="the fitted per-layer rate over log(sigma): 1 is the claim's exponential law, 0 is gradient "
                     "norms flat in depth; within 0.1 of 0 the depth dependence is under a tenth of the law's, "
                     "and below it the gradients move the other way (grow where they should vanish)",
              text="tanh stacks, sigma < 1: gradients vanish at the rate log(sigma) (fitted rate / log(sigma) "
                   "within 25% of 1)"),
       Target("mlp_growth_rate_ratio", TWO_SIDED, lo=0.75, hi=1.25, no_effect=(-0.1, 0.1),
              reason="as for sigma < 1: 1 is the law, within 0.1 of 0 no depth dependence, below it the other way "
                     "(vanishing where they should grow); past 1.25 they grow faster than the law, still the "
                     "claimed direction",
              text="tanh stacks, sigma > 1: gradients grow at the rate log(sigma) (fitted rate / log(sigma) "
                   "within 25% of 1)")),
    _c("C3", "2.1", "Frequent gradient clipping in BERT-large training lowers the effective learning rate by "
       "27-35% and slows convergence.", "01_gradient_explosion",
       "1 - mean ||clipped update|| / ||unclipped update|| on identical gradient streams; steps to a target loss",
       Target("effective_lr_reduction", TWO_SIDED, lo=0.27, hi=0.35, no_effect=(-0.03, 0.03),
              reason="an effective learning rate within 3% of the unclipped one is a smaller change than any LR "
                     "grid resolves (grids step by 10% or more)",
              text="effective LR reduction 27-35% (AdamW, clip at 1.0)"),
       Target("convergence_slowdown", AT_LEAST, lo=1.1, no_effect=(0.95, 1.05),
              reason="steps to a target loss within 5% of the unclipped run's is the same training time for any "
                     "practical purpose (the claim's own 'slower' starts at 10%)",
              text="slower convergence (steps to target, clipped / unclipped >= 1.1)")),
    _c("C4", "2.2", "GPT-3 175B needs 350 GB of fp16 weights + 350 GB of gradients + 700 GB of Adam state = 1.4 TB, "
       "far beyond one 80 GB card.", "02_memory_wall",
       "exact bytes of the real 175B architecture under the post's accounting and under standard mixed "
       "precision (16 B/param), plus activations; analytic and measured (fake tensors)",
       Target("post_accounting_bytes", TWO_SIDED, lo=1.4e12 * 0.95, hi=1.4e12 * 1.05, exact=True,
              reason="an accounting, not an effect: the count lands on the post's 1.4 TB (within 5%) or not",
              text="1.4 TB (post's fp16 accounting)"),
       Target("mixed_precision_bytes", TWO_SIDED, lo=1.4e12 * 0.95, hi=1.4e12 * 1.05, exact=True,
              reason="an accounting, not an effect; the conclusion (beyond one 80 GB card) is the rule's",
              text="1.4 TB for what training needs (mixed precision)"),
       rule=_rule_c4),
    _c("C5", "2.2", "Under ZeRO-3, once communication latency exceeds 200 us, parameter synchronisation takes "
       "over 38% of each training step.", "03_zero3_communication",
       "share of a step spent in ZeRO-3 gathers/reduce-scatters vs latency, alpha-beta model calibrated on "
       "real collectives",
       Target("sync_share_at_200us", AT_LEAST, lo=0.38 * 0.95, no_effect=(0.0, 0.02), kind=MODELLED,
              reason="a synchronisation share under 2% of a step is no bottleneck to engineer against",
              tested_by="the sync share of real ZeRO-3/FSDP2 steps at >= 200 us link latency (multi-node), "
                        "from per-step profiles over repeated blocks",
              text="sync share > 38% at 200 us")),
    _c("C6", "3.1", "DGR (topology-aware groups, interleaved asynchronous group updates, delay compensation) cuts "
       "gradient variance to 1/8 of conventional training on a 256-layer Transformer.", "04_dgr_variance",
       "gradient variance across mini-batches and across layers, DGR vs plain, same data and seeds",
       Target("variance_reduction_factor", AT_LEAST, lo=8.0 * 0.9, no_effect=(0.8, 1.25), reason=_RATIO_BAND,
              text="variance reduced 8x (to 1/8)")),
    _c("C7", "3.2", "MVAS (Hessian-diagonal importance, fp16 for important and fp8/fp4 for the rest, re-planned "
       "by phase) takes Llama-65B from 320 GB to 192 GB at 0.92x speed and 78.2% -> 77.9% accuracy.",
       "05_mvas_llama",
       "exact memory of the real 65B architecture per policy (fake tensors); speed ratio and quality gap of a "
       "small Llama trained for real",
       Target("memory_reduction", AT_LEAST, lo=0.40 * 0.9, no_effect=(-0.02, 0.02), reason=_MEMORY_BAND,
              exact=True, text="320 -> 192 GB (-40%)"),
       Target("speed_ratio", NO_WORSE, lo=0.92 * 0.98, no_effect=(0.98, 1.02), reason=_SPEED_BAND,
              text="0.92x speed (a cost of at most 8%)"),
       Target("accuracy_gap", NO_WORSE, hi=0.003, no_effect=(-0.003, 0.003), reason=_QUALITY_BAND,
              text="78.2% -> 77.9% (gap <= 0.3 points, paired seeds)")),
    _c("C8", "4.1", "With >= 4 gradient-accumulation steps keep an fp32 master copy; scale gradients by "
       "2^5 / max_grad_norm.", "06_mixed_precision",
       "loss and precision with and without the master copy across accumulation steps; the scale rule vs "
       "torch.amp.GradScaler",
       Target("master_copy_loss_gain", AT_LEAST, lo=0.01, no_effect=(-0.01, 0.01),
              reason="a held-out loss difference under 0.01 nats (0.4% of these models' ~2.4) changes no "
                     "training decision",
              text="master copy helps from accumulation >= 4"),
       Target("master_copy_loss_gain_below_4", TWO_SIDED, lo=-0.01, hi=0.01,
              reason="an equivalence target: 'not below 4' means the gain below 4 lies within the same 0.01 "
                     "nats band",
              text="and not below 4"),
       Target("scale_rule_vs_gradscaler", NO_WORSE, lo=0.99, no_effect=(0.99, 1.01),
              reason="held-out losses within 1% (GradScaler's over the rule's) are the same training result",
              text="scale rule no worse than GradScaler"),
       rule=_rule_c8),
    _c("C9", "4.2", "On 8xA100: batch all-reduces into 200 ms windows, set NCCL_ASYNC_ERROR_HANDLING=0, and make "
       "gradient buckets a multiple of 8 MB.", "07_comm_bucketing",
       "bucketed all-reduce vs DDP's default buckets on torch.distributed: throughput, collectives, correctness",
       Target("ddp8_vs_ddp_default", NO_WORSE, lo=0.98, no_effect=(0.98, 1.02),
              reason=_SPEED_BAND + "; like for like: DDP with 8 MiB buckets against DDP with its 25 MiB default, "
                     "so that only the bucket size differs (our bucketer against DDP would mix in the "
                     "implementation)",
              text="8 MB-multiple buckets at least as fast as DDP's 25 MB default (DDP 8 MiB against DDP 25 MiB)"),
       Target("aligned_throughput_ratio", AT_LEAST, lo=1.05, no_effect=(0.98, 1.02),
              reason="per-byte all-reduce throughput within 2% on and off the grid is no reason to pick a bucket "
                     "size",
              text="buffers on the 8 MB grid all-reduce >= 5% faster per byte")),
    _c("C10", "5.1", "Start the learning rate at 1.2-1.5x the usual value, lengthen warmup by 30%, and trigger "
       "automatic scaling when the loss moves by more than 15%.", "08_convergence_recipe",
       "sweep of LR multiplier and warmup with and without the macro-architecture; loss-spike guard",
       Target("best_lr_multiplier", TWO_SIDED, lo=1.2, hi=1.5, no_effect=(0.9, 1.1),
              reason="an optimum moved by under 10% is within the flat top of a loss-vs-LR curve and below the "
                     "sweep grid's spacing",
              text="macro-stack LR optimum 1.2-1.5x plain's"),
       rule=_rule_c10),
    _c("C11", "5.2", "Speedups A100 3.2x theoretical / 2.8x achieved, V100 2.1x / 1.7x, RTX 3090 1.8x / 1.3x; "
       "consumer cards should disable ECC.", "09_hardware_speedups",
       "a step-time model from each card's published specs, validated against measured step times where it can "
       "run; what ECC costs on each card",
       *(Target(f"{card}_{what}_speedup", TWO_SIDED, lo=x * 0.9, hi=x * 1.1, no_effect=(0.95, 1.05),
                kind=MODELLED, tested_by=_CARD_NOTE,
                reason="a speedup under 5% is what driver and library versions move on one card",
                text=f"{name} {x:g}x {what}")
         for card, name, th, ach in (("a100", "A100", 3.2, 2.8), ("v100", "V100", 2.1, 1.7),
                                     ("rtx3090", "RTX 3090", 1.8, 1.3))
         for what, x in (("theoretical", th), ("achieved", ach))),
       Target("ecc_disable_speedup", AT_LEAST, lo=1.01, no_effect=(0.99, 1.01), kind=LOOKED_UP,
              reason="a step-time change under 1% from a driver toggle is not worth the lost error correction",
              tested_by="step times with ECC on and off on a consumer card that has the toggle (RTX 4090), "
                        "ABBA-interleaved",
              text="disabling ECC speeds consumer cards up"),
       rule=_rule_c11),
    _c("C12", "6", "AlphaFold2-style models need 55% less memory.", "10_applications",
       "memory of an Evoformer-style block stack with and without the techniques, against the plain and the "
       "activation-checkpointed baseline (how AlphaFold2 and OpenFold train); quality of a small trunk trained "
       "with and without",
       Target("memory_reduction", AT_LEAST, lo=0.55 * 0.9, no_effect=(-0.02, 0.02), reason=_MEMORY_BAND,
              exact=True, text="memory -55% (or more) against the plain baseline"),
       Target("memory_reduction_vs_checkpoint", AT_LEAST, lo=0.55 * 0.9, no_effect=(-0.02, 0.02),
              reason=_MEMORY_BAND, exact=True,
              text="memory -55% (or more) against the activation-checkpointed baseline"),
       _held_out_target(),
       rule=_rule_c12),
    _c("C13", "6", "PointNet can train with a 4x larger batch.", "10_applications",
       "largest batch under a fixed memory budget, with and without",
       Target("batch_growth", AT_LEAST, lo=4.0 * 0.95, no_effect=(0.95, 1.05), exact=True,
              reason="a largest batch within 5% of the baseline's changes no training recipe (batch sizes are "
                     "tuned in steps of 2x)",
              text="batch 4x"),
       _held_out_target(),
       rule=_rule_c13),
    _c("C14", "6", "Video understanding models reach 128 frames of temporal context.", "10_applications",
       "longest clip under a fixed memory budget for a space-time transformer, with and without",
       Target("max_frames", AT_LEAST, lo=128.0, exact=True,
              reason="no fixed band: each cell is graded against the baseline's frames in the same cell (the "
                     "rule): 128 frames is an effect of the techniques only where the baseline falls short of it",
              text="128 frames where the baseline falls short"),
       _held_out_target(),
       rule=_rule_c14),
    _c("C15", "6", "Joint CLIP image+text training drops from 48 GB to 29 GB with group_size 6, text fp16 and "
       "image fp8 (shallow) / fp16 (deep).", "11_clip",
       "exact memory of a real open_clip model under that policy; quality gap of a small CLIP trained for real",
       Target("memory_reduction", AT_LEAST, lo=(1 - 29 / 48) * 0.9, no_effect=(-0.02, 0.02), reason=_MEMORY_BAND,
              exact=True, text="48 -> 29 GB (-40%)"),
       Target("retrieval_gap", NO_WORSE, hi=0.02, no_effect=(-0.02, 0.02), reason=_QUALITY_BAND,
              text="retrieval unchanged (held-out recall@1 gap <= 2 points, paired seeds)"),
       rule=_rule_c15),
    _c("R1", "(added)", "mHC: projecting Hyper-Connection mixing onto doubly stochastic matrices keeps the composite "
       "signal gain bounded (about 1.6) where unconstrained HC explodes (about 3000 at 27B).",
       "01_gradient_explosion",
       "composite gain of residual, HC and mHC mixing vs depth; gradient norms and training stability",
       Target("mhc_peak_gain", AT_MOST, hi=2.0,
              reason="a bound, not an effect: the peak gain stays under 2 or it does not",
              text="mHC peak gain ~1.6 (<= 2)"),
       Target("hc_over_mhc_gain", AT_LEAST, lo=10.0, no_effect=(0.8, 1.25),
              reason="gains within 1.25x either way are the same signal scale (symmetric on a log scale)",
              text="HC gain >> mHC gain")),
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


# --- leave-one-out stability -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Change:
    """One left-out repetition that changes the claim's grade."""

    group: str  # "seeds" or "blocks": which repetitions
    index: int
    grade: str


@dataclass(frozen=True)
class Stability:
    """The grade on all repetitions and the grades that change when one repetition is left out."""

    grade: str
    changes: tuple[Change, ...]

    @property
    def stable(self) -> bool:
        return not self.changes

    def text(self) -> str:
        """``stable``, or ``unstable (without seeds 2: partially, ...)``: the paper's mark."""
        if self.stable:
            return "stable"
        return "unstable (" + ", ".join(f"without {c.group} {c.index}: {c.grade}" for c in self.changes[:3]) + \
            ("..." if len(self.changes) > 3 else "") + ")"

    def to_dict(self) -> dict:
        return {"grade": self.grade, "changes": [{"group": c.group, "index": c.index, "grade": c.grade}
                                                 for c in self.changes]}


def regrade_leaving_out(claim: Claim | str, per_seed_or_block_data: Mapping[str, object], *,
                        fixed: Mapping[str, object] | None = None) -> Stability:
    """Regrade ``claim`` with each seed (and each repetition block) left out, one at a time.

    ``per_seed_or_block_data`` maps a metric to its :class:`~macroarch.measure.stats.Repeated` (the raw
    per-seed or per-block data and the constructor that makes its estimate); repetitions of the same group
    (``"seeds"``, ``"blocks"``) are left out together across metrics, index by index. ``fixed`` holds the other
    metrics (exact counts, lookups) as they are. Returns the full grade and every left-out repetition whose
    grade differs from it: the paper marks a claim with any such change as unstable.
    """
    from macroarch.measure.stats import Repeated

    claim = get_claim(claim) if isinstance(claim, str) else claim
    fixed = dict(fixed or {})
    data = dict(per_seed_or_block_data)
    for k, r in data.items():
        if not isinstance(r, Repeated):
            raise TypeError(f"{k}: per-seed or per-block data must be a Repeated, got {type(r).__name__}")

    def grade_of(d: Mapping[str, Repeated]) -> str:
        return claim.grade({**fixed, **{k: r.estimate() for k, r in d.items()}}, scale="leave-one-out").grade

    full = grade_of(data)
    sizes: dict[str, int] = {}
    for k, r in data.items():
        if sizes.setdefault(r.group, r.n) != r.n:
            raise ValueError(f"{k}: {r.n} {r.group}, but another metric of the group has {sizes[r.group]}")
    changes = []
    for group, n in sizes.items():
        for i in range(n):
            g = grade_of({k: (r.leaving_out(i) if r.group == group else r) for k, r in data.items()})
            if g != full:
                changes.append(Change(group, i, g))
    return Stability(full, tuple(changes))


def regrade_record(claim: Claim | str, record: Mapping[str, object]) -> Stability:
    """:func:`regrade_leaving_out` from a result's ``stability`` record (``Run.leave_one_out`` stores the raw
    repetitions, their builds and the fixed numbers beside the outcome): the committed results regraded from
    their own data, independently of the run that recorded them."""
    from macroarch.measure.stats import Repeated

    data = {k: Repeated.from_dict(v) for k, v in dict(record["repeated"]).items()}
    return regrade_leaving_out(claim, data, fixed=dict(record.get("fixed") or {}))


__all__ = [
    "AT_LEAST", "AT_MOST", "CLAIMS", "CONTRADICTED", "Change", "Claim", "DIRECTIONS", "EXACT", "GRADES", "Graded",
    "INCONCLUSIVE", "NOT_REPRODUCED", "NOT_TESTABLE", "NO_WORSE", "PARTIALLY", "REPRODUCED", "Stability",
    "TWO_SIDED", "Target", "Verdict", "combine", "get_claim", "parse_claim_ids", "regrade_leaving_out",
    "regrade_record", "settle", "settle_combined",
]
