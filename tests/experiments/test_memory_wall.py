"""Notebook 02's harness on the tiny specs: bytes per parameter, the steps the planner measures against real-tensor
steps measured independently (``measure_training_step``), the checks that must fail, and the reported total being
the step's measured peak (never a sum of per-category maxima)."""

import dataclasses
import math

import pytest
from matplotlib.figure import Figure

from macroarch.experiments import memory_wall as mw
from macroarch.measure.memory import STATE_CATEGORIES, activation_bytes, measure_training_step
from macroarch.models import get_model_spec
from macroarch.planner.run import CATEGORY_NAMES
from macroarch.repro.figures import figure_problems

PRECISIONS = ("post", "bf16_mixed")
BATCH, SEQ = 2, 32


def _settings(measured_layers: int) -> mw.MemoryWallSettings:
    return mw.MemoryWallSettings(measured_layers=measured_layers, device="cpu", model="gpt3_tiny", batch_size=BATCH,
                                 seq_len=SEQ, precisions=PRECISIONS, c1_model="llama_10b_tiny", card_gb=1)


@pytest.fixture(scope="module")
def spec():
    return get_model_spec("gpt3_tiny")


@pytest.fixture(scope="module")
def accounting():
    return mw.analytic_accounting(_settings(1))


@pytest.fixture(scope="module")
def measured():
    return mw.measure_steps(_settings(1))


@pytest.fixture(scope="module")
def whole():
    return mw.measure_steps(_settings(0))


@pytest.fixture(scope="module")
def real(spec):
    """The arbiter: one real-tensor step per policy by the older, independent measurement (its own model, AdamW
    and tracker phases)."""
    return {p: measure_training_step(spec, BATCH, SEQ, p, fake=False, device="cpu") for p in PRECISIONS}


def test_settings_refuse_what_the_claim_cannot_be_graded_on():
    with pytest.raises(ValueError, match="precisions"):
        dataclasses.replace(_settings(1), precisions=("post",))
    with pytest.raises(ValueError, match="measured_layers"):
        dataclasses.replace(_settings(1), measured_layers=10_000)
    with pytest.raises(ValueError, match="c1_model"):
        dataclasses.replace(_settings(1), c1_model="no_such_model")


def test_depths_are_the_measured_layers_and_the_two_next_that_the_model_has(spec):
    assert mw.depths(get_model_spec("gpt3_175b"), 2) == (2, 3, 4)
    assert mw.depths(spec, 0) == ()  # the whole model
    assert mw.depths(spec, 1) == (1, 2)  # only two of them exist: extrapolated, not checked
    assert mw.depths(spec, 2) == ()  # one depth cannot be extrapolated from


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


@pytest.mark.parametrize("layers", [0, 1])
def test_the_planned_step_is_a_real_step_to_the_byte(layers, measured, whole, real):
    """The whole model, and the same extrapolated from 1 and 2 layers: peak, the categories at it and the state
    equal to a real step's; the activations are their largest over the step (the loss's fp32 copy of the logits
    and its padded labels beside what the forward pass keeps), as the real step's own maximum."""
    got = whole if layers == 0 else measured
    assert got.whole == (layers == 0)
    for p in PRECISIONS:
        b, r = got.bytes(p), real[p]
        assert (b.peak, b.at_peak) == (r.peak_bytes, r.by_category), p
        assert b.peak == b.phases[b.phase].peak_bytes and sum(b.at_peak.values()) == b.peak
        assert got.activations(p) == r.max_by_category["activations"] > r.end_of_forward["activations"]
        assert all(b.categories[CATEGORY_NAMES[k]] == r.max_by_category[k] for k in STATE_CATEGORIES)


def test_measured_state_equals_the_analytic_count_and_check_passes(measured):
    assert measured.state_exact
    measured.check()
    m = measured.metrics()
    assert m["state_analytic_equals_measured"] == 1 and m["measured_whole_model"] == 0
    assert m["measured_post_parameters_bytes"] == measured.analytic_state["post"]["parameters"]
    assert m["activation_rel_error"] == 0  # the loss's temporaries counted, the analytic count is exact
    for p in PRECISIONS:
        end_of_forward = activation_bytes(measured.spec, BATCH, SEQ, p, device_type="cpu")["total"]
        logits_fp32, padded_labels = 4 * BATCH * SEQ * measured.spec.shape.vocab_size, 8 * BATCH * (SEQ + 1)
        assert measured.activations(p) == end_of_forward + logits_fp32 + padded_labels
    assert "training state: analytic == measured to the byte: True" in measured.table()


def test_check_fails_when_the_accountings_disagree(measured):
    state = {p: dict(s) for p, s in measured.analytic_state.items()}
    state["post"]["gradients"] += 1
    with pytest.raises(AssertionError, match="disagree"):
        dataclasses.replace(measured, analytic_state=state).check()
    acts = {p: v * 2 for p, v in measured.analytic_activations.items()}
    with pytest.raises(AssertionError, match="activations off by 50.000%"):
        dataclasses.replace(measured, analytic_activations=acts).check()


def test_the_total_is_the_measured_peak_not_a_sum_of_category_maxima(accounting, whole, real):
    estimates, m = mw.headline(accounting, whole, card_gb=1)
    r = real["bf16_mixed"]
    assert m["mixed_precision_peak_bytes"] == r.peak_bytes
    assert sum(v for k, v in m.items() if k.startswith("mixed_precision_peak_") and k.endswith("_bytes")
               and k != "mixed_precision_peak_bytes") == r.peak_bytes  # the breakdown at the peak sums to it
    assert r.peak_bytes < sum(r.max_by_category.values())  # what the old "total" was: more than the step holds
    assert m["cards_needed"] == math.ceil(r.peak_bytes / 1e9)
    # the activations reported are the fake-tensor measurement; the analytic counts sit beside them
    assert m["activation_bytes"] == r.max_by_category["activations"]
    assert m["analytic_activation_bytes_gpu"] == accounting.activations_gpu["bf16_mixed"]
    assert m["peak_measured_whole_model"] == 1


def test_graded_state_is_exact_and_the_same_extrapolated(spec, accounting, measured, whole):
    n = accounting.n_params
    estimates, m = mw.headline(accounting, measured, card_gb=1)
    post, mixed = estimates["post_accounting_bytes"], estimates["mixed_precision_bytes"]
    assert post.is_exact and mixed.is_exact and post.n == 1 and mixed.method == "exact count"
    assert post.value == 8 * n and mixed.value == 16 * n
    assert m["peak_measured_whole_model"] == 0
    assert m["mixed_precision_peak_bytes"] == mw.headline(accounting, whole, card_gb=1)[1]["mixed_precision_peak_bytes"]
    fake_counts = dataclasses.replace(accounting, state={p: {k: 0 for k in s} for p, s in accounting.state.items()})
    assert mw.headline(fake_counts, whole, card_gb=1)[0]["post_accounting_bytes"].value == 8 * n  # measured
    texts = mw.c4_texts(accounting, measured, {**m, **{k: e.value for k, e in estimates.items()}}, _settings(1))
    assert "1, 2 of 2 layers, extrapolated" in texts["scale"] and "extrapolated in depth" in texts["measured_text"]
    assert f"{8 * n / 1e12:.3f} TB" in texts["measured_text"] and "peaks at" in texts["measured_text"]
    assert "measured" in texts["note"] and "analytic cross-check" in texts["note"]


def test_figures_say_what_they_show(accounting, measured, whole):
    fig = mw.plot_bytes_by_category(accounting, whole, _settings(0))
    assert isinstance(fig, Figure) and "measured peak" in fig.axes[0].get_title()
    assert "whole model" in fig.axes[0].get_title()
    assert "extrapolated" in mw.plot_bytes_by_category(accounting, measured, _settings(1)).axes[0].get_title()
    assert all(ax.get_ylabel() for ax in fig.axes)
    phases = mw.plot_phase_peaks(whole)  # backward split where the first block's begins
    assert [t.get_text().split("\n")[0] for t in phases.axes[0].get_xticklabels()] == \
        ["setup", "forward", "backward", "backward", "optimizer"]


def test_figures_fit_the_report_with_headroom_above_the_bars(accounting, measured, whole):
    """Issue 44: laid out for the report's page (``figure_problems``), and no bar flush with the top frame (the
    phase peaks' tallest bar touched it)."""
    for fig in (mw.plot_bytes_by_category(accounting, whole, _settings(0)),
                mw.plot_bytes_by_category(accounting, measured, _settings(1)), mw.plot_phase_peaks(whole)):
        assert figure_problems(fig) == [] and fig.get_size_inches()[0] <= 9
        for ax in fig.axes:
            top = max(p.get_y() + p.get_height() for p in ax.patches)
            assert top < ax.get_ylim()[1] * 0.95
        fig.clf()


def test_c1_baseline_is_mixed_precision_state_and_gpu_activations():
    c1 = mw.c1_baseline(_settings(1))
    c1.check()
    m = c1.metrics()
    assert m["c1_baseline_state_bytes"] == 16 * m["c1_baseline_params"]
    assert "c1_baseline_total_bytes" not in m  # a sum of state and activations is no measured total
    assert m["c1_baseline_state_exact"] == 1 and c1.measured.depths == (1, 2, 3)  # checked at the full 3 layers
    real = measure_training_step(get_model_spec("llama_10b_tiny"), BATCH, SEQ, "bf16_mixed", fake=False,
                                 device="cpu")
    assert m["c1_baseline_measured_peak_bytes"] == real.peak_bytes
    with pytest.raises(AssertionError, match="llama_10b_tiny"):
        dataclasses.replace(c1, state_exact=False).check()
