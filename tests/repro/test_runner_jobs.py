"""Notebooks in parallel: the schedule (which notebooks share the machine, on which cores), and the runner with
several kernels at once on a throw-away project (fixture notebooks that meet each other, so that they can only
pass when they really run side by side), its lock, timings.json, Ctrl-C and seed offsets."""

import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import PROFILE_ONLY
from conftest import write_notebook as _notebook
from conftest import write_profile as _profile
from macroarch.config import ConfigError
from macroarch.repro import runner
from macroarch.repro.cli import main
from macroarch.repro.runner import Schedule, Task
from macroarch.repro.tracking import read_result, result_path

# --- the schedule, without notebooks ----------------------------------------------------------------------


def _simulate(tasks, cores, jobs, seconds):
    """Run ``Schedule`` against a clock of its own: each task takes ``seconds[stem]``. Returns, in start order,
    (stem, start, end, cores)."""
    s = Schedule(runner.plan(tasks), cores, jobs)
    now, running, done = 0.0, {}, []
    while not s.done:
        while (started := s.start_next()) is not None:
            task, pinned = started
            running[task.stem] = (now, pinned)
        stem = min(running, key=lambda k: running[k][0] + seconds[k])  # the next to end
        start, pinned = running.pop(stem)
        now = start + seconds[stem]
        done.append((stem, start, now, pinned))
        s.finish(stem)
    return sorted(done, key=lambda d: (d[1], [t.stem for t in runner.plan(tasks)].index(d[0])))


def _overlap(a, b):
    return a[1] < b[2] and b[1] < a[2]


TASKS = [Task("01", 1), Task("02", 1), Task("03", 1, exclusive=True), Task("04", 2), Task("05", 1),
         Task("07", 1, exclusive=True), Task("08", 8)]
SECONDS = {"01": 10, "02": 1, "03": 2, "04": 6, "05": 8, "07": 3, "08": 4}


def test_plan_puts_the_exclusive_notebooks_first_and_keeps_the_profile_order():
    assert [t.stem for t in runner.plan(TASKS)] == ["03", "07", "01", "02", "04", "05", "08"]


@pytest.mark.parametrize("jobs", [1, 2, 3, 4])
def test_schedule_never_shares_a_core_nor_an_exclusive_notebook(jobs):
    cores = (0, 1, 2, 3)
    ran = _simulate(TASKS, cores, jobs, SECONDS)
    assert sorted(r[0] for r in ran) == sorted(SECONDS)
    # every notebook starts in the plan's order
    assert [r[0] for r in ran] == [t.stem for t in runner.plan(TASKS)]
    for a in ran:
        need = {"03": 4, "07": 4, "04": 2, "08": 4}.get(a[0], 1)  # all cores when exclusive or wanting more
        assert len(a[3]) == need and set(a[3]) <= set(cores), a
        if a[0] in ("03", "07"):
            assert [b for b in ran if b is not a and _overlap(a, b)] == [], a
        # when it starts: at most `jobs` running, each on cores of its own
        now = [b for b in ran if b[1] <= a[1] < b[2]]
        assert len(now) <= jobs, (a, now)
        pinned = [c for b in now for c in b[3]]
        assert len(pinned) == len(set(pinned)), now


def test_schedule_runs_single_thread_notebooks_side_by_side_on_two_cores():
    tasks = [Task(f"0{i}", 1) for i in range(1, 5)]
    ran = _simulate(tasks, (4, 9), 2, {"01": 5, "02": 1, "03": 1, "04": 1})
    # 02, 03 and 04 run one after the other on the second core while 01 runs on the first
    assert [(r[0], r[1], r[3]) for r in ran] == [("01", 0, (4,)), ("02", 0, (9,)), ("03", 1, (9,)),
                                                  ("04", 2, (9,))]


def test_default_jobs_is_what_fits_on_the_cores():
    ones = [Task(str(i), 1) for i in range(5)]
    assert runner.default_jobs(ones, 2) == 2
    assert runner.default_jobs(ones, 16) == 5
    assert runner.default_jobs([Task("a", 2), Task("b", 1), Task("c", 3)], 3) == 2  # 1 + 2; not 3 more
    assert runner.default_jobs([Task("a", 16), Task("b", 8)], 16) == 1
    assert runner.default_jobs([Task("x", 1, exclusive=True)], 8) == 1
    assert runner.default_jobs([Task("x", 1, exclusive=True), Task("a", 1), Task("b", 1)], 8) == 2


def test_schedule_rejects_no_jobs():
    with pytest.raises(ConfigError, match="--jobs must be at least 1"):
        Schedule([Task("a")], (0,), 0)


def test_profiles_mark_the_multi_process_notebooks_exclusive():
    for profile in ("ci", "cpu", "gpu"):
        jobs = {j.stem: j for j in runner.load_profile(profile)}
        assert jobs["03_zero3_communication"].exclusive and jobs["07_comm_bucketing"].exclusive, profile
        if profile == "cpu":  # the single-threaded ones share the two cores
            assert [s for s, j in jobs.items() if j.exclusive] == ["03_zero3_communication", "07_comm_bucketing"]


def test_bad_exclusive_and_too_many_jobs_and_negative_offset_are_one_line(project, isolated, capsys):
    _profile(project, "ci", [{"notebook": "02_memory_wall", "parameters": {"size": 1}, "exclusive": "yes"}])
    with pytest.raises(ConfigError, match="exclusive must be true or false, got 'yes'"):
        runner.load_profile("ci")
    _profile(project, "ci", [{"notebook": "02_memory_wall", "parameters": {"size": 1}}])
    cores = len(os.sched_getaffinity(0))
    for argv, message in [(["--jobs", str(cores + 1)], f"may run on {cores} core(s)"),
                          (["--jobs", "0"], "--jobs must be at least 1"),
                          (["--seed-offset", "-1"], "--seed-offset must be a whole number, 0 or more")]:
        assert main(["reproduce", "--profile", "ci", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
    assert not (isolated / "out").exists()


# --- notebooks that meet: each waits until the other has started ------------------------------------------

MEETING = '''
import json, os, pathlib, time
from macroarch.repro.notebook import resolve_parameters
from macroarch.repro.tracking import read_result, result_path, start_run, write_json_atomic
params = resolve_parameters(STEM, globals())
here = pathlib.Path(os.environ["TEST_MEET"])
(here / f"{STEM}.json").write_text(json.dumps({"affinity": sorted(os.sched_getaffinity(0)),
                                               "omp": os.environ.get("OMP_NUM_THREADS"), "pid": os.getpid()}))
deadline = time.monotonic() + 120
while any(not (here / f"{o}.json").exists() for o in WAIT_FOR) or (WAIT_FOR and not (here / "go").exists()):
    assert time.monotonic() < deadline, f"{STEM}: {WAIT_FOR} never started beside it"
    time.sleep(0.1)
for claim in CLAIMS:
    with start_run(claim, profile, {**params, "machine": {"cpu_model": "test"}}) as run:
        run.summary(x=1)
        run.verdict(grade="reproduced", measured="1", target="t", scale="s")
    if COMPILE:  # what tracking records at a run's end: macroarch.mvas.compile_stats()
        r = read_result(result_path(claim, profile))
        r["compile"] = COMPILE
        write_json_atomic(result_path(claim, profile), r)
'''
SEEDED = PROFILE_ONLY + "seed: int = 0  # initial weights\n"


def _meeting(project, stem, claims, wait_for=(), compile=None):
    code = (f"STEM = {stem!r}\nCLAIMS = {list(claims)!r}\nWAIT_FOR = {list(wait_for)!r}\nCOMPILE = {compile!r}\n"
            + MEETING)
    _notebook(project / "notebooks" / f"{stem}.ipynb", code, params=SEEDED)


@pytest.fixture
def meeting(project, isolated, monkeypatch):
    """02 and 04 wait for each other (and for ``go``); 07, exclusive, waits for nobody."""
    _meeting(project, "02_memory_wall", ["C4"], wait_for=["04_dgr_variance"])
    _meeting(project, "04_dgr_variance", ["C6"], wait_for=["02_memory_wall"],
             compile={"compile_seconds": 1.5, "compiles": 3})
    _meeting(project, "07_comm_bucketing", ["C9"])
    _profile(project, "ci", [{"notebook": "02_memory_wall"}, {"notebook": "04_dgr_variance"},
                             {"notebook": "07_comm_bucketing", "exclusive": True}])
    here = isolated / "meet"
    here.mkdir()
    monkeypatch.setenv("TEST_MEET", str(here))
    return here


def _start(*args):
    # Ctrl-C is the default SIGINT action even where pytest runs with SIGINT ignored (see test_runner)
    return subprocess.Popen([sys.executable, "-m", "macroarch.repro.cli", "reproduce", "--profile", "ci", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _wait_for(proc, *paths):
    deadline = time.monotonic() + 180
    while not all(p.exists() for p in paths):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the notebooks never started"
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two notebooks side by side need two cores")
def test_two_notebooks_at_once_pinned_apart_and_the_exclusive_one_alone(meeting, isolated, capsys):
    proc = _start("--jobs", "2", "--no-paper")
    try:
        _wait_for(proc, meeting / "02_memory_wall.json", meeting / "04_dgr_variance.json")
        # both kernels run now: the profile is locked, and timings.json shows both running
        assert main(["reproduce", "--profile", "ci"]) == 75
        assert f"already being reproduced by pid {proc.pid}" in capsys.readouterr().err
        live = json.loads((isolated / "out" / "ci" / "timings.json").read_text())
        assert live["status"] == "running"
        assert {s: e["status"] for s, e in live["notebooks"].items()} == {
            "07_comm_bucketing": "ok", "02_memory_wall": "running", "04_dgr_variance": "running"}
    finally:
        (meeting / "go").write_text("")
        out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    for claim in ("C4", "C6", "C9"):
        assert read_result(result_path(claim, "ci"))["status"] == "complete", claim

    t = json.loads((isolated / "out" / "ci" / "timings.json").read_text())
    nb = t["notebooks"]
    assert t["status"] == "complete" and t["jobs"] == 2 and list(nb) == ["07_comm_bucketing", "02_memory_wall",
                                                                            "04_dgr_variance"]
    cores = sorted(os.sched_getaffinity(0))
    assert t["cores"] == cores and t["machine"]["usable_cores"] == cores and t["machine"]["cpu_capability"]
    # each kernel ran on the cores the runner says it pinned it to, with as many threads
    for stem, e in nb.items():
        seen = json.loads((meeting / f"{stem}.json").read_text())
        assert seen["affinity"] == e["cores"] and seen["omp"] == str(len(e["cores"])), stem
        assert e["status"] == "ok" and e["seconds"] > 0 and e["end_s"] > e["start_s"]
    assert nb["07_comm_bucketing"]["cores"] == cores and nb["07_comm_bucketing"]["exclusive"]
    assert not set(nb["02_memory_wall"]["cores"]) & set(nb["04_dgr_variance"]["cores"])
    # the exclusive notebook overlapped nothing (from the recorded times), the other two each other
    ex = nb["07_comm_bucketing"]
    for stem in ("02_memory_wall", "04_dgr_variance"):
        assert ex["end_s"] <= nb[stem]["start_s"] or nb[stem]["end_s"] <= ex["start_s"], stem
    assert ex["beside"] == []
    assert nb["02_memory_wall"]["beside"] == ["04_dgr_variance"] and nb["04_dgr_variance"]["beside"] == [
        "02_memory_wall"]
    assert nb["04_dgr_variance"]["compile"] == {"compile_seconds": 1.5, "compiles": 3}
    assert nb["02_memory_wall"]["compile"] is None
    assert t["compile"] == {"compile_seconds": 1.5, "compiles": 3, "notebooks_recorded": 1,
                            "notebooks_without_record": 2}
    assert "with --jobs 2 on" in out and "compiling 2s for 3 kernel(s) in 1 notebook(s)" in out
    assert t["machine"]["python"] == platform.python_version()
    first = isolated / "first"  # this run's results, for its paper below (the resume may run some again)
    shutil.copytree(isolated / "out" / "ci", first / "ci")

    # resumed: the skipped notebooks keep what they took in timings.json (one whose stamp is older than a
    # package file saved meanwhile, in a tree others edit, runs again)
    assert main(["reproduce", "--profile", "ci", "--no-paper"]) == 0
    again = json.loads((isolated / "out" / "ci" / "timings.json").read_text())["notebooks"]
    skipped = [s for s, e in again.items() if e["status"] == "skipped"]
    assert skipped and {e["status"] for e in again.values()} <= {"skipped", "ok"}
    for stem in skipped:
        assert again[stem]["earlier"]["seconds"] == nb[stem]["seconds"], stem

    # the paper keeps the record (data/timings.json) and says, per claim, what ran beside its notebook
    from macroarch.repro import paper

    built = paper.build("ci", records=paper.from_results("ci", first), paper_dir=isolated / "paper", pdf=False,
                        timings=first / "ci" / "timings.json")
    assert json.loads((built / "data" / "timings.json").read_text())["notebooks"] == nb
    rows = {line.split("|")[1].strip(): line for line in (built / "claims.md").read_text().splitlines()
            if line.startswith("| C")}
    assert "its notebook ran beside 04_dgr_variance" in rows["C4"]
    assert "its notebook ran beside 02_memory_wall" in rows["C6"]
    assert "its notebook ran alone (exclusive)" in rows["C9"]


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two notebooks side by side need two cores")
def test_ctrl_c_with_two_running_interrupts_both_in_one_line(meeting, isolated):
    _profile(isolated / "project", "ci", [{"notebook": "02_memory_wall"}, {"notebook": "04_dgr_variance"}])
    proc = _start("--jobs", "2")
    _wait_for(proc, meeting / "02_memory_wall.json", meeting / "04_dgr_variance.json")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("macroarch: interrupted (02_memory_wall stopped after "), lines
    assert ", 04_dgr_variance stopped after " in lines[0] and lines[0].endswith("run the same command again to resume")
    for claim, stem in (("C4", "02_memory_wall"), ("C6", "04_dgr_variance")):
        r = read_result(result_path(claim, "ci"))
        assert r["status"] == "interrupted", claim
        job = runner.load_job("ci", stem)
        assert not runner.is_fresh(job, "ci")  # resumable: the next run runs it again
    # the kernels are gone, not left running
    deadline = time.monotonic() + 30
    pids = [json.loads((meeting / f"{s}.json").read_text())["pid"] for s in ("02_memory_wall", "04_dgr_variance")]
    while any(_alive(p) for p in pids):
        assert time.monotonic() < deadline, f"kernels {[p for p in pids if _alive(p)]} still run"
        time.sleep(0.2)
    t = json.loads((isolated / "out" / "ci" / "timings.json").read_text())
    assert t["status"] == "interrupted"
    assert {s: e["status"] for s, e in t["notebooks"].items()} == {"02_memory_wall": "interrupted",
                                                                    "04_dgr_variance": "interrupted"}


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# --- seed offsets ---------------------------------------------------------------------------------------


def test_seed_offset_changes_the_seed_and_keeps_the_results_apart(project, isolated, capsys, monkeypatch):
    _meeting(project, "04_dgr_variance", ["C6"])
    _profile(project, "ci", [{"notebook": "04_dgr_variance"}, {"notebook": "02_memory_wall",
                                                                "parameters": {"size": 1}}])
    monkeypatch.setenv("TEST_MEET", str(isolated))
    (job, c4) = runner.load_profile("ci")
    offset = job.with_seed_offset(100)
    assert job.effective_parameters("ci")["seed"] == 0 and offset.effective_parameters("ci")["seed"] == 100
    assert offset.papermill_parameters("ci") == {"profile": "ci", "seed": 100}
    assert not c4.has_seed("ci") and c4.with_seed_offset(100).papermill_parameters("ci") == {"profile": "ci"}

    assert main(["reproduce", "--profile", "ci", "--only", "C6", "--no-paper"]) == 0
    base = read_result(result_path("C6", "ci"))
    # resume tells the offsets apart (checked at once: a package file saved meanwhile makes every stamp stale)
    assert runner.is_fresh(job, "ci") and not runner.is_fresh(offset, "ci")
    assert main(["reproduce", "--profile", "ci", "--only", "C4,C6", "--seed-offset", "100", "--jobs", "1"]) == 0
    printed = capsys.readouterr().out
    assert "note: 02_memory_wall has no 'seed' parameter" in printed
    root = isolated / "out" / "seed100"
    assert runner.is_fresh(offset, "ci", out=root) and not runner.is_fresh(job, "ci", out=root)
    moved = read_result(result_path("C6", "ci", root))
    assert moved["config"]["seed"] == 100 and base["config"]["seed"] == 0
    assert read_result(result_path("C6", "ci")) == base  # the offset-0 result is untouched
    assert json.loads((root / "ci" / "timings.json").read_text())["seed_offset"] == 100
    assert (root / "ci" / "paper" / "claims.md").is_file() and not (isolated / "out" / "ci" / "paper").exists()


# --- the real ci notebooks --------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two notebooks side by side need two cores")
def test_real_ci_notebooks_two_at_once_under_the_lock(isolated, capsys):
    """02 and 09 side by side, after 03 (exclusive, the shortest such) alone: the results, the lock while they run,
    timings.json."""
    import threading

    done = {}
    t = threading.Thread(target=lambda: done.update(outcomes=runner.reproduce(
        "ci", only="C4,C5,C11", jobs=2, echo=lambda *a, **k: None)))
    t.start()
    path = isolated / "out" / "ci" / "timings.json"
    deadline = time.monotonic() + 600
    locked = False
    while t.is_alive():
        assert time.monotonic() < deadline, "the ci notebooks took more than 10 minutes"
        with _suppress():
            running = [s for s, e in json.loads(path.read_text())["notebooks"].items() if e["status"] == "running"]
            if len(running) == 2 and not locked:
                assert main(["reproduce", "--profile", "ci", "--only", "C4"]) == 75
                locked = True
        time.sleep(0.2)
    t.join()
    assert locked, "never saw both notebooks running"
    assert "is already being reproduced" in capsys.readouterr().err
    assert [(o.job.stem, o.status) for o in done["outcomes"]] == [
        ("03_zero3_communication", "ok"), ("02_memory_wall", "ok"), ("09_hardware_speedups", "ok")]
    for claim in ("C4", "C5", "C11"):
        assert read_result(result_path(claim, "ci"))["status"] == "complete", claim
    nb = json.loads(path.read_text())["notebooks"]
    ex = nb["03_zero3_communication"]
    assert ex["beside"] == [] and all(ex["end_s"] <= nb[s]["start_s"] for s in ("02_memory_wall",
                                                                              "09_hardware_speedups"))
    assert nb["02_memory_wall"]["beside"] == ["09_hardware_speedups"]
    assert not set(nb["02_memory_wall"]["cores"]) & set(nb["09_hardware_speedups"]["cores"])


def _suppress():
    import contextlib

    return contextlib.suppress(OSError, ValueError, KeyError)


def test_board_shows_every_running_notebook_and_prints_above_them():
    import io

    from macroarch.repro.progress import Board

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    term, printed = Terminal(), []
    board = Board(term, echo=lambda text, **k: (printed.append(text), term.write(text + "\n")))
    board.add("a", "[1/2] a", "core 0")
    board.add("b", "[2/2] b", "core 1")
    board.update("a", 2, 5)
    assert board.texts()[0].startswith("[1/2] a  cell 3/5, 0s, core 0") and board.texts()[1].startswith("[2/2] b")
    mark = len(term.getvalue())
    board.print("[2/2] b ok")
    board.remove("b")
    # two lines on the terminal: back over both before the line of its own, then the one still running
    after = term.getvalue()[mark:]
    assert after.startswith("\r\x1b[2K\x1b[1A\x1b[2K[2/2] b ok\n") and after.endswith("[1/2] a  cell 3/5, 0s, core 0")
    assert printed == ["[2/2] b ok"]

    log = io.StringIO()  # not a terminal: nothing but the lines of their own, and the periodic ones
    board = Board(log, echo=lambda text, **k: log.write(text + "\n"), every_s=0.0)
    with board:
        board.add("a", "[1/1] a")
        time.sleep(1.5)
    assert "  ... [1/1] a  starting, " in log.getvalue() and "\r" not in log.getvalue()
