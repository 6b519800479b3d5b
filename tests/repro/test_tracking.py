import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest

from macroarch.repro import tracking
from macroarch.config import ConfigError
from macroarch.repro.claims import get_claim
from macroarch.repro.tracking import read_result, result_path, start_run, write_json_atomic


def _verdict():
    return get_claim("C4").grade({"post_accounting_bytes": 1.4e12, "mixed_precision_bytes": 2.8e12}, scale="test")


def test_complete_run_writes_result_and_offline_wandb(isolated):
    from macroarch.repro.wandb_offline import find_offline_runs

    with start_run("C4", "ci", {"batch_size": 2, "nested": {"a": 1}}) as run:
        assert read_result(run.path)["status"] == "running"
        for step in range(3):
            run.log(step=step, loss=1.0 / (step + 1))
        run.summary(total_bytes=123, ratio=0.25)
        fig, ax = plt.subplots()
        ax.bar(["a", "b"], [1, 2])
        run.figure("bars", fig)
        plt.close(fig)
        run.verdict(_verdict())
    r = read_result(result_path("C4", "ci"))
    assert r["status"] == "complete" and r["error"] is None
    assert r["config"] == {"batch_size": 2, "nested": {"a": 1}}
    assert r["metrics"] == {"total_bytes": 123, "ratio": 0.25}
    assert r["series"]["loss"] == [{"step": 0, "value": 1.0}, {"step": 1, "value": 0.5},
                                   {"step": 2, "value": 1.0 / 3}]
    assert r["verdict"]["grade"] == "partially"
    assert (run.dir / "bars.png").is_file() and r["figures"] == ["bars"]
    assert r["wandb"]["mode"] == "offline" and r["wandb"]["error"] is None

    (w,) = find_offline_runs(isolated)
    assert w.run_id == r["wandb"]["id"]
    assert w.config["claim"] == "C4" and w.config["nested"] == {"a": 1}
    assert w.summary["verdict"] == r["verdict"]
    assert w.summary["total_bytes"] == 123 and w.summary["ratio"] == 0.25 and w.summary["status"] == "complete"
    loss = [(row["step"], row["series/loss"]) for row in w.history if "series/loss" in row]
    assert loss == [(s["step"], s["value"]) for s in r["series"]["loss"]]
    assert w.exit_code == 0


def test_raising_run_is_marked_failed_and_reraises(isolated, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    with pytest.raises(ZeroDivisionError):
        with start_run("C4", "ci", {}) as run:
            run.summary(x=1)
            run.verdict(_verdict())
            raise ZeroDivisionError("1 / 0")
    r = read_result(result_path("C4", "ci"))
    assert r["status"] == "failed"
    assert r["error"]["type"] == "ZeroDivisionError" and "1 / 0" in r["error"]["traceback"]


def test_run_without_verdict_is_failed(isolated, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    with start_run("C4", "ci", {}) as run:
        run.summary(x=1)
    r = read_result(result_path("C4", "ci"))
    assert r["status"] == "failed" and "without a verdict" in r["error"]["message"]


def test_wandb_failure_does_not_fail_the_run(isolated, monkeypatch):
    import wandb

    def broken_init(*a, **k):
        raise ConnectionError("W&B is unreachable")

    monkeypatch.setattr(wandb, "init", broken_init)
    with pytest.warns(UserWarning, match="unreachable"):
        with start_run("C4", "ci", {}) as run:
            run.log(step=0, loss=1.0)
            run.verdict(_verdict())
    r = read_result(result_path("C4", "ci"))
    assert r["status"] == "complete"
    assert "unreachable" in r["wandb"]["error"] and r["wandb"]["id"] is None


def test_wandb_failure_mid_run(isolated, monkeypatch):
    with pytest.warns(UserWarning, match="disk full"):
        with start_run("C4", "ci", {}) as run:
            def broken_log(*a, **k):
                raise OSError("disk full")

            monkeypatch.setattr(run._wandb, "log", broken_log)
            run.log(step=0, loss=1.0)
            run.log(step=1, loss=0.5)  # W&B is off now; the result file still gets it
            run.verdict(_verdict())
    r = read_result(result_path("C4", "ci"))
    assert r["status"] == "complete" and len(r["series"]["loss"]) == 2
    assert "disk full" in r["wandb"]["error"]


def test_bad_input(isolated, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    with pytest.raises(ConfigError, match="'C99'"):
        with start_run("C99", "ci", {}):
            pass
    with pytest.raises(ConfigError, match="'laptop'"):
        with start_run("C4", "laptop", {}):
            pass
    assert not (isolated / "out").exists()
    with pytest.raises(ValueError, match="'loss' is not finite"):
        with start_run("C4", "ci", {}) as run:
            run.log(step=0, loss=float("nan"))
    assert read_result(result_path("C4", "ci"))["status"] == "failed"


def test_atomic_write_leaves_old_file_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    write_json_atomic(path, {"status": "complete"})

    def boom(*a, **k):
        raise OSError("interrupted")

    monkeypatch.setattr(tracking.json, "dump", boom)
    with pytest.raises(OSError):
        write_json_atomic(path, {"status": "running"})
    assert json.loads(path.read_text()) == {"status": "complete"}
    assert os.listdir(tmp_path) == ["r.json"]  # no temporary file left behind


def test_new_run_drops_old_figures(isolated, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    d = result_path("C4", "ci").parent
    d.mkdir(parents=True)
    (d / "stale.png").write_bytes(b"old")
    with start_run("C4", "ci", {}) as run:
        run.verdict(_verdict())
    assert not (d / "stale.png").exists()
