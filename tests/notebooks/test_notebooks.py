"""Every notebook of the ci profile, executed by papermill exactly as `macroarch reproduce --profile ci` does."""

import pytest

from macroarch.repro import paper, runner
from macroarch.repro.claims import GRADES
from macroarch.repro.tracking import read_result, result_path

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

    # The paper built from the result files and from the W&B offline runs read back is the same.
    a = paper.build("ci", source="results", paper_dir=isolated / "paper_results")
    b = paper.build("ci", source="wandb", paper_dir=isolated / "paper_wandb")
    assert (a / "claims.md").read_text() == (b / "claims.md").read_text()
    for claim in job.claims:
        assert f"| {claim} |" in (a / "claims.md").read_text()
        assert paper.NOT_MEASURED not in next(line for line in (a / "claims.md").read_text().splitlines()
                                              if line.startswith(f"| {claim} |"))
    assert sorted(p.name for p in (a / "figures").iterdir()) == sorted(p.name for p in (b / "figures").iterdir())
