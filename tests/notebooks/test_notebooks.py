"""Every notebook of the ci profile, executed by papermill exactly as `macroarch reproduce --profile ci` does.

One execution per notebook, and everything checked on it: the results, every parameter recorded in both
result.json and the W&B run, the W&B run's evidence artifact, and the paper built from either source.
"""

import pytest
import torch

from macroarch.measure.machine import auto_compute_dtype, native_bf16_cpu
from macroarch.repro import notebook as nbparams
from macroarch.repro import paper, runner
from macroarch.repro.claims import GRADES
from macroarch.repro.tracking import read_result, result_path

JOBS = runner.load_profile("ci")


def _parameter_names(job):
    if job.annotated:
        return set(nbparams.notebook_parameters(job.stem))
    import papermill

    return set(papermill.inspect_notebook(str(job.path)))


@pytest.mark.slow
@pytest.mark.parametrize("job", JOBS, ids=[j.stem for j in JOBS])
def test_notebook_runs_under_ci_profile(job, isolated):
    from macroarch.repro.wandb_offline import find_offline_runs

    outcome = runner.execute(job, "ci")
    assert outcome.status == "ok", outcome.error
    assert not outcome.wandb_errors, outcome.wandb_errors
    executed = isolated / "out" / "ci" / f"{job.stem}.ipynb"
    assert executed.is_file()
    assert "IProgress not found" not in executed.read_text()  # progress bars render as text, without a warning
    runs = {r.run_id: r for r in find_offline_runs(isolated)}
    names = _parameter_names(job)
    for claim in job.claims:
        r = read_result(result_path(claim, "ci"))
        assert r["status"] == "complete"
        assert r["verdict"]["grade"] in GRADES and r["verdict"]["scale"] and r["verdict"]["measured"]
        assert r["metrics"], f"{claim}: no metrics recorded"
        for name in r["figures"]:
            assert (result_path(claim, "ci").parent / f"{name}.png").stat().st_size > 1000
        # every figure laid out for the report's page (issue 44): legible at its width, nothing overlapping
        assert not r.get("figure_problems"), f"{claim}: {r.get('figure_problems')}"
        assert r["wandb"]["mode"] == "offline" and r["wandb"]["error"] is None

        # Every parameter of the notebook is in the run's config, in result.json and in W&B alike (issue 11).
        w = runs[r["wandb"]["id"]]
        assert names <= set(r["config"]), f"{claim}: result.json lacks {sorted(names - set(r['config']))}"
        assert names <= set(w.config), f"{claim}: the W&B config lacks {sorted(names - set(w.config))}"
        assert {n: w.config[n] for n in names} == {n: r["config"][n] for n in names}
        assert w.config["machine"]["cpu_capability"] and r["config"]["profile"] == "ci"
        # The CPU the run was measured on and the dtype it computed in (issue 20): "auto" is resolved for this
        # machine before the run starts, and both land in result.json and W&B alike.
        machine = r["config"]["machine"]
        assert machine["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
        assert machine["native_bf16"] == native_bf16_cpu()
        if "compute_dtype" in names:
            default = nbparams.notebook_parameters(job.stem)["compute_dtype"].default
            expected = auto_compute_dtype() if default == "auto" else default
            assert r["config"]["compute_dtype"] == w.config["compute_dtype"] == expected
        assert (w.group, w.job_type) == ("ci", job.stem)

        # The run's evidence artifact holds this run's executed notebook and result.json (issue 19).
        (art,) = [a for a in w.artifacts if a.type == "evidence"]
        assert {"result.json", f"{job.stem}.ipynb"} <= set(art.files)
        assert all(p.is_relative_to(w.directory) for p in art.files.values())
        assert art.files[f"{job.stem}.ipynb"].read_bytes() == executed.read_bytes()
        assert read_result(art.files["result.json"])["verdict"] == r["verdict"]

    # The paper built from the result files and from the W&B offline runs read back is the same.
    a = paper.build("ci", source="results", paper_dir=isolated / "paper_results", pdf=False)
    b = paper.build("ci", source="wandb", paper_dir=isolated / "paper_wandb", pdf=False)
    assert (a / "claims.md").read_text() == (b / "claims.md").read_text()
    for claim in job.claims:
        row = next(line for line in (a / "claims.md").read_text().splitlines() if line.startswith(f"| {claim} |"))
        assert paper.NOT_MEASURED not in row and f"(evidence/{job.stem}.ipynb)" in row
    assert sorted(p.name for p in (a / "figures").iterdir()) == sorted(p.name for p in (b / "figures").iterdir())
    assert (a / "evidence" / f"{job.stem}.ipynb").read_bytes() == (b / "evidence" / f"{job.stem}.ipynb").read_bytes()
