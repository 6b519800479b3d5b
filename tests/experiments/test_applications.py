"""The harness of notebook 10 (C12-C14): variants, measurements, the grading rules, bad input."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from macroarch import mvas
from macroarch.experiments import applications as A
from macroarch.measure.fit import Fit
from macroarch.measure.memory import STATE_CATEGORIES, StepMemory
from macroarch.measure.stats import Estimate
from macroarch.repro.claims import CONTRADICTED, NOT_REPRODUCED, PARTIALLY, REPRODUCED, get_claim
from macroarch.repro.notebook import resolve

TOY_TRUNK = {"layers": 2, "width": 64, "crop": 16, "batch": 1}


def _plan(model):
    """A plan without training: every packable tensor equally important, 0.9 B per weight."""
    named = dict(model.named_parameters())
    return mvas.importance_plan(named, {n: torch.ones_like(p) for n, p in named.items()}, weight_bytes=0.9)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="unknown model 'alexnet'; known: esmfold_trunk, pointnet"):
        A.get_app("alexnet")
    ci = A.ApplicationsSettings.from_params(resolve("10_applications", {"profile": "ci"}))
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
    with pytest.raises(ValueError, match=r"0.001 GB is below the peak of one step at the smallest size \(2 clouds\)"):
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


def _fits(name, sizes):
    """A FitTable from {variant: {budget: size}}."""
    report = StepMemory(1, {}, {}, 0.0)
    fits = {v: {b: Fit(n, 1, n + 1, 2, 2, 1, report) for b, n in by.items()} for v, by in sizes.items()}
    return A.FitTable(name, fits, {v: {} for v in sizes})


KEPT = Estimate(0.0, -0.01, 0.01, n=4, method="paired t over held-out batches, one training seed")


def _verdict(claim_id, metrics, quality=KEPT):
    """The verdict as notebook 10 grades it: the harness's texts, the claim's grader (the small run's held-out
    loss change ``quality``)."""
    return get_claim(claim_id).grade({**metrics, "held_out_loss_change": quality},
                                     **A.verdict_texts(claim_id, metrics, scale="toy"))


def test_c13_grading():
    claim = get_claim("C13")
    cases = {(10, 40): REPRODUCED, (4, 4): NOT_REPRODUCED, (4, 6): PARTIALLY, (4, 2): CONTRADICTED}
    for (base, stack), grade in cases.items():
        fits = _fits("pointnet", {"baseline": {24: base, 80: base * 3}, "mvas_dgr": {24: stack, 80: stack * 3}})
        m = A.c13_metrics(fits)
        assert m["batch_growth_24gb"] == pytest.approx(stack / base)
        assert _verdict("C13", m).grade == grade
    mixed = A.c13_metrics(_fits("pointnet", {"baseline": {24: 10, 80: 10}, "mvas_dgr": {24: 40, 80: 11}}))
    assert claim.grade({**mixed, "held_out_loss_change": KEPT}, scale="toy").grade == PARTIALLY


def test_c14_grading():
    def grade(stack, base):
        fits = [_fits(m, {"baseline": {24: base, 80: base + 8}, "mvas_dgr": {24: stack, 80: stack + 8}})
                for m in ("timesformer", "videomae")]
        m = A.c14_metrics(*fits)
        assert m["max_frames"] == stack
        return _verdict("C14", m)

    v = grade(128, 64)
    assert v.grade == REPRODUCED and "without the techniques" not in v.note
    assert "timesformer_24gb: 128 frames (baseline 64)" in v.note
    assert "timesformer_24gb: 128 (64)" in v.measured
    both = grade(256, 160)  # the baseline reaches 128 as well: not the techniques' doing
    assert both.grade == NOT_REPRODUCED and "which reaches 128 without the techniques" in both.note
    assert grade(64, 32).grade == PARTIALLY
    assert grade(32, 32).grade == NOT_REPRODUCED
    assert grade(24, 32).grade == CONTRADICTED


def test_c12_grading_and_text():
    table = A.SizeTable("esmfold_trunk", {v: {256: StepMemory(peak, {**dict.fromkeys(
        ("parameters", "gradients", "optimizer_state", "master_weights", "temporaries", "other"), 0),
        "activations": peak}, {}, 0.0)} for v, peak in (("baseline", 100 * 10**9), ("mvas_dgr", 44 * 10**9),
                                                        ("checkpoint", 50 * 10**9),
                                                        ("checkpoint_mvas_dgr", 20 * 10**9))})
    m = {**A.c12_metrics(table, 256), **table.metrics()}
    assert m["memory_reduction"] == pytest.approx(0.56) and m["stack_over_checkpoint_reduction_256"] == 0.6
    assert m["memory_reduction_vs_checkpoint"] == pytest.approx(0.6)
    v = _verdict("C12", m)
    assert v.grade == REPRODUCED and v.measured.startswith("100.0 GB -> 44.0 GB (-56%) at crop 256; checkpointed "
                                                           "50.0 GB -> 20.0 GB (-60%)")
    assert "reduction by crop 256: 56%" in v.note and "checkpointing alone -50%" in v.note
    lost = Estimate(0.3, 0.2, 0.4, n=4, method="paired t over held-out batches, one training seed")
    assert _verdict("C12", m, quality=lost).grade == PARTIALLY
    m["memory_reduction"] = 0.1
    assert _verdict("C12", m).grade == PARTIALLY
    with pytest.raises(ValueError, match="C15"):
        A.verdict_texts("C15", m, scale="toy")


def test_small_runs_train_both_variants(isolated):
    dims = A.small_dims("videomae", width=32, layers=2, crop=8, points=8, frames=4, image=16)
    r = A.train_compare("videomae", dims, steps=3, batch_size=4, lr=1e-3, compute_dtype="float32", weight_bytes=0.9,
                        importance_batches=1, eval_batches=1)
    assert set(r.logs) == {"baseline", "mvas_dgr"} and all(len(log.losses) == 3 for log in r.logs.values())
    assert r.logs["baseline"].losses[0] == pytest.approx(r.logs["mvas_dgr"].losses[0], rel=0.05)  # same start
    assert r.speed_ratio > 0 and set(r.eval_loss) == {"baseline", "mvas_dgr"}
    assert any(t.format != "fp32" for t in r.plan.tensors)
    assert "videomae_mvas_dgr_final_loss" in r.metrics()
    assert [len(x) for x in r.eval_losses.values()] == [1, 1]
    change = r.quality_change()
    assert change.value == pytest.approx(r.eval_loss["mvas_dgr"] / r.eval_loss["baseline"] - 1)
    assert "held-out batches" in change.method and not change.has_interval  # one batch: no interval
    est = A.quality_estimates(r)
    assert est["held_out_loss_change"] == est["held_out_loss_change_videomae"] == change
