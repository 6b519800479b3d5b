"""Notebook 06's harness (C8): the runs on a toy model, their controls, the sizes on a CPU that emulates bf16,
and the statistics on synthetic sweeps whose answer is known."""

import dataclasses
import math

import numpy as np
import pytest
import torch
from model_zoo import alphabet_batches, tiny_gpt

from macroarch.experiments import mixed_precision as mp


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


def _setup(initial_loss=6.0):
    return mp.Setup(SETTINGS, mp.Sizes(10, 10, False, "test", (10, 10)), None, [], [], 1000, initial_loss)


def _result(loss, diverged=False, lost=0.1):
    return mp.RunResult([loss], math.nan if diverged else loss, 0 if diverged else None, 0.0,
                        {"lost_update_fraction": math.nan if diverged else lost, "stalled_fraction": 0.0})


def test_accumulation_metrics_grade_the_master_copy_by_k():
    s = _setup()
    # bf16: the master copy gains 0.01 below k = 4 and 0.05 from 4 on; master-copy losses spread by 0.001 over k.
    master = {1: 3.000, 2: 3.001, 4: 3.002, 8: 3.003}
    results = {}
    for k in (1, 2, 4, 8):
        results[mp.run_name("bf16", True, k)] = _result(master[k])
        results[mp.run_name("bf16", False, k)] = _result(master[k] + (0.05 if k >= 4 else 0.01))
        results[mp.run_name("fp16", True, k)] = _result(3.0)
        results[mp.run_name("fp16", False, k)] = _result(0.0, diverged=True)  # charged the initial loss, 6.0
    m = mp.accumulation_metrics(s, mp.AccumulationSweep(_result(2.9), results))
    assert m["master_copy_loss_gain"] == pytest.approx(0.05)
    assert m["master_copy_loss_gain_below_4"] == pytest.approx(0.01)
    assert m["master_copy_noise"] == pytest.approx(np.std([3.000, 3.001, 3.002, 3.003], ddof=1))
    assert m["fp16_master_copy_loss_gain_at_4_plus"] == pytest.approx(3.0)
    assert m["fp16_nomaster_diverged_runs"] == 4 and m["bf16_nomaster_diverged_runs"] == 0
    assert m["fp16_nomaster_k4_eval_loss"] == 6.0 and "fp16_nomaster_k4_lost_update_fraction" not in m
    assert m["fp32_reference_eval_loss"] == 2.9 and m["initial_eval_loss"] == 6.0


def test_scaling_metrics_compare_gradscaler_with_the_rule():
    s = _setup()
    runs = {method: mp.RunResult([1.0], loss, None, 0.0, {"overflow_steps": 0, "underflow_fraction": 0.0,
                                                         "grad_rel_error": 0.0, "final_scale": 1.0})
            for method, loss in (("none", 3.0), ("gradscaler", 3.3), ("norm_rule", 3.0))}
    m = mp.scaling_metrics(s, runs)
    assert m["scale_rule_vs_gradscaler"] == pytest.approx(1.1) and m["gradscaler_eval_loss"] == 3.3
