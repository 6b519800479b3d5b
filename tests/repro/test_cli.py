"""The command line: exit statuses, one-line errors that name the bad input, nothing written on error."""

import json
import subprocess
import sys

import pytest

from conftest import write_profile
from macroarch.repro import paper
from macroarch.repro.claims import get_claim
from macroarch.repro.cli import main
from macroarch.repro.tracking import result_path, start_run


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
    (["paper", "--profile", "ci", "--source", "wandb"], None, "no W&B runs of profile 'ci'"),
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


def test_only_on_ci_leaves_the_cpu_paper_byte_identical(project, isolated, capsys):
    """The README's own example used to rewrite the committed (cpu) paper as a ci paper."""
    with start_run("C4", "cpu", {"size": 2}) as run:  # the committed paper: a cpu run
        run.summary(post_accounting_bytes=1.4e12, mixed_precision_bytes=2.8e12)
        run.verdict(get_claim("C4").grade(run.metrics, scale="cpu scale"))
    cpu_paper = paper.build("cpu")
    assert cpu_paper == project / "paper"
    before = {p: p.read_bytes() for p in _files(cpu_paper)}

    assert main(["reproduce", "--profile", "ci", "--only", "C4"]) == 0
    assert {p: p.read_bytes() for p in _files(cpu_paper)} == before
    ci_paper = isolated / "out" / "ci" / "paper"
    assert "out/ci/paper" in capsys.readouterr().out
    assert "size 1" in next(line for line in (ci_paper / "claims.md").read_text().splitlines()
                            if line.startswith("| C4 |"))


def test_reproduce_exit_status(project, isolated, capsys):
    assert main(["reproduce", "--profile", "ci"]) == 1  # the failing fixture notebook
    assert "paper of profile ci written to" in capsys.readouterr().out
    assert main(["reproduce", "--profile", "ci", "--only", "C4", "--no-paper"]) == 0
    assert "skipped: up to date" in capsys.readouterr().out


def test_claims_and_runs_list(project, isolated, capsys, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert main(["reproduce", "--profile", "ci", "--only", "C4", "--no-paper"]) == 0
    capsys.readouterr()
    assert main(["claims"]) == 0
    table = capsys.readouterr().out
    c4 = next(line for line in table.splitlines() if line.startswith("C4 "))
    assert "partially" in c4 and "02_memory_wall" in c4 and "1.4 TB for what training needs (mixed precision)" in c4
    assert "(planned)" in next(line for line in table.splitlines() if line.startswith("C11 "))
    assert main(["runs"]) == 0
    results, _, offline = capsys.readouterr().out.partition("W&B offline runs")
    (row,) = [line.split() for line in results.splitlines() if line.startswith("C4 ")]
    assert row[:4] == ["C4", "ci", "complete", "partially"] and row[-2] == "offline"
    (wrow,) = [line.split() for line in offline.splitlines() if line.startswith(row[-1])]
    assert wrow[1:5] == ["C4", "ci", "complete", "partially"] and wrow[5] == "0"


def test_cpu_column_comes_from_the_paper_when_there_are_no_results(project, isolated, capsys, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    with start_run("C4", "cpu", {}) as run:
        run.summary(post_accounting_bytes=1.4e12, mixed_precision_bytes=2.8e12)
        run.verdict(get_claim("C4").grade(run.metrics, scale="x"))
    paper.build("cpu")
    result_path("C4", "cpu").unlink()  # a fresh clone: the paper, no result files
    assert main(["claims"]) == 0
    c4 = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("C4 "))
    assert c4.split()[3:6] == ["-", "partially", "-"]


@pytest.mark.parametrize("command", [["claims"], ["runs"], ["paper", "--profile", "ci"],
                                     ["reproduce", "--profile", "ci"]])
def test_malformed_result_file_is_one_line(project, isolated, capsys, command):
    path = result_path("C4", "ci")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps([1, 2]))
    code = main(command)
    err = capsys.readouterr().err.strip()
    if command[0] == "reproduce":  # the run replaces it (and the fixture's failing notebook makes it exit 1)
        assert code == 1 and err == "" and json.loads(path.read_text())["status"] == "complete"
        return
    assert "C4/result.json: malformed result file" in err and len(err.splitlines()) == 1
    assert code == (0 if command[0] in ("claims", "runs") else 2)


@pytest.mark.parametrize("command", [["claims"], ["runs"], ["paper", "--profile", "ci"],
                                     ["reproduce", "--profile", "ci"]])
def test_output_folder_that_is_a_file_is_one_line(project, isolated, capsys, monkeypatch, command):
    (isolated / "a-file").write_text("")
    monkeypatch.setenv("MACROARCH_OUT", str(isolated / "a-file"))
    assert main(command) == 2
    err = capsys.readouterr().err.strip()
    assert "MACROARCH_OUT=" in err and "is a file" in err and len(err.splitlines()) == 1


def test_console_script_exit_status(tmp_path):
    exe = [sys.executable, "-m", "macroarch.repro.cli", "reproduce", "--profile", "nope"]
    p = subprocess.run(exe, capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 2 and "unknown profile 'nope'" in p.stderr


def _options(parser):
    """Every option and positional of ``parser`` and its subcommands, as (command path, action)."""
    import argparse

    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += [(f"{name} {path}".strip(), a) for path, a in _options(sub)]
        elif not isinstance(action, argparse._HelpAction):
            out.append(("", action))
    return out


def test_every_option_of_every_command_has_help_text():
    from macroarch.repro.cli import build_parser

    missing = [f"macroarch {path} {'/'.join(a.option_strings) or a.dest}" for path, a in _options(build_parser())
               if not (a.help or "").strip() and not isinstance(a, type(None))]
    assert not missing, "options without help: " + ", ".join(missing)


def test_memory_precisions_are_the_packages():
    from macroarch.measure.memory import PRECISIONS
    from macroarch.repro.cli import MEMORY_PRECISIONS

    assert tuple(PRECISIONS) == MEMORY_PRECISIONS
