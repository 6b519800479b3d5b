"""The ZeRO-3 cost model against hand-derived numbers and its own limiting cases."""

import math

import pytest

from macroarch.measure.memory import parameter_count
from macroarch.measure.zero3 import (
    Cluster,
    Unit,
    all_gather_time,
    all_reduce_time,
    fit_alpha_beta,
    fsdp_units,
    latency_for_share,
    sync_share,
    training_flops,
    zero3_step,
)
from macroarch.models import get_model_spec

A100 = Cluster("8x A100", 8, latency=10e-6, bandwidth=300e9, peak_flops=312e12, mfu=0.5)


def test_ring_collectives_follow_the_alpha_beta_formulas():
    # 8 ranks, 1 GB gathered: 7 steps of latency and 7/8 of the bytes over each rank's link.
    assert all_gather_time(1e9, 8, 1e-5, 1e11) == pytest.approx(7e-5 + 7 / 8 * 1e-2)
    assert all_reduce_time(1e9, 8, 1e-5, 1e11) == pytest.approx(2 * (7e-5 + 7 / 8 * 1e-2))
    assert all_gather_time(1e9, 1, 1e-5, 1e11) == 0.0


@pytest.mark.parametrize("name", ["gpt3_175b", "llama_65b", "llama_10b", "gpt3_tiny"])
def test_units_hold_every_parameter_and_flops_are_about_6n(name):
    spec = get_model_spec(name)
    units = fsdp_units(spec)
    assert len(units) == spec.shape.n_layers + 1
    assert sum(u.params for u in units) == parameter_count(spec)
    if name != "gpt3_tiny":  # large models: 6N per token, plus attention (a few percent at 2048 tokens)
        assert 6.0 < training_flops(spec, 1) / parameter_count(spec) < 6.5


def test_gpt3_units_match_a_hand_count():
    s = get_model_spec("gpt3_175b").shape
    h = s.d_model
    assert fsdp_units(s)[1].params == 12 * h * h + 13 * h  # qkv, proj, fc, proj weights and biases, 2 LayerNorms
    assert fsdp_units(s)[0].params == s.vocab_size * h + s.max_seq_len * h + 2 * h  # tied head, final norm


def test_step_counts_three_collectives_per_block_and_two_for_the_root():
    spec = get_model_spec("gpt3_175b")
    step = zero3_step(spec, A100, 2048)
    assert step.collectives == 3 * 96 + 2
    assert step.latency_part == pytest.approx(step.collectives * 7 * A100.latency)
    bytes_moved = 2 * parameter_count(spec) * 3 - 2 * fsdp_units(spec)[0].params  # root gathered once
    assert step.comm - step.latency_part == pytest.approx(7 / 8 * bytes_moved / 300e9)
    assert step.compute == pytest.approx(training_flops(spec, 2048) / (312e12 * 0.5))


def test_overlap_never_hurts_and_has_the_right_limits():
    spec = get_model_spec("llama_10b")
    for alpha in (1e-6, 1e-4, 1e-3):
        step = zero3_step(spec, A100.with_latency(alpha), 2048)
        assert step.compute <= step.overlapped <= step.serial + 1e-12
    units = [Unit("root", 10**6, 0.0)] + [Unit(f"b{i}", 10**6, 0.0) for i in range(4)]
    no_compute = zero3_step(units, A100, 1)
    assert no_compute.overlapped == pytest.approx(no_compute.comm)  # nothing to hide behind
    alone = zero3_step(spec, Cluster("one", 1, 1e-3, 1e9, 312e12, 0.5), 2048)
    assert alone.comm == 0 and alone.collectives == 0 and alone.overlapped == pytest.approx(alone.compute)


def test_share_grows_with_latency_and_latency_for_share_inverts_it():
    spec = get_model_spec("llama_10b")
    shares = [sync_share(spec, A100.with_latency(a), 2048) for a in (1e-6, 1e-5, 1e-4, 1e-3)]
    assert shares == sorted(shares) and shares[0] > 0
    for overlap in (False, True):
        alpha = latency_for_share(spec, A100, 2048, 0.38, overlap=overlap)
        assert sync_share(spec, A100.with_latency(alpha), 2048, overlap=overlap) == pytest.approx(0.38, abs=1e-6)
    assert latency_for_share(spec, A100, 2048, 0.99, hi=1e-3) is None


def test_measured_compute_replaces_flops_over_peak():
    spec = get_model_spec("gpt3_tiny")
    step = zero3_step(spec, A100, 64, compute_seconds=0.25)
    assert step.compute == pytest.approx(0.25)


def test_fit_recovers_latency_and_bandwidth():
    alpha, bandwidth, n = 80e-6, 2.5e9, 2
    sizes = [2**k for k in range(10, 27, 2)]
    times = [all_gather_time(s, n, alpha, bandwidth) for s in sizes]
    a, b = fit_alpha_beta(sizes, times, n)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(bandwidth, rel=1e-6)
    with pytest.raises(ValueError, match="world_size"):
        fit_alpha_beta(sizes, times, 1)


@pytest.mark.parametrize("kwargs", [dict(world_size=0), dict(latency=-1.0), dict(bandwidth=0.0), dict(mfu=1.5)])
def test_cluster_rejects_bad_values(kwargs):
    base = dict(name="x", world_size=2, latency=1e-5, bandwidth=1e9, peak_flops=1e12, mfu=0.5)
    with pytest.raises(ValueError):
        Cluster(**(base | kwargs))


def test_a_bad_share_is_refused():
    with pytest.raises(ValueError, match="share"):
        latency_for_share(get_model_spec("gpt3_tiny"), A100, 64, 1.2)
    assert math.isfinite(sync_share(get_model_spec("gpt3_tiny"), A100, 64, overlap=True))
