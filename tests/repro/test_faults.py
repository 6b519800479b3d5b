"""Faults the pipeline must notice (issue 47): a truncated executed notebook, a full disk, a result file with
wrong value types, a pid reused by another process, SIGTERM, a failed run carrying an earlier run's verdict."""

import datetime as dt
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time

import nbformat
import pytest

from conftest import PROFILE_ONLY
from conftest import write_notebook as _notebook
from conftest import write_profile as _profile
from macroarch.repro import paper, runner, tracking
from macroarch.repro.claims import get_claim
from macroarch.repro.cli import main
from macroarch.repro.tracking import (
    ResultFileError,
    read_result,
    result_path,
    run_is_alive,
    start_run,
    write_json_atomic,
)


def _full_disk(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")


def _job(profile="ci", claim="C4"):
    (job,) = runner.select(runner.load_profile(profile), claim)
    return job


def _executed_notebook(path, papermill_meta):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("1")]
    nb.metadata["papermill"] = papermill_meta
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)


CLEAN = {"exception": None, "start_time": "2025-01-01T00:00:00", "end_time": "2025-01-01T00:00:05"}


def _fresh_looking(project, isolated):
    """What a clean execution of 02_memory_wall under ci leaves (written here, no kernel): result, executed
    notebook, stamp. Returns the job and the executed notebook."""
    job = _job()
    params = runner._jsonable(job.effective_parameters("ci", project))
    write_json_atomic(result_path("C4", "ci"), {
        "schema": 1, "claim": "C4", "profile": "ci", "notebook": "02_memory_wall", "status": "complete",
        "started": runner._now(), "finished": runner._now(), "config": params, "metrics": {"x": 1},
        "verdict": {"grade": "partially"}})
    executed = isolated / "out" / "ci" / "02_memory_wall.ipynb"
    _executed_notebook(executed, CLEAN)
    time.sleep(0.01)
    write_json_atomic(runner._stamp_path("ci", "02_memory_wall", isolated / "out"),
                      {"notebook": "02_memory_wall", "parameters": params, "finished": runner._now()})
    assert runner.is_fresh(job, "ci")  # the baseline: such a state is up to date
    return job, executed


# --- 1. a truncated executed notebook ------------------------------------------------------------------------

def test_truncated_executed_notebook_is_not_up_to_date(project, isolated):
    job, executed = _fresh_looking(project, isolated)
    text = executed.read_text()
    executed.write_text(text[: len(text) // 2])
    assert not runner.is_fresh(job, "ci")


@pytest.mark.parametrize("meta", [{**CLEAN, "exception": True}, {**CLEAN, "end_time": None}, None])
def test_executed_notebook_papermill_did_not_finish_cleanly_is_not_up_to_date(project, isolated, meta):
    job, executed = _fresh_looking(project, isolated)
    stamp = runner._stamp_path("ci", "02_memory_wall", isolated / "out")
    mtime = stamp.stat().st_mtime
    if meta is None:
        _executed_notebook(executed, {})
        nb = json.loads(executed.read_text())
        del nb["metadata"]["papermill"]
        executed.write_text(json.dumps(nb))
    else:
        _executed_notebook(executed, meta)
    os.utime(stamp, (mtime, mtime))
    assert not runner.is_fresh(job, "ci")


def test_paper_does_not_copy_a_truncated_notebook_as_evidence(isolated, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    with start_run("C4", "ci", {}) as run:
        run.summary(post_accounting_bytes=1.4e12, mixed_precision_bytes=2.8e12)
        run.verdict(get_claim("C4").grade(run.metrics, scale="s"))
    executed = isolated / "out" / "ci" / "02_memory_wall.ipynb"
    _executed_notebook(executed, CLEAN)
    executed.write_text(executed.read_text()[:40])
    p = isolated / "p"
    with pytest.warns(paper.EvidenceWarning, match=r"02_memory_wall\.ipynb: not copied as evidence of C4"):
        paper.build("ci", paper_dir=p, pdf=False)
    assert not (p / "evidence" / "02_memory_wall.ipynb").exists()
    row = next(line for line in (p / "claims.md").read_text().splitlines() if line.startswith("| C4 |"))
    assert "02_memory_wall" not in row.split("|")[-2]  # no evidence link
    assert main(["paper", "--profile", "ci", "--no-pdf"]) == 0  # the command says so in one line
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("macroarch: warning: ") and "not a whole notebook" in err[0]


# --- 2. a full disk -------------------------------------------------------------------------------------------

def test_full_disk_write_names_the_file_and_leaves_no_partial(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    write_json_atomic(path, {"status": "complete"})
    monkeypatch.setattr(tracking.json, "dump", _full_disk)
    with pytest.raises(OSError, match="No space left on device") as e:
        write_json_atomic(path, {"status": "running"})
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(path) and str(path) in str(e.value)
    assert os.listdir(tmp_path) == ["r.json"] and json.loads(path.read_text()) == {"status": "complete"}


def test_full_disk_paper_text_and_copy_leave_no_partial(tmp_path, monkeypatch):
    def half(self, *a, **k):
        open(self, "w").write("half")  # noqa: SIM115
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(paper.Path, "write_text", half)
    with pytest.raises(OSError, match="claims.md"):
        paper.write_text(tmp_path / "claims.md", "text")
    assert os.listdir(tmp_path) == []


def _papermill_cannot_write(monkeypatch):
    import papermill.iorw

    def write(self, buf, path):
        with open(path, "w", encoding="utf-8") as f:
            f.write(buf[: len(buf) // 3])  # what fit on the disk
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(papermill.iorw.LocalHandler, "write", write)


def test_full_disk_under_papermill_is_a_failed_outcome_naming_the_notebook(project, isolated, monkeypatch):
    _papermill_cannot_write(monkeypatch)
    o = runner.execute(_job(), "ci")
    pdir = isolated / "out" / "ci"
    assert o.status == "failed"
    assert o.error == f"cannot write the executed notebook {pdir / '.02_memory_wall.partial.ipynb'}: " \
                      "No space left on device"
    assert sorted(p.name for p in pdir.glob("*.ipynb")) + sorted(p.name for p in pdir.glob(".*.ipynb")) == []
    r = read_result(result_path("C4", "ci"))
    assert r["status"] == "failed" and "No space left on device" in r["error"]["message"]


def test_full_disk_for_results_too_fails_the_notebook_not_the_batch(project, isolated, monkeypatch):
    _papermill_cannot_write(monkeypatch)

    def write(path, data, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(runner, "write_json_atomic", write)
    o = runner.execute(_job(), "ci")  # does not raise
    assert o.status == "failed"
    assert f"C4 not marked failed: cannot write {result_path('C4', 'ci')}: No space left on device" in o.error


def test_timings_that_cannot_be_written_are_a_warning(isolated, monkeypatch):
    monkeypatch.setattr(runner, "machine", lambda: {"cpu_model": "test"})
    monkeypatch.setattr(runner, "write_json_atomic",
                        lambda path, data, **k: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on "
                                                                              "device", str(path))))
    t = runner._Timings("ci", isolated / "out", 1, [0], 0)
    assert t.write("running")["status"] == "running"  # does not raise
    assert t.unwritten == f"cannot write {t.path}: No space left on device"


def test_full_disk_at_the_lock_stops_with_one_line_naming_it(project, isolated, monkeypatch, capsys):
    class FullOs:
        def __getattr__(self, name):
            return getattr(os, name)

        @staticmethod
        def write(fd, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(runner, "os", FullOs())
    assert main(["reproduce", "--profile", "ci", "--only", "C4", "--no-paper"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"macroarch: error: {isolated / 'out' / 'ci' / '.lock'}: No space left on device"]


# --- 3. a result file with wrong value types ---------------------------------------------------------------

GOOD = {"schema": 1, "claim": "C5", "profile": "ci", "notebook": "03_zero3_communication", "status": "complete",
        "started": "2025-01-01T00:00:00+00:00", "config": {}, "metrics": {}, "verdict": {"grade": "partially"}}


@pytest.mark.parametrize("key, value, said", [
    ("verdict", "yes", "'verdict' is a string (\"yes\"), expected an object or null"),
    ("metrics", [1, 2], "'metrics' is a list ([1, 2]), expected an object"),
    ("status", 5, "'status' is a whole number (5), expected a string"),
    ("config", "x", "'config' is a string (\"x\"), expected an object"),
    ("pid", True, "'pid' is a boolean (true)"),
    ("verdict", {"measured": "1"}, "'verdict' has no 'grade' string"),
])
def test_wrong_value_types_are_named(tmp_path, key, value, said):
    p = tmp_path / "result.json"
    p.write_text(json.dumps({**GOOD, key: value}))
    with pytest.raises(ResultFileError) as e:
        read_result(p)
    assert str(e.value).startswith(f"{p}: malformed result file (") and said in str(e.value)
    assert "\n" not in str(e.value)


def test_paper_and_runs_show_a_malformed_result_as_unreadable_and_build_the_rest(isolated, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    with start_run("C4", "ci", {}) as run:
        run.summary(post_accounting_bytes=1.4e12, mixed_precision_bytes=2.8e12)
        run.verdict(get_claim("C4").grade(run.metrics, scale="s"))
    bad = result_path("C5", "ci")
    bad.parent.mkdir(parents=True)
    bad.write_text(json.dumps({**GOOD, "verdict": "yes"}))

    assert main(["paper", "--profile", "ci", "--no-pdf"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{bad}: malformed result file ('verdict' is a string" in err[0]
    table = (isolated / "out" / "ci" / "paper" / "claims.md").read_text().splitlines()
    c4 = next(line for line in table if line.startswith("| C4 |"))
    c5 = next(line for line in table if line.startswith("| C5 |"))
    assert "**partially**" in c4 and "**unreadable**" in c5 and "'verdict' is a string" in c5
    report = (isolated / "out" / "ci" / "paper" / "reproduction.md").read_text()
    assert "**Unreadable.**" in report

    assert main(["runs", "--profile", "ci"]) == 0
    captured = capsys.readouterr()
    assert "'verdict' is a string" in captured.err and len(captured.err.strip().splitlines()) == 1
    assert any(line.startswith("C5") and "unreadable" in line for line in captured.out.splitlines())


# --- 4. a pid reused by another process --------------------------------------------------------------------

def _running(**extra):
    return {**GOOD, "status": "running", "verdict": None, "pid": os.getpid(), "host": socket.gethostname(), **extra}


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="the identity is read from /proc")
def test_a_live_pid_of_another_process_is_not_a_running_run(tmp_path):
    me = tracking.process_identity(os.getpid())
    assert me and me.split("/")[-1].isdigit()
    assert run_is_alive(_running(process_identity=me))
    assert not run_is_alive(_running(process_identity=me.split("/")[0] + "/1"))  # same pid, started at another time
    assert run_is_alive(_running())  # a result written before the identity was recorded: the pid alone, as before
    p = tmp_path / "result.json"
    p.write_text(json.dumps(_running(process_identity="another-boot/123")))
    assert paper.record_from_result(read_result(p), p, tmp_path).state == "interrupted"


def test_a_run_records_its_process_identity(isolated, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    run = start_run("C4", "ci", {})
    try:
        r = read_result(result_path("C4", "ci"))
        assert r["status"] == "running" and r["process_identity"] == tracking.process_identity(os.getpid())
    finally:
        run.finish(RuntimeError("done"))


# --- 5. SIGTERM ----------------------------------------------------------------------------------------------

WAITING = '''
import os, pathlib, time
from macroarch.repro.claims import get_claim
from macroarch.repro.tracking import start_run
run = start_run("C4", profile, {"machine": {"cpu_model": "test"}})
pathlib.Path(os.environ["TEST_MARKER"]).write_text("started")
while True:
    time.sleep(0.1)
'''


def test_sigterm_is_ctrl_c_one_line_interrupted_resumable_exit_143(project, isolated):
    _notebook(project / "notebooks" / "02_memory_wall.ipynb", WAITING, params=PROFILE_ONLY)
    _profile(project, "ci", [{"notebook": "02_memory_wall"}])
    marker = isolated / "marker"
    proc = subprocess.Popen([sys.executable, "-m", "macroarch.repro.cli", "reproduce", "--profile", "ci", "--only",
                             "C4"], env={**os.environ, "TEST_MARKER": str(marker)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the notebook never started"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("macroarch: interrupted by SIGTERM (02_memory_wall stopped after ")
    assert lines[0].endswith("); run the same command again to resume")
    assert read_result(result_path("C4", "ci"))["status"] == "interrupted"
    assert not runner.is_fresh(_job(), "ci")  # resumable: the next run runs it again


def test_sigterm_outside_the_runner_loop_is_an_interrupt_with_its_signal():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(runner.Interrupted) as e, runner.sigterm_as_ctrl_c():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends
    assert e.value.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == before  # restored


# --- 6. a failed run must not carry the previous run's verdict ------------------------------------------

def test_a_failed_run_does_not_keep_an_earlier_runs_verdict_or_wandb_id(project, isolated):
    path = result_path("C4", "ci")
    write_json_atomic(path, {**GOOD, "claim": "C4", "notebook": "02_memory_wall", "metrics": {"x": 1.0},
                             "started": "2020-01-01T00:00:00+00:00", "finished": "2020-01-01T00:01:00+00:00",
                             "git_commit": "abc", "wandb": {"mode": "offline", "id": "oldrun12"}})
    started = dt.datetime.now(dt.UTC)
    unwritten = runner._mark_unfinished(_job(), "ci", isolated / "out", started, "failed", "boom")
    r = read_result(path)
    assert r["status"] == "failed" and r["error"]["message"] == "02_memory_wall: boom"
    assert r["verdict"] is None and r["metrics"] == {} and r["wandb"] is None
    assert r["started"] == started.isoformat(timespec="seconds")  # this execution's record
    assert r["previous"] == {"started": "2020-01-01T00:00:00+00:00", "finished": "2020-01-01T00:01:00+00:00",
                             "status": "complete", "git_commit": "abc"}
    rec = paper.record_from_result(r, path, isolated / "out")
    assert rec.state == "failed" and rec.wandb_run is None and rec.verdict is None
    assert unwritten == []  # every result could be written
