"""The committed paper's grades regraded with each seed (each timing block) left out, from the raw repetitions
its records carry (``paper/data/<claim>.json``'s ``stability``, written by ``Run.leave_one_out``), independently of
the runs that recorded them: the same grade on all repetitions as the verdict, the same left-out repetitions that
change it, and the paper's verdict table marking exactly those claims unstable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from macroarch.repro.claims import CLAIMS, regrade_record

ROOT = Path(__file__).resolve().parents[2]
RECORDS = {p.stem: json.loads(p.read_text()) for p in sorted((ROOT / "paper" / "data").glob("*.json"))
           if p.stem in CLAIMS}  # paper/data also holds the run's timings.json
# the claims whose notebooks record the check: every claim graded from repetitions (C4, C5, C11 rest on exact
# counts, models or lookups, and have none to leave out)
CHECKED = {"C1", "C2", "C3", "C6", "C7", "C8", "C9", "C10", "C12", "C13", "C14", "C15", "R1"}
WITH_CHECK = sorted(c for c, d in RECORDS.items() if d.get("stability"))


def test_every_claim_with_repeated_data_carries_its_check():
    measured = {c for c, d in RECORDS.items() if d.get("state") == "measured"}
    assert CHECKED & measured <= set(WITH_CHECK), sorted(CHECKED & measured - set(WITH_CHECK))


@pytest.mark.parametrize("claim", WITH_CHECK)
def test_committed_grade_regrades_the_same_leaving_each_repetition_out(claim):
    d = RECORDS[claim]
    rec = d["stability"]
    again = regrade_record(claim, rec)
    assert again.grade == rec["grade"] == d["verdict"]["grade"]
    assert [{"group": c.group, "index": c.index, "grade": c.grade} for c in again.changes] == rec["changes"]
    row = next(line for line in (ROOT / "paper" / "claims.md").read_text().splitlines()
               if line.startswith(f"| {claim} |"))
    assert ("unstable:" in row) == bool(rec["changes"]), row
