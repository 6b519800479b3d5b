"""Notebook 02's harness on the tiny specs: bytes per parameter, the full-size rule, the checks that must fail."""

import dataclasses
import math

import pytest
from matplotlib.figure import Figure

from macroarch.experiments import memory_wall as mw
from macroarch.models import get_model_spec

PRECISIONS = ["post", "bf16_mixed"]


@pytest.fixture(scope="module")
def spec():
    return get_model_spec("gpt3_tiny").scaled(n_layers=4)


@pytest.fixture(scope="module")
def accounting(spec):
    return mw.analytic_accounting(spec, PRECISIONS, 2, 32, "cpu")


@pytest.fixture(scope="module")
def measured(spec):
    return mw.measure_steps(mw.measured_spec(spec, 2), PRECISIONS, 2, 32, "cpu")


def test_measured_spec_keeps_the_width_and_cuts_the_depth(spec):
    assert mw.measured_spec(spec, 0) is spec
    small = mw.measured_spec(spec, 2)
    assert small.shape.n_layers == 2 and small.shape.d_model == spec.shape.d_model


def test_analytic_state_is_bytes_per_parameter_times_parameters(accounting):
    n = sum(p.numel() for p in accounting.spec.build(device="meta").parameters())
    assert accounting.n_params == n
    assert accounting.state["post"]["total"] == 8 * n  # fp16 weights, grads, m, v
    assert accounting.state["bf16_mixed"]["total"] == 16 * n  # + fp32 master, fp32 m and v
    m = accounting.metrics()
    assert m["analytic_post_total_bytes"] == 8 * n and m["n_params"] == n
    assert set(m) >= {"analytic_bf16_mixed_activation_bytes_gpu", "analytic_bf16_mixed_activation_bytes_cpu",
                      "korthikanti_activation_bytes"}
    assert "Korthikanti" in accounting.table()


def test_measured_state_equals_the_analytic_count_and_check_passes(measured):
    assert measured.state_exact
    measured.check()
    m = measured.metrics()
    assert m["state_analytic_equals_measured"] == 1
    assert m["measured_post_parameters_bytes"] == measured.analytic_state["post"]["parameters"]
    assert m["activation_rel_error"] == max(abs(measured.reports[p].activation_bytes
                                                / measured.analytic_activations[p] - 1) for p in PRECISIONS)
    assert "training state: analytic == measured to the byte: True" in measured.table()


def test_check_fails_when_the_accountings_disagree(measured):
    state = {p: dict(s) for p, s in measured.analytic_state.items()}
    state["post"]["gradients"] += 1
    with pytest.raises(AssertionError, match="disagree"):
        dataclasses.replace(measured, analytic_state=state).check()
    acts = {p: v * 2 for p, v in measured.analytic_activations.items()}
    with pytest.raises(AssertionError, match="activations off by 50"):
        dataclasses.replace(measured, analytic_activations=acts).check()


def test_headline_is_analytic_at_full_size_unless_the_whole_model_was_measured(spec, accounting, measured):
    n = accounting.n_params
    act = accounting.activations_gpu["bf16_mixed"]
    h = mw.headline(accounting, measured, card_gb=1)
    assert h["post_accounting_bytes"] == 8 * n and h["mixed_precision_bytes"] == 16 * n
    assert h["mixed_with_activations_bytes"] == 16 * n + act
    assert h["cards_needed"] == math.ceil((16 * n + act) / 1e9)
    whole = mw.measure_steps(spec, PRECISIONS, 2, 32, "cpu")
    fake_counts = dataclasses.replace(accounting, state={p: {k: 0 for k in s} for p, s in accounting.state.items()})
    assert mw.headline(fake_counts, whole, card_gb=1)["post_accounting_bytes"] == 8 * n  # read from the measurement
    texts = mw.c4_texts(accounting, measured, h, 2, 32, 1)
    assert "analytic (measured at 2 layers)" in texts["scale"]
    assert f"{8 * n / 1e12:.3f} TB" in texts["measured_text"]
    assert isinstance(mw.plot_bytes_by_category(accounting, measured, 2, 32, 1), Figure)
    assert isinstance(mw.plot_phase_peaks(measured), Figure)


def test_c1_baseline_is_mixed_precision_state_plus_gpu_activations():
    spec = get_model_spec("llama_10b_tiny")
    c1 = mw.c1_baseline(spec, 1, 2, 32, "cpu")
    c1.check()
    m = c1.metrics()
    assert m["c1_baseline_state_bytes"] == 16 * m["c1_baseline_params"]
    assert m["c1_baseline_total_bytes"] == m["c1_baseline_state_bytes"] + m["c1_baseline_activation_bytes"]
    assert m["c1_baseline_state_exact"] == 1 and c1.measured_spec.shape.n_layers == 1
    with pytest.raises(AssertionError, match="llama_10b_tiny"):
        dataclasses.replace(c1, state_exact=False).check()
