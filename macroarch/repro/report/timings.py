"""The runner's timing record as the paper keeps it: ``data/timings.json``, one entry per notebook.

The runner writes ``papermill_runs/out/<profile>/timings.json`` (:class:`macroarch.repro.runner._Timings`): the
machine, and per notebook its status, wall time, start and end, cores, whether the profile marks it exclusive,
which notebooks overlapped it (``beside``) and its compile time. That folder is not committed, so the paper keeps
its own copy: :func:`merge` takes, for every notebook, the entry of the execution that measured the paper's
records of its claims (a skipped notebook's entry is the ``earlier`` one it carries), from the runner's new
record or else from the paper's stored copy. An entry belongs to a record when the record's run started inside
the entry's execution; an entry no record of the paper belongs to is dropped, so the copy never describes a run
the paper does not show. Nothing here measures: every time and name is the runner's.
"""

from __future__ import annotations

import datetime as _dt
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: the paper's copy, beside the claims' records
FILE = "timings.json"
#: the runner writes whole seconds into a result's ``started`` and milliseconds into its own entries
_SLACK_S = 1.0


def read(path: Path) -> dict | None:
    """A timing record, or None where it is absent or unreadable (the report says so)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("notebooks"), dict) else None


def _when(text: Any) -> _dt.datetime | None:
    try:
        t = _dt.datetime.fromisoformat(str(text))
    except (TypeError, ValueError):
        return None
    return t if t.tzinfo else t.replace(tzinfo=_dt.UTC)


def executed(entry: Any) -> dict | None:
    """The entry of the execution a notebook's entry stands for: itself, or for a skipped notebook the
    ``earlier`` entry it carries (None where there is none)."""
    if not isinstance(entry, Mapping):
        return None
    if entry.get("status") == "skipped":
        return executed(entry.get("earlier"))
    return dict(entry) if entry.get("started") else None


def holds(entry: Mapping[str, Any], started: str | None) -> bool:
    """Whether a run that started at ``started`` ran inside the execution ``entry`` records."""
    t, a = _when(started), _when(entry.get("started"))
    if t is None or a is None:
        return False
    b = _when(entry.get("finished")) or _dt.datetime.now(_dt.UTC)  # still running
    slack = _dt.timedelta(seconds=_SLACK_S)
    return a - slack <= t <= b + slack


def merge(stored: Mapping[str, Any] | None, new: Mapping[str, Any] | None, records: Mapping[str, Any]) -> dict | None:
    """The paper's timing record: per notebook of ``records`` (``paper.ClaimRecord`` by claim), the entry of the
    execution its records ran in, from ``new`` (the runner's record) first, else ``stored`` (the paper's copy);
    the run-wide fields (machine, wall time, jobs) of the newest record that gave an entry. None when no entry
    belongs to any record."""
    starts: dict[str, list[str]] = {}
    for r in records.values():
        if r.started:
            starts.setdefault(r.notebook, []).append(r.started)
    notebooks: dict[str, dict] = {}
    source = None
    for whole in (new, stored):
        if not whole:
            continue
        for stem, entry in (whole.get("notebooks") or {}).items():
            e = executed(entry)
            if stem in notebooks or e is None or not any(holds(e, s) for s in starts.get(stem, ())):
                continue
            notebooks[stem] = e
            source = source or whole
    if not notebooks:
        return None
    return {**{k: v for k, v in source.items() if k != "notebooks"}, "notebooks": notebooks}


def entry(timings: Mapping[str, Any] | None, notebook: str) -> dict | None:
    """The executed entry of ``notebook`` in a timing record (None where it has none)."""
    return executed(((timings or {}).get("notebooks") or {}).get(notebook))


def beside_text(e: Mapping[str, Any] | None) -> str:
    """What ran beside a notebook, in words: ``beside 04_dgr_variance``, ``alone (exclusive)``, ``alone``, or
    ``not recorded`` where there is no entry."""
    if e is None:
        return "not recorded"
    others: Sequence[str] = e.get("beside") or []
    if others:
        return "beside " + ", ".join(others)
    return "alone (exclusive)" if e.get("exclusive") else "alone"


def seconds(e: Mapping[str, Any] | None) -> float | None:
    s = (e or {}).get("seconds")
    return float(s) if isinstance(s, (int, float)) and not isinstance(s, bool) else None
