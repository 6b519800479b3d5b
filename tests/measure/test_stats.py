"""Estimates against independent arithmetic: t intervals from the textbook formula, ratios from numpy logs."""

import math
import statistics

import numpy as np
import pytest
from scipy.stats import t as student_t

from macroarch.measure import stats as S


def _t_interval(x, confidence=0.9):
    """The textbook Student t interval of a mean (independent of scipy's ttest_1samp)."""
    n, m, sd = len(x), statistics.fmean(x), statistics.stdev(x)
    h = student_t.ppf(0.5 + confidence / 2, n - 1) * sd / math.sqrt(n)
    return m - h, m + h


def test_mean_interval_is_the_t_interval():
    x = [2.1, 2.5, 1.9, 2.8, 2.2]
    e = S.mean_interval(x)
    lo, hi = _t_interval(x)
    assert e.value == pytest.approx(statistics.fmean(x)) and e.n == 5 and e.kind == S.MEASURED
    assert (e.low, e.high) == (pytest.approx(lo), pytest.approx(hi)) and e.confidence == 0.9


def test_paired_difference_takes_the_gap_per_seed():
    base, tech = [1.0, 2.0, 3.0, 4.0], [1.1, 2.3, 3.0, 4.2]
    e = S.paired_difference(base, tech)
    diffs = [b - a for a, b in zip(base, tech)]
    assert e.value == pytest.approx(statistics.fmean(diffs)) and e.method == "paired t over seeds"
    assert (e.low, e.high) == tuple(pytest.approx(v) for v in _t_interval(diffs))
    # unpaired, the seeds' own spread (1..4) would swamp the gap; paired it does not
    assert e.high - e.low < 0.5
    with pytest.raises(ValueError, match="each seed needs both"):
        S.paired_difference([1, 2], [1, 2, 3])


def test_ratio_from_blocks_geomean_and_median():
    a = [2.0, 2.2, 1.9, 2.1, 2.4, 2.0]
    b = [1.0, 1.0, 1.0, 1.1, 1.2, 0.9]
    logs = np.log(np.array(a) / np.array(b))
    g = S.ratio_from_blocks(a, b)
    assert g.value == pytest.approx(math.exp(logs.mean())) and g.log_scale and g.unit == "x"
    lo, hi = _t_interval(list(logs))
    assert (g.low, g.high) == (pytest.approx(math.exp(lo)), pytest.approx(math.exp(hi)))
    m = S.ratio_from_blocks(a, b, statistic="median")
    assert m.value == pytest.approx(math.exp(np.median(logs))) and "percentile bootstrap" in m.method
    assert m.low <= m.value <= m.high
    assert S.ratio_from_blocks([2.0] * 3, [1.0] * 3).value == pytest.approx(2.0)  # B twice as fast
    with pytest.raises(ValueError, match="positive"):
        S.ratio_from_blocks([1.0, 0.0], [1.0, 1.0])


def test_no_interval_below_two_repetitions_and_few_for_a_bootstrap():
    one = S.mean_interval([3.0])
    assert not one.has_interval and one.n == 1 and "one repetition" in one.method
    few = S.bootstrap(([1.0, 2.0, 3.0],), np.mean)
    assert not few.has_interval and f"< {S.MIN_BOOTSTRAP_N}" in few.method
    assert S.n_to_decide(one, 2.0) is None


def test_bootstrap_is_seeded_and_handles_constant_data():
    x = [0.1, 0.4, 0.35, 0.2, 0.5, 0.3, 0.45]
    a, b = S.bootstrap((x,), np.mean), S.bootstrap((x,), np.mean)
    assert a == b and a.low < statistics.fmean(x) < a.high
    const = S.bootstrap(([1.0] * 8,), np.mean)
    assert const.low == const.high == 1.0


def test_exact_modelled_looked_up():
    e = S.exact(1.4e12, "B")
    assert e.is_exact and e.low == e.high == e.value and e.n == 1 and "exact count" in e.describe()
    m = S.modelled(1.3, 0.52, bound=0.6)
    assert m.kind == S.MODELLED and (m.low, m.high) == (pytest.approx(1.3 * 0.48), pytest.approx(1.3 * 1.52))
    assert "within its 60% bound" in m.method
    assert "failed validation" in S.modelled(1.3, 1.54, bound=0.6).method
    lk = S.looked_up(1.0, "NVIDIA data sheet")
    assert lk.kind == S.LOOKED_UP and not lk.has_interval and "data sheet" in lk.method
    with pytest.raises(ValueError, match="source"):
        S.looked_up(1.0, "")


def test_dict_round_trip_and_validation():
    e = S.paired_difference([1.0, 2.0, 3.0], [1.5, 2.1, 3.4])
    assert S.Estimate.from_dict(e.to_dict()) == e
    assert S.Estimate.from_dict(S.mean_interval([1.0]).to_dict()).low is None
    with pytest.raises(ValueError, match="'lo'"):
        S.Estimate.from_dict({"value": 1.0, "method": "x", "lo": 0.0})
    with pytest.raises(ValueError, match="low .* > high"):
        S.Estimate(1.0, 2.0, 0.5)
    with pytest.raises(ValueError, match="both set"):
        S.Estimate(1.0, 0.5, None)
    with pytest.raises(ValueError, match="kind"):
        S.Estimate(1.0, kind="guessed")
    with pytest.raises(ValueError, match="exact count is a point"):
        S.Estimate(1.0, 0.9, 1.1, method=S.EXACT)
    assert float(e) == e.value


def _smallest_n(s: float, d: float, confidence: float = 0.9) -> int:
    """Brute force: the first n whose t half-width, t(n-1) s / sqrt(n), is below d."""
    from scipy import stats

    n = 2
    while stats.t.ppf(0.5 + confidence / 2, n - 1) * s / math.sqrt(n) >= d:
        n += 1
    return n


def test_n_to_decide_with_students_t_at_the_new_n():
    from scipy import stats

    t3 = stats.t.ppf(0.95, 3)
    e = S.Estimate(1.0, 0.0, 2.0, n=4, method="t")
    s = 1.0 * 2 / t3  # half-width 1 at n=4 is t(3) s / 2
    assert S.n_to_decide(e, 1.5) == _smallest_n(s, 0.5)
    assert S.n_to_decide(e, 0.75) == _smallest_n(s, 0.25)  # below the value: the lower half-width
    assert S.n_to_decide(e, 3.0) == 4  # already on one side
    assert S.n_to_decide(e, 1.0) is None  # on the boundary: no n decides
    # the figure holds for real data: samples with the same mean and spread, n_to_decide of them, clear it
    x = [0.2, 0.6, 1.4, 1.8]
    est = S.mean_interval(x)
    n = S.n_to_decide(est, 1.6)
    reps = np.resize(x, 4 * math.ceil(n / 4))  # whole copies keep the mean and nearly the spread
    assert S.mean_interval(reps).high < 1.6 and est.high > 1.6
    assert S.mean_interval(x[:2] + x[2:]).high > 1.6
    # on a log scale (ratios) the distances are taken on logs
    r = S.Estimate(1.1, 1.0, 1.21, n=5, method="t on logs", log_scale=True)
    s_log = math.log(1.21 / 1.1) * math.sqrt(5) / stats.t.ppf(0.95, 4)
    assert S.n_to_decide(r, 1.05) == _smallest_n(s_log, math.log(1.1 / 1.05))


def test_geomean_interval_is_a_t_interval_on_logs():
    from scipy import stats

    x = [36.8, 99.6, 38.3]
    e = S.geomean_interval(x)
    logs = np.log(x)
    ci = stats.t.interval(0.9, len(x) - 1, loc=logs.mean(), scale=stats.sem(logs))
    assert e.value == pytest.approx(math.exp(logs.mean()))
    assert (e.low, e.high) == (pytest.approx(math.exp(ci[0])), pytest.approx(math.exp(ci[1])))
    assert e.low > 0 and e.log_scale and e.n == 3 and e.unit == "x" and "on logs" in e.method
    with pytest.raises(ValueError, match="positive"):
        S.geomean_interval([1.0, -2.0])


def test_repeated_leaves_one_out():
    r = S.Repeated(S.paired_difference, ([1.0, 2.0, 3.0], [1.5, 2.5, 3.0]))
    assert r.n == 3 and r.estimate() == S.paired_difference([1.0, 2.0, 3.0], [1.5, 2.5, 3.0])
    assert r.leaving_out(2).estimate().value == pytest.approx(0.5)
    with pytest.raises(ValueError, match="equally long"):
        S.Repeated(S.paired_difference, ([1.0], [1.0, 2.0]))


def test_n_to_decide_on_a_boundary_up_to_rounding_is_none():
    # 0.5 - 0.49, 0.6 - 0.58, 0.55 - 0.52: a mean of 0.02 up to rounding, on a boundary at 0.02
    e = S.mean_interval([0.5 - 0.49, 0.6 - 0.58, 0.55 - 0.52])
    assert S.n_to_decide(e, 0.02) is None
    far = S.Estimate(1.0, 0.0, 2.0, n=4, method="t")
    assert S.n_to_decide(far, 1.0 + 1e-6) is None  # past the cap: more repetitions than any run makes
