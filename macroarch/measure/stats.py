"""Estimates with intervals: every number a claim is graded on, with how sure the run is of it.

An :class:`Estimate` is a value, an interval at a stated confidence (90% unless said), the number of
repetitions ``n`` the interval rests on, the method that produced it, its ``kind`` (``measured``, ``modelled``
or ``looked up``) and a unit. The grader (:mod:`macroarch.repro.claims`) decides grades from the interval,
so the constructors here are the only way a harness should turn repetitions into a graded number:

- :func:`paired_difference`: a quality gap from paired seeds (baseline and technique share initialisation,
  data order and evaluation batches; the gap is taken per seed, then a t interval over the per-seed gaps);
- :func:`ratio_from_blocks`: a speed ratio from ABBA-interleaved timing blocks (one time per block and side;
  the ratio is taken per block, and the interval is on the log ratios, so it is symmetric in "x times faster"
  and "x times slower");
- :func:`mean_interval`: a t interval for the mean of repetitions;
- :func:`geomean_interval`: the geometric mean of positive repetitions (ratios, gains) with a t interval on
  their logs: a ratio's spread is multiplicative, and an interval on the linear scale can reach below zero;
- :func:`bootstrap`: any other statistic of per-seed rows (an optimum over a sweep, a variance ratio),
  by ``scipy.stats.bootstrap`` (BCa by default);
- :func:`exact`: a deterministic count (bytes, a largest batch): a point, method ``"exact count"``, n = 1;
- :func:`modelled`: a model's prediction; its validation error becomes its interval (an error band, not a
  sampling interval), and a model that failed its own validation bound says so in ``method``;
- :func:`looked_up`: a value read from a table or a data sheet: a point, no interval.

Intervals come from maintained implementations (``scipy.stats.ttest_1samp(...).confidence_interval`` and
``scipy.stats.bootstrap``), never from a resampler written here. Fewer than two repetitions give no interval
(``low`` and ``high`` are ``None`` and ``method`` says why); a bootstrap needs :data:`MIN_BOOTSTRAP_N`
repetitions, below which its few distinct resamples cannot carry a 90% interval. Such an estimate can never
decide a grade (an exact count can: it has no spread to be unsure of).

:func:`n_to_decide` says how many repetitions would put the interval on one side of a boundary, from the
run's own spread (Student's t at the new n): a planning figure, not a guarantee.

This module imports nothing from :mod:`macroarch.repro`: experiments build estimates here, the grader reads
them (as :class:`Estimate` objects or their :meth:`Estimate.to_dict` form).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields

import numpy as np

MEASURED, MODELLED, LOOKED_UP = "measured", "modelled", "looked up"
KINDS = (MEASURED, MODELLED, LOOKED_UP)

EXACT = "exact count"
DEFAULT_CONFIDENCE = 0.90
#: :func:`n_to_decide` answers None past this many repetitions (no run could make them)
N_TO_DECIDE_CAP = 10**7
#: below this many repetitions a bootstrap gives no interval (n = 5 has 126 distinct resamples, and BCa's
#: acceleration and bias corrections are estimated from the same few points)
MIN_BOOTSTRAP_N = 6


@dataclass(frozen=True)
class Estimate:
    """A graded number: value, interval and where it came from.

    Attributes:
        value: the point estimate (the statistic on all repetitions).
        low, high: the interval at ``confidence``; both ``None`` when there is none (n < 2, a lookup). An exact
            count has ``low == high == value``.
        confidence: the interval's confidence level, in (0, 1).
        n: how many repetitions (seeds, blocks) the estimate rests on; 1 for exact counts, models and lookups.
        method: how the interval was made (``"paired t over seeds"``, ``"exact count"``, ...), in words.
        kind: ``measured``, ``modelled`` or ``looked up``.
        unit: the value's unit, for text (``"x"``, ``"nats"``, ``"B"``); may be empty.
        log_scale: the interval was made on log values (ratios): :func:`n_to_decide` works on that scale.
    """

    value: float
    low: float | None = None
    high: float | None = None
    confidence: float = DEFAULT_CONFIDENCE
    n: int = 1
    method: str = "single value"
    kind: str = MEASURED
    unit: str = ""
    log_scale: bool = False

    def __post_init__(self) -> None:
        for name in ("value", "low", "high"):
            x = getattr(self, name)
            if x is not None:
                if isinstance(x, bool) or not isinstance(x, (int, float, np.floating, np.integer)) \
                        or not math.isfinite(x):
                    raise ValueError(f"Estimate.{name} must be a finite number, got {x!r}")
                object.__setattr__(self, name, float(x))
        if (self.low is None) != (self.high is None):
            raise ValueError(f"Estimate: low and high are both set or both None, got low={self.low}, high={self.high}")
        if self.low is not None and self.low > self.high:
            raise ValueError(f"Estimate: low {self.low} > high {self.high}")
        if not 0 < self.confidence < 1:
            raise ValueError(f"Estimate.confidence must be in (0, 1), got {self.confidence}")
        if isinstance(self.n, bool) or int(self.n) != self.n or self.n < 1:
            raise ValueError(f"Estimate.n must be a positive integer, got {self.n!r}")
        object.__setattr__(self, "n", int(self.n))
        if self.kind not in KINDS:
            raise ValueError(f"Estimate.kind must be one of {KINDS}, got {self.kind!r}")
        if self.method == EXACT and (self.low != self.value or self.high != self.value or self.n != 1):
            raise ValueError("an exact count is a point: low == high == value and n == 1 (use exact())")
        if self.log_scale and (self.value <= 0 or (self.low is not None and self.low <= 0)):
            raise ValueError(f"Estimate on a log scale must be positive, got {self.value} [{self.low}, {self.high}]")

    def __float__(self) -> float:
        """The point estimate, for arithmetic and text (the interval is not carried along)."""
        return self.value

    @property
    def is_exact(self) -> bool:
        return self.method == EXACT

    @property
    def has_interval(self) -> bool:
        return self.low is not None

    def describe(self, digits: int = 4) -> str:
        """One line for verdicts: ``0.0123 [0.0051, 0.0195] nats (90% paired t over seeds, n=5, measured)``."""
        def f(x: float) -> str:
            return f"{x:.{digits}g}"

        unit = f" {self.unit}" if self.unit else ""
        if self.is_exact:
            return f"{f(self.value)}{unit} ({EXACT})"
        if not self.has_interval:
            return f"{f(self.value)}{unit} ({self.method}, n={self.n}, {self.kind}: no interval)"
        return (f"{f(self.value)} [{f(self.low)}, {f(self.high)}]{unit} ({self.confidence:.0%} {self.method}, "
                f"n={self.n}, {self.kind})")

    def to_dict(self) -> dict:
        """JSON-ready: every field by name (``low``/``high`` ``None`` when there is no interval)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> Estimate:
        """The inverse of :meth:`to_dict`; an unknown key is an error that names it (``value`` is required)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"Estimate.from_dict: unknown key(s) {unknown}; known: {sorted(known)}")
        if "value" not in d:
            raise ValueError("Estimate.from_dict: no 'value'")
        return cls(**dict(d))


def is_estimate_dict(x: object) -> bool:
    """Whether ``x`` looks like :meth:`Estimate.to_dict` output (a mapping with a ``value`` and a ``method``)."""
    return isinstance(x, Mapping) and "value" in x and "method" in x


def as_estimate(x: Estimate | Mapping) -> Estimate:
    return x if isinstance(x, Estimate) else Estimate.from_dict(x)


def _check_confidence(confidence: float) -> None:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")


def _samples(name: str, samples: Sequence[float]) -> np.ndarray:
    x = np.asarray(samples, dtype=float).ravel()
    if x.size == 0:
        raise ValueError(f"{name}: no samples")
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{name}: samples must be finite, got {x.tolist()}")
    return x


def mean_interval(samples: Sequence[float], *, confidence: float = DEFAULT_CONFIDENCE, unit: str = "",
                  method: str = "t interval over repetitions") -> Estimate:
    """The mean of independent repetitions with a Student t interval (``scipy.stats.ttest_1samp``).

    Repetitions that all agree give a zero-width interval (the quantity did not vary); one repetition gives
    no interval.
    """
    from scipy import stats

    _check_confidence(confidence)
    x = _samples("mean_interval", samples)
    mean = float(x.mean())
    if x.size < 2:
        return Estimate(mean, confidence=confidence, n=1, method=f"{method} (one repetition)", unit=unit)
    if np.all(x == x[0]):
        return Estimate(mean, mean, mean, confidence=confidence, n=x.size, method=method, unit=unit)
    with warnings.catch_warnings():  # nearly equal samples: scipy warns about precision, the interval is fine
        warnings.simplefilter("ignore", RuntimeWarning)
        ci = stats.ttest_1samp(x, 0.0).confidence_interval(confidence_level=confidence)
    return Estimate(mean, min(float(ci.low), mean), max(float(ci.high), mean), confidence=confidence, n=x.size,
                    method=method, unit=unit)


def geomean_interval(samples: Sequence[float], *, confidence: float = DEFAULT_CONFIDENCE, unit: str = "x",
                     method: str = "t interval over repetitions") -> Estimate:
    """The geometric mean of positive repetitions (per-seed ratios, gains) with a t interval on their logs.

    A ratio varies by factors: 36.8, 99.6 and 38.3 are each a factor of about 1.6 from their geometric mean,
    while a linear t interval around their mean reaches below zero, a value a ratio cannot take. The interval
    is :func:`mean_interval` on ``log(samples)``, mapped back with ``exp``; ``method`` says so and the estimate is
    marked ``log_scale`` (:func:`n_to_decide` then works on logs).
    """
    x = _samples("geomean_interval", samples)
    if np.any(x <= 0):
        raise ValueError(f"geomean_interval: samples must be positive, got {x.tolist()}")
    e = mean_interval(np.log(x), confidence=confidence, method=f"geometric mean, {method} on logs")
    return Estimate(math.exp(e.value), None if e.low is None else math.exp(e.low),
                    None if e.high is None else math.exp(e.high), confidence=confidence, n=e.n, method=e.method,
                    unit=unit, log_scale=True)


def paired_difference(baseline_per_seed: Sequence[float], technique_per_seed: Sequence[float], *,
                      confidence: float = DEFAULT_CONFIDENCE, unit: str = "") -> Estimate:
    """``technique - baseline``, taken per seed, with a t interval over the per-seed differences.

    Element i of both sequences must come from the same seed (same initialisation, data order and evaluation
    batches): pairing removes the seed-to-seed spread both sides share. For a gap defined the other way
    (``baseline - technique``, e.g. an accuracy lost), swap the arguments.
    """
    a = _samples("paired_difference baseline", baseline_per_seed)
    b = _samples("paired_difference technique", technique_per_seed)
    if a.size != b.size:
        raise ValueError(f"paired_difference: {a.size} baseline seeds but {b.size} technique seeds; "
                         "each seed needs both")
    return mean_interval(b - a, confidence=confidence, unit=unit, method="paired t over seeds")


def ratio_from_blocks(a_times: Sequence[float], b_times: Sequence[float], *, statistic: str = "geomean",
                      confidence: float = DEFAULT_CONFIDENCE, seed: int = 0) -> Estimate:
    """How many times faster B is than A (``time_A / time_B``) from interleaved timing blocks.

    ``a_times[i]`` and ``b_times[i]`` are the times of block i (an ABBA block: A, B, B, A or its mirror, each
    side's time its steps' median or sum), so drift during the run cancels within a block. The ratio is taken
    per block; ``statistic`` is ``"geomean"`` (the geometric mean of the per-block ratios, a t interval on
    their logs) or ``"median"`` (their median, a percentile bootstrap interval on the logs: BCa's jackknife
    is degenerate for a median of few blocks; needs :data:`MIN_BOOTSTRAP_N` blocks). A value above 1 means B is
    faster.
    """
    a = _samples("ratio_from_blocks a_times", a_times)
    b = _samples("ratio_from_blocks b_times", b_times)
    if a.size != b.size:
        raise ValueError(f"ratio_from_blocks: {a.size} A blocks but {b.size} B blocks; each block times both")
    if np.any(a <= 0) or np.any(b <= 0):
        raise ValueError("ratio_from_blocks: times must be positive")
    logs = np.log(a / b)
    if statistic == "geomean":
        e = mean_interval(logs, confidence=confidence,
                          method="geometric mean of per-block ratios, t interval on log ratios over ABBA blocks")
    elif statistic == "median":
        e = bootstrap((logs,), np.median, confidence=confidence, seed=seed, method="percentile",
                      label="median of per-block ratios, percentile bootstrap on log ratios over ABBA blocks")
    else:
        raise ValueError(f"ratio_from_blocks: statistic must be 'geomean' or 'median', got {statistic!r}")
    return Estimate(math.exp(e.value), None if e.low is None else math.exp(e.low),
                    None if e.high is None else math.exp(e.high), confidence=confidence, n=e.n, method=e.method,
                    unit="x", log_scale=True)


def bootstrap(data: Sequence[Sequence[float]], statistic: Callable[..., float], *,
              confidence: float = DEFAULT_CONFIDENCE, method: str = "BCa", paired: bool = True,
              n_resamples: int = 9999, seed: int = 0, unit: str = "", label: str = "") -> Estimate:
    """A statistic of per-repetition data with a ``scipy.stats.bootstrap`` interval.

    ``data`` is a tuple of equally long sequences (one element per seed or block); with ``paired`` they are
    resampled together (seed i's values stay together). ``statistic(*arrays)`` returns a float. The resampling
    is seeded (``seed``), so the same data give the same interval. Below :data:`MIN_BOOTSTRAP_N` repetitions
    there is no interval. Data whose resamples all give the same statistic get a zero-width interval.
    """
    from scipy import stats

    _check_confidence(confidence)
    arrays = tuple(_samples("bootstrap data", d) for d in data)
    if not arrays:
        raise ValueError("bootstrap: no data")
    n = arrays[0].size
    if paired and any(x.size != n for x in arrays):
        raise ValueError(f"bootstrap: paired data must be equally long, got {[x.size for x in arrays]}")
    label = label or f"bootstrap {method} over repetitions"
    value = float(statistic(*arrays))
    if not math.isfinite(value):
        raise ValueError(f"bootstrap: the statistic on all data is not finite ({value})")
    if n < MIN_BOOTSTRAP_N:
        return Estimate(value, confidence=confidence, n=n, unit=unit,
                        method=f"{label} (n={n} < {MIN_BOOTSTRAP_N}: too few for a bootstrap interval)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a degenerate resampling distribution: handled below
        res = stats.bootstrap(arrays, statistic, n_resamples=n_resamples, confidence_level=confidence,
                              method=method, paired=paired, vectorized=False, rng=np.random.default_rng(seed))
    low, high = float(res.confidence_interval.low), float(res.confidence_interval.high)
    if not (math.isfinite(low) and math.isfinite(high)):
        spread = np.ptp(res.bootstrap_distribution)
        if spread != 0:
            raise ValueError(f"bootstrap: {method} gave no finite interval for non-degenerate data; "
                             "try method='percentile' or more repetitions")
        low = high = value
    return Estimate(value, min(low, value), max(high, value), confidence=confidence, n=n, method=label, unit=unit)


def exact(value: float, unit: str = "") -> Estimate:
    """A deterministic count (bytes, a largest batch, a frame count): a point that needs no repetition."""
    return Estimate(value, value, value, n=1, method=EXACT, unit=unit)


def modelled(value: float, rel_error: float, *, bound: float | None = None, model: str = "model",
             confidence: float = DEFAULT_CONFIDENCE, unit: str = "") -> Estimate:
    """A model's prediction with its validation error as the interval: ``value * (1 +- rel_error)``.

    ``rel_error`` is the model's relative error where it was checked against measurements; ``bound`` the error
    the model promises. A model whose error exceeds its bound failed its own validation, and ``method`` says
    so (the grader reads every modelled number as not testable here either way).
    """
    if not (rel_error >= 0 and math.isfinite(rel_error)):
        raise ValueError(f"modelled: rel_error must be a finite number >= 0, got {rel_error!r}")
    how = f"{model}, validation error {rel_error:.0%}"
    if bound is not None:
        how += f" (over its {bound:.0%} bound: failed validation)" if rel_error > bound else \
            f" (within its {bound:.0%} bound)"
    return Estimate(value, value - abs(value) * rel_error, value + abs(value) * rel_error, confidence=confidence,
                    n=1, method=how, kind=MODELLED, unit=unit)


def looked_up(value: float, source: str, unit: str = "") -> Estimate:
    """A value read from a table or data sheet (``source`` names it): a point with no interval."""
    if not source:
        raise ValueError("looked_up: name the source the value was read from")
    return Estimate(value, n=1, method=f"looked up: {source}", kind=LOOKED_UP, unit=unit)


@dataclass(frozen=True)
class Repeated:
    """The raw repetitions behind an estimate, kept so that it can be rebuilt with one left out.

    ``build(*arrays, **options)`` makes the estimate (``paired_difference``, ``ratio_from_blocks``,
    ``mean_interval``, ...); ``arrays`` are equally long, element i of each from repetition i; ``group`` names
    the repetitions (``"seeds"``, ``"blocks"``): leaving out seed 3 leaves it out of every metric of that group.
    """

    build: Callable[..., Estimate]
    arrays: tuple[tuple[float, ...], ...]
    group: str = "seeds"
    options: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        arrays = tuple(tuple(float(x) for x in a) for a in self.arrays)
        if not arrays or len({len(a) for a in arrays}) != 1:
            raise ValueError(f"Repeated: arrays must be equally long, got lengths {[len(a) for a in arrays]}")
        object.__setattr__(self, "arrays", arrays)

    @property
    def n(self) -> int:
        return len(self.arrays[0])

    def estimate(self) -> Estimate:
        return self.build(*self.arrays, **self.options)

    def leaving_out(self, i: int) -> Repeated:
        if not 0 <= i < self.n:
            raise IndexError(f"Repeated: no repetition {i} of {self.n}")
        return Repeated(self.build, tuple(a[:i] + a[i + 1:] for a in self.arrays), self.group, self.options)

    def to_dict(self) -> dict:
        """JSON-ready, so that a result file can be regraded from its own raw data: ``build`` as
        ``"module:qualname"`` (a module-level function), the arrays, the group and the options (tuples as lists)."""
        name = f"{self.build.__module__}:{self.build.__qualname__}"
        if "<" in name:
            raise ValueError(f"Repeated.to_dict: build {name} is not a module-level function")
        return {"build": name, "arrays": [list(a) for a in self.arrays], "group": self.group,
                "options": {k: list(v) if isinstance(v, tuple) else v for k, v in self.options.items()}}

    @classmethod
    def from_dict(cls, d: Mapping) -> Repeated:
        """The inverse of :meth:`to_dict` (lists in the options back as tuples)."""
        import importlib

        module, _, qualname = str(d["build"]).partition(":")
        build = importlib.import_module(module)
        for part in qualname.split("."):
            build = getattr(build, part)
        options = {k: tuple(v) if isinstance(v, list) else v for k, v in dict(d.get("options") or {}).items()}
        return cls(build, tuple(tuple(a) for a in d["arrays"]), str(d.get("group", "seeds")), options)


def n_to_decide(estimate: Estimate, boundary: float) -> int | None:
    """The n at which the interval would clear ``boundary``, from the run's own spread.

    The interval's half-width on the boundary's side, ``w``, is read as ``t(n - 1) * s / sqrt(n)`` (Student's
    quantile at the estimate's confidence), which gives the spread ``s`` of one repetition; the answer is the
    smallest ``n'`` with ``t(n' - 1) * s / sqrt(n') < |d|``, ``d`` the distance from the estimate to the boundary,
    assuming the estimate stays where it is. On a log scale (``log_scale``) the same is done on logs. For a
    bootstrap interval this is an approximation: a planning figure, not a guarantee. Returns ``estimate.n`` if
    the interval already lies on one side (or is exact), and ``None`` when no n can be derived: no interval
    (nothing says how much the number varies), the estimate sits on the boundary (up to rounding), or the answer
    is past :data:`N_TO_DECIDE_CAP`.
    """
    from scipy import stats

    if estimate.is_exact:
        return estimate.n
    if not estimate.has_interval or estimate.kind != MEASURED:
        return None
    f = math.log if estimate.log_scale else (lambda x: x)
    if estimate.log_scale and boundary <= 0:
        return estimate.n  # a positive ratio is always above a boundary at or below 0
    v, lo, hi, b = f(estimate.value), f(estimate.low), f(estimate.high), f(boundary)
    if not lo < b < hi:
        return estimate.n
    d = abs(b - v)
    if d <= 1e-9 * max(abs(b), abs(v), hi - lo):  # on the boundary, up to rounding: no n moves it off
        return None
    w = (hi - v) if b > v else (v - lo)
    n = estimate.n

    def quantile(m: int) -> float:
        return float(stats.t.ppf(0.5 + estimate.confidence / 2, m - 1)) if m > 1 else math.inf

    s = w * math.sqrt(n) / quantile(max(n, 2))
    z = float(stats.norm.ppf(0.5 + estimate.confidence / 2))
    m = max(n + 1, math.ceil((z * s / d) ** 2))  # the normal answer is a lower bound: t(m - 1) > z
    if m > N_TO_DECIDE_CAP:
        return None  # more repetitions than any run could make: say that none decides it
    while quantile(m) * s / math.sqrt(m) >= d:
        m += max(1, m // 64)
    return m
