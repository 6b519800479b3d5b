"""benchmarks/step_ab.py: the lock-step bookkeeping (ABBA order, ratios of the blocks side by side), its argument
checks, and one short real run of two workers. Nothing here asserts a speed."""

from __future__ import annotations

import json

import pytest

FOREACH = "torch AdamW fp32 foreach"


@pytest.fixture(scope="module")
def ab(load_benchmark):
    return load_benchmark("step_ab")


class FakeWorker:
    def __init__(self, name, times, log):
        self.name, self.times, self.log = name, iter(times), log

    def block(self):
        self.log.append(self.name)
        return next(self.times), 0.0


def test_lockstep_takes_turns_abba(ab):
    log = []
    a, b = FakeWorker("A", [1.0, 2.0, 4.0], log), FakeWorker("B", [1.1, 1.8, 4.4], log)
    blocks_a, blocks_b = ab.lockstep(a, b, 3)
    assert log == ["A", "B", "B", "A", "A", "B"]
    assert [t for t, _ in blocks_a] == [1.0, 2.0, 4.0] and [t for t, _ in blocks_b] == [1.1, 1.8, 4.4]


def test_summary_ratios_of_blocks_side_by_side(ab):
    # the machine slows down 4x over the run; each B block is 10% slower than the A block beside it, but one
    r = ab.summary([(t, 0.0) for t in (1.0, 2.0, 4.0, 4.0, 2.0)], [(t, 3.0) for t in (1.1, 2.2, 4.4, 4.4, 1.0)])
    assert r["ratio_median"] == pytest.approx(1.1)
    assert (r["a_min_s"], r["b_min_s"], r["blocks"]) == (1.0, 1.0, 5)
    assert (r["a_faults_per_step"], r["b_faults_per_step"]) == (0.0, 3.0)
    assert r["a_median_s"] == 2.0 and r["b_median_s"] == pytest.approx(2.2)
    assert r["ratio_quartiles"] == pytest.approx((1.1, 1.1))  # the one fast B block is an outlier, outside them
    # few blocks: the quartiles stay within the ratios measured
    lo, hi = ab.summary([(1.0, 0), (1.0, 0)], [(1.0, 0), (2.0, 0)])["ratio_quartiles"]
    assert 1.0 <= lo <= hi <= 2.0


def test_a_side_that_faults_is_warned_about(ab):
    def result(fa, fb):
        return dict(a_faults_per_step=fa, b_faults_per_step=fb)
    assert ab.fault_warning(result(0, 1999)).startswith("warning: B's steps take 1999 page faults each, A's 0")
    assert "A's process gets fresh pages" in ab.fault_warning(result(2050, 23))
    assert ab.fault_warning(result(3, 5)) is None  # neither faults
    assert ab.fault_warning(result(1800, 2000)) is None  # both alike: the ratio still compares code


def test_parse_env_and_checkout_errors(ab, tmp_path):
    assert ab.parse_env("A=1, B = x,", name="--a-env") == {"A": "1", "B": "x"}
    assert ab.parse_env(None, name="--a-env") == {}
    with pytest.raises(ValueError, match="--b-env: 'FOO' is not NAME=VALUE"):
        ab.parse_env("FOO", name="--b-env")
    with pytest.raises(ValueError, match="is not a checkout of this repository"):
        ab.checkout(str(tmp_path), name="--a-path")
    assert (ab.checkout(None, name="--a-path") / "benchmarks" / "step_ab.py").is_file()


@pytest.mark.parametrize("args,message", [
    (["--b-env", "NOPE"], "'NOPE' is not NAME=VALUE"),
    (["--size", "100"], "multiple of 131072"),
    (["--blocks", "0"], "--blocks 0 must be >= 1"),
])
def test_bad_arguments_are_named(ab, capsys, args, message):
    with pytest.raises(SystemExit) as e:
        ab.main(args)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_two_workers_in_lockstep(ab, tmp_path, capsys):
    out = tmp_path / "ab.json"
    common = ["--size", "128k", "--blocks", "3", "--steps", "2", "--warmup", "1", "--a-optimizer", FOREACH,
              "--b-optimizer", FOREACH]
    r = ab.main([*common, "--b-env", "MACROARCH_AB_TEST=1", "--out", str(out)])
    data = json.loads(out.read_text())
    assert len(data["a_blocks"]) == len(data["b_blocks"]) == 3 and r["blocks"] == 3
    assert data["sides"][1]["env"] == {"MACROARCH_AB_TEST": "1"}
    ratios = sorted(b[0] / a[0] for a, b in zip(data["a_blocks"], data["b_blocks"]))
    assert r["ratio_median"] == pytest.approx(ratios[1])
    assert all(f >= 0 for _, f in data["a_blocks"] + data["b_blocks"])
    assert "B/A, blocks side by side: median" in capsys.readouterr().out


def test_a_failing_worker_is_named_and_nothing_is_reported(ab, tmp_path, monkeypatch):
    monkeypatch.setattr(ab, "WORKER", "import sys; sys.exit(sys.argv[2] + ' cannot run here')")
    out = tmp_path / "ab.json"
    with pytest.raises(SystemExit, match="the worker for .* X=1 failed: no such optimizer cannot run here"):
        ab.main(["--a-optimizer", "no such optimizer", "--a-env", "X=1", "--out", str(out)])
    assert not out.exists()
