"""The runner on a throw-away project: fixture notebooks under the registry's stems, executed by papermill."""

import json
import time

import pytest

from conftest import write_notebook as _notebook
from conftest import write_profile as _profile
from macroarch.repro import runner
from macroarch.config import ConfigError
from macroarch.repro.tracking import read_result, result_path


def test_failure_is_isolated_and_resume_skips_fresh(project, isolated):
    printed = []
    outcomes = runner.reproduce("ci", echo=lambda text, end="\n", **k: printed.append(text + end))
    lines = "".join(printed).splitlines()
    assert [o.status for o in outcomes] == ["failed", "ok"]
    assert "deliberate failure ci" in outcomes[0].error
    out = isolated / "out" / "ci"
    assert (out / "02_memory_wall.ipynb").is_file()
    assert (out / "01_gradient_explosion.failed.ipynb").is_file()
    assert not (out / "01_gradient_explosion.ipynb").exists()
    for claim in ("C2", "C3", "R1"):  # the failing notebook's claims are failed, not missing or stale
        r = read_result(result_path(claim, "ci"))
        assert r["status"] == "failed" and "deliberate failure" in r["error"]["message"]
    assert read_result(result_path("C4", "ci"))["status"] == "complete"
    assert lines[0].startswith("[1/2] 01_gradient_explosion") and "failed in" in lines[0]
    assert lines[1].startswith("[2/2] 02_memory_wall") and "ok in" in lines[1] and "C4 partially" in lines[1]
    assert "1 ran, 0 skipped, 1 failed" in "".join(printed)

    before = (out / "02_memory_wall.ipynb").stat().st_mtime
    outcomes = runner.reproduce("ci", echo=lambda *a, **k: None)
    assert [o.status for o in outcomes] == ["failed", "skipped"]
    assert (out / "02_memory_wall.ipynb").stat().st_mtime == before

    outcomes = runner.reproduce("ci", only="C4", force=True, echo=lambda *a, **k: None)
    assert [(o.job.stem, o.status) for o in outcomes] == [("02_memory_wall", "ok")]


def test_changes_make_a_notebook_stale(project):
    (job,) = runner.select(runner.load_profile("ci"), "C4")
    assert not runner.is_fresh(job, "ci")
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


@pytest.mark.parametrize("entries, message", [
    ([{"notebook": "99_nothing"}], "unknown notebook '99_nothing'"),
    ([{"notebook": "02_memory_wall", "parameters": {"sise": 1}}], "unknown parameter 'sise'"),
    ([{"notebook": "02_memory_wall", "params": {}}], "unknown key 'params'"),
    ([{"notebook": "02_memory_wall"}, {"notebook": "02_memory_wall"}], "listed twice"),
])
def test_bad_profiles_are_rejected_by_name(project, entries, message):
    _profile(project, "ci", entries)
    with pytest.raises(ConfigError, match=message):
        runner.load_profile("ci")


def test_malformed_yaml_and_unknown_profile_or_claim(project):
    (project / "papermill_runs" / "ci.yaml").write_text("notebooks: [\n  - notebook: 02_memory_wall\n bad")
    with pytest.raises(ConfigError, match="malformed YAML in .*ci.yaml line"):
        runner.load_profile("ci")
    with pytest.raises(ConfigError, match="unknown profile 'laptop'"):
        runner.load_profile("laptop")
    with pytest.raises(ConfigError, match="no such file"):
        runner.load_profile("gpu")
    _profile(project, "ci", [{"notebook": "02_memory_wall"}])
    with pytest.raises(ConfigError, match="'C77'"):
        runner.select(runner.load_profile("ci"), "C77")
    with pytest.raises(ConfigError, match="C7 have no notebook"):
        runner.select(runner.load_profile("ci"), "C4,C7")
