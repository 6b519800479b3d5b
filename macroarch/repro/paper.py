"""The paper builder: results of one profile -> ``paper/figures``, ``paper/claims.md``, ``paper/reproduction.md``.

Nothing here measures or recomputes: every number comes from a result (``result.json`` files, or the
W&B runs that carry the same config, metrics and verdict, read back offline). Both sources give the
same table; a test holds them to it. A claim without a complete result is listed as not yet measured.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from macroarch.config import ConfigError
from macroarch.paths import check_profile, out_root, project_root, wandb_root
from macroarch.repro.claims import CLAIMS, Claim
from macroarch.repro.tracking import COMPLETE, read_result, result_path

SOURCES = ("results", "wandb")
NOT_MEASURED = "not yet measured"


@dataclass
class ClaimResult:
    """A complete result of one claim, whichever source it came from."""

    claim: str
    profile: str
    verdict: dict[str, str]
    metrics: dict[str, Any]
    figures: dict[str, Path] = field(default_factory=dict)  # name -> png
    origin: str = ""


def from_results(profile: str, out: Path | None = None) -> dict[str, ClaimResult]:
    """Complete results of ``profile`` from ``papermill_runs/out/<profile>/<claim>/result.json``."""
    out = out or out_root()
    found = {}
    for claim in CLAIMS:
        path = result_path(claim, profile, out)
        try:
            r = read_result(path)
        except (OSError, ValueError):
            continue
        if r.get("status") != COMPLETE or not r.get("verdict"):
            continue
        figures = {n: path.parent / f"{n}.png" for n in r.get("figures", [])}
        found[claim] = ClaimResult(claim, profile, r["verdict"], r.get("metrics", {}),
                                   {n: p for n, p in figures.items() if p.is_file()}, origin=str(path))
    return found


def from_wandb(profile: str, wandb_dir: Path | None = None) -> dict[str, ClaimResult]:
    """Complete results of ``profile`` from W&B offline runs: the latest complete run per claim."""
    from macroarch.repro.wandb_offline import find_offline_runs

    found: dict[str, ClaimResult] = {}
    for run in find_offline_runs(wandb_dir or wandb_root()):  # sorted oldest first: later runs win
        claim, run_profile = run.config.get("claim"), run.config.get("profile")
        if claim not in CLAIMS or run_profile != profile:
            continue
        if run.summary.get("status") != COMPLETE or not isinstance(run.summary.get("verdict"), Mapping):
            continue
        metric_names = [k for k in run.summary if not k.startswith(("_", "figures/", "series/")) and
                        k not in ("verdict", "status", "step")]
        metrics = {k: run.summary[k] for k in metric_names}
        figures = {}
        for row in run.history:
            for key, value in row.items():
                if key.startswith("figures/") and isinstance(value, Mapping) and value.get("path"):
                    png = run.files / value["path"]
                    if png.is_file():
                        figures[key.removeprefix("figures/")] = png
        found[claim] = ClaimResult(claim, profile, dict(run.summary["verdict"]), metrics, figures,
                                   origin=str(run.directory))
    return found


def collect(profile: str, source: str = "results") -> dict[str, ClaimResult]:
    check_profile(profile)
    if source == "results":
        return from_results(profile)
    if source == "wandb":
        return from_wandb(profile)
    raise ConfigError(f"unknown source {source!r}; expected one of {', '.join(SOURCES)}")


# --- rendering ----------------------------------------------------------------------------------------

def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ").strip() or "-"


def _evidence(claim: Claim, profile: str) -> str:
    return f"[{claim.notebook}](../papermill_runs/out/{profile}/{claim.notebook}.ipynb)"


def claims_table(results: Mapping[str, ClaimResult], profile: str) -> str:
    """The verdict table, one row per claim of the registry, in registry order."""
    head = ("Claim", "Statement", "Target", "Measured", "Scale", "Profile", "Verdict", "Evidence")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cid, claim in CLAIMS.items():
        r = results.get(cid)
        if r is None:
            row = (cid, claim.statement, claim.target_text, "-", "-", "-", NOT_MEASURED, "-")
        else:
            v = r.verdict
            row = (cid, claim.statement, v.get("target") or claim.target_text, v.get("measured"), v.get("scale"),
                   r.profile, f"**{v.get('grade')}**", _evidence(claim, r.profile))
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    return "\n".join(lines) + "\n"


def _metric_value(name: str, v: Any) -> str:
    """Numbers as recorded; byte counts (metrics named ``*_bytes``) also in decimal GB, as the post counts."""
    text = f"{v:.6g}" if isinstance(v, float) else str(v)
    if name.endswith("_bytes") and isinstance(v, (int, float)) and abs(v) >= 1e6:
        text += f" ({v / 1e9:,.2f} GB)"
    return text


def report(results: Mapping[str, ClaimResult], profile: str, figure_names: Mapping[str, list[str]],
           source: str) -> str:
    measured = [c for c in CLAIMS if c in results]
    lines = [
        "# Reproduction report",
        "",
        "Every claim of the post (see `shared/CLAIMS.md`), measured by one notebook and graded by the rule in",
        "`macroarch/claims.py`. Numbers below are read from the runs; nothing here was typed in by hand.",
        "",
        f"Profile: `{profile}`; source: {source}; {len(measured)} of {len(CLAIMS)} claims measured.",
        "",
        "## Verdicts",
        "",
        claims_table(results, profile),
    ]
    for cid in measured:
        r, claim = results[cid], CLAIMS[cid]
        v = r.verdict
        lines += [f"## {cid} (section {claim.section}): {v.get('grade')}", "", f"> {claim.statement}", "",
                  f"- Measured: {v.get('measured')}", f"- Target: {v.get('target')}", f"- Scale: {v.get('scale')}",
                  f"- What counts as measuring it: {claim.measures}"]
        if v.get("note"):
            lines.append(f"- Note: {v['note']}")
        lines.append(f"- Evidence: {_evidence(claim, profile)}")
        lines.append("")
        for name in figure_names.get(cid, []):
            lines += [f"![{cid} {name}](figures/{cid}_{name}.png)", ""]
        if r.metrics:
            lines += ["| metric | value |", "|---|---|"]
            lines += [f"| {k} | {_metric_value(k, r.metrics[k])} |" for k in sorted(r.metrics)]
            lines.append("")
    pending = [c for c in CLAIMS if c not in results]
    if pending:
        lines += ["## Not yet measured", "", ", ".join(pending), ""]
    return "\n".join(lines)


def build(profile: str = "cpu", *, source: str = "results", paper_dir: Path | None = None,
          results: Mapping[str, ClaimResult] | None = None) -> Path:
    """Write the paper for ``profile`` from ``source``; returns the paper folder."""
    results = collect(profile, source) if results is None else results
    paper = paper_dir or (project_root() / "paper")
    figures = paper / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    for old in figures.glob("*.png"):  # a figure whose claim lost its result must not linger
        old.unlink()
    names: dict[str, list[str]] = {}
    for cid, r in results.items():
        for name, png in sorted(r.figures.items()):
            shutil.copyfile(png, figures / f"{cid}_{name}.png")
            names.setdefault(cid, []).append(name)
    _write_text(paper / "claims.md", f"# Claims and verdicts (profile `{profile}`)\n\n" +
                claims_table(results, profile))
    _write_text(paper / "reproduction.md", report(results, profile, names, source))
    return paper


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.partial")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
