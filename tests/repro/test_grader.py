"""The grader on synthetic intervals: every outcome, one-sided targets both ways, combination, leave-one-out."""

import pytest

from macroarch.measure.stats import Estimate, Repeated, exact, looked_up, modelled, n_to_decide, paired_difference
from macroarch.repro.claims import (
    AT_LEAST,
    AT_MOST,
    CONTRADICTED,
    INCONCLUSIVE,
    NO_WORSE,
    NOT_REPRODUCED,
    NOT_TESTABLE,
    PARTIALLY,
    REPRODUCED,
    TWO_SIDED,
    Claim,
    Target,
    Verdict,
    combine,
    get_claim,
    regrade_leaving_out,
    settle_combined,
)


def iv(low, high, n=10):
    return Estimate((low + high) / 2, low, high, n=n, method="t")


# "at least 8x, no effect within [0.8, 1.25]": the shape of C6
UP = Target("factor", AT_LEAST, lo=8.0, no_effect=(0.8, 1.25), reason="test")
# "at most 0.1, no effect within [0.9, 1.1]": the shape of C2
DOWN = Target("err", AT_MOST, hi=0.1, no_effect=(0.9, 1.1), reason="test")
# "no worse than 2% slower": the shape of C9's bucket speed
NOWORSE = Target("speed", NO_WORSE, lo=0.98, no_effect=(0.98, 1.02), reason="test")
# "no worse than a 0.5 point gap" (lower is better): the shape of C1's quality
GAP = Target("gap", NO_WORSE, hi=0.005, no_effect=(-0.005, 0.005), reason="test")
RANGE = Target("lr", TWO_SIDED, lo=1.2, hi=1.5, no_effect=(0.9, 1.1), reason="test")


@pytest.mark.parametrize("target, interval, grade", [
    (UP, iv(8.5, 12.0), REPRODUCED),
    (UP, iv(50.0, 90.0), REPRODUCED),        # over-delivering an "at least" is not penalised
    (UP, iv(2.0, 4.0), PARTIALLY),
    (UP, iv(0.9, 1.1), NOT_REPRODUCED),
    (UP, iv(0.3, 0.6), CONTRADICTED),
    (UP, iv(1.1, 2.0), INCONCLUSIVE),        # crosses the band's edge
    (UP, iv(6.0, 9.0), INCONCLUSIVE),        # crosses the target's edge
    (DOWN, iv(0.01, 0.05), REPRODUCED),
    (DOWN, iv(0.3, 0.5), PARTIALLY),
    (DOWN, iv(0.95, 1.05), NOT_REPRODUCED),
    (DOWN, iv(1.5, 2.0), CONTRADICTED),
    (DOWN, iv(0.05, 0.2), INCONCLUSIVE),
    (NOWORSE, iv(0.99, 1.01), REPRODUCED),   # no effect is what "no worse than" claims
    (NOWORSE, iv(1.5, 2.0), REPRODUCED),     # better is fine too
    (NOWORSE, iv(0.45, 0.55), CONTRADICTED),  # a 2x slowdown
    (NOWORSE, iv(0.95, 1.0), INCONCLUSIVE),
    (GAP, iv(-0.02, 0.004), REPRODUCED),
    (GAP, iv(0.01, 0.02), CONTRADICTED),
    (GAP, iv(-0.004, 0.012), INCONCLUSIVE),
    (RANGE, iv(1.25, 1.4), REPRODUCED),
    (RANGE, iv(1.7, 2.0), PARTIALLY),        # two-sided: past the range is off in size
    (RANGE, iv(1.12, 1.18), PARTIALLY),
    (RANGE, iv(0.95, 1.05), NOT_REPRODUCED),
    (RANGE, iv(0.5, 0.8), CONTRADICTED),
    (RANGE, iv(0.95, 1.3), INCONCLUSIVE),
])
def test_every_outcome_from_the_interval(target, interval, grade):
    g = target.grade(interval)
    assert g.grade == grade
    assert (len(g.possible) > 1) == (grade == INCONCLUSIVE)


def test_inconclusive_states_the_n_that_decides_and_that_n_decides():
    e = paired_difference([0.0] * 4, [0.001, 0.009, -0.003, 0.011])  # gap 0.0045, interval across 0.005
    g = GAP.grade(e)
    assert g.grade == INCONCLUSIVE and g.n_to_decide == n_to_decide(e, 0.005) > 4
    assert f"n = {g.n_to_decide}" in g.why and "0.005" in g.why
    # an interval across two boundaries needs the larger n of the two
    wide = Estimate(4.0, 1.0, 9.0, n=5, method="t")
    assert UP.grade(wide).n_to_decide == max(n_to_decide(wide, 1.25), n_to_decide(wide, 8.0))


def test_exact_points_decide_and_single_draws_do_not():
    assert UP.grade(exact(3.0)).grade == PARTIALLY
    assert Target("b", AT_LEAST, lo=3.8, no_effect=(0.95, 1.05), exact=True, reason="t").grade(1.0).grade \
        == NOT_REPRODUCED  # a bare number of an exact metric is a point
    single = UP.grade(9.0)  # a bare number of a varying quantity: one draw
    assert single.grade == INCONCLUSIVE and "n=1" in single.why and single.n_to_decide is None
    assert single.possible == {REPRODUCED, PARTIALLY, NOT_REPRODUCED, CONTRADICTED}


def test_modelled_and_looked_up_are_not_testable_and_say_what_would_test_them():
    t = Target("s", AT_LEAST, lo=0.36, no_effect=(0.0, 0.02), kind="modelled", tested_by="a real ZeRO-3 run",
               reason="t")
    g = t.grade(0.5)
    assert g.grade == NOT_TESTABLE and "a real ZeRO-3 run" in g.why
    assert UP.grade(modelled(9.0, 0.05)).grade == NOT_TESTABLE  # however well the model did
    assert UP.grade(looked_up(9.0, "data sheet")).grade == NOT_TESTABLE


def test_an_interval_at_lower_confidence_is_refused():
    with pytest.raises(ValueError, match="80% confidence"):
        UP.grade(Estimate(9.0, 8.5, 9.5, n=5, confidence=0.8, method="t"))


def test_targets_reject_bad_definitions():
    with pytest.raises(ValueError, match="direction"):
        Target("m", "roughly", lo=1.0, reason="r")
    with pytest.raises(ValueError, match="lo only"):
        Target("m", AT_LEAST, hi=1.0, reason="r")
    with pytest.raises(ValueError, match="overlaps"):
        Target("m", AT_LEAST, lo=1.0, no_effect=(0.9, 1.5), reason="r")
    with pytest.raises(ValueError, match="reason"):
        Target("m", AT_LEAST, lo=1.0, no_effect=(0.9, 1.0))
    with pytest.raises(ValueError, match="margin"):
        Target("m", NO_WORSE, lo=0.98, reason="r")
    with pytest.raises(ValueError, match="tested_by"):
        Target("m", AT_LEAST, lo=1.0, kind="modelled", reason="r")
    with pytest.raises(ValueError, match="finite"):
        UP.grade(float("nan"))


def _claim(*targets):
    return Claim("X1", "0", "a test claim", "00_test", tuple(targets), "synthetic")


def test_combination_is_decided_when_every_choice_agrees():
    two = _claim(UP, GAP)
    # memory-like target short of the claim: whatever the gap turns out to be, the claim is partially
    v = two.grade({"factor": iv(2.0, 4.0), "gap": iv(-0.004, 0.012)}, scale="s")
    assert v.grade == PARTIALLY and "gap: inconclusive" in v.note
    # met, with the gap undecided between kept and lost: inconclusive
    v = two.grade({"factor": iv(9.0, 10.0), "gap": iv(-0.004, 0.012)}, scale="s")
    assert v.grade == INCONCLUSIVE
    assert combine([REPRODUCED, NOT_TESTABLE]) == REPRODUCED and combine([NOT_TESTABLE]) == NOT_TESTABLE
    with pytest.raises(ValueError, match="settle"):
        combine([INCONCLUSIVE])
    assert settle_combined({"factor": UP.grade(iv(0.3, 0.6)), "err": DOWN.grade(iv(1.5, 2.0))}) == CONTRADICTED


def test_verdict_records_every_graded_number_and_reads_old_verdicts():
    v = _claim(UP, GAP).grade({"factor": exact(9.0), "gap": iv(-0.004, 0.004, n=6).to_dict()}, scale="s")
    rec = v.to_dict()["estimates"]
    assert rec["factor"]["method"] == "exact count" and rec["factor"]["grade"] == REPRODUCED
    assert rec["gap"] | {"n": 6, "kind": "measured", "confidence": 0.9, "low": -0.004, "high": 0.004} == rec["gap"]
    assert Verdict.from_dict(v.to_dict()) == v
    old = {"grade": "partially", "measured": "m", "target": "t", "scale": "s", "note": ""}
    assert Verdict.from_dict(old).estimates == {}
    assert "factor 9 (exact count)" in v.measured


def test_one_sided_registry_targets_both_ways():
    c12 = get_claim("C12")
    kept = {"held_out_loss_change": iv(-0.01, 0.01)}

    def c12_grade(plain, vs_checkpoint):
        return c12.grade({"memory_reduction": plain, "memory_reduction_vs_checkpoint": vs_checkpoint, **kept},
                         scale="s").grade

    assert c12_grade(0.66, 0.70) == REPRODUCED  # beats 55%
    assert c12_grade(-0.2, -0.3) == CONTRADICTED
    c9 = get_claim("C9")
    fast = {"ddp8_vs_ddp_default": iv(1.10, 1.20), "aligned_throughput_ratio": iv(1.06, 1.10)}
    assert c9.grade(fast, scale="s").grade == REPRODUCED
    slow = {"ddp8_vs_ddp_default": iv(0.45, 0.55), "aligned_throughput_ratio": iv(0.90, 0.95)}
    assert c9.grade(slow, scale="s").grade == CONTRADICTED


def test_leave_one_out_finds_the_seed_a_grade_rests_on():
    claim = _claim(GAP)
    steady = Repeated(paired_difference, ([0.0] * 6, [0.001, -0.001, 0.0, 0.001, -0.002, 0.0]))
    s = regrade_leaving_out(claim, {"gap": steady})
    assert s.grade == REPRODUCED and s.stable
    # one seed far off: with it the interval crosses 0.005, without it the gap is decided
    shaky = Repeated(paired_difference, ([0.0] * 6, [0.001, -0.001, 0.0, 0.001, -0.002, 0.02]))
    s = regrade_leaving_out(claim, {"gap": shaky})
    assert s.grade == INCONCLUSIVE and not s.stable
    assert [(c.group, c.index, c.grade) for c in s.changes] == [("seeds", 5, REPRODUCED)]


def test_leave_one_out_leaves_a_block_out_of_every_metric_of_its_group():
    claim = _claim(NOWORSE, GAP)
    from macroarch.measure.stats import ratio_from_blocks

    speed = Repeated(ratio_from_blocks, ([1.0, 1.0, 1.0, 1.0], [1.0, 0.99, 1.0, 0.6]), group="blocks")
    gap = Repeated(paired_difference, ([0.0] * 3, [0.0, 0.001, -0.001]))
    s = regrade_leaving_out(claim, {"speed": speed, "gap": gap})
    assert s.grade == INCONCLUSIVE
    assert {(c.group, c.index) for c in s.changes} == {("blocks", 3)}
    with pytest.raises(ValueError, match="another metric of the group"):
        regrade_leaving_out(claim, {"speed": speed, "gap": Repeated(paired_difference, ([0.0] * 3, [0.0] * 3),
                                                                     group="blocks")})
    with pytest.raises(TypeError, match="Repeated"):
        regrade_leaving_out(claim, {"gap": 0.1})
