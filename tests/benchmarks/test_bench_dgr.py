"""benchmarks/dgr.py: the paired step-time ratio and a tiny end-to-end run (sync DGR bitwise equal to plain)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("dgr")


def test_paired_ratio_quartiles_pair_each_dgr_step_with_the_plain_step_before_it(bench):
    # a machine that slows down 2x halfway: the ratio of medians mixes the two halves, the pairs do not
    plain = [1.0, 1.0, 1.0, 2.0, 2.0, 2.0]
    dgr = [1.05, 1.05, 1.05, 2.1, 2.1, 2.1]
    low, mid, high = bench.paired_ratio_quartiles(plain, dgr)
    assert low == pytest.approx(1 / 1.05) and mid == pytest.approx(1 / 1.05) and high == pytest.approx(1 / 1.05)
    low, mid, high = bench.paired_ratio_quartiles([1.0, 2.0, 3.0, 4.0, 5.0], [1.0, 1.0, 1.0, 1.0, 1.0])
    assert (low, mid, high) == (2.0, 3.0, 4.0)
    assert bench.paired_ratio_quartiles([2.0], [4.0]) == (0.5, 0.5, 0.5)
    with pytest.raises(ValueError, match="3 plain and 2 DGR"):
        bench.paired_ratio_quartiles([1.0, 1.0, 1.0], [1.0, 1.0])


def test_a_small_run_reports_the_paired_ratio_and_bitwise_equal_weights(bench, capsys):
    bench.main(["--layers", "4", "--width", "32", "--heads", "2", "--batch-size", "2", "--seq-len", "16",
                "--group-size", "2", "--steps", "2", "--no-memory"])
    out = capsys.readouterr().out
    assert "weights bitwise equal" in out
    assert "paired ratios plain/DGR" in out
