"""The command line: exit statuses, one-line errors that name the bad input, nothing written on error."""

import subprocess
import sys

import pytest

from conftest import write_profile
from macroarch.repro.cli import main


def _files(root):
    return sorted(p for p in root.rglob("*") if p.is_file())


@pytest.mark.parametrize("argv, fix, message", [
    (["reproduce", "--profile", "laptop"], None, "unknown profile 'laptop'"),
    (["reproduce", "--profile", "ci", "--only", "C99"], None, "unknown claim id 'C99'"),
    (["reproduce", "--profile", "ci"], [{"notebook": "03_nothing_here"}], "unknown notebook '03_nothing_here'"),
    (["reproduce", "--profile", "ci"], [{"notebook": "02_memory_wall", "parameters": {"batch": 3}}],
     "unknown parameter 'batch'"),
    (["reproduce", "--profile", "ci"], "notebooks: [oops", "malformed YAML"),
    (["paper", "--profile", "ci", "--source", "csv"], None, "unknown source 'csv'"),
])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(project, isolated, capsys, argv, fix, message):
    if isinstance(fix, list):
        write_profile(project, "ci", fix)
    elif isinstance(fix, str):
        (project / "papermill_runs" / "ci.yaml").write_text(fix)
    before = _files(isolated)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert _files(isolated) == before


def test_reproduce_exit_status_and_paper(project, isolated, capsys):
    assert main(["reproduce", "--profile", "ci"]) == 1  # the failing fixture notebook
    out = capsys.readouterr().out
    assert "paper written to" in out
    assert (project / "paper" / "claims.md").is_file()
    assert main(["reproduce", "--profile", "ci", "--only", "C4", "--no-paper"]) == 0
    assert "skipped: up to date" in capsys.readouterr().out


def test_claims_and_runs_list(project, isolated, capsys, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert main(["reproduce", "--profile", "ci", "--only", "C4", "--no-paper"]) == 0
    capsys.readouterr()
    assert main(["claims"]) == 0
    table = capsys.readouterr().out
    c4 = next(line for line in table.splitlines() if line.startswith("C4 "))
    assert "partially" in c4 and "02_memory_wall" in c4
    assert main(["runs"]) == 0
    results, _, offline = capsys.readouterr().out.partition("W&B offline runs")
    (row,) = [line.split() for line in results.splitlines() if line.startswith("C4 ")]
    assert row[:4] == ["C4", "ci", "complete", "partially"] and row[-2] == "offline"
    (wrow,) = [line.split() for line in offline.splitlines() if line.startswith(row[-1])]
    assert wrow[1:5] == ["C4", "ci", "complete", "partially"] and wrow[5] == "0"


def test_console_script_exit_status(tmp_path):
    exe = [sys.executable, "-m", "macroarch.repro.cli", "reproduce", "--profile", "nope"]
    p = subprocess.run(exe, capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 2 and "unknown profile 'nope'" in p.stderr
