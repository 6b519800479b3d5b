import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest

from macroarch.repro import paper
from macroarch.config import ConfigError
from macroarch.repro.claims import CLAIMS, get_claim
from macroarch.repro.tracking import start_run


def _record(profile, post_bytes):
    with start_run("C4", profile, {"n": 1}) as run:
        run.summary(post_accounting_bytes=post_bytes, mixed_precision_bytes=2 * post_bytes, odd=1 / 3)
        run.log(step=0, loss=2.0)
        fig, ax = plt.subplots()
        ax.plot([0, 1], [post_bytes, 2 * post_bytes])
        run.figure("bytes", fig)
        plt.close(fig)
        run.verdict(get_claim("C4").grade(run.metrics, scale="test scale", note="a | pipe"))


def test_results_and_wandb_give_the_same_paper(isolated):
    _record("ci", 1.3e12)  # an older run, superseded below
    _record("ci", 1.397e12)
    _record("cpu", 1.0e12)  # another profile must not leak in
    a = paper.build("ci", source="results", paper_dir=isolated / "a")
    b = paper.build("ci", source="wandb", paper_dir=isolated / "b")
    claims_a, claims_b = (a / "claims.md").read_text(), (b / "claims.md").read_text()
    assert claims_a == claims_b
    c4 = next(line for line in claims_a.splitlines() if line.startswith("| C4 "))
    assert "**partially**" in c4 and "test scale" in c4 and "02_memory_wall" in c4
    assert "1.397e+12" in c4 and "a \\| pipe" not in c4  # the note lives in the report, not the table
    for cid in CLAIMS:
        if cid != "C4":
            assert f"| {cid} |" in claims_a
            row = next(line for line in claims_a.splitlines() if line.startswith(f"| {cid} |"))
            assert paper.NOT_MEASURED in row
    rep_a = (a / "reproduction.md").read_text().replace("source: results", "")
    rep_b = (b / "reproduction.md").read_text().replace("source: wandb", "")
    assert rep_a == rep_b
    assert "![C4 bytes](figures/C4_bytes.png)" in rep_a and "| odd | 0.333333 |" in rep_a
    assert (a / "figures" / "C4_bytes.png").read_bytes() == (b / "figures" / "C4_bytes.png").read_bytes()


def test_failed_runs_are_not_measured(isolated, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    with pytest.raises(RuntimeError):
        with start_run("C4", "ci", {}) as run:
            run.verdict(get_claim("C4").grade({"post_accounting_bytes": 1.4e12, "mixed_precision_bytes": 2.8e12},
                                              scale="x"))
            raise RuntimeError("late failure")
    assert paper.collect("ci") == {}
    out = paper.build("ci", paper_dir=isolated / "p")
    assert "| C4 |" in (out / "claims.md").read_text()
    assert list((out / "figures").glob("*.png")) == []


def test_unknown_source_or_profile():
    with pytest.raises(ConfigError, match="unknown source 'csv'"):
        paper.collect("ci", "csv")
    with pytest.raises(ConfigError, match="unknown profile 'tpu'"):
        paper.collect("tpu")
