"""The runner on a throw-away project: fixture notebooks under the registry's stems, executed by papermill."""

import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import PROFILE_ONLY, RECORDING
from conftest import write_notebook as _notebook
from conftest import write_profile as _profile
from macroarch.config import ConfigError
from macroarch.repro import runner
from macroarch.repro.cli import main
from macroarch.repro.tracking import read_result, result_path


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_failure_is_isolated_resume_skips_fresh_and_budgets_are_reported(project, isolated):
    _profile(project, "ci", [{"notebook": "01_gradient_explosion"},
                             {"notebook": "02_memory_wall", "parameters": {"size": 1}, "budget": 1}],
             budget="10m")
    printed, terminal = [], _Terminal()
    outcomes = runner.reproduce("ci", jobs=1, echo=lambda text, end="\n", **k: printed.append(text + end),
                                stream=terminal)  # one at a time: the lines in the profile's order
    lines = "".join(printed).splitlines()
    assert [o.status for o in outcomes] == ["failed", "ok"]
    assert outcomes[0].error == "RuntimeError: deliberate failure ci"  # the first line, not a traceback
    out = isolated / "out" / "ci"
    assert (out / "02_memory_wall.ipynb").is_file()
    assert (out / "01_gradient_explosion.failed.ipynb").is_file()
    assert not (out / "01_gradient_explosion.ipynb").exists()
    for claim in ("C2", "C3", "R1"):  # the failing notebook's claims are failed, not missing or stale
        r = read_result(result_path(claim, "ci"))
        assert r["status"] == "failed" and "deliberate failure" in r["error"]["message"]
    assert read_result(result_path("C4", "ci"))["status"] == "complete"
    assert lines[0].startswith("[1/2] 01_gradient_explosion") and " failed " in lines[0] and "of 10m" in lines[0]
    assert lines[1].startswith("[2/2] 02_memory_wall") and " ok " in lines[1] and "C4 partially" in lines[1]
    assert "of 1s (over budget)" in lines[1] and "over its budget of 1s" in lines[2]
    assert "1 ran, 0 skipped, 1 failed" in "".join(printed)
    assert "cell 1/3" in terminal.getvalue() and "\r" in terminal.getvalue()  # the live line, on a terminal

    before = (out / "02_memory_wall.ipynb").stat().st_mtime
    outcomes = runner.reproduce("ci", echo=lambda *a, **k: None)
    assert [o.status for o in outcomes] == ["failed", "skipped"]
    assert (out / "02_memory_wall.ipynb").stat().st_mtime == before

    outcomes = runner.reproduce("ci", only="C4", force=True, echo=lambda *a, **k: None)
    assert [(o.job.stem, o.status) for o in outcomes] == [("02_memory_wall", "ok")]


def test_what_ran_is_what_is_recorded_and_resume_compares_parameters(project, isolated):
    """The README's direct papermill example: ``-p profile ci`` must run (and record) the ci sizes, and the
    runner must not take a run with other parameters for its own."""
    import papermill

    nb = project / "notebooks" / "02_memory_wall.ipynb"
    papermill.execute_notebook(str(nb), str(isolated / "direct.ipynb"), parameters={"profile": "ci"},
                               kernel_name="python3", progress_bar=False, cwd=str(project))
    r = read_result(result_path("C4", "ci"))
    assert r["config"]["size"] == 1 and r["config"]["profile"] == "ci"  # ci's size, not the cell's cpu default

    (job,) = runner.select(runner.load_profile("ci"), "C4")
    assert not runner.is_fresh(job, "ci")  # a run by hand is not the runner's
    assert runner.execute(job, "ci").status == "ok"
    assert runner.is_fresh(job, "ci")
    papermill.execute_notebook(str(nb), str(isolated / "direct.ipynb"), parameters={"profile": "ci", "size": 5},
                               kernel_name="python3", progress_bar=False, cwd=str(project))
    assert read_result(result_path("C4", "ci"))["config"]["size"] == 5
    assert not runner.is_fresh(job, "ci")  # the result now holds other parameters than the profile's


def test_changes_make_a_notebook_stale(project):
    (job,) = runner.select(runner.load_profile("ci"), "C4")
    assert runner.execute(job, "ci").status == "ok"
    assert runner.is_fresh(job, "ci")
    # new parameters
    _profile(project, "ci", [{"notebook": "02_memory_wall", "parameters": {"size": 2}}])
    (job2,) = runner.load_profile("ci")
    assert not runner.is_fresh(job2, "ci")
    # an edited notebook
    time.sleep(0.01)
    job.path.touch()
    assert not runner.is_fresh(job, "ci")
    # an incomplete result
    assert runner.execute(job, "ci").status == "ok"
    p = result_path("C4", "ci")
    r = json.loads(p.read_text())
    r["status"] = "running"
    p.write_text(json.dumps(r))
    assert not runner.is_fresh(job, "ci")


def test_notebook_that_records_nothing_fails(project):
    _notebook(project / "notebooks" / "02_memory_wall.ipynb", "x = 1")
    (job,) = runner.select(runner.load_profile("ci"), "C4")
    outcome = runner.execute(job, "ci")
    assert outcome.status == "failed" and "C4" in outcome.error
    assert read_result(result_path("C4", "ci"))["status"] == "failed"


def test_unannotated_parameters_cell_gets_its_values_from_papermill(project):
    """A notebook not converted yet (``name = value`` lines): a name check, and papermill injects the values."""
    _notebook(project / "notebooks" / "02_memory_wall.ipynb",
              RECORDING.replace('params = resolve_parameters("02_memory_wall", globals())',
                                'params = {"size": size}'), params="profile = 'cpu'\nsize = 1")
    _profile(project, "ci", [{"notebook": "02_memory_wall", "parameters": {"size": 3}}])
    (job,) = runner.load_profile("ci")
    assert not job.annotated and job.papermill_parameters("ci") == {"size": 3, "profile": "ci"}
    assert runner.execute(job, "ci").status == "ok"
    assert read_result(result_path("C4", "ci"))["config"]["size"] == 3
    _profile(project, "ci", [{"notebook": "02_memory_wall", "parameters": {"sise": 3}}])
    with pytest.raises(ConfigError, match="unknown parameter 'sise'"):
        runner.load_profile("ci")


THREE_RUNS = '''
import time
from macroarch.repro.tracking import start_run
for i, claim in enumerate(["C2", "C3", "R1"]):
    with start_run(claim, profile, {"machine": {}}) as run:
        run.summary(x=i)
        run.verdict(grade="reproduced", measured=str(i), target="t", scale="s")
    time.sleep(6 if i == 0 else 0)  # the first run's W&B process waits longer than its linger after finishing
'''


def test_every_run_of_a_notebook_gets_the_executed_notebook_as_evidence(project, isolated, monkeypatch):
    from macroarch.repro.wandb_offline import find_offline_runs

    monkeypatch.setenv("WANDB_MODE", "offline")
    # the most the W&B processes wait for papermill's last write once the kernel is gone (they stop as soon as it is
    # there): 1 s missed it on a slow evening (an evidence artifact without the notebook)
    monkeypatch.setenv("MACROARCH_WANDB_LINGER", "4")
    _notebook(project / "notebooks" / "01_gradient_explosion.ipynb", THREE_RUNS, params=PROFILE_ONLY)
    (job,) = runner.select(runner.load_profile("ci"), "C2")
    outcome = runner.execute(job, "ci")
    assert outcome.status == "ok" and not outcome.wandb_errors, (outcome.error, outcome.wandb_errors)
    executed = (isolated / "out" / "ci" / "01_gradient_explosion.ipynb").read_bytes()
    runs = find_offline_runs(isolated)
    assert sorted(r.config["claim"] for r in runs) == ["C2", "C3", "R1"]
    for r in runs:
        (art,) = [a for a in r.artifacts if a.type == "evidence"]
        assert art.files["01_gradient_explosion.ipynb"].read_bytes() == executed, r.config["claim"]
        assert read_result(result_path(r.config["claim"], "ci"))["wandb"]["state"] == "finished"


@pytest.mark.parametrize("entries, message", [
    ([{"notebook": "99_nothing"}], "unknown notebook '99_nothing'"),
    ([{"notebook": "02_memory_wall", "parameters": {"sise": 1}}], "unknown parameter 'sise'"),
    ([{"notebook": "02_memory_wall", "params": {}}], "unknown key 'params'"),
    ([{"notebook": "02_memory_wall", "parameters": {"size": 1}}, {"notebook": "02_memory_wall"}], "listed twice"),
    ([{"notebook": "02_memory_wall", "parameters": {"size": "two"}}], "parameter 'size' must be int, got 'two'"),
    ([{"notebook": "02_memory_wall", "parameters": {"size": True}}], "parameter 'size' must be int, got True"),
    ([{"notebook": "02_memory_wall"}], "parameter 'size' is None in the notebook and ci.yaml gives no value"),
    ([{"notebook": "02_memory_wall", "parameters": {"size": 1}, "timeout": True}], "timeout must be a whole"),
    ([{"notebook": "02_memory_wall", "parameters": {"size": 1}, "budget": "soon"}], "budget must be a duration"),
    ([{"notebook": "02_memory_wall", "parameters": {"size": 1, "profile": "cpu"}}], "'profile' is set by the"),
])
def test_bad_profiles_are_rejected_by_name(project, entries, message):
    _profile(project, "ci", entries)
    with pytest.raises(ConfigError, match=message):
        runner.load_profile("ci")


def test_wrong_parameter_type_exits_2_before_any_kernel_starts(project, isolated, capsys, monkeypatch):
    _profile(project, "ci", [{"notebook": "02_memory_wall", "parameters": {"size": "two"}}])
    started = []
    monkeypatch.setattr(runner, "execute", lambda *a, **k: started.append(a))
    assert main(["reproduce", "--profile", "ci"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "parameter 'size' must be int, got 'two' (str)" in err
    assert started == [] and not (isolated / "out").exists()


def test_malformed_yaml_and_unknown_profile_or_claim(project):
    (project / "papermill_runs" / "ci.yaml").write_text("notebooks: [\n  - notebook: 02_memory_wall\n bad")
    with pytest.raises(ConfigError, match="malformed YAML in .*ci.yaml line"):
        runner.load_profile("ci")
    (project / "papermill_runs" / "ci.yaml").write_bytes("notebooks: [caf\xe9]".encode("latin-1"))
    with pytest.raises(ConfigError, match="ci.yaml: not UTF-8 text"):
        runner.load_profile("ci")
    with pytest.raises(ConfigError, match="unknown profile 'laptop'"):
        runner.load_profile("laptop")
    with pytest.raises(ConfigError, match="no such file"):
        runner.load_profile("gpu")
    _profile(project, "ci", [{"notebook": "02_memory_wall", "parameters": {"size": 1}}])
    with pytest.raises(ConfigError, match="'C77'"):
        runner.select(runner.load_profile("ci"), "C77")
    with pytest.raises(ConfigError, match="C7 have no notebook"):
        runner.select(runner.load_profile("ci"), "C4,C7")


def test_durations():
    assert runner.parse_duration("6m", "x") == 360 and runner.parse_duration("1h30m", "x") == 5400
    assert runner.parse_duration(45, "x") == 45 and runner.parse_duration("90s", "x") == 90
    assert [runner.format_duration(s) for s in (252, 360, 42.3, 3725)] == ["4m12s", "6m", "42s", "1h02m"]


# --- the runner as a process: a notebook that waits, so that the test can act while it runs --------------

WAITING = '''
import os, pathlib, time
from macroarch.repro.claims import get_claim
from macroarch.repro.notebook import resolve_parameters
from macroarch.repro.tracking import start_run
params = resolve_parameters("02_memory_wall", globals())
run = start_run("C4", profile, {**params, "machine": {"cpu_model": "test"}})
marker = pathlib.Path(os.environ["TEST_MARKER"])
marker.write_text("started")
while not marker.with_suffix(".go").exists():
    time.sleep(0.1)
run.summary(post_accounting_bytes=1.4e12, mixed_precision_bytes=2.8e12)
run.verdict(get_claim("C4").grade(run.metrics, scale="x"))
run.finish()
'''


def _start_runner(project, isolated, *args):
    _notebook(project / "notebooks" / "02_memory_wall.ipynb", WAITING, params=PROFILE_ONLY)
    _profile(project, "ci", [{"notebook": "02_memory_wall"}])
    marker = isolated / "marker"
    env = {**os.environ, "TEST_MARKER": str(marker)}
    # Ctrl-C is the default SIGINT action even where pytest itself runs with SIGINT ignored (a background job of a
    # non-interactive shell, `make test &`: the runner would inherit the ignore and never see the signal)
    proc = subprocess.Popen([sys.executable, "-m", "macroarch.repro.cli", "reproduce", "--profile", "ci", "--only",
                             "C4", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the notebook never started"
        time.sleep(0.1)
    return proc, marker


def test_two_runs_of_a_profile_at_once_the_second_gets_the_lock_message(project, isolated, capsys):
    proc, marker = _start_runner(project, isolated, "--no-paper")
    try:
        assert main(["reproduce", "--profile", "ci", "--only", "C4"]) == 75
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1
        assert f"profile ci is already being reproduced by pid {proc.pid}" in err and "reproduce" in err
    finally:
        (isolated / "marker.go").write_text("")
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert read_result(result_path("C4", "ci"))["status"] == "complete"  # the first run was not disturbed


def test_ctrl_c_exits_130_with_one_line_and_resumes(project, isolated):
    proc, _ = _start_runner(project, isolated)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == ["macroarch: interrupted (02_memory_wall stopped after "
                     f"{lines[0].split('after ')[1].split(')')[0]}); run the same command again to resume"]
    r = read_result(result_path("C4", "ci"))
    assert r["status"] == "interrupted"
    (job,) = runner.select(runner.load_profile("ci"), "C4")
    assert not runner.is_fresh(job, "ci")  # resumable: the next run runs it again


def test_killed_run_then_paper_shows_it_interrupted_with_resolving_evidence(project, isolated, capsys):
    proc, _ = _start_runner(project, isolated)
    os.killpg(proc.pid, signal.SIGKILL)  # the runner; its kernel notices its parent is gone and ends
    proc.communicate(timeout=30)
    r = read_result(result_path("C4", "ci"))
    assert r["status"] == "running"
    deadline = time.monotonic() + 30
    while _alive(r["pid"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert main(["paper", "--profile", "ci"]) == 0
    paper = isolated / "out" / "ci" / "paper"
    row = next(line for line in (paper / "claims.md").read_text().splitlines() if line.startswith("| C4 |"))
    assert "**interrupted**" in row
    link = row.split("](")[1].split(")")[0]
    assert (paper / link).is_file()  # the partial notebook, kept in the paper


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_kernel_that_dies_before_it_answers_is_started_once_more(project, isolated, monkeypatch):
    """jupyter_client's free-port race between two kernels started at once: the first start dies before
    kernel_info, the notebook runs on the second; a kernel that dies twice fails the notebook, naming it."""
    import papermill

    real, calls = papermill.execute_notebook, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("Kernel died before replying to kernel_info")
        return real(*args, **kwargs)

    monkeypatch.setattr(papermill, "execute_notebook", flaky)
    (job,) = runner.select(runner.load_profile("ci"), "C4")
    assert runner.execute(job, "ci").status == "ok" and len(calls) == 2
    assert read_result(result_path("C4", "ci"))["status"] == "complete"

    def dead(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("Kernel died before replying to kernel_info")

    monkeypatch.setattr(papermill, "execute_notebook", dead)
    calls.clear()
    outcome = runner.execute(job, "ci")
    assert outcome.status == "failed" and "kernel_info" in outcome.error and len(calls) == runner.KERNEL_START_ATTEMPTS
