"""Measured bytes (MemTracker) against the analytic accounting, and fake tensors against real ones."""

import pytest
import torch

from macroarch.measure.memory import (
    ACTIVATION_TOLERANCE,
    CATEGORIES,
    activation_bytes,
    measure_training_step,
    training_state_bytes,
)
from macroarch.models import get_model_spec

B, S = 2, 24


def _check_training_state(report, spec, precision):
    expected = training_state_bytes(spec, precision)
    # Parameters, moments and master copies exist all step long; gradients are all alive after backward.
    assert report.end_of_forward["parameters"] == expected["parameters"]
    assert report.max_by_category["gradients"] == expected["gradients"]
    assert report.end_of_forward["optimizer_state"] == expected["optimizer_state"]
    assert report.end_of_forward["master_weights"] == expected["master_weights"]


def _check_activations(report, spec, precision, b, s):
    expected = activation_bytes(spec, b, s, precision, device_type="cpu")["total"]
    assert abs(report.activation_bytes - expected) <= ACTIVATION_TOLERANCE * expected


@pytest.mark.parametrize("precision", ["fp32", "bf16_mixed", "post"])
@pytest.mark.parametrize("name", ["gpt3_tiny", "llama_65b_tiny", "llama_10b_tiny"])
def test_measured_step_matches_analytic(name, precision):
    spec = get_model_spec(name)
    report = measure_training_step(spec, B, S, precision, device="cpu")
    _check_training_state(report, spec, precision)
    _check_activations(report, spec, precision, B, S)


@pytest.mark.parametrize(
    "name, changes, precision, b, s",
    [
        ("gpt3_tiny", dict(dropout=0.0), "bf16_mixed", 1, 32),  # no dropout; b = 1 keeps q, k, v as views
        ("gpt3_tiny", dict(tied_embeddings=False), "fp32", 3, 7),
        ("llama_65b_tiny", dict(n_kv_heads=2), "bf16_mixed", 2, 16),  # grouped-query attention
        ("llama_65b_tiny", dict(dropout=0.1), "fp32", 2, 16),  # attention dropout
        ("llama_10b_tiny", {}, "mixed", 1, 40),  # fp16 weights, fp32 master copy
    ],
)
def test_measured_variants_match_analytic(name, changes, precision, b, s):
    spec = get_model_spec(name).scaled(**changes) if changes else get_model_spec(name)
    report = measure_training_step(spec, b, s, precision, device="cpu")
    _check_training_state(report, spec, precision)
    _check_activations(report, spec, precision, b, s)


def test_other_holds_buffers_inputs_and_step_counters():
    spec = get_model_spec("llama_65b_tiny")
    report = measure_training_step(spec, B, S, "fp32", device="cpu")
    model = spec.build()
    buffers = sum(t.numel() * t.element_size() for t in model.buffers())
    step_counters = 4 * len(list(model.parameters()))  # AdamW's 0-d fp32 step per parameter tensor
    assert report.end_of_forward["other"] == buffers + step_counters + 8 * B * S


@pytest.mark.parametrize("name, precision", [("gpt3_tiny", "bf16_mixed"), ("llama_65b_tiny", "fp32")])
def test_fake_tensors_measure_what_real_tensors_do(name, precision):
    real = measure_training_step(name, B, S, precision, device="cpu")
    fake = measure_training_step(name, B, S, precision, device="cpu", fake=True)
    assert fake.fake and not real.fake
    # Same kernels, same shapes: every category matches to the byte, activations included.
    assert fake.end_of_forward == real.end_of_forward
    assert fake.max_by_category == real.max_by_category
    assert (fake.peak_bytes, fake.by_category) == (real.peak_bytes, real.by_category)
    assert fake.phases == real.phases


def test_full_width_layers_add_the_analytic_per_layer_bytes():
    # How a full-size model is measured with fewer layers: every layer adds the same bytes.
    spec = get_model_spec("llama_65b")
    one, two = (
        measure_training_step(spec.scaled(n_layers=n), 1, 64, "bf16_mixed", device="cpu", fake=True) for n in (1, 2)
    )
    per_layer = activation_bytes(spec, 1, 64, "bf16_mixed", device_type="cpu")["per_layer"]
    assert two.activation_bytes - one.activation_bytes == per_layer
    state_one, state_two = (training_state_bytes(spec.scaled(n_layers=n), "bf16_mixed") for n in (1, 2))
    for category in ("parameters", "optimizer_state", "master_weights"):
        added = two.phases["setup"].by_category[category] - one.phases["setup"].by_category[category]
        assert added == state_two[category] - state_one[category]


def test_report_is_consistent():
    report = measure_training_step("gpt3_tiny", B, S, "bf16_mixed", device="cpu")
    assert set(report.by_category) == set(CATEGORIES)
    assert sum(report.by_category.values()) == report.peak_bytes
    assert max(p.peak_bytes for p in report.phases.values()) == report.peak_bytes
    assert all(report.max_by_category[c] >= report.by_category[c] for c in CATEGORIES)
    assert set(report.phases) == {"setup", "forward", "backward", "optimizer"}


def test_a_builder_can_stand_in_for_a_spec():
    spec = get_model_spec("gpt3_tiny")
    via_builder = measure_training_step(lambda device, dtype: spec.build(device=device, dtype=dtype), B, S, "fp32",
                                        device="cpu")
    via_spec = measure_training_step(spec, B, S, "fp32", device="cpu")
    assert via_builder.end_of_forward == via_spec.end_of_forward


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="fp8_magic"):
        measure_training_step("gpt3_tiny", B, S, "fp8_magic", device="cpu")
    with pytest.raises(ValueError, match="seq_len"):
        measure_training_step("gpt3_tiny", B, 0, device="cpu")
    with pytest.raises(ValueError, match="gpt4"):
        measure_training_step("gpt4", B, S, device="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given when there is no GPU")
def test_fake_cuda_without_a_gpu_says_to_use_cpu():
    with pytest.raises(ValueError, match="device='cpu'"):
        measure_training_step("gpt3_tiny", B, S, device="cuda", fake=True)
