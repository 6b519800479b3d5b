"""Notebook 06's harness (C8): the runs on a toy model, their controls, the sizes on a CPU that emulates bf16,
and the statistics on synthetic sweeps whose answer is known."""

import dataclasses
import math

import numpy as np
import pytest
import torch
from model_zoo import alphabet_batches, tiny_gpt

from macroarch.experiments import mixed_precision as mp
from macroarch.repro.claims import GRADES, get_claim, regrade_leaving_out
from macroarch.repro.figures import figure_problems


def test_accumulation_counts_see_the_same_tokens_per_update():
    # In fp32 the mean of k micro-batch gradients is the full-batch gradient up to rounding: the trajectories agree.
    train, held_out = alphabet_batches(6), alphabet_batches(2, seed=1)
    a = mp.accumulation_run(tiny_gpt(), train, held_out, lr=1e-2, accumulation_steps=1, master_weights=False)
    b = mp.accumulation_run(tiny_gpt(), train, held_out, lr=1e-2, accumulation_steps=4, master_weights=False)
    assert a.losses == pytest.approx(b.losses, rel=1e-4) and a.eval_loss == pytest.approx(b.eval_loss, rel=1e-4)
    assert a.losses[-1] < a.losses[0] and not a.diverged and len(a.losses) == 6


def test_accumulation_run_counts_lost_updates_in_bf16():
    train, held_out = alphabet_batches(4), alphabet_batches(1, seed=1)
    off = mp.accumulation_run(tiny_gpt(torch.bfloat16), train, held_out, lr=1e-3, accumulation_steps=2,
                              master_weights=False)
    on = mp.accumulation_run(tiny_gpt(torch.bfloat16), train, held_out, lr=1e-3, accumulation_steps=2,
                             master_weights=True)
    assert off.metrics["lost_update_fraction"] > 0.01  # LayerNorm gains at 1.0 cannot move by 1e-3 in bf16
    assert on.metrics["lost_update_fraction"] < 1e-3 and on.metrics["master_copies"] > 0
    assert off.metrics["master_copies"] == 0


def test_a_non_finite_loss_stops_the_run_where_it_happened():
    model = tiny_gpt()
    train = alphabet_batches(5)
    calls = []

    def poison(step, loss):  # after the third update, the weights turn NaN
        calls.append(step)
        if step == 2:
            with torch.no_grad():
                next(model.parameters()).fill_(float("nan"))

    r = mp.accumulation_run(model, train, alphabet_batches(1, seed=1), lr=1e-3, accumulation_steps=1,
                            master_weights=False, on_update=poison)
    assert r.diverged_at == 3 and len(r.losses) == 3 and calls == [0, 1, 2] and math.isnan(r.eval_loss)


@pytest.mark.parametrize("method", mp.SCALING_METHODS)
def test_loss_scaling_runs_probe_underflow(method):
    result = mp.loss_scaling_run(tiny_gpt(), alphabet_batches(3), alphabet_batches(1, seed=1), method=method,
                                 lr=1e-3, probe_every=2)
    assert result.metrics["probes"] == 2 and 0.0 <= result.metrics["underflow_fraction"] <= 1.0
    assert math.isfinite(result.eval_loss) and len(result.series["scale"]) == 3
    assert result.series["scale"][0] == {"none": 1.0, "gradscaler": 65536.0, "norm_rule": 32.0}[method]


def test_unknown_names_are_rejected():
    with pytest.raises(ValueError, match="method"):
        mp.loss_scaling_run(tiny_gpt(), alphabet_batches(1), alphabet_batches(1), method="fp8", lr=1e-3)
    with pytest.raises(ValueError, match="accumulation_steps"):
        mp.accumulation_run(tiny_gpt(), alphabet_batches(1, rows=6), alphabet_batches(1), lr=1e-3, accumulation_steps=4,
                            master_weights=False)


SETTINGS = mp.MixedPrecisionSettings(n_layers=2, width=32, n_heads=2, seq_len=32, batch_size=8, steps=200,
                                     accumulation=(1, 2, 4, 8), scaling_steps=150, emulated_steps=60, probe_every=3,
                                     eval_batches=2, device="cpu", threads=1)


def test_runs_shrink_only_where_bf16_is_emulated():
    settings = SETTINGS
    info = dict(cpu_model="x", cpu_capability="AVX2", native_bf16=False)
    emulated = mp.run_sizes(settings, info)
    assert (emulated.steps, emulated.scaling_steps, emulated.emulated) == (60, 60, True)
    assert emulated.config() == {"steps_run": 60, "scaling_steps_run": 60, "bf16_emulated": True}
    assert emulated.shrunk and "shrunk to 60" in emulated.describe() and "AVX2" in emulated.describe()
    native = mp.run_sizes(settings, dict(info, cpu_capability="AVX512", native_bf16=True))
    assert (native.steps, native.scaling_steps, native.emulated) == (200, 150, False)
    gpu = mp.run_sizes(dataclasses.replace(settings, device="cuda"), info)  # a GPU's bf16 is not the CPU's question
    assert (gpu.steps, gpu.scaling_steps, gpu.emulated) == (200, 150, False)
    small = mp.run_sizes(dataclasses.replace(settings, steps=6, scaling_steps=6), info)  # never grows
    assert (small.steps, small.scaling_steps, small.shrunk) == (6, 6, False)
    assert not native.shrunk and "the profile's sizes" in native.describe()


def test_settings_name_the_field_that_is_wrong():
    with pytest.raises(ValueError, match="accumulation"):
        dataclasses.replace(SETTINGS, accumulation=(1, 3))  # 3 does not divide the batch of 8
    with pytest.raises(ValueError, match="dtypes"):
        dataclasses.replace(SETTINGS, dtypes=("fp8",))


SEEDS = (0, 1, 2, 3)


def _setup(initial_loss=6.0, accumulation=(1, 2, 4, 8)):
    settings = dataclasses.replace(SETTINGS, seeds=len(SEEDS), accumulation=accumulation)
    return mp.Setup(settings, mp.Sizes(10, 10, False, "test", (10, 10)), None, {}, [], 1000, initial_loss)


def _result(loss, diverged=False, lost=0.1):
    return mp.RunResult([loss], math.nan if diverged else loss, 0 if diverged else None, 0.0,
                        {"lost_update_fraction": math.nan if diverged else lost, "stalled_fraction": 0.0})


def _accumulation(seed_gain_high, seed_gain_low, fp16_diverges=True):
    """bf16: per seed, the master copy gains ``seed_gain_high[seed]`` from k = 4 on and ``seed_gain_low[seed]`` below;
    each seed has its own loss level (shared by master on and off: it cancels in the pairing)."""
    results = {}
    for seed in SEEDS:
        level = 3.0 + 0.1 * seed
        for k in (1, 2, 4, 8):
            master = level + 0.001 * k
            results[mp.run_name("bf16", True, k), seed] = _result(master)
            gain = seed_gain_high[seed] if k >= 4 else seed_gain_low[seed]
            results[mp.run_name("bf16", False, k), seed] = _result(master + gain)
            results[mp.run_name("fp16", True, k), seed] = _result(level)
            results[mp.run_name("fp16", False, k), seed] = _result(0.0, diverged=fp16_diverges)
    return mp.AccumulationSweep({seed: _result(2.9) for seed in SEEDS}, results)


def test_master_copy_gains_are_paired_differences_over_seeds():
    s = _setup()
    high, low = [0.05, 0.04, 0.06, 0.05], [0.01, -0.01, 0.0, 0.005]
    sweep = _accumulation(high, low)
    est = mp.accumulation_estimates(s, sweep)
    e = est["master_copy_loss_gain"]
    # Reference: a t interval over the per-seed gains, by hand (the seed levels differ by 0.3: pairing removes them).
    from scipy import stats

    t = stats.t.ppf(0.95, len(SEEDS) - 1) * np.std(high, ddof=1) / math.sqrt(len(SEEDS))
    assert e.value == pytest.approx(np.mean(high)) and e.n == len(SEEDS) and "paired" in e.method
    assert (e.low, e.high) == (pytest.approx(np.mean(high) - t), pytest.approx(np.mean(high) + t))
    assert est["master_copy_loss_gain_below_4"].value == pytest.approx(np.mean(low))
    # fp16 without master diverges: charged the untrained 6.0, so its gain is 6.0 - 3.0 - 0.1 * seed on average.
    assert est["fp16_master_copy_loss_gain_at_4_plus"].value == pytest.approx(6.0 - 3.0 - 0.1 * np.mean(SEEDS))
    m = mp.accumulation_metrics(s, sweep)
    assert m["fp16_nomaster_diverged_runs"] == 4 * len(SEEDS) and m["bf16_nomaster_diverged_runs"] == 0
    assert m["fp16_nomaster_k4_eval_loss"] == 6.0 and "fp16_nomaster_k4_lost_update_fraction" not in m
    assert m["fp32_reference_eval_loss"] == 2.9 and m["initial_eval_loss"] == 6.0
    verdict = get_claim("C8").grade({**m, **est, **mp.scaling_estimates(s, _scaling([1.0, 1.001, 0.999, 1.0]))},
                                    scale="t")
    assert verdict.estimates["master_copy_loss_gain"]["n"] == len(SEEDS)


def _scaling(ratios):
    runs = {}
    for seed, ratio in zip(SEEDS, ratios):
        for method, loss in (("none", 3.0), ("gradscaler", 3.0 * ratio), ("norm_rule", 3.0)):
            runs[method, seed] = mp.RunResult([1.0], loss, None, 0.0, {"overflow_steps": 0, "underflow_fraction": 0.0,
                                                                       "grad_rel_error": 0.0, "final_scale": 1.0},
                                              {"scale": [1.0, 1.0]})
    return runs


def test_scale_rule_ratio_is_a_geometric_mean_with_a_t_interval_on_logs():
    # A ratio's spread is multiplicative: the interval is a t interval on log ratios (scipy here), mapped back.
    from scipy import stats

    s = _setup()
    ratios = [1.1, 1.08, 1.12, 1.3]
    e = mp.scaling_estimates(s, _scaling(ratios))["scale_rule_vs_gradscaler"]
    logs = np.log(ratios)
    ci = stats.ttest_1samp(logs, 0.0).confidence_interval(confidence_level=0.9)
    assert e.value == pytest.approx(math.exp(logs.mean())) and e.value < np.mean(ratios)
    assert (e.low, e.high) == (pytest.approx(math.exp(ci.low)), pytest.approx(math.exp(ci.high)))
    assert e.n == len(SEEDS) and e.log_scale and e.unit == "x" and "on logs" in e.method
    assert mp.scaling_metrics(s, _scaling(ratios))["gradscaler_eval_loss"] == pytest.approx(3.0 * np.mean(ratios))


def test_leaving_a_seed_out_rebuilds_the_graded_estimates():
    s = _setup()
    sweep, scaling = _accumulation([0.05, 0.04, 0.06, 0.05], [0.001, -0.001, 0.0, 0.0005]), _scaling([1.0] * 4)
    rep = mp.repeated(s, sweep, scaling)
    assert set(rep) == {"master_copy_loss_gain", "master_copy_loss_gain_below_4", "scale_rule_vs_gradscaler"}
    assert rep["master_copy_loss_gain"].estimate().value == pytest.approx(0.05)
    assert rep["master_copy_loss_gain"].leaving_out(2).estimate().value == pytest.approx(np.mean([0.05, 0.04, 0.05]))
    assert regrade_leaving_out("C8", rep).grade in GRADES


def test_paired_seeds_share_initial_weights_and_batches():
    settings = dataclasses.replace(SETTINGS, seeds=2, steps=2, scaling_steps=2, emulated_steps=2)
    s = mp.setup(settings, mp.run_sizes(settings))
    a, b, c = s.build("bf16", 0), s.build("bf16", 0), s.build("bf16", 1)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(x, y) for x, y in zip(a.parameters(), c.parameters()))
    assert set(s.train) == {0, 1} and not torch.equal(s.train[0][0][0], s.train[1][0][0])
    fp32 = s.build("fp32", 0)
    assert all(torch.equal(x.to(torch.bfloat16), y) for x, y in zip(fp32.parameters(), a.parameters()))


C8 = get_claim("C8")
TARGETS = dict(gain_target=C8.target_for("master_copy_loss_gain"),
               below_4_target=C8.target_for("master_copy_loss_gain_below_4"),
               scale_target=C8.target_for("scale_rule_vs_gradscaler"))


def test_the_figure_marks_diverged_runs_inside_the_axes_and_scales_to_the_graded_gain(tmp_path):
    # issue 44 and an audit: a 25-inch row of five panels printed at 1.9 pt; the diverged runs' triangles sat half
    # outside the axes on the top spine, the legend's triangle was grey where the markers were coloured, the k = 4
    # line cut through the "fp16: diverged" text, and the scale-rule panel had no x label.
    s = _setup()
    fig = mp.plot(s, _accumulation([0.05, 0.04, 0.06, 0.05], [0.01, -0.01, 0.0, 0.005]), _scaling([1.0] * 4),
                  **TARGETS)
    fig.savefig(tmp_path / "c8.png")
    assert figure_problems(fig) == [] and fig.get_size_inches()[0] <= 8
    gain_axis, ratio_axis, loss_axis = fig.axes[:3]
    low, high = gain_axis.get_ylim()
    assert high - low < 0.2  # the 0.05-nat gain is visible: the diverged fp16 runs (a 3-nat "gain") are not plotted
    for ax in (gain_axis, loss_axis):
        markers = [line for line in ax.lines if "diverged" in line.get_label()]
        assert markers and not ax.texts
        bottom, top = ax.get_ylim()
        for line in markers:  # inside the axes, wholly, and clipped to them
            assert all(bottom < y < top for y in line.get_ydata()) and line.get_clip_on()
            y_px = ax.transData.transform((1, line.get_ydata()[0]))[1]
            assert y_px + line.get_markersize() <= ax.get_window_extent().y1
        handles = {t.get_text(): h for t, h in zip(ax.get_legend().get_texts(), ax.get_legend().legend_handles)}
        for line in markers:  # the legend's marker is the plotted one, in its colour
            assert handles[line.get_label()].get_color() == line.get_color() == "C1"
    assert ratio_axis.get_xlabel() and all(ax.get_xlabel() and ax.get_ylabel() for ax in fig.axes)
    # the targets drawn are the registry's: the post's k >= 4 band starts at its lo
    bands = [c for c in gain_axis.collections if "k >= 4" in c.get_label()]
    assert bands and bands[0].get_paths()[0].vertices[:, 1].min() == pytest.approx(TARGETS["gain_target"].lo)


def test_the_verdict_text_carries_every_graded_number_with_its_interval():
    s = _setup()
    sweep, scaling = _accumulation([0.05, 0.04, 0.06, 0.05], [0.01, -0.01, 0.0, 0.005]), _scaling([1.0, 1.1, 1, 1])
    m = {**mp.accumulation_metrics(s, sweep), **mp.scaling_metrics(s, scaling)}
    text = mp.verdict_texts(s, sweep, scaling, m)["measured_text"]
    est = {**mp.accumulation_estimates(s, sweep), **mp.scaling_estimates(s, scaling)}
    assert est["master_copy_loss_gain"].describe(3) in text and est["master_copy_loss_gain_below_4"].describe(3) in text
    assert est["scale_rule_vs_gradscaler"].describe(4) in text and "n=4, measured" in text


def test_the_harness_does_not_import_the_reproduction_layer():
    # issue 41: the figure drew its targets from macroarch.repro.claims; the notebook passes them now.
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(mp))
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m and m.startswith("macroarch.repro")]
