"""Notebook 03's harness: the post's setting, the sensitivity, and the calibration path on synthetic timings."""

import numpy as np
import pytest
from matplotlib.figure import Figure

from macroarch.experiments import zero3_communication as z3
from macroarch.measure.memory import parameter_count
from macroarch.measure.workload import Workload
from macroarch.measure.zero3 import zero3_step
from macroarch.models import get_model_spec

KW = dict(seq_len=2048, param_bytes=2, grad_bytes=2)
ALPHA = {"all_gather": 150e-6, "reduce_scatter": 300e-6, "all_reduce": 400e-6}
BANDWIDTH = {"all_gather": 1e9, "reduce_scatter": 0.5e9, "all_reduce": 0.4e9}


@pytest.fixture(scope="module")
def a100():
    return z3.a100_cluster(8, 300.0, 0.8, 312.0, 0.5)


@pytest.fixture(scope="module")
def post(a100):
    return z3.post_setting(["gpt3_175b", "llama_10b"], a100, 2048, z3.latency_grid([1.0, 1000.0], 7), 0.38, **KW)


def test_grid_and_cluster():
    grid = z3.latency_grid([1.0, 1000.0], 4)
    assert grid == pytest.approx([1e-6, 1e-5, 1e-4, 1e-3])
    a100 = z3.a100_cluster(8, 300.0, 0.8, 312.0, 0.5)
    assert (a100.latency, a100.bandwidth, a100.peak_flops, a100.world_size) == (200e-6, 240e9, 312e12, 8)


def test_post_setting_shares_and_crossings(post, a100):
    m = post.metrics()
    spec = get_model_spec("gpt3_175b")
    assert m["sync_share_at_200us"] == zero3_step(spec, a100, 2048, **KW).share_serial
    assert m["collectives_per_step"] == 3 * spec.shape.n_layers + 2  # a gather per unit forward and backward + RS
    assert m["state_bytes_per_gpu"] == 16 * parameter_count(spec) / 8  # 16 B/param of mixed precision over 8 GPUs
    assert "llama_10b_sync_share_at_200us" in m and "llama_10b_state_bytes_per_gpu" in m
    for share in post.models.values():
        assert np.all(np.diff(share.serial) > 0) and np.all(share.overlapped <= share.serial + 1e-12)
        crossing = share.crossing[0]
        if crossing is not None:  # where the share is the target
            assert zero3_step(share.spec, a100.with_latency(crossing), 2048, **KW).share_serial == pytest.approx(0.38,
                                                                                                              rel=1e-3)
            assert m.get("latency_at_38pct_us" if share.spec.name == "gpt3_175b" else
                         f"{share.spec.name}_latency_at_38pct_us") == pytest.approx(crossing * 1e6)
    rows = post.series()
    assert [i for i, _ in rows] == list(range(7))
    assert rows[3][1]["gpt3_175b_latency_us"] == pytest.approx(31.6227766, rel=1e-6)
    assert "38% reached at" in post.table()


def test_sensitivity_grows_with_mfu_and_shrinks_with_tokens(a100):
    sens = z3.sensitivity("gpt3_175b", a100, **KW)
    assert list(sens.shares) == [0.3, 0.5, 0.7]
    shares = np.array(list(sens.shares.values()))
    assert np.all(np.diff(shares, axis=0) > 0) and np.all(np.diff(shares, axis=1) < 0)
    assert sens.metrics()["sync_share_at_200us_max_over_sensitivity"] == shares.max()
    assert "MFU 0.70" in sens.text()


@pytest.fixture
def calib(monkeypatch):
    """``calibrate`` on timings that follow the ring formula exactly, instead of launched gloo ranks."""
    def fake_measure(work, *, sizes, repeats, steps, world_size, threads):
        n = world_size
        seconds = {op: [(n - 1) * ALPHA[op] + (n - 1) / n * s / BANDWIDTH[op] for s in sizes] for op in ALPHA}
        return dict(world_size=n, sizes=list(sizes), seconds=seconds, compute_s=0.01, fsdp_step_s=0.05,
                    fsdp_collectives=8, n_params=123_456)

    monkeypatch.setattr(z3, "measure_zero3", fake_measure)
    return z3.calibrate(Workload(d_model=32, n_layers=2, n_heads=2, seq_len=8), [12, 16], 1, 1, 2, 1)


def test_calibration_recovers_the_link_it_was_timed_on(calib):
    assert calib.measured["sizes"] == [4096, 16384, 65536]  # every power of 4 from 2**12 to 2**16
    for op in z3.FITTED_OPS:
        alpha, bandwidth = calib.fits[op]
        assert alpha == pytest.approx(ALPHA[op], rel=1e-9) and bandwidth == pytest.approx(BANDWIDTH[op], rel=1e-9)
        assert calib.ring_seconds(op, 4096) == pytest.approx(calib.measured["seconds"][op][0], rel=1e-9)
    m = calib.metrics()
    assert m["here_alpha_us"] == pytest.approx(150) and m["here_rs_bandwidth_GBps"] == pytest.approx(0.5)
    assert [set(v) for _, v in calib.series()] == [{"calibration_bytes", "all_gather_s", "reduce_scatter_s",
                                                    "all_reduce_s"}] * 3


def test_check_here_sets_the_model_beside_the_measured_step(calib, post, a100):
    work = Workload(d_model=32, n_layers=2, n_heads=2, seq_len=8)
    here = z3.check_here(calib, work, post.latencies, 0.38)
    m = here.metrics()
    assert m["fsdp_sync_measured_s"] == pytest.approx(0.04)
    assert m["here_share_measured"] == pytest.approx(0.8)
    assert m["fsdp_collectives_predicted"] == 3 * 2 + 2
    assert m["fsdp_predicted_over_measured"] == pytest.approx(here.predicted.comm / 0.04)
    assert here.predicted.compute == pytest.approx(0.01)  # the measured compute, not peak x MFU
    assert here.cluster.latency == pytest.approx(ALPHA["all_gather"])
    sens = z3.sensitivity("gpt3_175b", a100, **KW)
    assert isinstance(z3.plot_sync_share(post, sens, calib, here), Figure)
    texts = z3.c5_texts(post, calib, here, post.metrics() | sens.metrics() | m)
    assert "llama_10b: " in texts["measured_text"] and "alpha 150 us" in texts["scale"]
