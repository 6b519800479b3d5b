"""The report's sections, built from the paper's records, the registry, the profile, git and the timing record.

:func:`document` returns the whole :class:`~macroarch.repro.report.document.Document`; :data:`SECTIONS` is its
list of top-level headings, in order (the tests hold both outputs to it). Hand-written prose comes from
``templates/`` (placeholders only); every number comes from a record, the registry or the profile.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from macroarch.measure.stats import DEFAULT_CONFIDENCE, MIN_BOOTSTRAP_N
from macroarch.repro import claims as registry
from macroarch.repro.claims import CLAIMS, INCONCLUSIVE, NOT_TESTABLE, Claim, Target
from macroarch.repro.report import metrics as M
from macroarch.repro.report import provenance, templates
from macroarch.repro.report.document import Bullets, Code, Document, Figure, Para, Quote, Section, Table

SUMMARY, SOURCE, METHODS, DATA, HYPER, ENV, STATS, RESULTS = (
    "Summary", "The source and why it is hard to reproduce", "Methods", "Data sets",
    "Hyperparameters and baseline tuning", "Environment and cost", "Statistics", "Results by claim")
DISCUSSION, THREATS, RERUN, REFS, APPENDIX = (
    "Discussion", "Threats to validity", "How to rerun each row", "References", "Appendix: metrics by claim")
SECTIONS = (SUMMARY, SOURCE, METHODS, DATA, HYPER, ENV, STATS, RESULTS, DISCUSSION, THREATS, RERUN, REFS, APPENDIX)

REFERENCES = (
    ("ZeRO", "S. Rajbhandari, J. Rasley, O. Ruwase, Y. He. ZeRO: Memory Optimizations Toward Training Trillion "
             "Parameter Models. SC 2020.", "https://arxiv.org/abs/1910.02054"),
    ("DC-ASGD", "S. Zheng, Q. Meng, T. Wang, W. Chen, N. Yu, Z.-M. Ma, T.-Y. Liu. Asynchronous Stochastic Gradient "
                "Descent with Delay Compensation. ICML 2017.", "https://arxiv.org/abs/1609.08326"),
    ("HAWQ", "Z. Dong, Z. Yao, A. Gholami, M. W. Mahoney, K. Keutzer. HAWQ: Hessian AWare Quantization of Neural "
             "Networks with Mixed-Precision. ICCV 2019.", "https://arxiv.org/abs/1905.03696"),
    ("mHC", "Z. Xie et al. (DeepSeek-AI). mHC: Manifold-Constrained Hyper-Connections. 2025.",
     "https://arxiv.org/abs/2512.24880"),
    ("HC", "D. Zhu et al. Hyper-Connections. ICLR 2025.", "https://arxiv.org/abs/2409.19606"),
    ("Korthikanti et al.", "V. Korthikanti, J. Casper, S. Lym, L. McAfee, M. Andersch, M. Shoeybi, B. Catanzaro. "
                           "Reducing Activation Recomputation in Large Transformer Models. MLSys 2023.",
     "https://arxiv.org/abs/2205.05198"),
    ("Mixed precision", "P. Micikevicius et al. Mixed Precision Training. ICLR 2018.", "https://arxiv.org/abs/1710.03740"),
)

_STATES = ("measured", "failed", "interrupted", "running", "unreadable", "not yet measured")  # paper.STATES
_GRADE_ORDER = ("reproduced", "partially", "not reproduced", "contradicted", "inconclusive", "not testable here")


@dataclass
class Context:
    """What the sections read: the records (``paper.ClaimRecord`` by claim), where the paper is, git, timings."""

    records: Mapping[str, Any]
    profile: str
    paper: Path
    source: str
    repo: Path | None = None  # the repository whose HEAD the measured commits are compared with
    history: Path | None = None  # the committed paper folder whose data/<claim>.json history is shown
    timings: dict | None = None
    timings_path: Path | None = None
    jobs: list = field(default_factory=list)  # the profile's NotebookJobs ([] if it cannot be read)
    changes: dict[str, provenance.Changes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for commit in {provenance.plain_commit(r.git_commit) for r in self.records.values() if r.git_commit}:
            self.changes[commit] = provenance.changed_since(self.repo, commit)

    def measured(self, cid: str) -> Any | None:
        r = self.records.get(cid)
        return r if r is not None and r.state == "measured" else None


# --- per-claim pieces --------------------------------------------------------------------------------------

def _num(x: float | None, digits: int = 4) -> str:
    return "-" if x is None else f"{x:.{digits}g}"


@dataclass(frozen=True)
class Basis:
    """What a target's grade rests on, read from the verdict's estimates, else the record's metrics."""

    metric: str
    text: str  # value [low, high] unit
    how: str  # exact count / 90% interval, n=... / no interval recorded / modelled / looked up
    grade: str  # the target's own grade ("" where the record has none)
    decided: bool  # an exact count or an interval that decides it
    n_to_decide: int | None = None


def basis(r: Any, t: Target) -> Basis:
    est = ((r.verdict or {}).get("estimates") or {}).get(t.metric)
    if est:
        unit = f" {est['unit']}" if est.get("unit") else ""
        lo, hi = est.get("low"), est.get("high")
        if est.get("kind", "measured") != "measured":
            how = f"{est['kind']} ({est.get('method')})"
            decided = False
        elif est.get("method") == "exact count":
            how, decided = "exact count", True
        elif lo is None:
            how, decided = f"no interval ({est.get('method')}, n={est.get('n')})", False
        else:
            how = f"{est.get('confidence', DEFAULT_CONFIDENCE):.0%} {est.get('method')}, n={est.get('n')}"
            decided = est.get("grade") != INCONCLUSIVE
        text = _num(est["value"]) + (f" [{_num(lo)}, {_num(hi)}]" if lo is not None and lo != hi else "") + unit
        return Basis(t.metric, text, how, est.get("grade", ""), decided, est.get("n_to_decide"))
    v = r.metrics.get(t.metric)
    if v is None:
        return Basis(t.metric, "-", "not recorded", "", False)
    value = v.get("value") if isinstance(v, Mapping) else v
    lo, hi = r.metrics.get(f"{t.metric}_lo"), r.metrics.get(f"{t.metric}_hi")
    if t.kind != "measured":
        return Basis(t.metric, _num(value), f"{t.kind}; no interval recorded", "", False)
    if t.exact:
        return Basis(t.metric, _num(value), "exact count", "", True)
    if lo is not None and hi is not None:
        return Basis(t.metric, f"{_num(value)} [{_num(lo)}, {_num(hi)}]",
                     "interval of an old record (method and confidence not recorded)", "", False)
    return Basis(t.metric, _num(value), "no interval recorded", "", False)


def strength(r: Any, claim: Claim) -> str:
    """robust (every graded target decided by an exact count or an interval), noise level (some target rests
    on a point), or not testable."""
    grade = (r.verdict or {}).get("grade")
    if grade == NOT_TESTABLE:
        return "not testable here"
    if grade == INCONCLUSIVE:
        return "undecided"
    bs = [basis(r, t) for t in claim.targets]
    measured = [b for b, t in zip(bs, claim.targets) if t.kind == "measured"]
    if measured and all(b.decided for b in measured):
        return "robust"
    return "point only"


def stability(r: Any) -> str:
    """The leave-one-out mark: ``stable``, ``unstable (...)`` from a recorded check, else ``not checked``.

    A run records it with ``Run.leave_one_out`` (the record's ``stability``: the grade, the changes and the raw
    data); ``metrics["stability"]`` in the same form is read too."""
    s = getattr(r, "stability", None) if r is not None else None
    if not isinstance(s, Mapping):
        s = r.metrics.get("stability") if r is not None else None
    if not isinstance(s, Mapping) or "changes" not in s:
        return "not checked"
    changes = s.get("changes") or []
    if not changes:
        return "stable"
    return "unstable (" + ", ".join(f"without {c.get('group')} {c.get('index')}: {c.get('grade')}"
                                    for c in changes[:3]) + ("..." if len(changes) > 3 else "") + ")"


def _run_text(r: Any) -> str:
    commit = provenance.plain_commit(r.git_commit)[:7]
    dirty = "+dirty" if r.git_commit and r.git_commit.endswith("+dirty") else ""
    return ", ".join(s for s in (r.profile, (r.started or "")[:10], commit + dirty) if s)


def _evidence_links(r: Any, paper: Path) -> str:
    parts = []
    if r.evidence is not None:
        parts.append(f"[{r.evidence.name.removesuffix('.ipynb')}]({r.evidence.relative_to(paper).as_posix()})")
    if r.wandb_run:
        parts.append(f"W&B `{r.wandb_run}` (offline)")
    return ", ".join(parts) or "-"


def _grade_cell(r: Any, claim: Claim) -> str:
    if r is None:
        return "not yet measured"
    if r.state != "measured":
        return f"{r.state}: {r.error}" if r.state in ("failed", "unreadable") else r.state
    grade = r.verdict.get("grade")
    s = strength(r, claim)
    return f"**{grade}** ({s})" if s == "robust" else f"{grade} ({s})"


def _graded_cell(r: Any, claim: Claim) -> str:
    if r is None or r.state != "measured":
        return "-"
    return "; ".join(f"{b.metric}: {b.text} ({b.how})" for b in (basis(r, t) for t in claim.targets))


# --- sections ----------------------------------------------------------------------------------------------

def _context_values(ctx: Context) -> dict[str, str]:
    values = dict(templates.NAMES)
    for cid, c in CLAIMS.items():
        r = ctx.measured(cid)
        values.update({cid: cid, f"{cid}.statement": c.statement, f"{cid}.target": c.target_text,
                       f"{cid}.section": c.section, f"{cid}.grade": r.verdict["grade"] if r else "not yet measured"})
    values.update(confidence=f"{DEFAULT_CONFIDENCE:.0%}", min_bootstrap_n=str(MIN_BOOTSTRAP_N),
                  step_time_bound=f"{registry.STEP_TIME_MODEL_BOUND:.0%}", n_claims=str(len(CLAIMS) - 1),
                  profile=ctx.profile)
    return values


def _prose(section: Section, name: str, ctx: Context) -> Section:
    for heading, blocks in templates.blocks(name, _context_values(ctx)):
        if heading is None:
            section.add(*blocks)
        else:
            section.subsections.append(Section(heading, list(blocks)))
    return section


def header(ctx: Context) -> list:
    counts = {s: sum(r.state == s for r in ctx.records.values()) for s in _STATES}
    counts["not yet measured"] = len(CLAIMS) - len(ctx.records)
    states = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    lines = [Para(f"Profile `{ctx.profile}`; last built from: {ctx.source}; {states} (of {len(CLAIMS)} claims). "
                  "Every number below is read from a run; the prose around them holds no typed number.")]
    by_commit: dict[str, list[str]] = {}
    for cid, r in ctx.records.items():
        if r.git_commit:
            by_commit.setdefault(r.git_commit, []).append(cid)
    items = []
    for commit, cids in sorted(by_commit.items(), key=lambda kv: -len(kv[1])):
        ch = ctx.changes[provenance.plain_commit(commit)]
        dirty = " (a working tree with uncommitted changes)" if commit.endswith("+dirty") else ""
        where = f"HEAD is `{ch.head[:7]}`" if ch.head else "HEAD unknown"
        if ch.files is None:
            flagged = f"which code changed since cannot be told: {ch.why_unknown}"
        else:
            hit = [cid for cid in cids if ch.in_paths(provenance.CODE_PATHS[cid])]
            flagged = (f"{len(ch.files)} files changed since; the measured code paths changed for "
                       f"{', '.join(hit)}" if hit else f"{len(ch.files)} files changed since, none in the measured "
                       "code paths") if ch.files else "nothing changed since"
        items.append(f"Measured at commit `{provenance.plain_commit(commit)[:12]}`{dirty}: "
                     f"{', '.join(cids)}; {where}; {flagged}.")
    lines.append(Bullets(tuple(items)) if items else Para("No claim has a recorded commit."))
    return lines


def summary(ctx: Context) -> Section:
    s = _prose(Section(SUMMARY), "summary", ctx)
    rows = []
    for cid, claim in CLAIMS.items():
        r = ctx.records.get(cid)
        rows.append((f"[{cid}](#{_claim_slug(cid, r)})", claim.statement, _grade_cell(r, claim),
                     _graded_cell(r, claim), stability(r) if r is not None and r.state == "measured" else "-",
                     _run_text(r) if r else "-", _evidence_links(r, ctx.paper) if r else "-"))
    s.add(Table(("Claim", "Statement", "Verdict", "Graded number (interval, basis)", "Leave-one-out", "Run",
                 "Evidence"), tuple(rows), widths=(0.7, 3.2, 1.4, 2.8, 1.0, 1.2, 1.8),
                caption="The verdicts. Bold: robust (decided by exact counts or intervals clear of every boundary)."))
    grades = [r.verdict["grade"] for r in ctx.records.values() if r.state == "measured"]
    s.add(Para("Grades: " + ", ".join(f"{g} {grades.count(g)}" for g in _GRADE_ORDER if g in grades) + "."
               if grades else "No claim has been measured yet."))
    return s


def _claim_title(cid: str, r: Any) -> str:
    if r is None:
        return f"{cid}: not yet measured"
    return f"{cid}: {r.verdict.get('grade') if r.state == 'measured' else r.state}"


def _claim_slug(cid: str, r: Any) -> str:
    from macroarch.repro.report.document import slug

    return slug(_claim_title(cid, r))


def data_sets(ctx: Context) -> Section:
    from macroarch.data import ShapesSpec
    from macroarch.data import text as text_data
    from macroarch.data.applications import PointCloudSpec, ProteinSpec, VideoSpec

    s = _prose(Section(DATA), "datasets", ctx)
    rows = [("byte corpus", f"max_bytes={text_data.DEFAULT_MAX_BYTES:,}; vocabulary {text_data.BYTE_VOCAB_SIZE}",
             "train / val by a hash of each file's path", "`data_scripts/build_text_corpus.py`")]
    for name, spec, splits in (("rendered shapes", ShapesSpec, "train / val / heldout"),
                               ("proteins", ProteinSpec, "as the notebook draws them"),
                               ("point clouds", PointCloudSpec, "as the notebook draws them"),
                               ("videos", VideoSpec, "as the notebook draws them")):
        defaults = ", ".join(f"{f.name}={f.default}" for f in fields(spec)
                             if f.default is not MISSING and isinstance(f.default, (int, float, str)))
        script = "build_shapes.py" if spec is ShapesSpec else "build_application_data.py"
        rows.append((name, defaults, splits, f"`data_scripts/{script}`"))
    s.add(Table(("Data set", "Size and settings (defaults)", "Splits", "Built by"), tuple(rows),
                widths=(1.2, 4, 2, 2)))
    return s


def hyperparameters(ctx: Context) -> Section:
    s = _prose(Section(HYPER), "hyperparameters", ctx)
    if not ctx.jobs:
        s.add(Para(f"The profile `{ctx.profile}` could not be read here; its parameters are not listed."))
        return s
    for job in ctx.jobs:
        params = "; ".join(f"{k}={v}" for k, v in job.parameters.items()) or "(the notebook's defaults)"
        s.add(Para(f"**{job.stem}** ({', '.join(job.claims)}): `{params}`"))
    return s


def _elapsed(a: str | None, b: str | None) -> float | None:
    try:
        return (_dt.datetime.fromisoformat(b) - _dt.datetime.fromisoformat(a)).total_seconds()
    except (TypeError, ValueError):
        return None


def _minutes(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds / 60:.1f} min"


def _papermill_seconds(ctx: Context, notebook: str) -> float | None:
    p = ctx.paper / "evidence" / f"{notebook}.ipynb"
    try:
        return float(json.loads(p.read_text(encoding="utf-8"))["metadata"]["papermill"]["duration"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def notebook_seconds(ctx: Context, notebook: str) -> tuple[float | None, str]:
    """What a notebook took, and where that figure is from (timings.json, papermill, the budget)."""
    entry = ((ctx.timings or {}).get("notebooks") or {}).get(notebook) or {}
    if entry.get("status") == "skipped":
        entry = entry.get("earlier") or {}
    if isinstance(entry.get("seconds"), (int, float)):
        return float(entry["seconds"]), "timings.json"
    pm = _papermill_seconds(ctx, notebook)
    if pm is not None:
        return pm, "papermill (evidence notebook)"
    job = next((j for j in ctx.jobs if j.stem == notebook), None)
    if job is not None and job.budget:
        return float(job.budget), "the profile's budget"
    return None, "unknown"


def environment(ctx: Context) -> Section:
    s = _prose(Section(ENV), "environment", ctx)
    t = ctx.timings
    if t:
        m = t.get("machine") or {}
        s.add(Para(f"Timing record `{ctx.timings_path.name if ctx.timings_path else 'timings.json'}` of a run "
                   f"{t.get('status')} at {(t.get('finished') or t.get('started') or '')[:19]}: machine "
                   f"{m.get('cpu_model', '?')} ({m.get('cpu_capability', '?')}), {m.get('cpu_count', '?')} CPUs, "
                   f"{len(t.get('cores') or [])} cores used, torch {m.get('torch', '?')}; wall "
                   f"{_minutes(t.get('wall_seconds'))} with {t.get('jobs')} notebook(s) at a time."))
        rows = []
        for stem, e in (t.get("notebooks") or {}).items():
            e2 = e.get("earlier") if e.get("status") == "skipped" and e.get("earlier") else e
            comp = e2.get("compile") or {}
            rows.append((stem, ", ".join(e.get("claims") or []), e.get("status", "-"), _minutes(e2.get("seconds")),
                         _minutes(e2.get("budget_seconds")), ", ".join(map(str, e2.get("cores") or [])) or "-",
                         ", ".join(e2.get("beside") or []) or "-",
                         f"{comp.get('compile_seconds', 0):.0f} s, {comp.get('compiles', 0)} kernels" if comp else "-"))
        s.add(Table(("Notebook", "Claims", "Status", "Wall", "Budget", "Cores", "Beside", "Compiling"), tuple(rows),
                    widths=(2, 1.2, 1, 1, 1, 0.8, 2.2, 1.4)))
    else:
        s.add(Para(f"The timing record (`papermill_runs/out/{ctx.profile}/timings.json`) is absent from this "
                   "checkout, so the machine and the per-notebook wall times below come from the runs' own records "
                   "(the verdict's scale names the machine) and from papermill's record in each evidence notebook."))
    rows = []
    for cid, r in ctx.records.items():
        if r.state != "measured":
            continue
        seconds, where = notebook_seconds(ctx, r.notebook)
        rows.append((cid, r.notebook, (r.started or "")[:19], _minutes(_elapsed(r.started, r.finished)),
                     f"{_minutes(seconds)} ({where})"))
    if rows:
        s.add(Table(("Claim", "Notebook", "Started (UTC)", "This claim's run", "Its notebook"), tuple(rows),
                    widths=(0.6, 2, 1.8, 1.2, 2.4)))
    machines = sorted({m.strip() for r in ctx.records.values() if r.state == "measured"
                       for m in re.findall(r"[^;,]*(?:Processor|CPU)[^;,(]*\([^)]*\)", r.verdict.get("scale", ""))})
    if machines and not t:
        s.add(Para("The machine, as the verdicts' scales name it: " + "; ".join(machines) + "."))
    return s


def statistics(ctx: Context) -> Section:
    s = _prose(Section(STATS), "statistics", ctx)
    rows = []
    for cid, claim in CLAIMS.items():
        for t in claim.targets:
            rows.append((cid, f"`{t.metric}`", t.direction, t.region_text(), t.band_text(), f"{t.confidence:.0%}",
                         t.bare_number_text(), t.reason))
    s.add(Table(("Claim", "Metric", "Direction", "Target", "No effect", "Conf.", "A bare number is", "Why the band"),
                tuple(rows), widths=(0.6, 1.8, 0.9, 0.9, 0.9, 0.5, 1.8, 3.4), caption="The registry's targets."))
    reps = []
    for job in ctx.jobs:
        keys = {k: v for k, v in job.parameters.items()
                if any(w in k for w in ("seed", "repeat", "block", "trial", "rounds"))}
        if keys:
            reps.append(f"{job.stem}: " + ", ".join(f"{k}={v}" for k, v in keys.items()))
    if reps:
        s.add(Para("Repetitions the profile sets (seeds, timing blocks, repeats); notebooks not listed use their "
                   "parameters cell's defaults:"), Bullets(tuple(reps)))
    s.add(Para("How each claim combines its targets:"),
          Bullets(tuple(f"{cid}: {claim.grading_text.replace('``', '`')}" for cid, claim in CLAIMS.items())))
    return s


def _what_would_change(r: Any, claim: Claim) -> list[str]:
    out = []
    for t in claim.targets:
        b = basis(r, t)
        if t.kind != "measured":
            out.append(f"`{t.metric}` is {t.kind}: {t.tested_by} would test it.")
        elif b.how == "exact count":
            out.append(f"`{t.metric}` is an exact count: only a change of the model, the accounting or the code "
                       f"moves it (target {t.region_text()}, no-effect band {t.band_text()}).")
        elif b.grade == INCONCLUSIVE and b.n_to_decide:
            out.append(f"`{t.metric}` ({b.text}) crosses a boundary; n = {b.n_to_decide} repetitions would decide "
                       "it at this run's spread.")
        elif not b.decided:
            out.append(f"`{t.metric}` ({b.text}) has {b.how}: a repeated measurement with an interval "
                       f"(target {t.region_text()}, no-effect band {t.band_text()}) could move the grade either way.")
        else:
            out.append(f"`{t.metric}` ({b.text}) clears every boundary; an interval that reached "
                       f"{', '.join(f'{x:g}' for x in t.boundaries)} would change it.")
    return out


def claim_section(cid: str, ctx: Context) -> Section:
    claim, r = CLAIMS[cid], ctx.records.get(cid)
    s = Section(_claim_title(cid, r))
    s.add(Quote(f"{claim.statement} (post section {claim.section})"))
    if r is None:
        return s.add(Para(f"Not yet measured: run `macroarch reproduce --profile {ctx.profile} --only {cid}`."))
    s.add(Para(f"**What we measured.** {claim.measures}."))
    v = r.verdict or {}
    if r.state == "measured":
        s.add(Para(f"**Scale.** {v.get('scale')}"))
        for name in sorted(r.figures):
            s.add(Figure(f"figures/{cid}_{name}.png", f"{cid} {name}", f"{cid}: {name.replace('_', ' ')}."))
        rows = []
        for t in claim.targets:
            b = basis(r, t)
            rows.append((f"`{t.metric}`", t.describe(), f"{t.direction} {t.region_text()}; band {t.band_text()}",
                         b.text, b.how, b.grade or "-"))
        s.add(Table(("Number", "The post", "Target", "Measured", "Basis", "Grade"), tuple(rows),
                    widths=(1.6, 2.4, 1.6, 1.6, 2, 0.9), caption="What the verdict rests on."))
        s.add(Para(f"**Verdict: {v.get('grade')}** ({strength(r, claim)}; leave-one-out: {stability(r)}). "
                   f"{v.get('note') or ''}"))
        s.add(Para(f"**Measured.** {v.get('measured')}"))
        s.add(Para("**What would change it.**"), Bullets(tuple(_what_would_change(r, claim))))
    elif r.state == "failed":
        s.add(Para(f"**Failed.** {r.error}"))
    elif r.state == "unreadable":
        s.add(Para(f"**Unreadable.** The result file is not a result, so nothing of it is shown: {r.error}"))
    else:
        s.add(Para(f"**{r.state.capitalize()}.** The run did not finish; the row shows no number."))
    history = provenance.grade_history(ctx.repo, (ctx.history or ctx.paper) / "data" / f"{cid}.json") \
        if ctx.repo else None
    if history:
        s.add(Table(("Committed", "Commit", "Grade", "Measured at"),
                    tuple((h.date, f"`{h.commit[:7]}`", h.grade, f"`{h.measured_at[:7]}`") for h in history),
                    widths=(1, 1, 1.5, 1), caption="Earlier committed grades (git log of its paper record)."))
        flips = [f"{a.grade} -> {b.grade} ({b.date})" for a, b in zip(history, history[1:]) if a.grade != b.grade]
        s.add(Para("Grade changes: " + "; ".join(flips) + "." if flips else "The committed grade never changed."))
    else:
        s.add(Para("Earlier committed grades: none (this paper's record has no committed history)."))
    if r.git_commit:
        ch = ctx.changes[provenance.plain_commit(r.git_commit)]
        hit = ch.in_paths(provenance.CODE_PATHS[cid])
        if hit is None:
            s.add(Para(f"**Code since the measurement.** Cannot be told: {ch.why_unknown}."))
        elif hit:
            shown = ", ".join(f"`{f}`" for f in hit[:12]) + (f" and {len(hit) - 12} more" if len(hit) > 12 else "")
            s.add(Para(f"**Code since the measurement.** Changed in the measured paths since "
                       f"`{ch.commit[:7]}`: {shown}. The number may not be what HEAD measures."))
        else:
            s.add(Para(f"**Code since the measurement.** None of its measured paths changed since `{ch.commit[:7]}`."))
    s.add(Para(f"**Evidence.** {_evidence_links(r, ctx.paper)}; run: {_run_text(r)}."))
    if r.wandb_run:
        s.add(Para(f"The W&B run `{r.wandb_run}` is offline: its artifact `evidence-{cid}-{r.profile}` (result, "
                   f"figures, executed notebook) is on the machine that ran it, not in a clone; its files are "
                   f"committed here in `data/{cid}.json`, `figures/` and `evidence/`. To get the run itself, rerun "
                   f"the row (see How to rerun each row) or `wandb sync` its folder on that machine."))
    return s


def results(ctx: Context) -> Section:
    return Section(RESULTS, [Para("One section per claim, in the registry's order: the post's words, what was "
                                  "measured, the figures, the numbers the verdict rests on with their intervals, "
                                  "the verdict, what would change it, its earlier grades and its evidence. The "
                                  "full metric dumps are in the appendix.")],
                   [claim_section(cid, ctx) for cid in CLAIMS])


def discussion(ctx: Context) -> Section:
    s = _prose(Section(DISCUSSION), "discussion", ctx)
    groups: dict[str, list[str]] = {}
    for cid, claim in CLAIMS.items():
        r = ctx.measured(cid)
        if r is None:
            continue
        key = strength(r, claim)
        groups.setdefault(key, []).append(f"{cid} {r.verdict['grade']}")
    for key, title in (("robust", "Robust"), ("point only", "Resting on a point (noise level until repeated)"),
                       ("undecided", "Inconclusive"), ("not testable here", "Not testable here")):
        if groups.get(key):
            s.add(Para(f"**{title}:** {', '.join(groups[key])}."))
    wrong = [f"{cid}: {r.verdict.get('note') or r.verdict.get('measured')}" for cid in CLAIMS
             if (r := ctx.measured(cid)) is not None and r.verdict["grade"] in ("contradicted", "not reproduced")]
    if wrong:
        s.add(Para("**Where the post does not hold here:**"), Bullets(tuple(wrong)))
    return s


def rerun(ctx: Context) -> Section:
    s = _prose(Section(RERUN), "rerun", ctx)
    rows = []
    for cid, claim in CLAIMS.items():
        seconds, where = notebook_seconds(ctx, claim.notebook)
        others = [c for c, k in CLAIMS.items() if k.notebook == claim.notebook and c != cid]
        rows.append((cid, f"`macroarch reproduce --profile {ctx.profile} --only {cid} --force`",
                     claim.notebook + (f" (also {', '.join(others)})" if others else ""),
                     f"{_minutes(seconds)} ({where})"))
    s.add(Table(("Claim", "Command", "Notebook", "Expected time"), tuple(rows), widths=(0.5, 3.4, 2.4, 1.8)))
    s.add(Code(f"make reproduce            # every notebook of the {ctx.profile} profile, then the paper\n"
               "make paper                # reproduction.md and reproduction.pdf from the latest results"))
    return s


def references() -> Section:
    """The papers above, then the data sheets and whitepapers the hardware table reads (its own source list,
    ``macroarch.measure.hardware.SOURCES``, so the report cites what the model used)."""
    from macroarch.measure.hardware import SOURCES

    papers = tuple(f"**{key}**: {text} [{url}]({url})" for key, text, url in REFERENCES)
    sheets = tuple(f"**{key}**: {text}" for key, text in SOURCES.items() if key not in ("assumed", "measured"))
    return Section(REFS, [Bullets(papers), Para("Accelerator data sheets and whitepapers (the step-time model's "
                                                "sources, as `macroarch/measure/hardware.py` lists them):"),
                          Bullets(sheets)])


def appendix(ctx: Context) -> Section:
    s = Section(APPENDIX, [Para("Every metric each run recorded, grouped by the first word of its name, with the "
                                "unit its name states (bytes also in decimal GB; fractions also in percent). A "
                                "blank unit: the name states none.")])
    for cid in CLAIMS:
        r = ctx.measured(cid)
        if r is None or not r.metrics:
            continue
        sub = Section(f"{cid} metrics", anchor=f"{cid.lower()}-metrics")
        for group, names in M.groups(r.metrics):
            sub.add(Table(("Metric", "Value", "Unit"),
                          tuple((f"`{n}`", M.value_text(n, r.metrics[n]), M.unit_of(n) or "-") for n in names),
                          widths=(3, 3, 1.2), caption=f"{cid}, {group}"))
        s.subsections.append(sub)
    return s


def document(ctx: Context) -> Document:
    sections = [summary(ctx), _prose(Section(SOURCE), "source", ctx), _prose(Section(METHODS), "methods", ctx),
                data_sets(ctx), hyperparameters(ctx), environment(ctx), statistics(ctx), results(ctx),
                discussion(ctx), _prose(Section(THREATS), "threats", ctx), rerun(ctx), references(), appendix(ctx)]
    assert tuple(s.title for s in sections) == SECTIONS
    return Document("Reproduction report", header(ctx), sections)
