"""Every notebook of the ci profile, executed by papermill exactly as `macroarch reproduce --profile ci` does."""

import pytest

from macroarch import runner
from macroarch.claims import GRADES
from macroarch.tracking import read_result, result_path

JOBS = runner.load_profile("ci")


@pytest.mark.slow
@pytest.mark.parametrize("job", JOBS, ids=[j.stem for j in JOBS])
def test_notebook_runs_under_ci_profile(job, isolated):
    outcome = runner.execute(job, "ci")
    assert outcome.status == "ok", outcome.error
    assert (isolated / "out" / "ci" / f"{job.stem}.ipynb").is_file()
    for claim in job.claims:
        r = read_result(result_path(claim, "ci"))
        assert r["status"] == "complete"
        assert r["verdict"]["grade"] in GRADES and r["verdict"]["scale"] and r["verdict"]["measured"]
        assert r["metrics"], f"{claim}: no metrics recorded"
        for name in r["figures"]:
            assert (result_path(claim, "ci").parent / f"{name}.png").stat().st_size > 1000
        assert r["wandb"]["mode"] == "offline" and r["wandb"]["error"] is None
