"""The paper: every claim's latest run, as a verdict table (``claims.md``) and a report with figures.

Nothing here measures or recomputes: every number comes from a run, read from its ``result.json`` or from
the W&B run that carries the same config, metrics, verdict and evidence (read back offline). Both sources
give the same paper; a test holds them to it.

The paper never lies by omission. Each claim's row shows the real state of its latest run:

- ``measured``: the grade, the number measured, the scale;
- ``failed``: the first line of the error, and the failed notebook as evidence;
- ``interrupted``: the run says ``running`` but the process that measured it is gone (killed, Ctrl-C);
- ``running``: a run in progress right now;
- ``unreadable``: its ``result.json`` exists but is not a result (truncated, wrong value types); the row names
  the file and what is wrong, and every other claim is still built (``collect(..., unreadable=True)``, what
  ``macroarch paper`` does);
- ``not yet measured``: no run of this claim for this profile, ever.

Evidence is only what it claims to be: an executed notebook that is not a whole notebook (truncated, not JSON),
or a measured run's notebook that papermill did not record as ending cleanly, is not copied into ``evidence/``;
an :class:`EvidenceWarning` names it and the row links no notebook.

The report itself (``reproduction.md`` and ``reproduction.pdf``: summary, methods, statistics, one section
per claim, provenance, appendix) is built by :mod:`macroarch.repro.report` from the merged records.

A paper belongs to one profile. It keeps its own copy of what it shows: ``data/<claim>.json`` (the row's
record), ``data/timings.json`` (the runner's timing record of the executions its records come from), ``figures/``
and ``evidence/`` (the executed notebooks, so every evidence link resolves, in a clone too). Building it
*merges*: a claim whose run is newer than the paper's record replaces that record, every other row stays as it
was, so ``reproduce --only C4`` updates C4's row and nothing else. Only the ``cpu`` profile writes ``paper/``;
other profiles write ``papermill_runs/out/<profile>/paper/``, so a ``ci`` run never touches the committed paper.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from macroarch.config import ConfigError
from macroarch.paths import check_profile, out_root, project_root, wandb_root
from macroarch.repro import report
from macroarch.repro.claims import CLAIMS
from macroarch.repro.tracking import (
    COMPLETE,
    FAILED,
    INTERRUPTED,
    RUNNING,
    ResultFileError,
    notebook_problem,
    read_result,
    result_path,
    run_is_alive,
    write_json_atomic,
)

SOURCES = ("results", "wandb")
PAPER_PROFILE = "cpu"  # the profile whose paper is paper/ (committed)
MEASURED, UNREADABLE, NOT_MEASURED = "measured", "unreadable", "not yet measured"
STATES = (MEASURED, FAILED, INTERRUPTED, RUNNING, UNREADABLE, NOT_MEASURED)


class EvidenceWarning(UserWarning):
    """An executed notebook that cannot serve as evidence (the message names it and why); it was not copied."""


@dataclass
class ClaimRecord:
    """The latest run of one claim, whichever source it came from: what its row in the paper shows."""

    claim: str
    profile: str
    state: str  # one of STATES (never NOT_MEASURED: that is the absence of a record)
    notebook: str
    started: str | None = None
    finished: str | None = None
    git_commit: str | None = None
    verdict: dict[str, str] | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # the first line of the error of a failed run; what is wrong with an unreadable one
    figures: dict[str, Path] = field(default_factory=dict)  # name -> png
    evidence: Path | None = None  # the executed notebook
    wandb_run: str | None = None
    origin: str = ""  # where the record was read from (not rendered)
    stability: dict[str, Any] | None = None  # the run's leave-one-out check (Run.leave_one_out), raw data included
    machine: dict[str, Any] | None = None  # the run's config["machine"] (CPU model, vector ISA, torch)
    figure_captions: dict[str, str] = field(default_factory=dict)  # name -> what the figure shows, as the run said


def paper_folder(profile: str) -> Path:
    """``paper/`` for the cpu profile; ``papermill_runs/out/<profile>/paper/`` for the others."""
    check_profile(profile)
    return project_root() / "paper" if profile == PAPER_PROFILE else out_root() / profile / "paper"


def _first_line(text: Any) -> str:
    return (str(text).strip().splitlines() or [""])[0][:300]


def _evidence_file(state: str, notebook: str, profile: str, started: str | None, out: Path) -> Path | None:
    """The executed notebook of a run under the runner, if it is still there and not older than the run."""
    pdir = out / profile
    names = {MEASURED: [f"{notebook}.ipynb"], FAILED: [f"{notebook}.failed.ipynb", f"{notebook}.ipynb"],
             INTERRUPTED: [f".{notebook}.partial.ipynb", f"{notebook}.failed.ipynb"],
             RUNNING: [f".{notebook}.partial.ipynb"]}[state]
    for name in names:
        p = pdir / name
        # The runner deletes a notebook's files when it starts it again, so a partial one is this run's (saved
        # when its current cell started: before the run did); a finished one is newer than the run it holds.
        if p.is_file() and (started is None or name.startswith(".") or _mtime_iso(p) >= started[:19]):
            return p
    return None


def _mtime_iso(path: Path) -> str:
    import datetime as _dt

    return _dt.datetime.fromtimestamp(path.stat().st_mtime, _dt.UTC).isoformat(timespec="seconds")[:19]


def record_from_result(r: Mapping[str, Any], path: Path, out: Path | None = None) -> ClaimRecord:
    """A result file's run as a paper record (its state decided from status, verdict and process)."""
    out = out or out_root()
    claim, profile = r.get("claim"), r.get("profile")
    status = r.get("status")
    if status == COMPLETE and r.get("verdict"):
        state = MEASURED
    elif status == RUNNING:
        state = RUNNING if run_is_alive(r) else INTERRUPTED
    elif status == INTERRUPTED:
        state = INTERRUPTED
    else:
        state = FAILED
    err = r.get("error") or {}
    error = None
    if state == FAILED:
        error = _first_line(f"{err.get('type', 'Error')}: {err.get('message', '')}") if err else \
            "the run ended without a complete result"
    notebook = r.get("notebook") or CLAIMS[claim].notebook
    figures = {n: path.parent / f"{n}.png" for n in r.get("figures", [])}
    return ClaimRecord(
        claim=claim, profile=profile, state=state, notebook=notebook, started=r.get("started"),
        finished=r.get("finished"), git_commit=r.get("git_commit"),
        verdict=r.get("verdict") if state == MEASURED else None,
        metrics=dict(r.get("metrics") or {}) if state == MEASURED else {}, error=error,
        figures={n: p for n, p in figures.items() if p.is_file()} if state == MEASURED else {},
        evidence=_evidence_file(state, notebook, profile, r.get("started"), out),
        wandb_run=(r.get("wandb") or {}).get("id"), origin=str(path),
        stability=r.get("stability") if state == MEASURED else None, machine=_machine(r.get("config")),
        figure_captions=_captions(r) if state == MEASURED else {})


def _machine(config: Any) -> dict[str, Any] | None:
    m = config.get("machine") if isinstance(config, Mapping) else None
    return dict(m) if isinstance(m, Mapping) else None


def _captions(result: Mapping[str, Any]) -> dict[str, str]:
    """A result's ``figure_captions`` (name -> text), its figures' only; {} where it records none."""
    found = result.get("figure_captions")
    if not isinstance(found, Mapping):
        return {}
    return {n: c for n, c in found.items() if isinstance(c, str) and c.strip() and n in result.get("figures", [])}


def from_results(profile: str, out: Path | None = None, *, unreadable: bool = False) -> dict[str, ClaimRecord]:
    """The latest run of each claim of ``profile`` from ``papermill_runs/out/<profile>/<claim>/result.json``.
    A result file that is not one (:func:`~macroarch.repro.tracking.read_result`'s checks, or another claim's or
    profile's) raises :class:`ResultFileError` naming it; with ``unreadable`` it becomes that claim's
    ``unreadable`` record instead (its ``error`` the same one line), so the other claims are still built."""
    out = out or out_root()
    found = {}
    for claim in CLAIMS:
        path = result_path(claim, profile, out)
        try:
            try:
                r = read_result(path)
            except FileNotFoundError:
                continue
            except OSError as e:
                raise ResultFileError(f"{path}: cannot read ({e.strerror})") from None
            if r.get("claim") != claim or r.get("profile") != profile:
                raise ResultFileError(f"{path}: holds claim {r.get('claim')!r} of profile {r.get('profile')!r}")
        except ResultFileError as e:
            if not unreadable:
                raise
            found[claim] = unreadable_record(claim, profile, str(e), path)
            continue
        found[claim] = record_from_result(r, path, out)
    return found


def unreadable_record(claim: str, profile: str, message: str, path: Path) -> ClaimRecord:
    """The record of a claim whose result file is not a result: ``message`` (one line, naming the file) says why."""
    return ClaimRecord(claim=claim, profile=profile, state=UNREADABLE, notebook=CLAIMS[claim].notebook,
                       error=_first_line(message), origin=str(path))


def from_wandb(profile: str, wandb_dir: Path | None = None) -> dict[str, ClaimRecord]:
    """The latest W&B run of each claim of ``profile``, read back from the offline runs."""
    from macroarch.repro.wandb_offline import find_offline_runs
    from macroarch.repro.wandb_sidecar import ARTIFACT_TYPE, plain_name

    root = wandb_dir or wandb_root()
    try:
        runs = find_offline_runs(root)
    except FileNotFoundError:
        runs = []
    found: dict[str, ClaimRecord] = {}
    for run in runs:  # oldest first: later runs win
        claim, run_profile = run.config.get("claim"), run.config.get("profile")
        if claim not in CLAIMS or run_profile != profile:
            continue
        status = run.summary.get("status")
        verdict = run.summary.get("verdict")
        if status == COMPLETE and isinstance(verdict, Mapping):
            state = MEASURED
        elif status == FAILED:
            state = FAILED
        else:  # no status, or the sidecar saw the measuring process end without finishing the run
            state = INTERRUPTED
        files: dict[str, Path] = {}
        for art in run.artifacts:
            if art.type == ARTIFACT_TYPE:
                files = {name: p for name, p in art.files.items() if p.is_file()}
        notebook = CLAIMS[claim].notebook
        evidence = next((files[n] for n in (f"{notebook}.ipynb", f"{notebook}.failed.ipynb") if n in files), None)
        metrics = {}
        if state == MEASURED:
            metrics = {name: v for k, v in run.summary.items() if (name := plain_name(claim, k)) is not None}
        figures = {n.removesuffix(".png"): p for n, p in files.items() if n.endswith(".png")} \
            if state == MEASURED else {}
        captions = {}
        if state == MEASURED and "result.json" in files:  # the evidence artifact holds the result file
            with contextlib.suppress(OSError, ResultFileError):
                captions = _captions(read_result(files["result.json"]))
        found[claim] = ClaimRecord(
            claim=claim, profile=profile, state=state, notebook=notebook,
            started=run.summary.get("started"), finished=run.summary.get("finished"),
            git_commit=run.config.get("git_commit"),
            verdict=dict(verdict) if state == MEASURED else None, metrics=metrics,
            error=_first_line(run.summary.get("error") or "the run ended without a complete result")
            if state == FAILED else None,
            figures=figures, evidence=evidence, wandb_run=run.run_id, origin=str(run.directory),
            stability=dict(s) if state == MEASURED and isinstance(s := run.summary.get("stability"), Mapping)
            else None, machine=_machine(run.config), figure_captions=captions)
    return found


def collect(profile: str, source: str = "results", *, unreadable: bool = False) -> dict[str, ClaimRecord]:
    """The latest record of each claim of ``profile`` from ``source``; ``unreadable``: see :func:`from_results`."""
    check_profile(profile)
    if source == "results":
        return from_results(profile, unreadable=unreadable)
    if source == "wandb":
        found = from_wandb(profile)
        if not found:
            raise ConfigError(f"no W&B runs of profile {profile!r} under {wandb_root() / 'wandb'}; "
                              f"the paper was left as it was")
        return found
    raise ConfigError(f"unknown source {source!r}; expected one of {', '.join(SOURCES)}")


# --- the paper's own records ------------------------------------------------------------------------------

def load_records(paper: Path) -> dict[str, ClaimRecord]:
    """The records a paper folder holds (``data/<claim>.json``), paths resolved inside the folder."""
    records = {}
    for cid in CLAIMS:
        p = paper / "data" / f"{cid}.json"
        if not p.is_file():
            continue
        try:
            d = json.loads(p.read_text(encoding="utf-8"))
            d["figures"] = {n: paper / "figures" / f"{cid}_{n}.png" for n in d.get("figures", [])}
            d["evidence"] = paper / d["evidence"] if d.get("evidence") else None
            records[cid] = ClaimRecord(**d)
        except (ValueError, TypeError, KeyError) as e:
            raise ResultFileError(f"{p}: malformed paper record ({e})") from None
    return records


def merge(stored: Mapping[str, ClaimRecord], new: Mapping[str, ClaimRecord]) -> dict[str, ClaimRecord]:
    """Stored records, each replaced by the new run of its claim unless that run is older. An unreadable result
    always replaces the stored record: the claim's latest run cannot be read, and the paper must not show an
    older one as if it were the latest."""
    merged = dict(stored)
    for cid, r in new.items():
        old = stored.get(cid)
        if old is None or r.state == UNREADABLE or (r.started or "") >= (old.started or ""):
            merged[cid] = r
    return merged


def _store(records: Mapping[str, ClaimRecord], paper: Path) -> dict[str, ClaimRecord]:
    """Copy each record's figures and evidence into ``paper`` and write its ``data/<claim>.json``; the
    records returned point at the copies. Files no record points at any more are removed."""
    figures, evidence, data = paper / "figures", paper / "evidence", paper / "data"
    for d in (figures, evidence, data):
        d.mkdir(parents=True, exist_ok=True)
    kept: dict[str, ClaimRecord] = {}
    for cid, r in records.items():
        r = ClaimRecord(**{**asdict(r), "figures": dict(r.figures)})
        figs = {}
        for name, png in sorted(r.figures.items()):
            dst = figures / f"{cid}_{name}.png"
            if png.resolve() != dst.resolve():
                _copy(png, dst)
            figs[name] = dst
        r.figures = figs
        if r.evidence is not None and (problem := notebook_problem(r.evidence, complete=r.state == MEASURED)):
            warnings.warn(EvidenceWarning(f"{r.evidence}: not copied as evidence of {cid} ({problem})"), stacklevel=2)
            r.evidence = None
        if r.evidence is not None:
            suffix = {MEASURED: "", FAILED: ".failed", INTERRUPTED: ".interrupted", RUNNING: ".running",
                      UNREADABLE: ".unreadable"}[r.state]
            dst = evidence / f"{r.notebook}{suffix}.ipynb"
            if r.evidence.resolve() != dst.resolve():
                _copy(r.evidence, dst)
            r.evidence = dst
        kept[cid] = r
        d = {**asdict(r), "figures": sorted(figs), "origin": "",
             "evidence": str(r.evidence.relative_to(paper)) if r.evidence else None}
        write_json_atomic(data / f"{cid}.json", d)
    used = {p.resolve() for r in kept.values() for p in [*r.figures.values(), r.evidence] if p is not None}
    for folder, pattern in ((figures, "*.png"), (evidence, "*.ipynb"), (data, "*.json")):
        for p in folder.glob(pattern):
            if folder is data:
                if p.stem not in kept and p.name != report.timings.FILE:
                    p.unlink()
            elif p.resolve() not in used:
                p.unlink()
    return kept


def _copy(src: Path, dst: Path) -> None:
    """Copy ``src`` over ``dst`` in one step; a failed copy (a full disk) leaves no ``.partial`` file and raises an
    ``OSError`` naming ``dst``."""
    tmp = dst.with_name(f".{dst.name}.partial")
    _replacing(dst, tmp, lambda: shutil.copyfile(src, tmp))


# --- rendering ----------------------------------------------------------------------------------------

def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ").strip() or "-"


def _evidence(r: ClaimRecord, paper: Path) -> str:
    parts = []
    if r.evidence is not None:
        parts.append(f"[{r.evidence.name.removesuffix('.ipynb')}]({r.evidence.relative_to(paper).as_posix()})")
    if r.wandb_run:
        parts.append(f"W&B `{r.wandb_run}`")
    return ", ".join(parts) or "-"


def _run_text(r: ClaimRecord) -> str:
    commit = (r.git_commit or "").split("+")[0][:7]
    dirty = "+dirty" if r.git_commit and r.git_commit.endswith("+dirty") else ""
    return ", ".join(s for s in (r.profile, (r.started or "")[:10], commit + dirty) if s)


def _verdict_text(r: ClaimRecord | None) -> str:
    if r is None:
        return NOT_MEASURED
    if r.state == MEASURED:
        changes = (r.stability or {}).get("changes") if isinstance(r.stability, Mapping) else None
        unstable = f" (unstable: {len(changes)} left-out repetition(s) change it)" if changes else ""
        return f"**{r.verdict.get('grade')}**{unstable}"
    if r.state == FAILED:
        return f"**failed**: {r.error}"
    if r.state == INTERRUPTED:
        return "**interrupted**: the run was stopped before it finished"
    if r.state == UNREADABLE:
        return f"**unreadable**: {r.error}"
    return f"running since {r.started}"


def claims_table(records: Mapping[str, ClaimRecord], paper: Path, timings: Mapping[str, Any] | None = None) -> str:
    """The verdict table, one row per claim of the registry, in registry order. With the paper's timing record
    (``timings``), each measured row's scale says what ran beside its notebook (``ran alone (exclusive)``)."""
    head = ("Claim", "Statement", "Target", "Measured", "Scale", "Run", "Verdict", "Evidence")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cid, claim in CLAIMS.items():
        r = records.get(cid)
        v = (r.verdict or {}) if r else {}
        scale = v.get("scale", "-")
        if r is not None and r.state == MEASURED and timings is not None:
            scale += f"; its notebook ran {report.timings.beside_text(report.timings.entry(timings, r.notebook))}"
        row = (cid, claim.statement, v.get("target") or claim.target_text, v.get("measured", "-"),
               scale, _run_text(r) if r else "-", _verdict_text(r), _evidence(r, paper) if r else "-")
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    return "\n".join(lines) + "\n"


def build(profile: str = PAPER_PROFILE, *, source: str = "results", paper_dir: Path | None = None,
          records: Mapping[str, ClaimRecord] | None = None, pdf: bool = True, timings: Path | None = None) -> Path:
    """Merge the latest runs of ``profile`` (from ``source``) into its paper and render it; returns the folder.

    Writes ``claims.md``, ``reproduction.md`` and (``pdf``) ``reproduction.pdf`` (see
    :mod:`macroarch.repro.report`), and ``data/timings.json``: the runner's timing record (``timings``, default
    :func:`run_timings_path`) merged into the paper's copy (:func:`macroarch.repro.report.timings.merge`), so a
    clone without ``papermill_runs/out`` still states the machine, the wall times and what ran beside what.
    Everything is read before anything is written: a source that fails (no W&B runs, a malformed result file)
    leaves the paper as it was."""
    records = collect(profile, source) if records is None else records
    paper = paper_dir or paper_folder(profile)
    stored = load_records(paper) if (paper / "data").is_dir() else {}
    kept = report.timings.read(paper / "data" / report.timings.FILE)
    ran = report.timings.read(timings or run_timings_path(profile, paper))
    merged = _store(merge(stored, records), paper)
    times = report.timings.merge(kept, ran, merged)
    if times is not None:
        write_json_atomic(paper / "data" / report.timings.FILE, times)
    else:
        (paper / "data" / report.timings.FILE).unlink(missing_ok=True)
    write_text(paper / "claims.md", f"# Claims and verdicts (profile `{profile}`)\n\n" +
               claims_table(merged, paper, times))
    report.write(report.context(merged, profile, paper, source), pdf=pdf)
    return paper


def run_timings_path(profile: str, paper: Path) -> Path:
    """The runner's ``timings.json`` for a paper: beside it where the paper lies in a results tree
    (``<out>/<profile>/paper``, a seed offset's or a non-cpu profile's), else ``out/<profile>/timings.json``."""
    if paper.name == "paper" and paper.parent.name == profile and (paper.parent / report.timings.FILE).is_file():
        return paper.parent / report.timings.FILE
    return out_root() / profile / report.timings.FILE


def write_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` in one step; a failed write leaves no ``.partial`` file and raises an
    ``OSError`` naming ``path``."""
    tmp = path.with_name(f".{path.name}.partial")
    _replacing(path, tmp, lambda: tmp.write_text(text, encoding="utf-8"))


def _replacing(path: Path, tmp: Path, write: Any) -> None:
    try:
        write()
        tmp.chmod(0o644)
        tmp.replace(path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if e.filename is not None and e.errno is not None:
            raise
        raise OSError(e.errno, e.strerror or str(e), str(path)) from None
