"""Notebook 07's harness (C9): what it reads from the measurements, on rows whose answer is known (the
measurements themselves run on real gloo ranks in tests/comm)."""

import math

import pytest

from macroarch.comm import MiB
from macroarch.experiments import comm_bucketing as cb


def _row(setup, step_ms, collectives=1.0, window_steps=(), error=0.0):
    from macroarch.measure.comm_bench import label

    return {"label": label(setup), "setup": setup, "step_s": step_ms / 1e3, "collectives_per_step": collectives,
            "bucket_bytes": [], "window_steps": list(window_steps), "max_grad_error": error}


def _bucketing():
    times = {1: 30.0, 8: 20.0, 12: 24.0, 16: 16.0, 24: 22.0, 25: 33.0}
    rows = [_row({"kind": "local"}, 10.0), _row({"kind": "ddp", "bucket_mb": None}, 25.0, error=1e-7),
            _row({"kind": "ddp", "bucket_mb": 8}, 22.0)]
    rows += [_row({"kind": "bucketer", "bucket_mb": mb}, t, collectives=100 / mb) for mb, t in times.items()]
    rows += [_row({"kind": "bucketer", "bucket_mb": 8, "window_ms": 200}, 18.0, 12.5 / 2, (1, 1, 2, 2)),
             _row({"kind": "bucketer", "bucket_mb": 8, "window_ms": 1000}, 10.0, 12.5 / 8, (1, 1, 8))]
    return cb.Bucketing(rows, list(times), 1_000_000)


def test_setups_cover_the_comparison():
    s = cb.setups([1, 8], [200])
    assert s[0] == {"kind": "local"} and {"kind": "ddp", "bucket_mb": None} in s
    assert {"kind": "bucketer", "bucket_mb": 8, "window_ms": 200} in s and len(s) == 6


def test_bucketing_metrics_read_the_right_rows():
    m = _bucketing().metrics()
    assert m["bucket_speedup_vs_ddp"] == pytest.approx(25 / 20) and m["bucket8_vs_ddp8"] == pytest.approx(22 / 20)
    assert m["best_multiple_of_8_mb"] == 16 and m["best_multiple_of_8_speedup_vs_ddp"] == pytest.approx(25 / 16)
    assert m["sync_overhead_ddp_default"] == pytest.approx(1.5) and m["max_grad_error_vs_average"] == 1e-7
    assert m["non_multiple_25_vs_24"] == pytest.approx(33 / 22)
    assert m["non_multiple_12_vs_8_16"] == pytest.approx(24 / 18)
    assert m["bucketer_8mb_step_ms"] == pytest.approx(20.0)


def test_windows_report_k_collectives_and_throughput():
    m, text = cb.windows(_bucketing(), [200, 1000])
    assert m["window_first_k"] == 2 and m["window_1000ms_k"] == 8
    assert m["window_200ms_throughput_gain"] == pytest.approx(20 / 18)
    assert m["window_1000ms_collectives_per_step"] == pytest.approx(12.5 / 8)
    assert "k = 8 micro-steps" in text


def test_alignment_ratio_compares_throughput_per_byte():
    # 8 and 16 MiB at 1 GB/s; 9 and 17 MiB at 0.5 GB/s: the grid is twice as fast per byte.
    a = cb.Alignment([8, 9, 16, 17], [8 * MiB / 1e9, 9 * MiB / 0.5e9, 16 * MiB / 1e9, 17 * MiB / 0.5e9])
    assert a.throughput == pytest.approx([1.0, 0.5, 1.0, 0.5]) and a.ratio == pytest.approx(2.0)


def test_failure_metrics_count_the_raised_errors():
    failed = {"rank exits, bucketer": dict(error_type="CollectiveError", seconds_to_error=0.1),
              "rank stalls, bucketer": dict(error_type="CollectiveError", seconds_to_error=5.0),
              cb.BLOCKING: dict(error_type=None, seconds_to_error=math.nan)}
    m = cb.failure_metrics(failed)
    assert m["failures_raised"] == 2 and m["stalled_rank_error_s"] == 5.0 and math.isnan(m["stalled_blocking_error_s"])
