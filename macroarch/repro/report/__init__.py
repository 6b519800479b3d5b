"""The reproduction report: one set of section objects, written as ``reproduction.md`` and ``reproduction.pdf``.

:func:`write` builds the :class:`~macroarch.repro.report.document.Document` from a paper's records
(:mod:`macroarch.repro.report.sections`: the summary with the verdict table, the source, methods, data sets,
hyperparameters, environment and cost, statistics, one section per claim, discussion, threats to validity,
rerun instructions, references and the metric appendix) and renders it to Markdown
(:mod:`~macroarch.repro.report.markdown`) and, through the Typst compiler, to PDF
(:mod:`~macroarch.repro.report.typst`). Both renderings come from the same objects, so they hold the same text.
Nothing here measures: the numbers come from the records, the registry, the profile, git and the runner's
``timings.json`` as the paper keeps it (``data/timings.json``, :mod:`~macroarch.repro.report.timings`). A
figure's caption is what its run recorded, read off the figure by :mod:`~macroarch.repro.report.captions`.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from macroarch.repro.report import provenance, timings
from macroarch.repro.report.document import Document
from macroarch.repro.report.markdown import to_markdown
from macroarch.repro.report.sections import SECTIONS, Context, document
from macroarch.repro.report.typst import to_typst, write_pdf


def context(records: Mapping[str, Any], profile: str, paper: Path, source: str, *, repo: Path | None = None,
            history: Path | None = None) -> Context:
    """What the sections read. ``repo`` defaults to the repository the paper lies in (else the project's);
    ``history`` is the committed paper folder whose records' git history is shown (default ``paper``). The
    timing record is the paper's own copy, ``data/timings.json`` (written by ``paper.build``)."""
    from macroarch.config import ConfigError
    from macroarch.paths import project_root
    from macroarch.repro.profiles import load_profile

    repo = repo or provenance.repo_root(paper) or provenance.repo_root(project_root())
    path = paper / "data" / timings.FILE
    try:
        jobs = load_profile(profile)
    except (ConfigError, OSError):  # a profile that does not load is said in its section, not raised here
        jobs = []
    return Context(records, profile, paper, source, repo=repo, history=history, timings=timings.read(path),
                   jobs=jobs)


def newest(records: Mapping[str, Any]) -> _dt.datetime | None:
    """The latest start or end among the records (the date the PDF states)."""
    stamps = []
    for r in records.values():
        for s in (r.started, r.finished):
            try:
                stamps.append(_dt.datetime.fromisoformat(s))
            except (TypeError, ValueError):
                pass
    return max(stamps) if stamps else None


def write(ctx: Context, *, pdf: bool = True) -> Document:
    """Write ``reproduction.md`` (and ``reproduction.pdf``) into the context's paper folder; returns the document."""
    from macroarch.repro.paper import write_text

    doc = document(ctx)
    write_text(ctx.paper / "reproduction.md", to_markdown(doc))
    if pdf:
        write_pdf(doc, ctx.paper, ctx.paper / "reproduction.pdf", when=newest(ctx.records))
    return doc


__all__ = ["SECTIONS", "Context", "Document", "context", "document", "timings", "to_markdown", "to_typst",
           "write", "write_pdf"]
