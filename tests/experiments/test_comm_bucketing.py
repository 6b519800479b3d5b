"""Notebook 07's harness (C9): what it reads from the measurements, on rows and blocks whose answer is known (the
measurements themselves run on real gloo ranks in tests/comm and in the notebook's ci run)."""

import dataclasses
import math
import os

import numpy as np
import pytest
from scipy import stats

from macroarch.config import ConfigError
from macroarch.experiments import comm_bucketing as cb
from macroarch.repro.claims import get_claim, regrade_leaving_out
from macroarch.repro.notebook import resolve


def _row(setup, step_ms, collectives=1.0, window_steps=(), error=0.0, times=None):
    from macroarch.measure.comm_bench import label

    return {"label": label(setup), "setup": setup, "step_s": step_ms / 1e3, "collectives_per_step": collectives,
            "bucket_bytes": [], "window_steps": list(window_steps), "max_grad_error": error,
            "times": [t / 1e3 for t in (times or [step_ms])]}


def _bucketing():
    times = {1: 30.0, 8: 20.0, 12: 24.0, 16: 16.0, 24: 22.0, 25: 33.0}
    rows = [_row({"kind": "local"}, 10.0), _row({"kind": "ddp", "bucket_mb": None}, 25.0, error=1e-7),
            _row({"kind": "ddp", "bucket_mb": 8}, 22.0)]
    rows += [_row({"kind": "bucketer", "bucket_mb": mb}, t, collectives=100 / mb, times=[t - 1, t, t + 2])
             for mb, t in times.items()]
    rows += [_row({"kind": "bucketer", "bucket_mb": 8, "window_ms": 200}, 18.0, 12.5 / 2, (1, 1, 2, 2)),
             _row({"kind": "bucketer", "bucket_mb": 8, "window_ms": 1000}, 10.0, 12.5 / 8, (1, 1, 8))]
    return cb.Bucketing(rows, list(times), 1_000_000)


def _abba(ratios, grid_ratios, drift=0.0):
    """Blocks whose per-block DDP / bucketer ratio is ``ratios[i]`` (DDP 8 MiB as slow as DDP 25), with a common
    drift over blocks that the per-block ratio must cancel; grid blocks with on-grid per-byte time ``1 / r``."""
    n = len(ratios)
    base = 0.1 * (1 + drift * np.arange(n))
    step_s = {cb.DDP_DEFAULT: list(base * ratios), cb.BUCKETER: list(base), cb.DDP8: list(base * ratios)}
    m = len(grid_ratios)
    off = list(1e-3 * (1 + drift * np.arange(m)))
    on = [o / r for o, r in zip(off, grid_ratios)]
    return cb.Abba(step_s, [8.0, 8.0, 16.0, 16.0][:m] + [8.0] * max(0, m - 4), on, off)


def test_setups_cover_the_sweep():
    s = cb.setups([1, 8], [200])
    assert s[0] == {"kind": "local"} and {"kind": "ddp", "bucket_mb": None} in s
    assert {"kind": "bucketer", "bucket_mb": 8, "window_ms": 200} in s and len(s) == 6


def test_every_pair_of_a_speed_block_runs_in_abba_order():
    names = list(cb.ABBA_SETUPS)
    for block in range(4):
        order = cb.block_order(names, block)
        assert order == order[::-1] and sorted(order) == sorted(names * 2)
        # each pair runs A B B A or B A A B: both at the same mean position in the block
        positions = {x: np.mean([i for i, y in enumerate(order) if y == x]) for x in names}
        assert len(set(positions.values())) == 1
    assert cb.block_order(names, 1)[0] == names[-1]


def test_grid_blocks_put_each_size_between_its_neighbours_both_ways():
    assert cb.grid_block([8, 16], 0) == (8, [7, 8, 8, 9]) and cb.grid_block([8, 16], 1) == (8, [9, 8, 8, 7])
    assert cb.grid_block([8, 16], 2)[0] == 16 and cb.grid_block([8, 16], 4)[0] == 8


def test_graded_ratios_are_block_estimates_with_interval_and_n():
    ratios = [1.02, 1.05, 1.03, 1.06, 1.04, 1.01]
    a = _abba(np.array(ratios), [1.1, 1.0, 1.2, 1.05, 1.1], drift=0.3)
    e = a.estimates()
    speed, grid = e["bucket_speedup_vs_ddp"], e["aligned_throughput_ratio"]
    logs = np.log(ratios)
    ci = stats.t.interval(0.9, len(logs) - 1, loc=logs.mean(), scale=stats.sem(logs))
    assert speed.n == 6 and speed.kind == "measured" and speed.log_scale
    assert speed.value == pytest.approx(math.exp(logs.mean()))  # the drift cancels within each block
    assert (speed.low, speed.high) == pytest.approx(tuple(np.exp(ci)))
    assert grid.n == 5 and grid.value == pytest.approx(math.exp(np.log([1.1, 1.0, 1.2, 1.05, 1.1]).mean()))
    assert e["bucket8_vs_ddp8"].value == pytest.approx(speed.value)
    assert e["ddp8_vs_ddp_default"].value == pytest.approx(1.0)
    assert len(a.speed_rows()) == 6 and len(a.grid_rows()) == 5 and "n=6" in a.text()


def test_the_grade_follows_the_interval_and_is_inconclusive_when_it_crosses():
    claim = get_claim("C9")
    tight = _abba(np.array([1.03, 1.04, 1.03, 1.05, 1.04, 1.03]), [1.08, 1.09, 1.07, 1.08, 1.08, 1.09])
    assert claim.grade(tight.estimates(), scale="test").grade == "reproduced"
    wide = _abba(np.array([0.9, 1.1, 0.95, 1.08, 0.92, 1.1]), [0.9, 1.2, 1.0, 1.15, 0.95, 1.1])
    v = claim.grade(wide.estimates(), scale="test")
    assert v.grade == "inconclusive" and v.estimates["aligned_throughput_ratio"]["n_to_decide"] > 6


def test_each_block_can_be_left_out():
    a = _abba(np.array([1.03, 1.04, 1.03, 1.05, 1.04, 1.03]), [1.08, 1.09, 1.07, 1.08, 1.08, 1.09])
    reps = a.repeated()
    assert {r.group for r in reps.values()} == {"speed blocks", "grid blocks"}
    assert reps["bucket_speedup_vs_ddp"].estimate() == a.estimates()["bucket_speedup_vs_ddp"]
    assert regrade_leaving_out("C9", reps).stable
    # the blocks round-trip through the result's tables (run.table's stored form)
    stored = {}
    for name, rows in (("speed_blocks", a.speed_rows()), ("grid_blocks", a.grid_rows())):
        stored[name] = {"columns": list(rows[0]), "rows": [list(r.values()) for r in rows]}
    back = cb.Abba.from_tables(stored)
    assert back.estimates()["aligned_throughput_ratio"] == a.estimates()["aligned_throughput_ratio"]
    speed = a.estimates()["bucket_speedup_vs_ddp"]
    assert back.estimates()["bucket_speedup_vs_ddp"].value == pytest.approx(speed.value)


def test_throughput_by_size_is_bytes_over_time():
    a = cb.Abba({cb.BUCKETER: [1.0]}, [8.0, 16.0], [0.001, 0.002], [0.002, 0.002])
    t = a.throughput_by_size()
    assert t["on"][8.0] == pytest.approx([2**20 / 0.001 / 1e9])
    assert t["off"][16.0] == pytest.approx([2**20 / 0.002 / 1e9])


def test_sweep_metrics_read_the_right_rows_and_are_not_the_graded_keys():
    b = _bucketing()
    m = b.metrics()
    assert m["sweep_ddp_over_bucketer8"] == pytest.approx(25 / 20)
    assert m["sweep_ddp8_over_bucketer8"] == pytest.approx(22 / 20)
    assert not {t.metric for t in get_claim("C9").targets} & set(m)
    assert m["sync_overhead_ddp_default"] == pytest.approx(1.5) and m["max_grad_error_vs_average"] == 1e-7
    assert m["bucketer_8mb_step_ms"] == pytest.approx(20.0)
    assert b.spread_s("bucketer 8 MiB") == pytest.approx((0.019, 0.022))


def test_windows_report_k_collectives_and_throughput():
    m, text = cb.windows(_bucketing(), [200, 1000])
    assert m["window_first_k"] == 2 and m["window_1000ms_k"] == 8
    assert m["window_200ms_throughput_gain"] == pytest.approx(20 / 18)
    assert m["window_1000ms_collectives_per_step"] == pytest.approx(12.5 / 8)
    assert "k = 8 micro-steps" in text


def test_failure_metrics_count_the_raised_errors():
    failed = {"rank exits, bucketer": dict(error_type="CollectiveError", seconds_to_error=0.1),
              "rank stalls, bucketer": dict(error_type="CollectiveError", seconds_to_error=5.0),
              cb.BLOCKING: dict(error_type=None, seconds_to_error=math.nan)}
    m = cb.failure_metrics(failed)
    assert m["failures_raised"] == 2 and m["stalled_rank_error_s"] == 5.0 and math.isnan(m["stalled_blocking_error_s"])


def test_settings_refuse_off_grid_sizes_and_single_blocks():
    s = cb.BucketingSettings.from_params(resolve("07_comm_bucketing", {"profile": "ci"}))
    with pytest.raises(ConfigError, match="grid_sizes_mb"):
        dataclasses.replace(s, grid_sizes_mb=(9,))
    with pytest.raises(ConfigError, match="abba_blocks"):
        dataclasses.replace(s, abba_blocks=1)


def test_the_figure_draws_intervals_targets_and_readable_ticks(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    s = cb.BucketingSettings.from_params(resolve("07_comm_bucketing", {"profile": "cpu"}))
    a = _abba(np.array([1.02, 1.05, 1.03, 1.06, 1.04, 1.01]), [1.1, 1.0, 1.2, 1.05, 1.1, 1.0])
    failed = {n: dict(seconds_to_error=1.0) for n in cb.SCENARIOS}
    fig = cb.plot(a, _bucketing(), failed, s, get_claim("C9").targets)
    fig.savefig(os.environ.get("C9_FIGURE", tmp_path / "c9.png"), dpi=80)
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        assert ax.get_ylabel(), ax.get_title()
        boxes = [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_text()]
        assert not any(b1.overlaps(b2) for i, b1 in enumerate(boxes) for b2 in boxes[i + 1:]), ax.get_title()
    assert any(c.__class__.__name__ == "ErrorbarContainer" for c in fig.axes[0].containers)
