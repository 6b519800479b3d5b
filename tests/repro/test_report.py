"""The report (macroarch.repro.report): its sections in both outputs, prose without typed numbers, the PDF's pages,
provenance against a real git history, and how a verdict's basis and stability are shown."""

import dataclasses
import datetime as _dt
import json
import re
import subprocess

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest

from macroarch.measure.stats import Repeated, paired_difference
from macroarch.repro import paper, report
from macroarch.repro.claims import CLAIMS, get_claim, regrade_leaving_out
from macroarch.repro.figures import MIN_PRINTED_PT, TEXT_WIDTH_IN, figure_problems
from macroarch.repro.report import captions, metrics, provenance, sections, templates
from macroarch.repro.report import timings as T
from macroarch.repro.tracking import read_result, result_path, start_run, write_json_atomic

FIG_IN, FIG_PT, DPI = (8.0, 4.0), 10.0, 150  # the test figure: its size, its text size, Run.figure's dpi


def _known_figure():
    """A two-panel figure of known size and text size, every axis labelled, the legend outside the axes."""
    with plt.rc_context({"font.size": FIG_PT}):
        fig, axes = plt.subplots(1, 2, figsize=FIG_IN, layout="constrained")
    for ax, title in zip(axes, ("bytes by category", "share of the peak")):
        ax.plot([0, 1, 2], [3, 1, 2], label="measured")
        ax.set(title=title, xlabel="depth (layers)", ylabel="memory (GB)")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center")
    assert figure_problems(fig) == []
    return fig


def _record_c4(profile="ci", post_bytes=1.397e12, figure=False):
    with start_run("C4", profile, {"n": 1}) as run:
        run.summary(post_accounting_bytes=post_bytes, mixed_precision_bytes=2 * post_bytes)
        if figure:
            fig = _known_figure()
            run.figure("bytes_by_category", fig)
            caption = captions.describe_figure(fig)
            plt.close(fig)
        run.verdict(get_claim("C4").grade(run.metrics, scale="test scale"))
    if figure:  # what Run.figure records once it keeps each figure's caption (figure_captions)
        r = read_result(result_path("C4", profile))
        write_json_atomic(result_path("C4", profile), {**r, "figure_captions": {"bytes_by_category": caption}})
        return caption
    return None


#: number words a template must not type (a count or a multiple belongs in a placeholder); "one" is left out, as
#: it is also a pronoun ("no one", "the one that"); "half-precision" is a number format's name, not a half
NUMBER_WORDS = re.compile(
    r"\b(?:two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|thirteen|fourteen|fifteen|sixteen|"
    r"seventeen|eighteen|nineteen|twenty|thirty|forty|fifty|sixty|seventy|eighty|ninety|hundreds?|thousands?|"
    r"millions?|billions?|dozens?|half(?![- ]precision)|halves|halved|twice|thrice|double[ds]?|triple[ds]?|"
    r"quadruple[ds]?|quarters?|(?:two|three|four|five|ten|hundred)fold)\b", re.IGNORECASE)


def _typed_numbers(text: str) -> list[str]:
    outside = templates.PLACEHOLDER.sub("", text)
    return [outside[max(m.start() - 20, 0):m.end() + 20] for p in (re.compile(r"\d"), NUMBER_WORDS)
            for m in p.finditer(outside)]


def test_the_typed_number_check_finds_digits_and_number_words():
    for typed in ("a 40% cut", "the two halves", "twice as fast", "ten seeds", "half the memory", "threefold"):
        assert _typed_numbers(typed), typed
    for fine in ("{C4} in {fp16}", "half-precision weights", "no one claims it", "one notebook", "often"):
        assert not _typed_numbers(fine), fine


def test_templates_hold_no_typed_number_and_every_placeholder_is_known():
    files = sorted(templates.TEMPLATES.glob("*.md"))
    assert {f.stem for f in files} >= {"summary", "source", "methods", "datasets", "hyperparameters", "environment",
                                       "statistics", "discussion", "threats", "rerun"}
    for f in files:
        typed = _typed_numbers(f.read_text())
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


def _pdf_images(path):
    """Every image placed in the PDF: (page index, placed width in points, pixel width)."""
    pdfium = pytest.importorskip("pypdfium2")
    from pypdfium2 import raw as pdfium_c

    doc = pdfium.PdfDocument(str(path))
    found = []
    for i in range(len(doc)):
        for obj in doc[i].get_objects(filter=[pdfium_c.FPDF_PAGEOBJ_IMAGE]):
            left, _, right, _ = obj.get_bounds()
            found.append((i, right - left, obj.get_px_size()[0]))
    return found


def test_markdown_and_pdf_hold_every_section_and_the_provenance_header(isolated, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    # the commit a run records, whether or not this checkout is a repository git will read (CI's copy, run as
    # another user, is not: git refuses a repository owned by someone else)
    monkeypatch.setattr("macroarch.repro.tracking.git_commit", lambda root=None: "1" * 40)
    caption = _record_c4(figure=True)
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

    # the figure: embedded once, at the text width, its text printed no smaller than the figures' floor, and
    # under a caption that says what it shows (read off the figure), not its file name
    images = _pdf_images(p / "reproduction.pdf")
    assert len(images) == 1, images
    _, placed_pt, pixels = images[0]
    assert placed_pt == pytest.approx(TEXT_WIDTH_IN * 72, abs=1.0)
    saved_in = pixels / DPI  # what bbox_inches="tight" kept, a little more or less than the figure's width
    assert FIG_IN[0] * 0.8 < saved_in < FIG_IN[0] * 1.2
    assert FIG_PT * placed_pt / 72 / saved_in >= MIN_PRINTED_PT
    assert "bytes by category: memory (GB) against depth (layers)" in caption
    assert f"C4, bytes by category: {caption}" in md
    assert "bytes by category: memory (GB) against depth (layers)" in full


def test_a_record_without_estimates_renders_as_no_interval_recorded(tmp_path):
    r = paper.ClaimRecord(claim="C1", profile="cpu", state="measured", notebook="05_mvas_llama",
                          verdict={"grade": "partially", "measured": "m", "target": "t", "scale": "s", "note": ""},
                          metrics={"memory_reduction": 0.6, "quality_gap": 0.0147})
    b_mem, b_gap = (sections.basis(r, t) for t in CLAIMS["C1"].targets)
    assert (b_mem.how, b_mem.decided) == ("exact count", True)  # the registry marks it exact
    assert (b_gap.how, b_gap.decided) == ("no interval recorded", False)
    assert sections.strength(r) == sections.POINT
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
    # the record shown now is not an earlier grade of itself
    assert provenance.earlier(history, "", measured + "+dirty") == [history[0]]
    assert provenance.earlier(history, "", "0" * 40) == [history[1]]


def _c4_record(**changes):
    verdict = get_claim("C4").grade({"post_accounting_bytes": 1.397e12, "mixed_precision_bytes": 2.794e12},
                                    scale="s").to_dict()
    return paper.ClaimRecord(**{"claim": "C4", "profile": "ci", "state": "measured", "notebook": "02_memory_wall",
                                "started": "2026-01-02T03:04:05+00:00", "finished": "2026-01-02T03:05:05+00:00",
                                "verdict": verdict, **changes})


def test_a_clean_checkout_does_not_list_the_shown_record_as_its_own_earlier_grade(tmp_path):
    repo = tmp_path / "repo"
    (repo / "paper" / "data").mkdir(parents=True)
    _git(repo, "init", "-q")
    older = _c4_record(started="2025-12-01T00:00:00+00:00", verdict={"grade": "reproduced"}, git_commit="0" * 40)
    (repo / "paper" / "data" / "C4.json").write_text(json.dumps(dataclasses.asdict(older)))
    _git(repo, "add", "-A")
    first = _git(repo, "commit", "-qm", "older run")
    shown = _c4_record(git_commit=first)
    (repo / "paper" / "data" / "C4.json").write_text(json.dumps(dataclasses.asdict(shown)))
    _git(repo, "add", "-A")
    second = _git(repo, "commit", "-qm", "the run the paper shows")
    ctx = sections.Context({"C4": shown}, "ci", repo / "paper", "results", repo=repo)
    text = report.to_markdown(report.Document("t", [], [sections.claim_section("C4", ctx)]))
    assert f"`{first[:7]}`" in text  # the older record's commit, in the table of earlier grades
    assert f"`{second[:7]}`" not in text  # the shown record's own commit is no earlier grade
    assert "Grade changes: reproduced -> partially (this record)." in text


def test_metric_units_and_groups():
    # names the audit found mislabelled: a difference of gradients, a reduction of one stack over another, a
    # standard error of an unnamed quantity
    assert metrics.unit_of("max_grad_error_vs_average") == "gradient units"
    assert metrics.unit_of("stack_over_checkpoint_reduction_256") == "fraction"
    assert metrics.unit_of("seed_standard_error") == ""
    assert metrics.unit_of("sync_overhead_bucketer8") == "fraction"
    assert metrics.unit_of("timing_blocks") == metrics.unit_of("grid_points") == "count"
    # and their neighbours keep theirs
    assert metrics.unit_of("variance_reduction_factor") == "x"
    assert metrics.unit_of("sweep_ddp_over_bucketer8") == "x"
    assert metrics.unit_of("post_ln_rate_stderr") == "log-growth per layer"
    assert metrics.unit_of("gradscaler_grad_rel_error") == "fraction"
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


# --- how firmly a grade stands, and which way it points ------------------------------------------------------

def _est(value, low, high, grade, *, method="paired t over seeds", kind="measured", n=4, target=(None, 0.1),
         band=(-0.1, 0.1), unit=""):
    return {"value": value, "low": low, "high": high, "confidence": 0.9, "n": n, "method": method, "kind": kind,
            "unit": unit, "grade": grade, "n_to_decide": None, "direction": "at least", "target": list(target),
            "no_effect": list(band) if band else None}


def _measured(cid, grade, estimates=None, note="", **fields):
    verdict = {"grade": grade, "measured": "m", "target": "t", "scale": "s", "note": note,
               "estimates": estimates or {}}
    return paper.ClaimRecord(**{"claim": cid, "profile": "ci", "state": "measured", "notebook": CLAIMS[cid].notebook,
                                "started": "2026-01-02T03:04:05+00:00", "verdict": verdict, **fields})


def _robust_negative():
    """C13 as the audit saw it: an exact count inside the no-effect band, the quality interval across a boundary,
    graded not reproduced whatever the quality turns out to be."""
    return _measured("C13", "not reproduced", {
        "batch_growth": _est(1.0, 1.0, 1.0, "not reproduced", method="exact count", n=1, target=(3.8, None),
                             band=(0.95, 1.05), unit="x"),
        "held_out_loss_change": _est(0.14, -0.08, 0.36, "inconclusive", target=(None, 0.05), band=(-0.05, 0.05))},
        note="RAW NOTE OF THE VERDICT")


def test_decided_grades_are_robust_for_or_against_and_a_point_is_noise():
    c4 = _c4_record()
    assert sections.strength(c4) == sections.EXACT and sections.rests_on(c4) == "exact counts"
    c13 = _robust_negative()
    assert sections.strength(c13) == sections.ROBUST and sections.rests_on(c13) == "exact counts and intervals"
    c7 = _measured("C7", "partially", {  # decided although one of its numbers is inconclusive
        "memory_reduction": _est(0.65, 0.65, 0.65, "reproduced", method="exact count", n=1),
        "speed_ratio": _est(0.6, 0.59, 0.61, "contradicted", n=192),
        "accuracy_gap": _est(0.0, -0.016, 0.015, "inconclusive")})
    assert sections.strength(c7) == sections.ROBUST
    point = _measured("C9", "reproduced")  # a record from before verdicts kept their estimates
    assert sections.strength(point) == sections.POINT
    assert sections.strength(_measured("C10", "inconclusive")) == sections.UNDECIDED
    assert sections.strength(_measured("C5", "not testable here")) == sections.UNTESTABLE

    ctx = sections.Context({"C13": c13, "C9": point, "C4": c4}, "ci", templates.TEMPLATES, "results")
    rows = {line.split("|")[1].strip(): line for line in report.to_markdown(
        report.Document("t", [], [sections.summary(ctx)])).splitlines() if line.startswith("| [C")}
    assert "**not reproduced** (decided: exact counts and intervals)" in rows["[C13](#c13-not-reproduced)"]
    assert "**partially** (decided: exact counts)" in rows["[C4](#c4-partially)"]
    assert "reproduced (resting on a point)" in rows["[C9](#c9-reproduced)"]
    assert "**reproduced" not in rows["[C9](#c9-reproduced)"]
    text = report.to_markdown(report.Document("t", [], [sections.discussion(ctx)]))
    assert "**Decided, against the post:** C13 not reproduced (exact counts and intervals)." in text
    assert "**Decided, partly for the post:** C4 partially (exact counts)." in text
    assert "**Resting on a point (noise level until repeated):** C9 reproduced." in text


def test_where_the_post_does_not_hold_is_prose_from_the_numbers_not_the_verdict_note():
    c13 = _robust_negative()
    ctx = sections.Context({"C13": c13}, "ci", templates.TEMPLATES, "results")
    text = report.to_markdown(report.Document("t", [], [sections.discussion(ctx)]))
    assert "RAW NOTE" not in text
    t = CLAIMS["C13"].targets[0]
    assert (f"the post's “{t.describe()}” needs at least 3.8 x: measured `batch_growth` 1 x (exact count), inside "
            "the no-effect band [0.95, 1.05]: no effect of the claimed kind") in text
    assert "held_out_loss_change" not in text.split("does not hold")[1]  # inconclusive: not a miss


def test_a_shared_basis_is_said_once_in_the_summary():
    method = "step-time model checked on some widths here: a long account of its validation"
    ests = {t.metric: _est(1.3, 1.2, 1.4, "not testable here", kind="modelled", method=method, unit="x")
            for t in CLAIMS["C11"].targets[:-1]}
    ests["ecc_disable_speedup"] = _est(1.0, None, None, "not testable here", kind="looked up", method="looked up")
    cell = sections._graded_cell(_measured("C11", "not testable here", ests), CLAIMS["C11"])
    assert method not in cell and cell.count("(modelled)") == 1 and cell.endswith("(looked up)")
    assert all(f"{t.metric}: 1.3 [1.2, 1.4] x" in cell for t in CLAIMS["C11"].targets[:-1])


# --- the timing record: what ran beside each notebook, the machine, the expected time ---------------------

def _timings(**notebooks):
    return {"schema": 1, "profile": "ci", "status": "complete", "started": "2026-01-02T03:00:00+00:00",
            "wall_seconds": 600.0, "jobs": 2, "cores": [0, 1],
            "machine": {"cpu_model": "AMD EPYC", "cpu_capability": "AVX2", "cpu_count": 2, "python": "3.11.7",
                        "torch": "2.9.1"}, "notebooks": notebooks}


def _entry(start, end, beside=(), exclusive=False, seconds=123.0, claims=()):
    return {"status": "ok", "claims": list(claims), "cores": [0], "exclusive": exclusive, "seconds": seconds,
            "budget_seconds": 300, "started": start, "finished": end, "beside": list(beside)}


def test_timings_merge_keeps_the_execution_each_record_came_from():
    rec = _c4_record()  # started 03:04:05
    inside = _entry("2026-01-02T03:04:00.500+00:00", "2026-01-02T03:06:00+00:00", beside=["04_dgr_variance"])
    before = _entry("2026-01-01T03:04:00+00:00", "2026-01-01T03:06:00+00:00")
    # the runner's record of a run that skipped the notebook carries the execution that measured it
    new = _timings(**{"02_memory_wall": {"status": "skipped", "earlier": inside}})
    merged = T.merge(None, new, {"C4": rec})
    assert merged["notebooks"] == {"02_memory_wall": inside} and merged["machine"]["cpu_model"] == "AMD EPYC"
    # an execution no record of the paper came from is left out; the stored copy serves where the run has none
    assert T.merge(None, _timings(**{"02_memory_wall": before}), {"C4": rec}) is None
    assert T.merge(merged, _timings(**{"02_memory_wall": before}), {"C4": rec})["notebooks"] == {
        "02_memory_wall": inside}
    assert T.beside_text(inside) == "beside 04_dgr_variance"
    assert T.beside_text({**inside, "beside": [], "exclusive": True}) == "alone (exclusive)"
    assert T.beside_text(None) == "not recorded"


def test_the_paper_keeps_the_timing_record_and_says_what_ran_beside(isolated, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    _record_c4()
    t0 = _dt.datetime.fromisoformat(read_result(result_path("C4", "ci"))["started"])

    def iso(seconds):  # a time relative to the C4 run's start
        return (t0 + _dt.timedelta(seconds=seconds)).isoformat()

    runner_timings = _timings(**{"02_memory_wall": _entry(iso(-2), iso(30), beside=["04_dgr_variance"],
                                                          seconds=150.0, claims=["C4"]),
                                 "07_comm_bucketing": _entry(iso(-100), iso(-50), exclusive=True)})
    write_json_atomic(isolated / "out" / "ci" / "timings.json", runner_timings)
    p = paper.build("ci", paper_dir=isolated / "p", pdf=False)
    kept = json.loads((p / "data" / "timings.json").read_text())
    assert list(kept["notebooks"]) == ["02_memory_wall"]  # 07 measured nothing this paper shows
    c4_row = next(row for row in (p / "claims.md").read_text().splitlines() if row.startswith("| C4"))
    assert "its notebook ran beside 04_dgr_variance" in c4_row

    # a clean checkout: the runner's folder is gone, the paper's copy still says it all
    (isolated / "out" / "ci" / "timings.json").unlink()
    paper.build("ci", paper_dir=p, pdf=False)
    assert json.loads((p / "data" / "timings.json").read_text()) == kept
    md = (p / "reproduction.md").read_text()
    env = md.split("## Environment and cost")[1].split("\n## ")[0]
    assert "AMD EPYC (AVX2), 2 logical CPUs" in env and "Python 3.11.7, torch 2.9.1" in env
    assert "| 02_memory_wall | C4 | ok |" in env and "beside 04_dgr_variance" in env
    assert f"Typst {sections.typst_version()}" in env
    c4 = md.split("### C4:")[1].split("\n### ")[0]
    assert "**Beside it.** Its notebook `02_memory_wall` ran beside 04_dgr_variance" in c4
    rerun = md.split("## How to rerun each row")[1].split("\n## ")[0]
    row = next(line for line in rerun.splitlines() if line.startswith("| C4 |"))
    assert "2.5 min (timings.json, beside 04_dgr_variance)" in row
    # without a timing record or an evidence notebook the time is not recorded: never the profile's budget
    other = next(line for line in rerun.splitlines() if line.startswith("| C6 |"))
    assert other.endswith("| not recorded |")

    # an exclusive notebook says so
    write_json_atomic(p / "data" / "timings.json", {**kept, "notebooks": {"02_memory_wall": {
        **kept["notebooks"]["02_memory_wall"], "beside": [], "exclusive": True}}})
    paper.build("ci", paper_dir=p, pdf=False)
    assert "its notebook ran alone (exclusive)" in (p / "claims.md").read_text()


def test_the_machine_and_versions_come_from_the_records():
    rec = _c4_record(machine={"cpu_model": "Intel(R) Xeon(R) Gold 6338 CPU @ 2.00GHz", "cpu_capability": "AVX512",
                              "native_bf16": False, "torch": "2.9.1"})
    m = sections.machine_of(rec)
    assert (m["cpu"], m["isa"], m["bf16"], m["torch"]) == ("Intel(R) Xeon(R) Gold 6338 CPU @ 2.00GHz", "AVX512",
                                                          "emulated", "2.9.1")
    # a record without its config's machine: the CPU as its verdict's scale names it (no "CPU" in the name)
    for scale, cpu, isa in (("4 seeds; AMD EPYC (AVX2, bf16 emulated), float32 compute", "AMD EPYC", "AVX2"),
                            ("validated on Intel(R) Xeon(R) Platinum 8480+ (AVX512, native bf16)",
                             "Intel(R) Xeon(R) Platinum 8480+", "AVX512")):
        old = _c4_record()
        old.verdict = {**old.verdict, "scale": scale}
        m = sections.machine_of(old)
        assert (m["cpu"], m["isa"], m["torch"]) == (cpu, isa, "not recorded")


def test_a_caption_says_what_the_figure_shows():
    fig = _known_figure()
    fig.suptitle("C4: memory at the step's peak")
    text = captions.describe_figure(fig)
    plt.close(fig)
    assert text == ("C4: memory at the step's peak. Panel 1: bytes by category: memory (GB) against depth (layers). "
                    "Panel 2: share of the peak: memory (GB) against depth (layers). Series: measured.")
    rec = _c4_record(figures={"a": None}, figure_captions={"a": text})
    assert sections.figure_caption("C4", "a", rec) == f"C4, a: {text}"
    # a record from before captions were kept: the registry's account of the measurement, not the file name
    assert CLAIMS["C4"].measures in sections.figure_caption("C4", "b", rec)


def test_a_tall_figure_and_its_caption_stay_above_the_page_number(tmp_path):
    """A figure taller than wide with a long caption ran into the footer over the page number (C6's, page 24 of the
    cpu paper): Typst cannot break a figure, so the image is given a height that leaves its caption room."""
    import pypdfium2 as pdfium

    from macroarch.repro.report.document import Document, Figure, Para, Section
    from macroarch.repro.report.typst import figure_layout

    fig, ax = plt.subplots(figsize=(7.8, 11.1))  # C6's shape (C9's and C14's are taller)
    ax.plot([0, 1], [0, 1])
    ax.set(xlabel="x (1)", ylabel="y (1)")
    (tmp_path / "figures").mkdir()
    fig.savefig(tmp_path / "figures" / "tall.png", dpi=60)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(8, 3))
    fig.savefig(tmp_path / "figures" / "wide.png", dpi=60)
    plt.close(fig)
    caption = "C6, variance: " + "Figure text, long as C6's. " * 30 + "END"
    assert figure_layout(tmp_path / "figures" / "wide.png", caption)[0] == "width: 100%"
    assert figure_layout(tmp_path / "nothing.png", caption)[0] == "width: 100%"  # unreadable: as before
    # the long description follows as a paragraph (it can break across pages): the image keeps most of its width
    size, short, after = figure_layout(tmp_path / "figures" / "tall.png", caption)
    assert (short, after) == ("C6, variance", caption.removeprefix("C6, variance: "))
    assert size == "width: 100%" or float(size.removeprefix("height: ").removesuffix("mm")) >= 225
    assert figure_layout(tmp_path / "figures" / "wide.png", caption)[1:] == (caption, "")

    doc = Document("T", [Para("head")], [Section("One", [Figure("figures/tall.png", "a tall figure", caption)])])
    pdf = pdfium.PdfDocument(report.write_pdf(doc, tmp_path, tmp_path / "t.pdf"))
    for page in pdf:
        text = page.get_textpage()
        words = text.get_text_range()
        if "END" not in words:
            continue
        end = words.index("END")
        caption_bottom = min(text.get_charbox(i)[1] for i in range(end, end + 3))
        number = words.rstrip().rsplit(None, 1)[-1]
        assert number.isdigit()
        at = words.rstrip().rindex(number)
        number_top = max(text.get_charbox(i)[3] for i in range(at, at + len(number)))
        assert caption_bottom > number_top  # PDF y grows upwards: the caption ends above the number
        break
    else:
        pytest.fail("the caption is not in the PDF")


# modules a harness imports that print or lay out but measure nothing
_NOT_MEASURING = {"macroarch/_progress.py", "macroarch/_table.py", "macroarch/paths.py", "macroarch/__init__.py"}


def test_each_claims_code_paths_hold_every_module_its_harness_imports():
    """The paper flags a claim whose measured code changed since its run by ``CODE_PATHS``; the notebooks that size
    full models moved onto ``macroarch.planner`` and the paths did not follow, so a planner change would have gone
    unflagged. Every macroarch module a claim's harness imports (at the top or inside a function) is in its paths."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]

    def module_file(name):
        parts = name.split(".")
        for k in range(len(parts), 0, -1):
            base = root.joinpath(*parts[:k])
            if base.with_suffix(".py").is_file():
                return base.with_suffix(".py").relative_to(root).as_posix()
            if (base / "__init__.py").is_file():
                return (base / "__init__.py").relative_to(root).as_posix()
        raise AssertionError(name)

    for cid, paths in provenance.CODE_PATHS.items():
        harness = next(p for p in paths if p.startswith("macroarch/experiments/") and p not in (
            "macroarch/experiments/loop.py", "macroarch/experiments/settings.py"))
        tree = ast.parse((root / harness).read_text())
        names = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
                 and n.module.startswith("macroarch")}
        names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
                  if a.name.startswith("macroarch")}
        missing = sorted({f for f in map(module_file, names) if f not in _NOT_MEASURING and not any(
            f == p or (p.endswith("/") and f.startswith(p)) for p in paths)})
        assert not missing, f"{cid}: {harness} imports {missing}, not in CODE_PATHS"
