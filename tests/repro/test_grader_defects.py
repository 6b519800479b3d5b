"""One test per grader defect of issue 42, each failing on the grader before the fix.

Each passes :class:`Estimate` objects with an interval (they read as their value through ``float()``, which is
all the old grader did with a metric), so the old grades are what the old rules made of these numbers.
Grades are spelled out as strings: "inconclusive" did not exist before.
"""

import pytest

from macroarch.measure.stats import Estimate, exact
from macroarch.repro.claims import get_claim


def _m(value, low, high, n=8, method="paired t over seeds"):
    return Estimate(value, low, high, n=n, method=method)


def _grade(cid, **metrics):
    return get_claim(cid).grade(metrics, scale="test")


@pytest.mark.parametrize("factor, grade", [
    (_m(0.5, 0.45, 0.56), "contradicted"),  # variance doubled: the old 10%-of-effect band (0.3-1.7) said no effect
    (_m(1.6, 1.5, 1.7), "partially"),       # variance down 1.6x: a real reduction, short of 8x
    (_m(1.02, 0.97, 1.08), "not reproduced"),  # inside the registry's fixed band
])
def test_c6_no_effect_band_is_fixed_not_a_tenth_of_the_claimed_effect(factor, grade):
    assert _grade("C6", variance_reduction_factor=factor).grade == grade


def test_c3_a_two_percent_slowdown_is_no_effect():
    # the old band was 10% of the claimed 0.1 slowdown: +-0.01, so 1.02 graded partially
    v = _grade("C3", effective_lr_reduction=_m(0.005, 0.0, 0.01), convergence_slowdown=_m(1.02, 1.01, 1.03))
    assert v.grade == "not reproduced"
    assert "convergence_slowdown: not reproduced" in v.note


def test_c9_a_slowdown_against_no_worse_than_is_contradicted():
    v = _grade("C9", ddp8_vs_ddp_default=_m(0.5, 0.48, 0.52, method="ABBA"),
               aligned_throughput_ratio=_m(0.5, 0.48, 0.52, method="ABBA"))
    assert v.grade == "contradicted"
    assert "ddp8_vs_ddp_default: contradicted" in v.note


def test_c9_grades_like_for_like_not_our_bucketer_against_ddp():
    # the bucketer against DDP mixes the implementation into a claim about bucket sizes: the graded speed is DDP
    # 8 MiB against DDP 25 MiB, and a bucketer number does not enter the grade
    from macroarch.repro.claims import get_claim

    assert [t.metric for t in get_claim("C9").targets] == ["ddp8_vs_ddp_default", "aligned_throughput_ratio"]
    v = _grade("C9", ddp8_vs_ddp_default=_m(1.0, 0.99, 1.01), aligned_throughput_ratio=_m(1.0, 0.99, 1.01),
               bucket_speedup_vs_ddp=_m(0.5, 0.48, 0.52))
    assert v.grade == "partially" and "bucket_speedup" not in v.note  # no worse than DDP 25; no grid effect


def test_c2_tanh_growth_and_vanishing_graded_apart_and_signed():
    # the unsigned worst relative error mixed the two sides and read over-explosion (2.2x the law) as the other
    # way; each side is now the signed fitted rate over log(sigma)
    linear = {"rate_rel_error": _m(1e-16, 1e-16, 1e-16)}
    both = _grade("C2", **linear, mlp_vanishing_rate_ratio=_m(1.0, 0.98, 1.02),
                  mlp_growth_rate_ratio=_m(0.05, 0.02, 0.08))
    assert both.grade == "partially"
    assert "mlp_vanishing_rate_ratio: reproduced" in both.note and "mlp_growth_rate_ratio: not reproduced" in both.note
    fast = _grade("C2", **linear, mlp_vanishing_rate_ratio=_m(1.0, 0.98, 1.02),
                  mlp_growth_rate_ratio=_m(2.2, 2.1, 2.3))
    assert "mlp_growth_rate_ratio: partially" in fast.note  # faster than the law: still the claimed direction
    other_way = _grade("C2", **linear, mlp_vanishing_rate_ratio=_m(1.0, 0.98, 1.02),
                       mlp_growth_rate_ratio=_m(-0.5, -0.6, -0.4))
    assert "mlp_growth_rate_ratio: contradicted" in other_way.note


def test_c8_scale_rule_slowdown_is_contradicted():
    v = _grade("C8", master_copy_loss_gain=_m(0.03, 0.02, 0.04), master_copy_loss_gain_below_4=_m(0.0, -0.005, 0.005),
               master_copy_noise=0.001, scale_rule_vs_gradscaler=_m(0.5, 0.48, 0.52))
    assert "scale rule contradicted" in v.note
    assert v.grade == "partially"  # the master copy advice holds, the scale rule is the other way


def test_c12_beating_the_claim_is_not_penalised():
    v = _grade("C12", memory_reduction=0.66, memory_reduction_vs_checkpoint=0.60,  # exact byte ratios: bare numbers
               held_out_loss_change=_m(0.0, -0.01, 0.01))
    assert v.grade == "reproduced"


def test_c12_is_graded_against_the_checkpointed_baseline_as_well():
    """C12's grade hinged on a baseline without activation checkpointing, which AlphaFold2-style training uses."""
    v = _grade("C12", memory_reduction=0.66, memory_reduction_vs_checkpoint=0.20,
               held_out_loss_change=_m(0.0, -0.01, 0.01))
    assert v.grade == "partially" and "against the checkpointed one partially" in v.note


def test_c12_c13_quality_lost_by_the_enabling_run_enters_the_grade():
    lost = _m(0.4, 0.3, 0.5, method="paired t over held-out batches, one training seed")
    assert _grade("C12", memory_reduction=0.66, memory_reduction_vs_checkpoint=0.60,
                  held_out_loss_change=lost).grade == "partially"
    assert _grade("C13", batch_growth=4.0, held_out_loss_change=lost).grade == "partially"
    unsure = _m(0.04, 0.0, 0.08, n=4)  # crosses the 5% edge: the quality cannot be told, nor the grade
    assert _grade("C13", batch_growth=4.0, held_out_loss_change=unsure).grade == "inconclusive"


def test_c11_more_model_error_never_buys_reproduced():
    preds = dict(a100_theoretical_speedup=1.33, a100_achieved_speedup=1.26, v100_theoretical_speedup=1.32,
                 v100_achieved_speedup=1.26, rtx3090_theoretical_speedup=1.31, rtx3090_achieved_speedup=1.27,
                 ecc_disable_speedup=1.0)
    small = _grade("C11", **preds, model_ratio_error=0.05, model_step_error=0.10)
    large = _grade("C11", **preds, model_ratio_error=0.52, model_step_error=1.54)  # failed its 60% bound
    for v in (small, large):
        assert v.grade == "not testable here"  # predictions and a lookup are not measurements
    assert "failed" in large.note and "154%" in large.note
    reproduced = [sum(e["grade"] == "reproduced" for e in v.estimates.values()) for v in (small, large)]
    assert reproduced == [0, 0]


def test_an_interval_across_the_target_is_inconclusive_with_the_n_to_decide():
    # the old grader read the point 0.003 <= 0.005 as met
    v = _grade("C1", memory_reduction=exact(0.60), quality_gap=_m(0.003, -0.004, 0.010, n=4))
    assert v.grade == "inconclusive"
    gap = v.estimates["quality_gap"]
    assert gap["grade"] == "inconclusive" and gap["n_to_decide"] > 4
    assert f"n = {gap['n_to_decide']}" in v.note


def test_a_single_draw_of_a_varying_quantity_is_inconclusive():
    v = _grade("C1", memory_reduction=0.60, quality_gap=0.003)  # the old notebooks' bare numbers
    assert v.grade == "inconclusive" and "n=1" in v.note
    assert v.estimates["memory_reduction"]["method"] == "exact count"
