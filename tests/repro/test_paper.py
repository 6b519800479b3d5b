import json
import re
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest

from macroarch.config import ConfigError
from macroarch.repro import paper
from macroarch.repro.claims import CLAIMS, get_claim
from macroarch.repro.tracking import ResultFileError, result_path, start_run, write_json_atomic


def _record(profile, post_bytes, claim="C4"):
    with start_run(claim, profile, {"n": 1}) as run:
        run.summary(post_accounting_bytes=post_bytes, mixed_precision_bytes=2 * post_bytes, odd=1 / 3)
        run.log(step=0, loss=2.0)
        fig, ax = plt.subplots()
        ax.plot([0, 1], [post_bytes, 2 * post_bytes])
        ax.set(title="accounting", xlabel="variant", ylabel="bytes (B)")
        run.figure("bytes", fig)
        plt.close(fig)
        if claim == "C4":
            run.verdict(get_claim("C4").grade(run.metrics, scale="test scale", note="a | pipe"))
        else:
            run.verdict(grade="reproduced", measured=f"{post_bytes:g}", target="t", scale="test scale")


def _fail(profile, claim="C5"):
    with pytest.raises(RuntimeError):
        with start_run(claim, profile, {}):
            raise RuntimeError("late failure\nwith a second line")


def _row(paper_dir, cid):
    return next(line for line in (paper_dir / "claims.md").read_text().splitlines() if line.startswith(f"| {cid} |"))


def _links_resolve(paper_dir):
    from macroarch.repro.report.document import slug

    for md in ("claims.md", "reproduction.md"):
        text = (paper_dir / md).read_text()
        anchors = {slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}
        for link in re.findall(r"\]\(([^)]+)\)", text):
            if link.startswith("#"):
                assert link[1:] in anchors, f"{md} links {link}, which is no heading of it"
            elif "://" not in link:
                assert (paper_dir / link).is_file(), f"{md} links {link}, which does not exist"


def _figures_with_captions(monkeypatch):
    """Run.figure as it is to record each figure's caption (figure_captions), read off the figure."""
    from macroarch.repro import tracking
    from macroarch.repro.report.captions import describe_figure

    save = tracking.Run.figure

    def figure(self, name, fig, **kw):
        path = save(self, name, fig, **kw)
        self._data.setdefault("figure_captions", {})[name] = describe_figure(fig)
        self._flush()
        return path

    monkeypatch.setattr(tracking.Run, "figure", figure)


def test_results_and_wandb_give_the_same_paper(isolated, monkeypatch):
    _figures_with_captions(monkeypatch)
    _record("ci", 1.3e12)  # an older run, superseded below
    _record("ci", 1.397e12)
    _record("cpu", 1.0e12)  # another profile must not leak in
    _fail("ci")
    a = paper.build("ci", source="results", paper_dir=isolated / "a")
    b = paper.build("ci", source="wandb", paper_dir=isolated / "b", pdf=False)
    claims_a, claims_b = (a / "claims.md").read_text(), (b / "claims.md").read_text()
    assert claims_a == claims_b
    c4 = _row(a, "C4")
    assert "**partially**" in c4 and "test scale" in c4 and "W&B `" in c4
    assert "1.397e+12" in c4 and "a \\| pipe" not in c4  # the note lives in the report, not the table
    assert "**failed**: RuntimeError: late failure |" in _row(a, "C5")  # the error's first line
    for cid in CLAIMS:
        if cid not in ("C4", "C5"):
            assert paper.NOT_MEASURED in _row(a, cid)
    rep_a = (a / "reproduction.md").read_text().replace("last built from: results", "")
    rep_b = (b / "reproduction.md").read_text().replace("last built from: wandb", "")
    assert rep_a == rep_b
    assert "![C4 bytes](figures/C4_bytes.png)" in rep_a and "| `odd` | 0.333333 | - |" in rep_a  # the appendix
    assert "*C4, bytes: accounting: bytes (B) against variant.*" in rep_a  # the caption, from either source
    assert (a / "reproduction.pdf").stat().st_size > 0 and not (b / "reproduction.pdf").exists()
    assert (a / "figures" / "C4_bytes.png").read_bytes() == (b / "figures" / "C4_bytes.png").read_bytes()
    assert sorted(p.name for p in (a / "data").iterdir()) == ["C4.json", "C5.json"]


def test_every_state_is_shown_and_links_resolve(isolated, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    _record("ci", 1.4e12)
    _fail("ci", "C5")
    out = isolated / "out" / "ci"
    (out / "03_zero3_communication.failed.ipynb").write_text("{}")  # the runner's failed notebook
    base = {"schema": 1, "profile": "ci", "started": "2026-01-01T00:00:00+00:00", "config": {}, "metrics": {},
            "figures": [], "verdict": None, "wandb": None}
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    write_json_atomic(result_path("C6", "ci"), {**base, "claim": "C6", "status": "running",
                                                "pid": int(dead.stdout), "host": __import__("socket").gethostname()})
    write_json_atomic(result_path("C7", "ci"), {**base, "claim": "C7", "status": "running",
                                                "pid": __import__("os").getpid(),
                                                "host": __import__("socket").gethostname()})
    p = paper.build("ci", paper_dir=isolated / "p", pdf=False)
    assert "**failed**: RuntimeError: late failure" in _row(p, "C5")
    assert "[03_zero3_communication.failed](evidence/03_zero3_communication.failed.ipynb)" in _row(p, "C5")
    assert "**interrupted**" in _row(p, "C6")  # says running, but its process is gone
    assert "running since" in _row(p, "C7")
    assert paper.NOT_MEASURED in _row(p, "C8")
    _links_resolve(p)
    rep = (p / "reproduction.md").read_text()
    assert "1 measured, 1 failed, 1 interrupted, 1 running, 12 not yet measured" in rep


def test_a_run_of_some_claims_merges_into_the_paper(isolated, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    _record("ci", 1.4e12)
    _record("ci", 2e12, claim="C5")
    p = paper.build("ci", paper_dir=isolated / "p", pdf=False)
    c4_row, c4_png = _row(p, "C4"), (p / "figures" / "C4_bytes.png").read_bytes()
    # the results go away (a fresh clone, a clean-runs), then one claim is measured again
    import shutil

    shutil.rmtree(isolated / "out")
    _record("ci", 3e12, claim="C5")
    paper.build("ci", paper_dir=p, pdf=False)
    assert _row(p, "C4") == c4_row and (p / "figures" / "C4_bytes.png").read_bytes() == c4_png
    assert "3e+12" in _row(p, "C5") and "2e+12" not in _row(p, "C5")
    _links_resolve(p)
    # a failing rerun replaces the measured row: the latest run is what the paper shows
    _fail("ci", "C5")
    paper.build("ci", paper_dir=p, pdf=False)
    assert "**failed**" in _row(p, "C5") and not (p / "figures" / "C5_bytes.png").exists()


def test_which_profile_writes_where(isolated, monkeypatch):
    monkeypatch.setenv("MACROARCH_ROOT", str(isolated / "project"))
    assert paper.paper_folder("cpu") == isolated / "project" / "paper"
    assert paper.paper_folder("ci") == isolated / "out" / "ci" / "paper"


def test_wandb_source_without_runs_is_an_error_and_leaves_the_paper(isolated, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    _record("ci", 1.4e12)
    p = paper.build("ci", paper_dir=isolated / "p", pdf=False)
    before = {f: f.read_bytes() for f in p.rglob("*") if f.is_file()}
    with pytest.raises(ConfigError, match="no W&B runs of profile 'ci'"):
        paper.build("ci", source="wandb", paper_dir=p, pdf=False)
    assert {f: f.read_bytes() for f in p.rglob("*") if f.is_file()} == before


def test_malformed_result_is_named(isolated, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    path = result_path("C4", "ci")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(["not", "a", "result"]))
    with pytest.raises(ResultFileError, match="C4/result.json: malformed result file"):
        paper.collect("ci")


def test_unknown_source_or_profile():
    with pytest.raises(ConfigError, match="unknown source 'csv'"):
        paper.collect("ci", "csv")
    with pytest.raises(ConfigError, match="unknown profile 'tpu'"):
        paper.collect("tpu")
