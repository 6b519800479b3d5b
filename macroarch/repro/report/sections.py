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
from macroarch.repro.claims import (
    CLAIMS,
    CONTRADICTED,
    INCONCLUSIVE,
    NOT_REPRODUCED,
    NOT_TESTABLE,
    PARTIALLY,
    REPRODUCED,
    Claim,
    Target,
)
from macroarch.repro.report import metrics as M
from macroarch.repro.report import provenance, templates
from macroarch.repro.report import timings as T
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
    timings: dict | None = None  # the paper's timing record (data/timings.json), None where it has none
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
    short: str = ""  # ``how`` in a few words, for the summary table (exact count, 90% interval, n=4, modelled)


def estimate_basis(key: str, est: Mapping[str, Any]) -> Basis:
    """What one graded number of a verdict (``verdict["estimates"][key]``) is and how it was obtained."""
    unit = f" {est['unit']}" if est.get("unit") else ""
    lo, hi = est.get("low"), est.get("high")
    if est.get("kind", "measured") != "measured":
        how, short, decided = f"{est['kind']} ({est.get('method')})", str(est["kind"]), False
    elif est.get("method") == "exact count":
        how, short, decided = "exact count", "exact count", True
    elif lo is None:
        how, decided = f"no interval ({est.get('method')}, n={est.get('n')})", False
        short = f"no interval, n={est.get('n')}"
    else:
        conf = f"{est.get('confidence', DEFAULT_CONFIDENCE):.0%}"
        how = f"{conf} {est.get('method')}, n={est.get('n')}"
        short, decided = f"{conf} interval, n={est.get('n')}", est.get("grade") != INCONCLUSIVE
    text = _num(est["value"]) + (f" [{_num(lo)}, {_num(hi)}]" if lo is not None and lo != hi else "") + unit
    return Basis(key, text, how, est.get("grade", ""), decided, est.get("n_to_decide"), short)


def basis(r: Any, t: Target) -> Basis:
    est = ((r.verdict or {}).get("estimates") or {}).get(t.metric)
    if est:
        return estimate_basis(t.metric, est)
    v = r.metrics.get(t.metric)
    if v is None:
        return Basis(t.metric, "-", "not recorded", "", False, short="not recorded")
    value = v.get("value") if isinstance(v, Mapping) else v
    lo, hi = r.metrics.get(f"{t.metric}_lo"), r.metrics.get(f"{t.metric}_hi")
    if t.kind != "measured":
        return Basis(t.metric, _num(value), f"{t.kind}; no interval recorded", "", False, short=t.kind)
    if t.exact:
        return Basis(t.metric, _num(value), "exact count", "", True, short="exact count")
    if lo is not None and hi is not None:
        return Basis(t.metric, f"{_num(value)} [{_num(lo)}, {_num(hi)}]",
                     "interval of an old record (method and confidence not recorded)", "", False,
                     short="interval, method not recorded")
    return Basis(t.metric, _num(value), "no interval recorded", "", False, short="no interval recorded")


EXACT, ROBUST, POINT, UNDECIDED, UNTESTABLE = "exact", "robust", "point only", "undecided", "not testable here"


def _measured_estimates(r: Any) -> list[Mapping[str, Any]]:
    ests = (r.verdict or {}).get("estimates") or {}
    return [e for e in ests.values() if isinstance(e, Mapping) and e.get("kind", "measured") == "measured"]


def strength(r: Any) -> str:
    """How firmly the claim's grade stands, from what its verdict recorded:

    - ``exact``: every measured number it was graded on is an exact count;
    - ``robust``: graded on exact counts and intervals; the registry's rules combine them with
      :func:`~macroarch.repro.claims.settle`, so a decided grade holds wherever in its interval each number lies
      (an inconclusive number among them included);
    - ``point only``: a verdict that recorded no estimates (written before intervals were kept) was graded on
      points: noise level until repeated;
    - ``undecided`` (inconclusive) and ``not testable here`` as graded.

    The record is judged by the numbers its verdict was graded on, not by the registry's targets of today."""
    grade = (r.verdict or {}).get("grade")
    if grade == NOT_TESTABLE:
        return UNTESTABLE
    if grade == INCONCLUSIVE:
        return UNDECIDED
    measured = _measured_estimates(r)
    if not measured:
        return POINT
    return EXACT if all(e.get("method") == "exact count" for e in measured) else ROBUST


def rests_on(r: Any) -> str:
    """``exact counts``, ``intervals`` or ``exact counts and intervals``: the measured numbers a verdict rests on."""
    kinds = {"exact counts" if e.get("method") == "exact count" else "intervals" if e.get("low") is not None
             else "points" for e in _measured_estimates(r)}
    return " and ".join(k for k in ("exact counts", "intervals", "points") if k in kinds) or "no measured number"


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
    s = strength(r)
    if s in (EXACT, ROBUST):
        return f"**{grade}** (decided: {rests_on(r)})"
    return f"{grade} (resting on a point)" if s == POINT else grade


def _graded_cell(r: Any, claim: Claim) -> str:
    """Each target's number, the basis said once for a run of targets that share it (C11's six modelled
    speedups read ``a: 1.3 x; b: 1.2 x; ... (modelled)``)."""
    if r is None or r.state != "measured":
        return "-"
    runs: list[tuple[str, list[str]]] = []
    for b in (basis(r, t) for t in claim.targets):
        if runs and runs[-1][0] == b.short:
            runs[-1][1].append(f"{b.metric}: {b.text}")
        else:
            runs.append((b.short, [f"{b.metric}: {b.text}"]))
    return "; ".join("; ".join(items) + f" ({how})" for how, items in runs)


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
                caption="The verdicts. Bold: decided by exact counts or intervals, wherever in its interval each "
                        "number lies; not bold: resting on a point, inconclusive or not testable here."))
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


def _notebook_metadata(path: Path | None) -> dict:
    """An evidence notebook's ``metadata`` ({} where it cannot be read)."""
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))["metadata"]  # type: ignore[union-attr]
    except (AttributeError, OSError, ValueError, KeyError, TypeError):
        return {}
    return meta if isinstance(meta, dict) else {}


def _papermill_seconds(ctx: Context, notebook: str) -> float | None:
    meta = _notebook_metadata(ctx.paper / "evidence" / f"{notebook}.ipynb")
    try:
        return float(meta["papermill"]["duration"])
    except (KeyError, TypeError, ValueError):
        return None


def notebook_seconds(ctx: Context, notebook: str) -> tuple[float | None, str]:
    """What a notebook took when it measured the paper's records, and which record says so: the timing record
    (``data/timings.json``), else papermill's record in the evidence notebook; (None, "not recorded") else."""
    e = T.entry(ctx.timings, notebook)
    if T.seconds(e) is not None:
        return T.seconds(e), "timings.json"
    pm = _papermill_seconds(ctx, notebook)
    if pm is not None:
        return pm, "papermill's record"
    return None, "not recorded"


#: a machine as ``macroarch.measure.machine.describe`` writes it into a verdict's scale, for records that do not
#: carry their config's machine: ``AMD EPYC (AVX2, bf16 emulated)``, ``Intel(R) Xeon(R) ... (AVX512, native bf16)``
_SCALE_MACHINE = re.compile(r"((?:[^;:,()]|\((?:R|TM)\))+?) \(([A-Za-z0-9_]+), (native bf16|bf16 emulated)\)")


def machine_of(r: Any) -> dict[str, str]:
    """The machine and software a record was measured with: CPU, vector ISA, bf16, torch from the run's config
    (else the CPU as the verdict's scale names it), Python from its evidence notebook; "not recorded" where
    neither says."""
    m = dict(r.machine or {})
    out = {"cpu": str(m.get("cpu_model") or ""), "isa": str(m.get("cpu_capability") or ""),
           "bf16": "" if "native_bf16" not in m else ("native" if m["native_bf16"] else "emulated"),
           "torch": str(m.get("torch") or "")}
    if not out["cpu"]:
        found = _SCALE_MACHINE.findall((r.verdict or {}).get("scale", ""))
        if found:
            cpu, isa, bf16 = found[-1]
            out.update(cpu=re.sub(r"^(validated|measured) on ", "", cpu.strip()), isa=out["isa"] or isa,
                       bf16=out["bf16"] or bf16.replace(" bf16", "").replace("bf16 ", ""))
    out["python"] = str((_notebook_metadata(r.evidence).get("language_info") or {}).get("version") or "")
    return {k: v or "not recorded" for k, v in out.items()}


def typst_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("typst")
    except PackageNotFoundError:
        return "not installed"


def environment(ctx: Context) -> Section:
    s = _prose(Section(ENV), "environment", ctx)
    by_machine: dict[tuple[str, ...], list[str]] = {}
    for cid, r in ctx.records.items():
        if r.state == "measured":
            m = machine_of(r)
            by_machine.setdefault(tuple(m[k] for k in ("cpu", "isa", "bf16", "torch", "python")), []).append(cid)
    if by_machine:
        s.add(Table(("CPU", "Vector ISA", "bf16", "torch", "Python", "Claims"),
                    tuple((*k, ", ".join(cids)) for k, cids in by_machine.items()),
                    widths=(2.2, 0.9, 0.9, 1.4, 0.8, 2.6),
                    caption="The machine and software of each measured claim (the run's config; Python from its "
                            "evidence notebook)."))
    s.add(Para(f"This PDF was typeset by Typst {typst_version()} (the `typst` Python package); the Markdown "
               "version holds the same text."))
    t = ctx.timings
    if t:
        m = t.get("machine") or {}
        s.add(Para(f"The timing record (`data/{T.FILE}`, copied from the runner's `papermill_runs/out/"
                   f"{ctx.profile}/{T.FILE}`) of the run started {str(t.get('started') or '')[:19]} "
                   f"({t.get('status')}): {m.get('cpu_model', 'CPU not recorded')} "
                   f"({m.get('cpu_capability', 'vector ISA not recorded')}), {m.get('cpu_count', '?')} logical CPUs, "
                   f"{len(t.get('cores') or [])} cores used, Python {m.get('python', 'not recorded')}, torch "
                   f"{m.get('torch', 'not recorded')}; wall {_minutes(t.get('wall_seconds'))} with up to "
                   f"{t.get('jobs')} notebooks at a time. Each notebook's row below is the execution that measured "
                   "the claims shown in this paper."))
        rows = []
        for stem, e in (t.get("notebooks") or {}).items():
            comp = e.get("compile") or {}
            rows.append((stem, ", ".join(e.get("claims") or []), e.get("status", "-"),
                         str(e.get("started") or "-")[:16], _minutes(e.get("seconds")),
                         _minutes(e.get("budget_seconds")), ", ".join(map(str, e.get("cores") or [])) or "-",
                         T.beside_text(e),
                         f"{comp.get('compile_seconds', 0):.0f} s, {comp.get('compiles', 0)} kernels" if comp else "-"))
        s.add(Table(("Notebook", "Claims", "Status", "Started (UTC)", "Wall", "Budget", "Cores", "Ran",
                     "Compiling"), tuple(rows), widths=(2, 1.1, 0.7, 1.3, 0.8, 0.8, 0.6, 2, 1.1)))
    else:
        s.add(Para(f"This paper holds no timing record (`data/{T.FILE}`): it was built from runs the runner did "
                   "not time, or before the runner kept one. The wall times below are papermill's record in each "
                   "evidence notebook, and what ran beside each notebook is not recorded."))
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


def _strength_text(r: Any) -> str:
    """How the grade stands, for the text after the grade (nothing to add to inconclusive or not testable)."""
    s = strength(r)
    if s in (EXACT, ROBUST):
        return f"decided by {rests_on(r)}"
    return "resting on a point" if s == POINT else ""


def _beside_sentence(ctx: Context, r: Any) -> str:
    """Which notebooks shared the machine with the execution that measured ``r`` (from the timing record)."""
    e = T.entry(ctx.timings, r.notebook)
    if e is None or not T.holds(e, r.started):
        return (f"Not recorded: this paper holds no timing record of the execution of `{r.notebook}` that measured "
                "it, so what shared the machine with it cannot be told.")
    cores = ", ".join(map(str, e.get("cores") or [])) or "?"
    text = (f"Its notebook `{r.notebook}` ran {T.beside_text(e)}, on core(s) {cores}, in the execution started "
            f"{str(e.get('started'))[:19]} (timing record).")
    if e.get("beside"):
        text += (" A neighbour shares the memory bandwidth: a speed ratio timed side by side within one process is "
                 "slowed on both sides alike, an absolute time is not.")
    return text


def figure_caption(cid: str, name: str, r: Any, *, first: bool = True) -> str:
    """What a figure shows: the caption its run recorded (``figure_captions``: the figure's titles, axes and
    legend), else, under a claim's first figure, the claim's measurement in the registry's words (a record
    from before captions were kept)."""
    words = name.replace("_", " ")
    recorded = (getattr(r, "figure_captions", None) or {}).get(name)
    if recorded:
        return f"{cid}, {words}: {recorded}"
    if first:
        return f"{cid}, {words}: from the run that measured {CLAIMS[cid].measures}."
    return f"{cid}, {words}: from the same run (its titles and axes say what each panel shows)."


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
        s.add(Para(f"**Beside it.** {_beside_sentence(ctx, r)}"))
        for i, name in enumerate(sorted(r.figures)):
            s.add(Figure(f"figures/{cid}_{name}.png", f"{cid} {name}", figure_caption(cid, name, r, first=i == 0)))
        rows = []
        for t in claim.targets:
            b = basis(r, t)
            rows.append((f"`{t.metric}`", t.describe(), f"{t.region_text()}; band {t.band_text()}",
                         b.text, b.how, b.grade or "-"))
        s.add(Table(("Number", "The post", "Target", "Measured", "Basis", "Grade"), tuple(rows),
                    widths=(1.6, 2.4, 1.6, 1.6, 2, 0.9), caption="What the verdict rests on."))
        how = "; ".join(x for x in (_strength_text(r), f"leave-one-out: {stability(r)}") if x)
        s.add(Para(f"**Verdict: {v.get('grade')}** ({how}). {v.get('note') or ''}"))
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
    earlier = provenance.earlier(history or [], r.started, r.git_commit)
    if earlier:
        s.add(Table(("Committed", "Commit", "Grade", "Measured at"),
                    tuple((h.date, f"`{h.commit[:7]}`", h.grade, f"`{h.measured_at[:7]}`") for h in earlier),
                    widths=(1, 1, 1.5, 1), caption="Earlier committed grades (git log of its paper record; the "
                                                   "record shown here left out)."))
        now = (r.verdict or {}).get("grade") if r.state == "measured" else r.state
        steps = [(h.grade, h.date) for h in earlier] + [(now, "this record")]
        flips = [f"{a} -> {b} ({when})" for (a, _), (b, when) in zip(steps, steps[1:]) if a != b]
        s.add(Para("Grade changes: " + "; ".join(flips) + "." if flips else
                   "The grade is the same in every earlier committed record."))
    else:
        s.add(Para("Earlier committed grades: none (no earlier run of this claim was committed to this paper)."))
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


def _target_of(claim: Claim, key: str) -> Target | None:
    """The registry target a graded number belongs to: its own, or the one it is a cell of
    (``batch_growth_24gb`` of ``batch_growth``)."""
    cells = [t for t in claim.targets if key == t.metric or key.startswith(t.metric + "_")]
    return max(cells, key=lambda t: len(t.metric), default=None)


def _needs_text(est: Mapping[str, Any]) -> str:
    lo, hi = (list(est.get("target") or []) + [None, None])[:2]
    unit = f" {est['unit']}" if est.get("unit") else ""
    if lo is not None and hi is not None:
        return f"between {lo:.4g} and {hi:.4g}{unit}"
    if lo is not None:
        return f"at least {lo:.4g}{unit}"
    return f"at most {hi:.4g}{unit}" if hi is not None else "a target the record does not state"


def _miss_text(est: Mapping[str, Any]) -> str:
    """Where a number that missed its target lies, in words, from its interval (its value where it has none),
    the target and the no-effect band the verdict recorded beside it."""
    lo, hi = (list(est.get("target") or []) + [None, None])[:2]
    low = est.get("low") if est.get("low") is not None else est["value"]
    high = est.get("high") if est.get("high") is not None else est["value"]
    band = est.get("no_effect")
    if (lo is None or low >= lo) and (hi is None or high <= hi):
        return (f"inside the target, yet {est.get('grade')} by the claim's rule (see how each claim combines its "
                "targets, under Statistics)")
    if est.get("grade") == CONTRADICTED and band:
        return f"wholly on the far side of the no-effect band [{band[0]:.4g}, {band[1]:.4g}]: the opposite of the claim"
    if band and band[0] <= low and high <= band[1]:
        return f"inside the no-effect band [{band[0]:.4g}, {band[1]:.4g}]: no effect of the claimed kind"
    if hi is not None and low > hi:
        return "above the target"
    return "below the target" if lo is not None and high < lo else "outside the target"


def where_it_fails(r: Any, claim: Claim) -> str | None:
    """One paragraph, built from the verdict's graded numbers: for each target some number misses, what the
    post says, the numbers and where they lie; None where no number misses."""
    groups: dict[str, list[tuple[str, Mapping[str, Any]]]] = {}
    for key, est in ((r.verdict or {}).get("estimates") or {}).items():
        if isinstance(est, Mapping) and est.get("grade") in (CONTRADICTED, NOT_REPRODUCED):
            t = _target_of(claim, key)
            groups.setdefault(t.metric if t is not None else key, []).append((key, est))
    if not groups:
        return None
    parts = []
    for metric, cells in groups.items():
        t = next((t for t in claim.targets if t.metric == metric), None)
        post = f"the post's “{t.describe()}” needs {_needs_text(cells[0][1])}" if t is not None else \
            f"`{metric}` needs {_needs_text(cells[0][1])}"
        numbers = ", ".join(f"`{k}` {estimate_basis(k, e).text} ({estimate_basis(k, e).short})" for k, e in cells)
        where = {_miss_text(e) for _, e in cells}
        if len(where) == 1:
            parts.append(f"{post}: measured {numbers}, {'each ' if len(cells) > 1 else ''}{where.pop()}")
        else:
            parts.append(f"{post}: measured " + ", ".join(f"`{k}` {estimate_basis(k, e).text} "
                                                          f"({estimate_basis(k, e).short}), {_miss_text(e)}"
                                                          for k, e in cells))
    how = ", ".join(x for x in (r.verdict["grade"], _strength_text(r)) if x)
    return (f"**{claim.id}** ({how}; post section {claim.section}): "
            + "; ".join(parts) + ".")


def discussion(ctx: Context) -> Section:
    """The prose, then the claims grouped by how firmly their grade stands and which way it points, then where the
    post does not hold, each sentence built from the verdicts' graded numbers."""
    s = _prose(Section(DISCUSSION), "discussion", ctx)
    groups: dict[str, list[str]] = {}
    for cid in CLAIMS:
        r = ctx.measured(cid)
        if r is None:
            continue
        grade, st = r.verdict["grade"], strength(r)
        if st in (EXACT, ROBUST):
            key = {REPRODUCED: "for", PARTIALLY: "partly", NOT_REPRODUCED: "against", CONTRADICTED: "against"}[grade]
            groups.setdefault(key, []).append(f"{cid} {grade} ({rests_on(r)})")
        elif st == UNDECIDED:
            ests = (r.verdict.get("estimates") or {}).items()
            needs = [f"n = {e['n_to_decide']} would decide `{k}`" for k, e in ests
                     if isinstance(e, Mapping) and e.get("grade") == INCONCLUSIVE and e.get("n_to_decide")]
            groups.setdefault(st, []).append(f"{cid}" + (f" ({'; '.join(needs)})" if needs else ""))
        else:
            groups.setdefault(st, []).append(f"{cid} {grade}" if st == POINT else cid)
    for key, title in (("for", "Decided, for the post"), ("partly", "Decided, partly for the post"),
                       ("against", "Decided, against the post"),
                       (POINT, "Resting on a point (noise level until repeated)"), (UNDECIDED, "Inconclusive"),
                       (UNTESTABLE, "Not testable here")):
        if groups.get(key):
            s.add(Para(f"**{title}:** {', '.join(groups[key])}."))
    wrong = [text for cid, claim in CLAIMS.items()
             if (r := ctx.measured(cid)) is not None and strength(r) not in (UNDECIDED, UNTESTABLE)
             and (text := where_it_fails(r, claim)) is not None]
    if wrong:
        s.add(Para("**Where the post does not hold here**, number by number (a decided grade's numbers that miss "
                   "their targets):"), Bullets(tuple(wrong)))
    return s


def _expected(ctx: Context, notebook: str) -> str:
    """A rerun's expected time: what the notebook took when it measured this paper's rows, and what shared the
    machine then (a rerun alone may be faster)."""
    seconds, where = notebook_seconds(ctx, notebook)
    if seconds is None:
        return where
    if where == "timings.json":
        where += ", " + T.beside_text(T.entry(ctx.timings, notebook))
    return f"{_minutes(seconds)} ({where})"


def rerun(ctx: Context) -> Section:
    s = _prose(Section(RERUN), "rerun", ctx)
    rows = []
    for cid, claim in CLAIMS.items():
        seconds, where = notebook_seconds(ctx, claim.notebook)
        others = [c for c, k in CLAIMS.items() if k.notebook == claim.notebook and c != cid]
        rows.append((cid, f"`macroarch reproduce --profile {ctx.profile} --only {cid} --force`",
                     claim.notebook + (f" (also {', '.join(others)})" if others else ""),
                     _expected(ctx, claim.notebook)))
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
