"""Notebook 09's harness: the op counter against hand counts, the traced plan against its budget, the step-time
model's error against the bound the notebook states, and the C11 grading rule."""

import math

import pytest
import torch
from matplotlib.collections import PolyCollection

from macroarch.experiments import hardware_speedups as hs
from macroarch.measure.stats import Estimate
from macroarch.measure.step_time import FUSED_BASELINE, Efficiency
from macroarch.repro.claims import get_claim
from macroarch.repro.figures import figure_problems
from macroarch.repro.notebook import notebook_parameters


@pytest.fixture(scope="module")
def traced():
    torch.set_num_threads(1)
    mach = hs.machine(matmul_n=128, copy_mb=4, repeats=2)
    return mach, hs.trace_traffic(64, 32, 32, 4, mach=mach, compute_dtype="float32", target_reduction=0.55)


def test_traced_traffic_is_at_least_what_fused_kernels_need_and_the_plan_meets_its_budget(traced):
    _, t = traced
    base, macro = t.traffic[hs.BASELINE], t.traffic[hs.MACRO]
    # fp32 AdamW must read weight, grad, m, v and write weight, m, v: 28 bytes per parameter at least
    assert base.optimizer >= 7 * 4 and macro.dequant >= 1 + 4  # read >= 1 B packed, write 4 B dense (fp32)
    assert base.dequant == 0 and 0 < macro.dequant_efficiency <= 1 and 0 < macro.optimizer_efficiency <= 1
    # the budget saves 55% of the packable weights' bytes: 0.45 x 4 B (fp32 here) on nearly every parameter
    assert t.managed_fraction > 0.9
    assert t.packed_weight_bytes == pytest.approx(0.45 * 4, rel=0.05)
    assert base.ops_per_layer > 0 and macro.ops_per_tensor > base.ops_per_tensor


@pytest.mark.slow
def test_step_time_model_stays_within_the_bound_the_notebook_states(traced):
    """The validation the notebook runs, at a size where a step still takes milliseconds."""
    mach, _ = traced
    bound = notebook_parameters("09_hardware_speedups")["error_bound"].default
    t = hs.trace_traffic(128, 64, 64, 8, mach=mach, compute_dtype="float32", target_reduction=0.55)
    v = hs.validate([128, 256], layers=2, head_dim=64, seq_len=64, batch_size=8, steps=6, traced=t, mach=mach,
                    compute_dtype="float32", target_reduction=0.55)
    assert v.max_error < bound, hs.validation_table(v)
    assert all(p.measured_ratio > 0 and p.predicted_ratio > 0 for p in v.points)


def test_predictions_pay_for_what_theory_leaves_out(traced):
    _, t = traced
    pred = hs.predict_cards(["A100 SXM4 80GB", "RTX 4090"], ["1.3B", "33B", "65B"], t, eff=Efficiency(0.7, 0.8, 0.8),
                            seq_len=2048, global_batch=512, world_size=8, reserve=0.1)
    for r in pred.cards.values():
        for size in r.plans:
            theo, ach = r.speedups("theoretical")[size], r.speedups("achieved")[size]
            assert math.isnan(theo) == math.isnan(ach)
            assert math.isnan(ach) or ach <= theo * (1 + 1e-9)  # costs only ever subtract
    a100 = pred.cards["A100 SXM4 80GB"]
    assert a100.plans["65B"][hs.BASELINE] is None and a100.plans["65B"]["achieved"] is not None  # 16 B/param
    assert math.isnan(a100.speedups("achieved")["65B"])  # no speedup against a baseline that cannot train
    # without fp8, the only gain is recomputation avoided: at most one forward pass in four
    assert a100.best("theoretical")[0] <= 4 / 3 + 1e-6
    rtx4090 = pred.cards["RTX 4090"].speedups("theoretical")["1.3B"]
    assert rtx4090 > a100.speedups("theoretical")["1.3B"] * 1.1  # fp8 matmuls on the card that has them
    eccs = {e.card: e for e in hs.ecc_effects(pred)}
    assert eccs["A100 SXM4 80GB"].gain_if_on == 1.0 and eccs["RTX 4090"].gain_default == 1.0  # off as shipped
    metrics = hs.metrics(_validation_stub(), pred, list(eccs.values()), traced[0])
    assert metrics["ecc_disable_speedup"] == 1.0 and "a100_achieved_speedup" in metrics


def _validation_stub():
    p = hs.Point(64, 1000, {hs.BASELINE: 1.0, hs.MACRO: 2.0}, {hs.BASELINE: 1.1, hs.MACRO: 2.0}, {})
    return hs.Validation([p], "float32", 1, 8, 1, 3)


def _grade(a100, v100, rtx, err, ecc=1.0, step_err=None):
    m = dict(a100_theoretical_speedup=a100[0], a100_achieved_speedup=a100[1], v100_theoretical_speedup=v100[0],
             v100_achieved_speedup=v100[1], rtx3090_theoretical_speedup=rtx[0], rtx3090_achieved_speedup=rtx[1],
             model_ratio_error=err, ecc_disable_speedup=ecc)
    if step_err is not None:
        m["model_step_error"] = step_err
    return get_claim("C11").grade(m, scale="test")


def test_c11_rule_reads_each_prediction_as_not_testable_whatever_its_error():
    """A prediction is not a measurement: however close to the post and however small the model's error, a modelled
    speedup and a looked-up ECC effect grade not testable here, and the verdict says what would test them."""
    for err, step_err in ((0.05, 0.3), (0.2, None), (0.5, 1.54)):
        for values in (((3.1, 2.7), (2.0, 1.75), (1.8, 1.3)), ((1.05, 1.05),) * 3, ((0.5, 0.5),) * 3):
            v = _grade(*values, err, ecc=1.2, step_err=step_err)
            assert v.grade == "not testable here", (err, values, v.note)
            assert all(e["grade"] == "not testable here" for e in v.estimates.values())
            assert "tested by:" in v.note and "ABBA" in v.note
    failed = _grade((3.1, 2.7), (2.0, 1.75), (1.8, 1.3), 0.05, step_err=1.54)
    assert "step-time error 154% over its 60% bound: failed validation" in failed.note
    # the model's error is each prediction's interval, recorded as modelled
    a100 = failed.estimates["a100_theoretical_speedup"]
    assert a100["kind"] == "modelled" and a100["low"] == pytest.approx(3.1 * 0.95)


def test_c11_estimates_are_modelled_and_looked_up_and_a_measured_speedup_would_be_graded(traced):
    mach, t = traced
    pred = hs.predict_cards(["A100 SXM4 80GB", "V100 SXM2 32GB", "RTX 3090", "RTX 4090"], ["1.3B", "7B"], t,
                            eff=Efficiency(0.7, 0.8, 0.8), seq_len=2048, global_batch=512, world_size=8, reserve=0.1)
    v = hs.Validation([hs.Point(64, 1000, {hs.BASELINE: 1.0, hs.MACRO: 2.0}, {hs.BASELINE: 2.54, hs.MACRO: 3.0}, {})],
                      "float32", 1, 8, 1, 3)
    est = hs.estimates(v, pred, hs.ecc_effects(pred))
    assert {k for k in est if k.endswith("_speedup")} >= {t.metric for t in get_claim("C11").targets}
    card = est["a100_achieved_speedup"]
    assert card.kind == "modelled" and card.n == 1 and "failed validation" in card.method
    assert card.high / card.value - 1 == pytest.approx(v.max_ratio_error)
    ecc = est["ecc_disable_speedup"]
    assert ecc.kind == "looked up" and ecc.value == 1.0 and not ecc.has_interval
    verdict = get_claim("C11").grade(est, scale="test")
    assert verdict.grade == "not testable here" and "failed validation" in verdict.measured
    # measured on the card (ABBA blocks), a speedup is graded from its interval like any other number
    measured = dict(est, a100_theoretical_speedup=Estimate(3.2, 3.1, 3.3, n=8, method="ABBA blocks"))
    g = get_claim("C11").grade(measured, scale="test")
    assert g.estimates["a100_theoretical_speedup"]["grade"] == "reproduced" and g.grade == "reproduced"


def test_the_validation_figure_says_what_its_axes_hold():
    # issue 44: "seconds per step (ms)"; 12 inches wide with a legend over the model's line
    fig = hs.plot_validation(_validation_stub())
    assert fig.axes[0].get_ylabel() == "step time (ms)" and all(ax.get_xlabel() and ax.get_ylabel()
                                                                  for ax in fig.axes)
    assert figure_problems(fig) == [] and fig.get_size_inches()[0] <= 8


def test_the_prediction_figure_draws_the_registry_targets_and_the_model_error(traced):
    # issue 44: 13 inches wide (text at 3.7 pt in the report), the card axis unlabelled, no graded region drawn
    _, t = traced
    cards = ["V100 SXM2 32GB", "A100 SXM4 80GB", "RTX 3090", "RTX 4090"]
    pred = hs.predict_cards(cards, ["1.3B", "7B", "33B"], t, eff=Efficiency(0.7, 0.8, 0.8), seq_len=2048,
                            global_batch=512, world_size=8, reserve=0.1)
    targets = get_claim("C11").targets
    fig = hs.plot_predictions(pred, 0.3, targets)
    assert figure_problems(fig) == [] and fig.get_size_inches()[0] <= 8
    bars = fig.axes[1]
    assert bars.get_xlabel() == "card"
    bands = sorted((p.vertices[:, 1].min(), p.vertices[:, 1].max()) for c in bars.collections
                   if isinstance(c, PolyCollection) for p in c.get_paths())
    graded = sorted((x.lo, x.hi) for x in targets if x.metric.split("_")[0] in hs.CARD_KEYS)
    assert bands == [(pytest.approx(lo), pytest.approx(hi)) for lo, hi in graded]
    caps = [line for line in bars.lines if line.get_marker() == "_"]  # error bars: the model's error, both ways
    values = [pred.cards[n].best("theoretical")[0] for n in cards]
    assert {round(y, 6) for line in caps for y in line.get_ydata()} >= {round(v * 1.3, 6) for v in values}


def test_the_verdict_text_describes_every_graded_prediction(traced):
    mach, t = traced
    pred = hs.predict_cards(["A100 SXM4 80GB", "V100 SXM2 32GB", "RTX 3090", "RTX 4090"], ["1.3B", "7B"], t,
                            eff=Efficiency(0.7, 0.8, 0.8), seq_len=2048, global_batch=512, world_size=8, reserve=0.1)
    v, eccs = _validation_stub(), hs.ecc_effects(pred)
    text = hs.texts(v, pred, eccs, mach, profile="ci", bound=0.6)["measured_text"]
    est = hs.estimates(v, pred, eccs, 0.6)
    for target in get_claim("C11").targets:
        assert est[target.metric].describe(3) in text, target.metric
    assert "modelled" in text and "looked up" in text


def test_the_harness_does_not_import_the_reproduction_layer():
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(hs))
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m and m.startswith("macroarch.repro")]


def test_the_fair_baseline_follows_the_compute_dtype():
    assert "fp32 master" in hs.fair_baseline("bfloat16") and "emulates bf16" in hs.fair_baseline("float32")
    assert FUSED_BASELINE.optimizer == 28.0
