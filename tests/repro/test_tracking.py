import json
import os
import stat
import subprocess
import sys
import textwrap
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest

from macroarch.config import ConfigError
from macroarch.repro import tracking
from macroarch.repro.claims import get_claim
from macroarch.repro.tracking import ResultFileError, read_result, result_path, start_run, write_json_atomic
from macroarch.repro.wandb_sidecar import metric_key, metric_kind, plain_name


def _verdict():
    return get_claim("C4").grade({"post_accounting_bytes": 1.4e12, "mixed_precision_bytes": 2.8e12}, scale="test")


def test_complete_run_writes_result_and_offline_wandb(isolated):
    from macroarch.repro.wandb_offline import find_offline_runs

    with start_run("C4", "ci", {"batch_size": 2, "nested": {"a": 1}}) as run:
        assert read_result(run.path)["status"] == "running"
        for step in range(3):
            run.log(step=step, loss=1.0 / (step + 1))
        run.summary(total_bytes=123, ratio=0.25)
        run.table("sweep", [{"lr": 1e-3, "loss": 2.5}, {"lr": 2e-3, "loss": 2.25}])
        fig, ax = plt.subplots()
        ax.bar(["a", "b"], [1, 2])
        run.figure("bars", fig)
        plt.close(fig)
        print("console line from the notebook")
        run.verdict(_verdict())
    r = read_result(result_path("C4", "ci"))
    assert r["status"] == "complete" and r["error"] is None
    assert {k: r["config"][k] for k in ("batch_size", "nested")} == {"batch_size": 2, "nested": {"a": 1}}
    assert r["config"]["machine"]["cpu_capability"]  # every run names the hardware it measured on
    assert r["metrics"] == {"total_bytes": 123, "ratio": 0.25}
    assert r["series"]["loss"] == [{"step": 0, "value": 1.0}, {"step": 1, "value": 0.5},
                                   {"step": 2, "value": 1.0 / 3}]
    assert r["tables"]["sweep"] == {"columns": ["lr", "loss"], "rows": [[1e-3, 2.5], [2e-3, 2.25]]}
    assert r["verdict"]["grade"] == "partially"
    assert (run.dir / "bars.png").is_file() and r["figures"] == ["bars"]
    assert r["pid"] == os.getpid() and r["notebook"] == "02_memory_wall"
    assert r["wandb"]["mode"] == "offline" and r["wandb"]["error"] is None and r["wandb"]["state"] == "finished"
    assert stat.S_IMODE(run.path.stat().st_mode) == 0o644

    (w,) = find_offline_runs(isolated)
    assert w.run_id == r["wandb"]["id"] and str(w.directory) == r["wandb"]["dir"]
    assert (w.group, w.job_type) == ("ci", "02_memory_wall")
    assert w.config["claim"] == "C4" and w.config["nested"] == {"a": 1}
    assert w.config["machine"] == r["config"]["machine"]
    assert w.summary["verdict"] == r["verdict"] and w.summary["status"] == "complete"
    # grouped by claim and kind in W&B, plain in result.json
    assert w.summary["C4/bytes/total_bytes"] == 123 and w.summary["C4/value/ratio"] == 0.25
    loss = [(row["step"], row["C4/series/loss"]) for row in w.history if "C4/series/loss" in row]
    assert loss == [(s["step"], s["value"]) for s in r["series"]["loss"]]
    assert w.summary["C4/verdict"]["_type"] == "table-file" and w.summary["C4/tables/sweep"]["nrows"] == 2
    # the verdict's graded numbers as a bar chart: its table holds each number with its interval, n, kind and grade
    graded = w.summary["C4/graded_table"]
    assert len(r["verdict"]["estimates"]) == 2  # post_accounting_bytes, mixed_precision_bytes
    assert graded["_type"] == "table-file" and (graded["ncols"], graded["nrows"]) == (7, 2)
    (table,) = [p for p in w.directory.rglob("*.table.json") if "graded" in p.name]
    rows = json.loads(table.read_text())
    assert rows["columns"] == ["number", "value", "low", "high", "n", "kind", "grade"]
    assert {row[0]: row[1] for row in rows["data"]} == {k: e["value"] for k, e in r["verdict"]["estimates"].items()}
    assert w.exit_code == 0
    # the evidence, as an artifact whose files live in the run's folder
    (art,) = [a for a in w.artifacts if a.type == "evidence"]
    assert art.name == "evidence-C4-ci" and art.metadata["git_commit"] == r["git_commit"]
    assert sorted(art.files) == ["bars.png", "result.json"]
    assert all(p.is_relative_to(w.directory) and p.is_file() for p in art.files.values())
    assert json.loads(art.files["result.json"].read_text())["verdict"] == r["verdict"]
    # what the README shows users: wandb's own terminal viewer reads the same run, console included
    leet = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--summary", "--json", str(w.directory)],
                          capture_output=True, text=True, timeout=60)
    seen = json.loads(leet.stdout)
    assert seen["state"] == "finished" and seen["summary"]["verdict"]["grade"] == "partially"
    assert any("console line from the notebook" in c["line"] for c in seen["console"])


def test_metric_names_group_by_claim_and_kind():
    assert metric_kind("analytic_bf16_mixed_total_bytes") == "bytes"
    assert metric_kind("speed_ratio") == "speed" and metric_kind("measured_post_seconds") == "speed"
    assert metric_kind("accuracy_gap") == "quality" and metric_kind("variance_reduction_factor") == "gradients"
    assert metric_kind("cards_needed") == "value"
    for name in ("memory_reduction", "x", "sync_share_at_200us"):
        assert plain_name("C7", metric_key("C7", name)) == name
    assert plain_name("C7", "C4/bytes/x") is None and plain_name("C7", "C7/series/loss") is None


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


def test_unreachable_server_costs_seconds_not_the_claim(isolated, monkeypatch):
    """An online run against a server that does not answer: recorded, costing no more than the wait it is given
    over the same run without W&B, timed side by side (on CI's loaded 2-core machine starting a run alone, with
    torch's machine probe and git, has taken 10 s)."""

    def one_run() -> float:
        t0 = time.monotonic()
        with start_run("C4", "ci", {}) as run:
            run.log(step=0, loss=1.0)
            run.verdict(_verdict())
        return time.monotonic() - t0

    monkeypatch.setenv("WANDB_MODE", "disabled")
    without = one_run()
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.setenv("MACROARCH_WANDB_INIT_TIMEOUT", "3")
    monkeypatch.setenv("MACROARCH_WANDB_WAIT", "4")
    online = one_run()
    assert online - without < 4 + 4, (online, without)  # the wait, plus starting W&B's process
    r = read_result(result_path("C4", "ci"))
    assert r["status"] == "complete" and r["wandb"]["error"]


def test_wandb_that_cannot_start_does_not_fail_the_run(isolated, monkeypatch):
    blocker = isolated / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("WANDB_DIR", str(blocker))  # W&B cannot create its folder (as with a full disk)
    with pytest.warns(UserWarning, match="W&B process did not start"):
        with start_run("C4", "ci", {}) as run:
            run.log(step=0, loss=1.0)
            run.verdict(_verdict())
    r = read_result(result_path("C4", "ci"))
    assert r["status"] == "complete" and "did not start" in r["wandb"]["error"]


def test_wandb_that_cannot_write_its_tables_and_artifacts_does_not_fail_the_run(isolated, monkeypatch):
    blocker = isolated / "blocker"
    blocker.write_text("")
    monkeypatch.setenv("WANDB_DATA_DIR", str(blocker / "data"))  # where W&B stages tables and artifacts
    with start_run("C4", "ci", {}) as run:
        run.summary(post_accounting_bytes=1.4e12, mixed_precision_bytes=2.8e12)
        run.verdict(_verdict())
    r = read_result(result_path("C4", "ci"))
    assert r["status"] == "complete" and r["verdict"]["grade"] == "partially"
    assert r["wandb"]["state"] == "failed" and "Unable to write staging files" in r["wandb"]["error"]


KILL_CORE = textwrap.dedent('''
    import json, sys, time
    import psutil
    from macroarch.repro.claims import get_claim
    from macroarch.repro.tracking import read_result, start_run
    from macroarch.repro.wandb_sidecar import read_status

    run = start_run("C4", "ci", {"size": 1})
    deadline = time.monotonic() + 60
    while read_status(run._sidecar.status_path).get("state") != "running" and time.monotonic() < deadline:
        time.sleep(0.1)
    cores = [p for p in psutil.Process(run._sidecar.pid).children(recursive=True) if "wandb-core" in p.name()]
    assert cores, "no wandb-core under the W&B process"
    for p in cores:
        p.kill()
    run.log(step=0, loss=1.0)
    import transformers  # noqa: F401  (in-process W&B failed here: its import hook talked to the dead service)
    run.summary(post_accounting_bytes=1.4e12, mixed_precision_bytes=2.8e12)
    run.verdict(get_claim("C4").grade(run.metrics, scale="x"))
    run.finish()
    r = read_result(run.path)
    print(json.dumps({"status": r["status"], "wandb": r["wandb"], "wandb_imported": "wandb" in sys.modules}))
''')


def test_killing_wandb_core_mid_run_leaves_a_complete_result(isolated):
    env = {**os.environ, "MACROARCH_WANDB_WAIT": "20"}
    p = subprocess.run([sys.executable, "-c", KILL_CORE], capture_output=True, text=True, timeout=240, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["status"] == "complete"
    assert out["wandb_imported"] is False  # the measuring process never imports wandb
    assert out["wandb"]["error"], out["wandb"]  # ... and the W&B failure is on record


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


@pytest.mark.parametrize("text, message", [
    ("[1, 2]", "a JSON list, not an object"),
    ('{"claim": "C4"}', "no 'status'"),
    ("{oops", "malformed result file"),
    (b"\xff\xfe", "malformed result file"),
])
def test_malformed_result_files_are_named(tmp_path, text, message):
    p = tmp_path / "result.json"
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ResultFileError, match=message) as e:
        read_result(p)
    assert str(p) in str(e.value) and "\n" not in str(e.value)


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


def test_leave_one_out_is_recorded_with_its_raw_data_and_regrades_from_the_file(isolated, monkeypatch):
    from macroarch.experiments.dgr_variance import _factor_estimate
    from macroarch.measure.stats import Repeated
    from macroarch.repro.claims import regrade_record
    from macroarch.repro.paper import claims_table, record_from_result

    monkeypatch.setenv("WANDB_MODE", "disabled")
    factors = (9.0, 9.2, 8.8, 2.0)  # one seed far off: with it the interval crosses the target's edge
    repeated = {"variance_reduction_factor": Repeated(_factor_estimate, (factors,))}
    with start_run("C6", "ci", {}) as run:
        run.estimate(variance_reduction_factor=_factor_estimate(factors))
        run.summary(layer_spread_factor=1.5)
        stability = run.leave_one_out(repeated)
        verdict = run.verdict(get_claim("C6").grade(run.measurements, scale="test"))
    assert stability.grade == verdict.grade == "inconclusive"
    assert [(c.group, c.index, c.grade) for c in stability.changes] == [("seeds", 3, "reproduced")]
    r = read_result(result_path("C6", "ci"))
    rec = r["stability"]
    assert rec["grade"] == "inconclusive" and rec["changes"] == [{"group": "seeds", "index": 3, "grade": "reproduced"}]
    assert rec["repeated"]["variance_reduction_factor"] == {
        "build": "macroarch.experiments.dgr_variance:_factor_estimate", "arrays": [list(factors)], "group": "seeds",
        "options": {}}
    assert rec["fixed"] == {"layer_spread_factor": 1.5}
    again = regrade_record("C6", json.loads(json.dumps(rec)))  # from the file alone
    assert again == stability
    record = record_from_result(r, result_path("C6", "ci"))
    assert "**inconclusive** (unstable: 1 left-out repetition(s) change it)" in claims_table({"C6": record},
                                                                                            isolated / "paper")
