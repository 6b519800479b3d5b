"""Notebook 11's harness (C15): the post's CLIP config applied unchanged, malformed configs refused with the model left
usable, fake-tensor memory equal to real-tensor memory byte for byte, the batch search, retrieval, the grading rule."""

import inspect
import math

import numpy as np
import pytest
import torch
import yaml
from scipy import stats

from macroarch import compose
from macroarch.config import load_config
from macroarch.experiments import clip
from macroarch.experiments.loop import TrainLog
from macroarch.measure.memory import CATEGORIES
from macroarch.measure.stats import exact
from macroarch.repro import cli
from macroarch.repro.claims import (
    CONTRADICTED,
    INCONCLUSIVE,
    NOT_REPRODUCED,
    PARTIALLY,
    REPRODUCED,
    get_claim,
    regrade_leaving_out,
)
from macroarch.repro.figures import figure_problems

POST_BLOCK = """
optim:
  macro_architecture: true
  group_size: 6
  precision_policy:
    text: fp16
    image: [fp8, fp16]   # fp8 for the shallow image layers, fp16 for the deep ones
"""
TINY = clip.small_clip_config(vocab_size=20, context_length=8, image_size=16, patch_size=8, width=32, vision_layers=2,
                              text_layers=2)


def test_the_config_file_is_the_posts_block_and_loads_unchanged():
    path = clip.post_config_path()
    assert yaml.safe_load(path.read_text()) == yaml.safe_load(POST_BLOCK)
    config = load_config(path)
    assert config == load_config(yaml.safe_load(POST_BLOCK))
    assert config.uses_mvas and config.uses_dgr and config.dgr.group_size == 6
    assert dict(config.mvas.precision_policy) == {"text": "fp16", "image": ("fp8", "fp16")}


def test_the_shallow_rule_on_vit_l_14():
    """Blocks 0-11 of ViT-L/14's 24 image blocks, its patch and position embeddings: fp8; the rest of the image
    tower: fp16; every text matrix: fp16; norms, biases and the class embedding (1024 elements) keep bf16."""
    model = clip.build_clip(clip.model_config("ViT-L-14"), torch.bfloat16, "meta")
    formats = {t.name: t.format for t in compose.precision_plan(model, load_config(clip.post_config_path())).tensors}
    blocks = len(model.visual.transformer.resblocks)
    assert blocks == 24
    for i in range(blocks):
        expected = "fp8_e4m3" if i < math.ceil(blocks / 2) else "fp16"
        for tail in ("attn.in_proj_weight", "attn.out_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"):
            assert formats[f"visual.transformer.resblocks.{i}.{tail}"] == expected, (i, tail)
        assert formats[f"visual.transformer.resblocks.{i}.ln_1.weight"] == "bf16"
    assert formats["visual.conv1.weight"] == formats["visual.positional_embedding"] == "fp8_e4m3"
    assert formats["visual.proj"] == "fp16" and formats["visual.class_embedding"] == "bf16"
    text = [n for n in formats if not n.startswith("visual.") and n != "logit_scale"]
    assert all(formats[n] in ("fp16", "bf16") for n in text)
    assert formats["token_embedding.weight"] == formats["transformer.resblocks.11.mlp.c_fc.weight"] == "fp16"
    assert "fp8_e4m3" in clip.plan_table(model, load_config(clip.post_config_path()))


@pytest.mark.parametrize("case, names", [
    ("unknown key", "group_sise"), ("image list of 3", "precision_policy.image"),
    ("unknown precision", "precision_policy.text"), ("group_size 0", "group_size"),
])
def test_a_malformed_config_names_the_key_and_leaves_the_clip_model_usable(case, names):
    cases = clip.malformed_cases()
    table = clip.check_malformed({case: cases[case]}, lambda: clip.example_model(TINY))
    row = table.splitlines()[-1]
    assert names in row and row.split()[-2:] == ["True", "True"], row


def test_check_malformed_refuses_to_pass_a_good_config():
    with pytest.raises(AssertionError, match="accepted"):
        clip.check_malformed({"post": yaml.safe_load(POST_BLOCK)}, lambda: clip.example_model(TINY))


def test_cli_config_check(tmp_path, capsys):
    assert cli.main(["config", "check", str(clip.post_config_path())]) == 0
    assert "ok" in capsys.readouterr().out
    for text, key in (("optim: {macro_architecture: true, group_size: 0}", "optim.group_size"),
                      ("optim: {precision_policy: {image: [fp8, fp16, fp4]}}", "optim.precision_policy.image"),
                      ("optim: {precision_policy: {text: fp9}}", "fp9"),
                      ("optim: {macro_architecture: true, grup_size: 6}", "grup_size")):
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        assert cli.main(["config", "check", str(bad)]) == 2
        err = capsys.readouterr().err
        assert key in err and len(err.strip().splitlines()) == 1, err


def _planned(variant, batch, config):
    """The planner's fake-tensor step of ``variant`` on the tiny CLIP (the post's config: MVAS + DGR in bf16)."""
    from macroarch.planner import plan

    combo = "mvas+dgr" if variant == "post" else "plain"
    return plan(clip.planner_model("tiny", TINY), batch, dtype="bf16_mixed" if variant == "post" else variant,
                policy=config if variant == "post" else None, combinations=[combo]).combination(combo)


@pytest.mark.parametrize("variant", ["fp32", "bf16_mixed", "post"])
def test_the_planners_fake_step_is_the_harness_real_step(variant):
    """One step of a small CLIP: the planner's, under fake tensors, against one stacked by the harness and run on
    real tensors (``real_step``), every category at the peak and each one's own maximum, to the byte."""
    config = load_config(clip.post_config_path())
    real = clip.real_step(TINY, variant, config, 4, "bfloat16")
    fake = clip.step_memory(_planned(variant, 4, config))
    assert real.peak_bytes == fake.peak_bytes and real.by_category == fake.by_category
    assert all(real.max_by_category[k] == v for k, v in fake.max_by_category.items())
    assert set(real.by_category) == set(CATEGORIES)
    assert real.max_by_category["parameters"] > 0 and real.max_by_category["activations"] > 0
    assert (real.max_by_category["master_weights"] > 0) == (variant == "bf16_mixed")
    pairs = clip.small_memory(TINY, config, 4, "bfloat16")
    assert set(pairs) == {"bf16_mixed", "post"} and "real = fake" in clip.memory_table(pairs)
    # where bf16 is emulated the post's config computes in fp32: the planner's fake step too (it took bf16's recipe)
    in_fp32 = clip.small_memory(TINY, config, 4, "float32")
    assert set(in_fp32) == {"fp32", "post"} and "real = fake" in clip.memory_table(in_fp32)
    wrong = {"bf16_mixed": (pairs["bf16_mixed"][0], pairs["post"][1])}
    with pytest.raises(AssertionError, match="differ"):
        clip.memory_table(wrong)


def test_memory_sweep_finds_the_batch_at_the_target():
    """The largest batch whose step fits the target: it fits, one more does not (both measured on real tensors by
    the harness, independently of the planner), and the post's config is measured there."""
    config = load_config(clip.post_config_path())
    sweep = clip.memory_sweep(["small"], [16, 64], config, baselines=["bf16_mixed"], target_gb=0.004, small=TINY)
    b = sweep.at_target["small", "bf16_mixed"]
    assert clip.real_step(TINY, "bf16_mixed", config, b, "bfloat16").peak_bytes <= 0.004e9
    assert clip.real_step(TINY, "bf16_mixed", config, b + 1, "bfloat16").peak_bytes > 0.004e9
    assert ("small", "post", b) in sweep.points and 0 < sweep.reduction("small", "bf16_mixed") < 1
    assert sweep.peak("small", "post", 16) == clip.real_step(TINY, "post", config, 16, "bfloat16").peak_bytes
    m = sweep.metrics()
    assert m["memory_reduction"] == sweep.reduction("small", "bf16_mixed") and m["small_batch_at_target"] == b
    assert "*" in sweep.table() and "fake tensors" in sweep.table()
    with pytest.raises(ValueError, match="below the peak of one step"):
        clip.memory_sweep(["small"], [16, 64], config, baselines=["bf16_mixed"], target_gb=1e-6, small=TINY)


def test_retrieval_counts_captions_of_equal_scenes_as_hits():
    class Split:  # 4 pairs; items 2 and 3 are the same scene
        images = torch.zeros(4, 3, 2, 2, dtype=torch.uint8)
        tokens = torch.zeros(4, 3, dtype=torch.long)
        scene_ids = torch.tensor([0, 1, 2, 2])

        def __len__(self):
            return 4

    image_features = torch.eye(4)
    text_features = torch.tensor([[0.6, 1, 0, 0], [1, 0.6, 0, 0], [0, 0, 0.1, 1], [0, 0, 1, 0.1]])

    class Model(torch.nn.Module):
        def forward(self, x, t):
            n = len(x)
            return image_features[:n], text_features[:n], torch.tensor(1.0)

    r = clip.retrieval(Model(), Split(), batch_size=4, dtype=torch.float32, ks=(1, 2))
    # image 0's best text is text 1 (a miss), its second text 0; image 2 -> text 3 (same scene: a hit)
    assert r["i2t_r1"] == 0.5 and r["i2t_r2"] == 1.0 and r["t2i_r1"] == 0.5
    assert math.isfinite(r["loss"])


def _training_with(recalls):
    """A SmallTraining whose seed s has held-out recall@1 ``recalls[s] = (baseline, post)`` both ways."""
    t = clip.SmallTraining("bf16_mixed", 1, 1)
    for s, (base, post) in enumerate(recalls):
        for v, r in (("bf16_mixed", base), ("post", post)):
            t.final[s, v] = dict(i2t_r1=r, t2i_r1=r)
    return t


def _full_training(recalls):
    """:func:`_training_with` plus what the figures and texts read: recall@5, loss logs, eval curves."""
    training = _training_with(recalls)
    for (s, v), r in list(training.final.items()):
        training.final[s, v] = dict(r, i2t_r5=0.8, t2i_r5=0.7, loss=2.0, val_i2t_r1=0.6, val_t2i_r1=0.6)
        training.logs[s, v] = TrainLog([3.0, 2.5, 2.0], [0.1] * 3)
        training.curves[s, v] = [(2, 0.3), (3, 0.4)]
    return training


def test_the_verdict_text_says_which_number_is_exact_and_which_has_an_interval():
    config = load_config(clip.post_config_path())
    sweep = clip.memory_sweep(["small"], [16, 64], config, baselines=["bf16_mixed"], target_gb=0.004, small=TINY)
    training = _full_training([(0.5, 0.49), (0.6, 0.58), (0.4, 0.42)])
    settings = clip.ClipSettings(memory_models=("small",), memory_batches=(16, 64), target_gb=0.004, n_train=64,
                                 width=32, vision_layers=2, text_layers=2, batch_size=16, steps=3, warmup_steps=1,
                                 eval_every=2, seeds=3, compute_dtype="float32", device="cpu", threads=1)
    text = clip.c15_texts(sweep, training, settings)["measured_text"]
    est = clip.c15_estimates(sweep, training)
    assert f"peak-memory reduction (mean over the architectures) {est['memory_reduction'].describe(3)}" in text
    assert "(exact count)" in text and est["retrieval_gap"].describe(3) in text
    assert "(90% paired t over seeds, n=3, measured)" in text


def test_the_retrieval_gap_is_paired_over_seeds():
    recalls = [(0.50, 0.49), (0.60, 0.58), (0.40, 0.41), (0.55, 0.52)]
    gap = _training_with(recalls).retrieval_gap()
    per_seed = [b - p for b, p in recalls]
    assert gap.n == 4 and gap.method == "paired t over seeds" and gap.value == pytest.approx(np.mean(per_seed))
    half = stats.t.ppf(0.95, 3) * np.std(per_seed, ddof=1) / math.sqrt(4)  # the 90% t interval, by hand
    assert gap.low == pytest.approx(gap.value - half) and gap.high == pytest.approx(gap.value + half)
    # pairing: a seed-to-seed spread both variants share (0.40 to 0.60) does not widen the interval
    unpaired = stats.ttest_ind([b for b, _ in recalls], [p for _, p in recalls]).confidence_interval(0.9)
    assert gap.high - gap.low < (unpaired.high - unpaired.low) / 4
    assert [r["gap"] for r in _training_with(recalls).seed_rows()] == pytest.approx(per_seed)


def test_train_small_runs_both_variants_on_the_same_batches(tmp_path, monkeypatch):
    monkeypatch.setenv("MACROARCH_DATA", str(tmp_path))
    data = clip.shapes_data(64, image_size=16)
    cfg = clip.small_clip_config(data.vocab_size, data.context_length, 16, 8, 32, 2, 1)
    settings = clip.ClipSettings(memory_models=("small",), memory_batches=(16,), target_gb=0.01, n_train=64,
                                 width=32, vision_layers=2, text_layers=1, batch_size=16, steps=4, warmup_steps=1,
                                 eval_every=2, seeds=1, compute_dtype="float32", device="cpu", threads=1,
                                 image_size=16)
    result = clip.train_small(data, cfg, load_config(clip.post_config_path()), settings)
    base, post = result.logs[0, "fp32"].losses, result.logs[0, "post"].losses
    assert len(base) == len(post) == 4
    assert abs(base[0] - post[0]) < 0.05 * base[0]  # the same weights (post's packed) on the same first batch
    assert [s for s, _ in result.curves[0, "post"]] == [2, 4]
    m = result.metrics()
    gap = result.retrieval_gap()
    assert gap.n == 1 and not gap.has_interval  # one seed: no interval, so it cannot decide a grade
    assert 0 <= m["post_recall1"] <= 1 and m["step_time_ratio"] > 0
    assert "held-out" in result.table()


@pytest.mark.parametrize("reduction, gaps, grade", [
    (0.40, (0.00, 0.01, -0.01, 0.005), REPRODUCED),  # the gap's interval inside the 2-point margin
    (0.40, (0.05, 0.06, 0.055, 0.07), PARTIALLY),  # memory as claimed, recall@1 lost beyond the margin
    (0.12, (0.00, 0.01, -0.01, 0.005), PARTIALLY),  # less memory saved than claimed, but clearly some
    (0.01, (0.00, 0.01, -0.01, 0.005), NOT_REPRODUCED),
    (-0.1, (0.00, 0.01, -0.01, 0.005), CONTRADICTED),
    (0.40, (-0.02, 0.06, 0.01, 0.04), INCONCLUSIVE),  # the gap's interval crosses the margin
])
def test_c15_grading(reduction, gaps, grade):
    training = _training_with([(0.5, 0.5 - g) for g in gaps])
    m = {"memory_reduction": reduction, "retrieval_gap": training.retrieval_gap().to_dict()}
    verdict = get_claim("C15").grade(m, scale="test")
    assert verdict.grade == grade
    assert verdict.estimates["retrieval_gap"]["n"] == len(gaps)


def test_c15_estimates_and_figure_show_the_graded_numbers():
    config = load_config(clip.post_config_path())
    sweep = clip.memory_sweep(["small"], [16, 64], config, baselines=["bf16_mixed"], target_gb=0.004, small=TINY)
    training = _training_with([(0.5, 0.49), (0.6, 0.6), (0.4, 0.42)])
    est = clip.c15_estimates(sweep, training)
    assert est["memory_reduction"].is_exact and est["memory_reduction"].value == sweep.metrics()["memory_reduction"]
    assert est["retrieval_gap"].n == 3 and est["retrieval_gap"].has_interval
    targets = get_claim("C15").targets
    fig = clip.plot_graded(sweep, training, targets)
    assert figure_problems(fig) == [] and fig.get_size_inches()[0] <= 9
    renderer = fig.canvas.get_renderer()
    memory_ax, gap_ax = fig.axes
    assert "%" in memory_ax.get_ylabel() and "percentage points" in gap_ax.get_ylabel()
    for ax in fig.axes:  # legends below the axes, never over the data
        assert ax.get_legend().get_window_extent(renderer).y1 <= ax.get_window_extent(renderer).y0 + 1
    caps = np.array([line.get_ydata()[0] for line in gap_ax.lines if line.get_marker() == "_"])  # the caps
    gap = est["retrieval_gap"]
    assert np.isclose(caps, gap.low * 100).any() and np.isclose(caps, gap.high * 100).any()
    # the graded mean is a bar of its own, its value in the tick label: no line strikes through a value label
    assert not memory_ax.texts
    (mean_bar,) = [p for p in memory_ax.patches if p.get_x() > 0.5]  # right of the one architecture's bar
    assert mean_bar.get_height() == pytest.approx(100 * est["memory_reduction"].value)
    assert any(f"{100 * est['memory_reduction'].value:.1f}%" in t.get_text() for t in memory_ax.get_xticklabels())
    lines = {round(line.get_ydata()[0], 6) for line in memory_ax.lines}
    assert round(100 * targets[0].lo, 6) in lines  # the graded threshold, from the targets passed in
    fig.clf()


def test_the_figures_fit_the_report_and_label_every_axis():
    config = load_config(clip.post_config_path())
    sweep = clip.memory_sweep(["small"], [16, 64], config, baselines=["bf16_mixed", "fp32"], target_gb=0.004,
                              small=TINY)
    fig = clip.plot_memory(sweep)
    assert figure_problems(fig) == [] and fig.get_size_inches()[0] <= 9
    (ax,) = [a for a in fig.axes if a.get_visible()]
    top = max(p.get_y() + p.get_height() for p in ax.patches)
    assert top < ax.get_ylim()[1] * 0.95  # no bar flush with the frame
    fig.clf()
    fig = clip.plot_training(_full_training([(0.5, 0.49), (0.6, 0.6), (0.4, 0.42)]))
    assert figure_problems(fig) == [] and fig.get_size_inches()[0] <= 9
    assert all(ax.get_ylabel() for ax in fig.axes)  # the retrieval panel had none
    fig.clf()


def test_leaving_a_seed_out_regrades_the_retrieval_gap_with_memory_fixed():
    recalls = [(0.50, 0.49), (0.60, 0.575), (0.40, 0.41), (0.55, 0.52)]
    training = _training_with(recalls)
    repeated = training.repeated()
    assert set(repeated) == {"retrieval_gap"} and repeated["retrieval_gap"].estimate() == training.retrieval_gap()
    without = repeated["retrieval_gap"].leaving_out(0).estimate()
    assert without == _training_with(recalls[1:]).retrieval_gap()
    stability = regrade_leaving_out("C15", repeated, fixed={"memory_reduction": exact(0.40)})
    assert stability.grade == get_claim("C15").grade({"memory_reduction": exact(0.40),
                                                      "retrieval_gap": training.retrieval_gap()}, scale="t").grade


def test_the_harness_takes_targets_from_the_notebook_not_the_registry():
    """Layering: the harness of notebook 11 never imports the grader (``macroarch.repro``)."""
    assert "macroarch.repro" not in inspect.getsource(clip)


def test_settings_name_the_field_that_is_wrong():
    good = dict(memory_models=["small"], memory_batches=[16], target_gb=0.01, n_train=64, width=32, vision_layers=2,
                text_layers=1, batch_size=16, steps=4, warmup_steps=1, eval_every=2, seeds=1,
                compute_dtype="float32", device="cpu", threads=1)
    assert clip.ClipSettings.from_params(good).memory_baselines == ("bf16_mixed", "fp32")
    assert clip.ClipSettings.from_params(dict(good, seed=100, seeds=3)).seed_list == (100, 101, 102)
    with pytest.raises(ValueError, match="patch_size"):
        clip.ClipSettings.from_params(dict(good, patch_size=5))  # does not divide the 32 px image
    with pytest.raises(ValueError, match="memory_baselines"):
        clip.ClipSettings.from_params(dict(good, memory_baselines=["fp8"]))
