"""GradientBucketer on real gloo process groups: 2 ranks on loopback, launched with torchrun's environment."""

import math
import os
from pathlib import Path

import pytest
from dist_checks import TINY

from macroarch.comm import CollectiveError, LaunchError, MiB, launch
from macroarch.measure.comm_bench import dead_rank

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.distributed


def run(target, world_size=2, **kwargs):
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    outcomes = launch(f"dist_checks:{target}", world_size, kwargs=kwargs, timeout=90, pg_timeout=30, env=env)
    return [o.result for o in outcomes]


SIZES = [0.004, 0.05, 8]  # MiB: many buckets with parameters split across them, a few, one
WINDOW_MS, SLEEP_S = 150.0, 0.05


@pytest.fixture(scope="module")
def two_ranks():
    """The equality, DGR and window checks, run in one launch of 2 ranks."""
    return run("all_checks", equality_kwargs={"bucket_mbs": SIZES}, dgr_kwargs={"steps": 3, "bucket_mb": 0.01},
               window_kwargs={"window_ms": WINDOW_MS, "sleep_s": SLEEP_S, "micro_steps": 12})


def test_bucketed_gradients_equal_ddp_and_an_explicit_average(two_ranks):
    sizes = SIZES
    ranks = [r["equality"] for r in two_ranks]
    # launched as torchrun launches: its environment, one thread per rank
    assert [r["RANK"] for r in ranks] == ["0", "1"] == [r["LOCAL_RANK"] for r in ranks]
    assert {r["WORLD_SIZE"] for r in ranks} == {"2"} and {r["MASTER_ADDR"] for r in ranks} == {"127.0.0.1"}
    assert {r["OMP_NUM_THREADS"] for r in ranks} == {"1"} and {r["threads"] for r in ranks} == {1}
    for r in ranks:
        tol = 1e-6 * r["reference_norm"]
        assert r["ddp_vs_reference"] <= tol
        for mb in sizes:
            assert r["vs_reference"][str(mb)] <= tol and r["vs_ddp"][str(mb)] <= tol
            # Every bucket but the last holds exactly bucket_mb; together they hold every gradient once.
            cap = int(mb * MiB) // 4 * 4
            sizes_ = r["sizes"][str(mb)]
            assert all(s == cap for s in sizes_[:-1]) and 0 < sizes_[-1] <= cap
            n_params = sum(p.numel() for p in TINY.model().parameters())
            assert sum(sizes_) == 4 * n_params
            assert len(sizes_) == math.ceil(4 * n_params / cap) == r["collectives"][str(mb)]
        assert r["straddling"]["0.004"] > 0  # parameters larger than a bucket are split, not promoted
        assert r["grads_are_bucket_views"]
        assert r["mixed_vs_reference"] <= 1e-6 and r["mixed_dtypes"] == ["torch.float32", "torch.float64"]
        # no_sync: two local micro-steps, one reduction, equal to DDP's no_sync accumulation.
        assert r["no_sync_waits"] == [False, False, True]
        assert r["no_sync_collectives"] == r["no_sync_buckets"]
        assert r["no_sync_vs_ddp"] <= 1e-6 * r["reference_norm"] * 3


def test_composes_with_dgr_updates_inside_backward(two_ranks):
    for r in (r["dgr"] for r in two_ranks):
        assert r["weights_moved"] > 1e-3  # training happened
        assert r["weights_vs_ddp"] <= 1e-5  # DGR-sync on bucketed averages == DDP + AdamW
        assert r["buckets_straddling_groups"] == 0 and r["buckets"] >= r["groups"]
        assert r["reductions"] == 3
        assert "before" in r["second_bucketer_error"] or "already" in r["second_bucketer_error"]


def _expected_windows(ranks, window_ms, tolerance=1e-3):
    """The documented rule, from the micro-step times each rank measured itself (backward end to backward end):
    window j + 1 has ceil(window_ms / t) micro-steps, t the ranks' mean micro-step time over window j; the first
    two windows have one. Where t lies within `tolerance` of a boundary of the ceiling, either count is allowed."""
    closes = [i for i, done in enumerate(ranks[0]["synced"]) if done]
    allowed = [{1}, {1}]
    for j in range(1, len(closes) - 1):
        per_step = [(r["backward_ends"][closes[j]] - r["backward_ends"][closes[j - 1]]) / (closes[j] - closes[j - 1])
                    for r in ranks]
        t_ms = 1000 * sum(per_step) / len(per_step)
        allowed.append({max(1, math.ceil(window_ms / (t_ms * f))) for f in (1 - tolerance, 1 + tolerance)})
    return allowed


def test_window_holds_reductions_as_documented(two_ranks):
    window_ms, sleep_s = WINDOW_MS, SLEEP_S
    a, b = (r["window"] for r in two_ranks)
    assert a["ks"] == b["ks"] and a["synced"] == b["synced"]  # the ranks agree on every window
    assert a["ks"][:2] == [1, 1]  # the first two windows are one micro-step: no micro-step time known yet
    # Each window's k follows from the ranks' mean micro-step time in the window before, timed here independently.
    allowed = _expected_windows([a, b], window_ms)
    assert all(k in ok for k, ok in zip(a["ks"], allowed)) and len(allowed) == len(a["ks"])
    for r in (a, b):
        assert r["history"] == r["ks"]
        # The windows partition the micro-steps: a window of k ends at the k-th micro-step after the last one.
        closes = [i + 1 for i, done in enumerate(r["synced"]) if done]
        assert closes == [sum(r["ks"][:j + 1]) for j in range(len(r["ks"]))]
        # A micro-step lasts at least sleep_s (and far less than the window), so 1 < k <= window / sleep.
        assert 1 < max(r["ks"]) <= math.ceil(window_ms / (1000 * sleep_s))
        assert sum(r["synced"]) == r["reductions"] == len(r["ks"])
        assert r["collectives"] == r["reductions"] * (r["buckets"] + 1)  # n_buckets + 1 per window
        assert r["backward_passes"] == 12
        assert max(r["errors"]) <= 1e-6  # mean over ranks and the window's micro-steps


def test_world_size_one_works_without_communication():
    (r,) = run("world_of_one", world_size=1)
    assert r == {"synced": True, "collectives": 0, "world_size": 1, "diff": 0.0}


@pytest.mark.parametrize("mode", ["exit", "stall"])
def test_dead_or_silent_rank_raises_within_the_timeout(mode):
    timeout = 1.5
    r = dead_rank(TINY, mode=mode, after_steps=1, collective_timeout=timeout, pg_timeout=30, timeout=60)
    assert r["steps_done"] == 1 and r["error_type"] == CollectiveError.__name__
    assert "rank 0 of 2" in r["error"] and "peer rank has probably died" in r["error"]
    assert r["seconds_to_error"] < timeout + 2.0
    if mode == "stall":  # nothing tells rank 0 the peer is gone: the timeout does
        assert r["seconds_to_error"] >= 0.9 * timeout and "timed out" in r["error"].lower()


def test_launch_kills_a_hung_launch_and_reports_failed_ranks():
    env = {"PYTHONPATH": str(HERE)}
    with pytest.raises(LaunchError, match="ran past its 3 s timeout"):
        launch("dist_checks:sleep", 2, kwargs={"seconds": 60}, timeout=3, env=env)
    with pytest.raises(LaunchError, match=r"failed on ranks \[1\][\s\S]*rank one fails on purpose"):
        launch("dist_checks:fail_on_rank_one", 2, timeout=60, env=env)
