"""The harness of notebook 10 (C12-C14): variants, measurements, paired training seeds, the grading rules and
verdict texts, the figures, bad input."""

from __future__ import annotations

import copy
import dataclasses
import inspect

import numpy as np
import pytest
import torch
from scipy import stats

from macroarch import mvas
from macroarch.experiments import applications as A
from macroarch.measure.fit import Fit
from macroarch.measure.memory import STATE_CATEGORIES, StepMemory
from macroarch.measure.stats import Estimate, Repeated, exact
from macroarch.repro.claims import (
    CONTRADICTED,
    GRADES,
    NOT_REPRODUCED,
    PARTIALLY,
    REPRODUCED,
    get_claim,
    regrade_leaving_out,
)
from macroarch.repro.figures import figure_problems
from macroarch.repro.notebook import resolve

TOY_TRUNK = {"layers": 2, "width": 64, "crop": 16, "batch": 1}


def _plan(model):
    """A plan without training: every packable tensor equally important, 0.9 B per weight."""
    named = dict(model.named_parameters())
    return mvas.importance_plan(named, {n: torch.ones_like(p) for n, p in named.items()}, weight_bytes=0.9)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="unknown model 'alexnet'; known: esmfold_trunk, pointnet"):
        A.get_app("alexnet")
    ci = A.ApplicationsSettings.from_params(resolve("10_applications", {"profile": "ci", "quality_seeds": 2}))
    with pytest.raises(ValueError, match="video_models must be names from timesformer, videomae, got \\('c3d',\\)"):
        dataclasses.replace(ci, video_models=("c3d",))
    with pytest.raises(ValueError, match="fit_variants"):
        dataclasses.replace(ci, fit_variants=("fp8",))
    model = A.build_model("esmfold_trunk", TOY_TRUNK)
    batch = A.random_batch("esmfold_trunk", TOY_TRUNK)
    with pytest.raises(ValueError, match="unknown variant 'fp8'"):
        A.setup("esmfold_trunk", "fp8", model, batch)
    with pytest.raises(ValueError, match="needs an MVAS plan"):
        A.setup("esmfold_trunk", "mvas_dgr", model, batch)
    with pytest.raises(ValueError, match="depths"):
        A.Measurements("esmfold_trunk", plan=None, depths=[1, 2])


def test_a_budget_below_one_sample_is_an_error():
    meas = A.Measurements("pointnet", plan=None, base={"points": 16, "classes": 8}, fake=False)
    with pytest.raises(ValueError, match=r"0.001 GB is below the peak of one step at the smallest size \(2 samples\)"):
        meas.fits([0.001], ["baseline"])


def test_checkpointing_changes_memory_not_gradients():
    torch.manual_seed(0)
    base = A.build_model("esmfold_trunk", TOY_TRUNK, dtype=torch.float32)
    ckpt = copy.deepcopy(base)
    batch = A.random_batch("esmfold_trunk", TOY_TRUNK)
    runs = [A.setup("esmfold_trunk", v, m, batch) for v, m in (("baseline", base), ("checkpoint", ckpt))]
    for runner, _ in runs:
        A.loss_of(runner, batch).backward()
    for (name, p), q in zip(base.named_parameters(), ckpt.parameters()):
        assert torch.equal(p.grad, q.grad), name
    meas = A.Measurements("esmfold_trunk", plan=_plan(base), base={**TOY_TRUNK, "crop": 32}, fake=False)
    table = meas.table([32])
    at = {v: table.reports[v][32] for v in A.VARIANTS}
    assert at["checkpoint"].by_category["activations"] < at["baseline"].by_category["activations"]
    state = {v: sum(r.by_category[k] for k in STATE_CATEGORIES) for v, r in at.items()}
    assert state["mvas_dgr"] < state["baseline"]  # packed weights, fp8 moments, no fp32 master
    assert table.reduction(32, "checkpoint") > 0 and table.reduction(32, "baseline") == 0


def test_depth_extrapolation_matches_the_whole_stack():
    plan = _plan(A.build_model("esmfold_trunk", TOY_TRUNK))
    deep = {**TOY_TRUNK, "layers": 5}
    meas = A.Measurements("esmfold_trunk", plan=plan, base=deep, depths=[2, 3], fake=False)
    whole = A.Measurements("esmfold_trunk", plan=plan, base=deep, fake=False)
    for variant in ("baseline", "mvas_dgr"):
        assert meas(variant, 16).peak_bytes == whole(variant, 16).peak_bytes
        assert meas(variant, 16).by_category == whole(variant, 16).by_category
    meas.check_depth("baseline", 16, 4)  # raises if the bytes at 4 blocks are not on the line through 2 and 3
    meas.check_depth("baseline", 16, 5)  # the whole trunk


@pytest.mark.parametrize("name, dims, size", [
    ("esmfold_trunk", {**TOY_TRUNK, "layers": 3}, 16),
    ("pointnet", {"points": 32, "classes": 8}, 3),
    ("timesformer", {"layers": 2, "width": 32, "image": 16, "classes": 4, "frames": 8}, 8),
    ("videomae", {"layers": 2, "width": 32, "image": 16, "classes": 4, "frames": 8}, 8),
])
def test_the_planners_fake_steps_are_the_harness_real_steps(name, dims, size):
    """Every variant of every application: the planner's fake-tensor step (``Measurements``, the variants as its
    combinations, the plan as per-role rules, PointNet's T-Nets recomputed with its blocks) against a real step
    stacked by the harness (``setup``: ``transfer_plan`` and ``compose.apply``, its own checkpointing), to the
    byte: the peak and every category at it. One extrapolated from 2 of the trunk's 3 blocks checks the depths."""
    plan = _plan(A.build_model(name, dims))
    meas = A.Measurements(name, plan=plan, base=dims, video_batch=2)
    searched = A.get_app(name).searched
    for variant in A.VARIANTS:
        fake = meas(variant, size)
        real_dims = {**dims, "batch": 2 if searched == "frames" else 1, searched: size}
        real = A.real_step(name, variant, real_dims, plan=plan)
        assert (fake.peak_bytes, fake.by_category) == (real.peak_bytes, real.by_category), variant


def test_pointnets_checkpointing_recomputes_its_t_nets():
    """Issue 45: the planner's ``checkpoint`` took PointNet's blocks only (``find_repeated_layers``); the harness
    recomputes both T-Nets too. Both hold fewer activations than the blocks alone, and the planner's equal the
    harness's real step."""
    from macroarch.planner import plan as plan_step
    from macroarch.planner.models import pointnet

    dims = {"points": 32, "classes": 8, "batch": 4}
    with_t_nets = plan_step(pointnet(8), 4, 32, combinations=["checkpoint"]).combination("checkpoint").measured
    blocks_only = dataclasses.replace(pointnet(8), checkpoint_units=None)
    without = plan_step(blocks_only, 4, 32, combinations=["checkpoint"]).combination("checkpoint").measured
    real = A.real_step("pointnet", "checkpoint", dims)
    assert with_t_nets.peak == real.peak_bytes and with_t_nets.at_peak == real.by_category
    assert with_t_nets.categories["activations"] < without.categories["activations"]


def test_the_fit_search_against_real_steps():
    """The planner's largest batch on a small PointNet fits a real step stacked by the harness, and one more does
    not (``boundary_check`` raises nothing and says so)."""
    plan = _plan(A.build_model("pointnet", {"points": 16, "classes": 8}))
    check = A.boundary_check(90, 16, ("baseline", "mvas_dgr"), plan=plan)
    assert check.ok and check.metrics()["fit_check_ok"] == 1
    for b, at, above in check.rows.values():
        assert at <= 90e6 < above and b >= 2
    assert "WRONG" not in check.describe()


def _fits(name, sizes):
    """A FitTable from {variant: {budget: size}}."""
    report = StepMemory(1, {}, {}, 0.0)
    fits = {v: {b: Fit(n, 1, n + 1, 2, 2, 1, report) for b, n in by.items()} for v, by in sizes.items()}
    return A.FitTable(name, fits, {v: {} for v in sizes})


KEPT = Estimate(0.0, -0.01, 0.01, n=4, method=A.QUALITY_METHOD)


def _verdict(claim_id, metrics, quality=KEPT, names=()):
    """The verdict as notebook 10 grades it: the harness's texts, the claim's grader (the small runs' held-out
    loss change ``quality``, overall and for each model of ``names``)."""
    m = {**metrics, "held_out_loss_change": quality, **{f"held_out_loss_change_{n}": quality for n in names}}
    return get_claim(claim_id).grade(m, **A.verdict_texts(claim_id, m, scale="toy"))


def test_c13_grading():
    claim = get_claim("C13")
    cases = {(10, 40): REPRODUCED, (4, 4): NOT_REPRODUCED, (4, 6): PARTIALLY, (4, 2): CONTRADICTED}
    for (base, stack), grade in cases.items():
        fits = _fits("pointnet", {"baseline": {24: base, 80: base * 3}, "mvas_dgr": {24: stack, 80: stack * 3}})
        m = A.c13_metrics(fits)
        assert m["batch_growth_24gb"] == pytest.approx(stack / base)
        assert _verdict("C13", m).grade == grade
        est = A.c13_estimates(fits)
        assert set(est) == {"batch_growth", "batch_growth_24gb", "batch_growth_80gb"}
        assert all(e.is_exact and e.value == m[k] for k, e in est.items())
    mixed = A.c13_metrics(_fits("pointnet", {"baseline": {24: 10, 80: 10}, "mvas_dgr": {24: 40, 80: 11}}))
    assert claim.grade({**mixed, "held_out_loss_change": KEPT}, scale="toy").grade == PARTIALLY


def test_c14_grading():
    def grade(stack, base):
        fits = [_fits(m, {"baseline": {24: base, 80: base + 8}, "mvas_dgr": {24: stack, 80: stack + 8}})
                for m in ("timesformer", "videomae")]
        m = A.c14_metrics(*fits)
        assert m["max_frames"] == stack
        assert A.c14_estimates(*fits)["baseline_frames_videomae_80gb"] == exact(base + 8, "frames")
        return _verdict("C14", {**m, **A.c14_estimates(*fits)})

    v = grade(128, 64)
    assert v.grade == REPRODUCED and "without the techniques" not in v.note
    assert "timesformer_24gb: 128 frames (baseline 64)" in v.note
    assert "TimeSformer-base 24 GB 128 frames (exact count) with MVAS + DGR, 64 frames (exact count) without" \
        in v.measured
    both = grade(256, 160)  # the baseline reaches 128 as well: not the techniques' doing
    assert both.grade == NOT_REPRODUCED and "which reaches 128 without the techniques" in both.note
    assert grade(64, 32).grade == PARTIALLY
    assert grade(32, 32).grade == NOT_REPRODUCED
    assert grade(24, 32).grade == CONTRADICTED


def _c12_table():
    return A.SizeTable("esmfold_trunk", {v: {256: StepMemory(peak, {**dict.fromkeys(
        ("parameters", "gradients", "optimizer_state", "master_weights", "temporaries", "other"), 0),
        "activations": peak}, {}, 0.0)} for v, peak in (("baseline", 100 * 10**9), ("mvas_dgr", 44 * 10**9),
                                                        ("checkpoint", 50 * 10**9),
                                                        ("checkpoint_mvas_dgr", 20 * 10**9))})


def test_c12_grading_and_text():
    table = _c12_table()
    m = {**A.c12_metrics(table, 256), **table.metrics()}
    assert m["memory_reduction"] == pytest.approx(0.56) and m["stack_over_checkpoint_reduction_256"] == 0.6
    assert m["memory_reduction_vs_checkpoint"] == pytest.approx(0.6)
    est = A.c12_estimates(table, 256)
    assert est["memory_reduction"].is_exact and est["memory_reduction"].value == pytest.approx(0.56)
    v = _verdict("C12", {**m, **est})
    assert v.grade == REPRODUCED
    assert v.measured.startswith("peak-memory reduction at crop 256: against the plain baseline 0.56 (exact count) "
                                 "(100.0 GB -> 44.0 GB), against the checkpointed one 0.6 (exact count) (50.0 GB -> "
                                 "20.0 GB)")
    assert "reduction by crop 256: 56%" in v.note and "checkpointing alone -50%" in v.note
    lost = Estimate(0.3, 0.2, 0.4, n=4, method=A.QUALITY_METHOD)
    assert _verdict("C12", m, quality=lost).grade == PARTIALLY
    m["memory_reduction"] = 0.1
    assert _verdict("C12", m).grade == PARTIALLY
    with pytest.raises(ValueError, match="C15"):
        A.verdict_texts("C15", m, scale="toy")


def test_every_graded_number_in_the_measured_text_carries_its_interval():
    """Issue 42: the memory numbers say they are exact counts, each small model's quality its interval, n, method."""
    table = _c12_table()
    quality = Estimate(0.012, -0.004, 0.028, n=4, method=A.QUALITY_METHOD)
    m = {**A.c12_metrics(table, 256), **table.metrics(), **A.c12_estimates(table, 256)}
    v = _verdict("C12", m, quality=quality, names=["esmfold_trunk"])
    assert f"ESMFold folding trunk {quality.describe(3)}" in v.measured
    assert "(90% paired t over training seeds, n=4, measured)" in v.measured
    assert v.measured.count("(exact count)") == 2
    fits = _fits("pointnet", {"baseline": {24: 10, 80: 30}, "mvas_dgr": {24: 40, 80: 120}})
    v = _verdict("C13", {**A.c13_metrics(fits), **A.c13_estimates(fits)}, quality=quality, names=["pointnet"])
    assert "24 GB 4 x (exact count), 80 GB 4 x (exact count)" in v.measured and quality.describe(3) in v.measured
    # a run's measurements hold each estimate as its dict: the text reads those too
    as_recorded = {k: e.to_dict() for k, e in A.c13_estimates(fits).items()}
    texts = A.verdict_texts("C13", {**A.c13_metrics(fits), **as_recorded,
                                     "held_out_loss_change_pointnet": quality.to_dict()}, scale="toy")
    assert "(exact count)" in texts["measured_text"] and "n=4" in texts["measured_text"]


def test_the_harnesses_take_targets_from_the_notebook_not_the_registry():
    """Layering: the harness of notebook 10 never imports the grader (``macroarch.repro``)."""
    assert "macroarch.repro" not in inspect.getsource(A)


# ------------------------------------------------------------------------------------------------ paired seeds

def _paired(changes, name="timesformer", steps=6):
    """PairedSeeds whose seed i has held-out losses (1, 1 + changes[i]) and flat training losses."""
    from macroarch.experiments.loop import TrainLog

    runs = []
    for i, c in enumerate(changes):
        logs = {v: TrainLog([2.0 - 0.1 * s for s in range(steps)], [0.1] * steps) for v in ("baseline", "mvas_dgr")}
        runs.append(A.TrainResult(name, 1000, logs, {"baseline": 1.0, "mvas_dgr": 1.0 + c}, None, {}, seed=i))
    return A.PairedSeeds(name, runs)


def test_the_quality_change_is_a_t_interval_over_paired_seeds():
    changes = [0.01, 0.03, -0.02, 0.04]
    est = _paired(changes).quality_change()
    ci = stats.ttest_1samp(changes, 0.0).confidence_interval(confidence_level=0.9)  # by hand, from scipy
    assert est.value == pytest.approx(np.mean(changes)) and est.n == 4 and est.method == A.QUALITY_METHOD
    assert (est.low, est.high) == pytest.approx((ci.low, ci.high))
    assert not _paired([0.02]).quality_change().has_interval  # one seed cannot decide a grade


def test_leaving_a_seed_out_regrades_every_model_from_the_rest():
    timesformer, videomae = _paired([0.01, 0.02, 0.3]), _paired([0.0, 0.01, 0.02], name="videomae")
    repeated = A.quality_repeated(timesformer, videomae)
    assert set(repeated) == {"held_out_loss_change", "held_out_loss_change_timesformer",
                             "held_out_loss_change_videomae"}
    assert all(r.group == "seeds" and r.n == 3 for r in repeated.values())
    without = repeated["held_out_loss_change_timesformer"].leaving_out(2).estimate()
    assert without.value == pytest.approx(0.015) and without.n == 2
    worst = repeated["held_out_loss_change"]
    assert worst.estimate() == A.quality_estimates(timesformer, videomae)["held_out_loss_change"]
    assert worst.estimate().value == pytest.approx(0.11)  # timesformer's mean: the worst of the two
    assert worst.leaving_out(2).estimate().value == pytest.approx(0.015)  # still timesformer's, without seed 2
    record = Repeated.from_dict(worst.to_dict())  # a result file regrades from its own raw data
    assert record.estimate() == worst.estimate()
    stability = regrade_leaving_out("C14", repeated, fixed=A.c14_estimates(
        _fits("timesformer", {"baseline": {24: 64}, "mvas_dgr": {24: 128}}),
        _fits("videomae", {"baseline": {24: 64}, "mvas_dgr": {24: 128}})))
    assert stability.grade in GRADES


def test_small_runs_train_both_variants_over_paired_seeds(isolated):
    dims = A.small_dims("videomae", width=32, layers=2, crop=8, points=8, frames=4, image=16)
    r = A.train_seeds("videomae", dims, seeds=[3, 4], data_seed=3, steps=3, batch_size=4, lr=1e-3,
                      compute_dtype="float32", weight_bytes=0.9, importance_batches=1, eval_batches=1)
    assert r.seeds == [3, 4] and r.steps == 3 and r.plan is r.runs[0].plan
    for run in r.runs:
        assert set(run.logs) == {"baseline", "mvas_dgr"} and all(len(log.losses) == 3 for log in run.logs.values())
        assert run.logs["baseline"].losses[0] == pytest.approx(run.logs["mvas_dgr"].losses[0], rel=0.05)  # same start
        assert run.loss_change() == pytest.approx(run.eval_loss["mvas_dgr"] / run.eval_loss["baseline"] - 1)
    assert r.runs[0].logs["baseline"].losses[0] != r.runs[1].logs["baseline"].losses[0]  # seeds differ
    assert any(t.format != "fp32" for t in r.plan.tensors)
    change = r.quality_change()
    assert change.n == 2 and change.value == pytest.approx(np.mean(r.changes()))
    m = r.metrics()
    assert m["videomae_quality_seeds"] == 2 and "videomae_seed4_mvas_dgr_eval_loss" in m
    assert not any(k.startswith("held_out_loss_change") for k in m)  # only the estimates are graded
    assert "held-out loss change" in r.describe() and "seed 4" in r.describe()


def test_every_seed_is_evaluated_on_the_same_held_out_batches(isolated):
    dims = A.small_dims("pointnet", width=32, layers=2, crop=8, points=16, frames=4, image=16)
    train3, held3 = A.data_batches("pointnet", dims, 4, 5, 2, torch.float32, seed=3, data_seed=0)
    train4, held4 = A.data_batches("pointnet", dims, 4, 5, 2, torch.float32, seed=4, data_seed=0)
    assert all(torch.equal(a["points"], b["points"]) for a, b in zip(held3, held4, strict=True))
    assert not torch.equal(train3[0]["points"], train4[0]["points"])  # another batch order


def test_settings_need_a_positive_number_of_quality_seeds():
    ci = A.ApplicationsSettings.from_params(resolve("10_applications", {"profile": "ci", "quality_seeds": 2}))
    assert ci.quality_seeds == 2
    with pytest.raises(ValueError, match="quality_seeds must be a positive number"):
        dataclasses.replace(ci, quality_seeds=0)


# ------------------------------------------------------------------------------------------------ figures

def _curve_fits(name, sizes, per_size, budgets=(24, 80)):
    """A FitTable whose peaks grow by ``per_size`` bytes per unit of size, searched over ``sizes``."""
    report = StepMemory(1, {}, {}, 0.0)
    curves, fits = {}, {}
    for v, k in (("baseline", 1.0), ("mvas_dgr", 0.5)):
        curves[v] = {s: int(k * per_size * s) for s in sizes}
        fits[v] = {}
        for b in budgets:
            s = max(x for x in sizes if curves[v][x] <= b * 1e9)
            fits[v][b] = Fit(s, curves[v][s], s + 1, curves[v][s] + 1, int(b * 1e9), 2, report)
    return A.FitTable(name, fits, curves)


def _size_table(name, sizes):
    cats = dict.fromkeys(("parameters", "gradients", "optimizer_state", "master_weights", "temporaries", "other"), 0)
    return A.SizeTable(name, {v: {s: StepMemory(int(k * s * 1e9), {**cats, "activations": int(k * s * 1e9)}, {}, 0.0)
                                  for s in sizes}
                              for v, k in zip(A.VARIANTS, (0.4, 0.3, 0.1, 0.05), strict=True)})


def _lines_at(ax, y):
    return [line for line in ax.lines if len(set(line.get_ydata())) == 1 and line.get_ydata()[0] == pytest.approx(y)]


def test_c12_figure_shows_the_graded_numbers_against_the_target():
    table = _size_table("esmfold_trunk", [256, 384])
    fits = _curve_fits("esmfold_trunk", [64, 96, 128, 192, 256, 384, 512, 768], 0.2e9)
    fig = A.plot_c12(table, fits, _paired([0.01, 0.02, -0.01], "esmfold_trunk"), 256, get_claim("C12").targets)
    assert figure_problems(fig) == []
    assert fig.get_size_inches()[0] <= 9
    cat, fit, graded, quality, loss, held = fig.axes[:6]
    assert len(fit.get_xticks()) > 1  # a single tick left the log axis unreadable
    assert _lines_at(graded, 55.0) and _lines_at(graded, 100 * get_claim("C12").targets[0].lo)  # the post's 55%
    assert sorted(round(p.get_height(), 6) for p in graded.patches if p.get_height() > 0)[-2:] == \
        pytest.approx(sorted([100 * table.reduction(256), 100 * table.reduction(256, "checkpoint_mvas_dgr",
                                                                                   "checkpoint")]))
    bars = max(p.get_x() + p.get_width() for p in cat.patches)
    assert bars < cat.get_xlim()[1] * 0.95  # no bar flush with the frame
    assert "nats" in loss.get_ylabel() and "nats" in held.get_ylabel()
    assert _lines_at(quality, 5.0)  # the 5% margin, and the estimate's caps at its interval
    est = _paired([0.01, 0.02, -0.01]).quality_change()
    caps = [line.get_ydata()[0] for line in quality.lines if line.get_marker() == "_"]
    assert caps == pytest.approx([100 * est.low, 100 * est.high])
    labels = " ".join(t.get_text() for t in cat.get_yticklabels())
    assert "M+D" not in labels and "MVAS + DGR" in labels
    fig.clf()


def test_c13_and_c14_figures_mark_their_targets_inside_the_frame():
    fits = _curve_fits("pointnet", [2, 4, 8, 16, 64, 256, 1024, 4096], 0.02e9)
    fig = A.plot_c13(_size_table("pointnet", [512]), fits, _paired([0.01, 0.0], "pointnet"),
                     get_claim("C13").targets)
    assert figure_problems(fig) == [] and _lines_at(fig.axes[2], 4.0)
    fig.clf()
    videos = [_curve_fits(m, [16, 32, 64, 128, 256, 512, 1024], 0.08e9) for m in ("timesformer", "videomae")]
    args = ([_size_table(v.name, [128]) for v in videos], videos,
            [_paired([0.5, 0.6], "timesformer"), _paired([0.0, 0.01], "videomae")], get_claim("C14").targets)
    fig, graded = A.plot_c14(*args), A.plot_c14_graded(*args)
    for f in (fig, graded):  # each fits an A4 page at the text width with a one-line caption (one figure did not)
        w, h = f.get_size_inches()
        assert figure_problems(f) == [] and w <= 9 and h / w <= 1.38
    for ax in fig.axes[1:4:2]:  # what fits: every star strictly inside the frame, not on its corner
        (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
        stars = [line for line in ax.lines if line.get_marker() == "*"]
        assert stars and all(x0 < line.get_xdata()[0] < x1 and y0 < line.get_ydata()[0] < y1 for line in stars)
        assert all(x1 / line.get_xdata()[0] > 1.1 for line in stars)
    assert _lines_at(graded.axes[0], 128.0)
    fig.clf()
    graded.clf()
    one = A.plot_c14(args[0][:1], args[1][:1], args[2][:1], args[3])  # the ci profile's one video model
    assert figure_problems(one) == []
    one.clf()
