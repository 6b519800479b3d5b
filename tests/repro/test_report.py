"""The report (macroarch.repro.report): its sections in both outputs, prose without typed numbers, the PDF's pages,
provenance against a real git history, and how a verdict's basis and stability are shown."""

import dataclasses
import json
import re
import subprocess

import pytest

from macroarch.measure.stats import Repeated, paired_difference
from macroarch.repro import paper, report
from macroarch.repro.claims import CLAIMS, get_claim, regrade_leaving_out
from macroarch.repro.report import metrics, provenance, sections, templates
from macroarch.repro.tracking import start_run


def _record_c4(profile="ci", post_bytes=1.397e12):
    with start_run("C4", profile, {"n": 1}) as run:
        run.summary(post_accounting_bytes=post_bytes, mixed_precision_bytes=2 * post_bytes)
        run.verdict(get_claim("C4").grade(run.metrics, scale="test scale"))


def test_templates_hold_no_typed_number_and_every_placeholder_is_known():
    files = sorted(templates.TEMPLATES.glob("*.md"))
    assert {f.stem for f in files} >= {"summary", "source", "methods", "datasets", "hyperparameters", "environment",
                                       "statistics", "discussion", "threats", "rerun"}
    for f in files:
        text = f.read_text()
        outside = templates.PLACEHOLDER.sub("", text)
        typed = re.findall(r".{0,20}\d.{0,20}", outside)
        assert not typed, f"{f.name} types a number outside a placeholder: {typed}"
    ctx = sections.Context({}, "ci", templates.TEMPLATES, "results")
    values = sections._context_values(ctx)
    for f in files:
        templates.blocks(f.stem, values)  # raises naming an unknown placeholder
    with pytest.raises(templates.TemplateError, match=r"template x: unknown placeholder \{nope\}"):
        templates.fill("x", "a {nope} b", values)


def _pdf_pages(path):
    pdfium = pytest.importorskip("pypdfium2")
    doc = pdfium.PdfDocument(str(path))
    texts = []
    for i in range(len(doc)):
        page = doc[i]
        bitmap = page.render(scale=0.5).to_numpy()
        assert bitmap.size and bitmap.min() < 128, f"page {i + 1} renders blank"
        texts.append(page.get_textpage().get_text_range())
    return texts


def test_markdown_and_pdf_hold_every_section_and_the_provenance_header(isolated, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    # the commit a run records, whether or not this checkout is a repository git will read (CI's copy, run as
    # another user, is not: git refuses a repository owned by someone else)
    monkeypatch.setattr("macroarch.repro.tracking.git_commit", lambda root=None: "1" * 40)
    _record_c4()
    p = paper.build("ci", paper_dir=isolated / "p")
    md = (p / "reproduction.md").read_text()
    headings = re.findall(r"^## (.+)$", md, flags=re.M)
    assert headings == ["Contents", *sections.SECTIONS]
    assert "Measured at commit `" in md.split("## Contents")[0]
    for cid in CLAIMS:
        assert re.search(rf"^### {cid}: ", md, flags=re.M), f"no section for {cid}"
    texts = _pdf_pages(p / "reproduction.pdf")
    assert len(texts) > 3
    raw = (p / "reproduction.pdf").read_bytes()
    fonts = set(re.findall(rb"/BaseFont\s*/(\w+)\+", raw))  # subset fonts: embedded ones carry a tag
    assert fonts and raw.count(b"/FontFile") >= len(fonts), "a font of the PDF is not embedded"
    full = re.sub(r"\s+", " ", " ".join(texts))
    assert "Measured at commit" in texts[0] and "Contents" in texts[0]
    for n, title in enumerate(sections.SECTIONS, 1):
        assert f"{n} {title}" in full, f"the PDF has no heading {n} {title!r}"
    # the C4 verdict and its exact basis appear in both
    assert "exact count" in md and "exact count" in full


def test_a_record_without_estimates_renders_as_no_interval_recorded(tmp_path):
    r = paper.ClaimRecord(claim="C1", profile="cpu", state="measured", notebook="05_mvas_llama",
                          verdict={"grade": "partially", "measured": "m", "target": "t", "scale": "s", "note": ""},
                          metrics={"memory_reduction": 0.6, "quality_gap": 0.0147})
    b_mem, b_gap = (sections.basis(r, t) for t in CLAIMS["C1"].targets)
    assert (b_mem.how, b_mem.decided) == ("exact count", True)  # the registry marks it exact
    assert (b_gap.how, b_gap.decided) == ("no interval recorded", False)
    assert sections.strength(r, CLAIMS["C1"]) == "point only"
    assert sections.stability(r) == "not checked"


def test_estimates_and_a_leave_one_out_check_are_shown():
    claim = get_claim("C1")
    base, tech = [0.50, 0.52, 0.49, 0.51, 0.50, 0.53], [0.50, 0.51, 0.49, 0.52, 0.50, 0.52]
    rep = Repeated(paired_difference, (base, tech))
    v = claim.grade({"memory_reduction": 0.6, "quality_gap": rep.estimate()}, scale="s")
    stab = regrade_leaving_out(claim, {"quality_gap": rep}, fixed={"memory_reduction": 0.6})
    r = paper.ClaimRecord(claim="C1", profile="cpu", state="measured", notebook="05_mvas_llama",
                          verdict=v.to_dict(), metrics={"stability": dataclasses.asdict(stab)})
    gap = sections.basis(r, claim.targets[1])
    est = v.estimates["quality_gap"]
    assert f"[{est['low']:.4g}, {est['high']:.4g}]" in gap.text
    assert gap.how.startswith("90% ") and f"n={len(base)}" in gap.how
    assert gap.grade == est["grade"]
    expected = "stable" if stab.stable else "unstable"
    assert sections.stability(r).startswith(expected)
    unstable = {"grade": "reproduced", "changes": [{"group": "seeds", "index": 2, "grade": "inconclusive"}]}
    r.metrics["stability"] = unstable
    assert sections.stability(r) == "unstable (without seeds 2: inconclusive)"


def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                   env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin"})
    return subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()


def test_provenance_flags_changed_paths_and_lists_earlier_grades(tmp_path):
    repo = tmp_path / "repo"
    (repo / "macroarch" / "experiments").mkdir(parents=True)
    (repo / "paper" / "data").mkdir(parents=True)
    harness = repo / "macroarch" / "experiments" / "memory_wall.py"
    record = repo / "paper" / "data" / "C4.json"
    harness.write_text("a = 1\n")
    _git(repo, "init", "-q")
    record.write_text(json.dumps({"verdict": {"grade": "reproduced"}, "git_commit": "0" * 40}))
    _git(repo, "add", "-A")
    measured = _git(repo, "commit", "-qm", "first")
    record.write_text(json.dumps({"verdict": {"grade": "partially"}, "git_commit": measured + "+dirty"}))
    harness.write_text("a = 2\n")
    _git(repo, "add", "-A")
    now = _git(repo, "commit", "-qm", "second")

    ch = provenance.changed_since(repo, measured)
    assert ch.head == now and set(ch.files) == {"macroarch/experiments/memory_wall.py", "paper/data/C4.json"}
    assert ch.in_paths(provenance.CODE_PATHS["C4"]) == ("macroarch/experiments/memory_wall.py",)
    assert ch.in_paths(provenance.CODE_PATHS["C9"]) == ()
    assert provenance.changed_since(repo, "f" * 40).files is None  # not in this clone: said, not guessed
    history = provenance.grade_history(repo, record)
    assert [h.grade for h in history] == ["reproduced", "partially"]
    assert history[1].measured_at == measured and history[1].commit == now
    assert provenance.grade_history(None, record) is None


def test_metric_units_and_groups():
    assert metrics.unit_of("measured_post_peak_bytes") == "bytes"
    assert metrics.unit_of("plain_w1_x0p5_eval_loss") == "nats"
    assert metrics.unit_of("best_lr_multiplier_lo") == "x"
    assert metrics.unit_of("memory_reduction_256") == "fraction"
    assert metrics.unit_of("max_frames_timesformer_24gb") == "frames"
    assert metrics.unit_of("bert_large_mean_grad_norm") == ""  # a name that states no unit gets none
    assert metrics.value_text("x_bytes", 2.5e9) == "2.5e+09 (2.50 GB)"
    groups = dict(metrics.groups({"a_x": 1, "a_y": 2, "b_z": 3}))
    assert groups == {"a": ["a_x", "a_y"], "other": ["b_z"]}


def test_pdf_of_the_same_document_holds_the_same_words(tmp_path):
    """Markdown and Typst render one Document: text with markup characters reaches the PDF verbatim."""
    from macroarch.repro.report.document import Document, Para, Section, Table

    odd = "a*b_c #d $e <f> @g [h] // i"
    doc = Document("T", [Para("head")], [Section("One", [Para(f"**bold** `code` {odd}"),
                                                          Table(("k", "v"), (("x_y", odd),))])])
    assert odd in report.to_markdown(doc)
    out = report.write_pdf(doc, tmp_path, tmp_path / "t.pdf")
    text = " ".join(_pdf_pages(out)).replace("\u200b", "")
    assert odd in text and "bold" in text and "1 One" in text
