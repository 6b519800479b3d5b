"""Committed notebooks are what git's clean filter makes of them, so a fresh clone after ``make`` shows none
modified; the filter the Makefile installs keeps cell ids (``nbstripout --install --keep-id`` alone does not) and
leaves the paper's evidence notebooks whole (their outputs are the evidence).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def stripped():
    """Each notebook as git's clean filter writes it (``nbstripout --keep-id``, which always writes, as the filter
    does; in place it leaves a file alone that it would change only in form), all in one process."""
    done = subprocess.run([sys.executable, "-m", "nbstripout", "--keep-id", "--textconv", *map(str, NOTEBOOKS)],
                          capture_output=True, timeout=120, check=True)
    # the notebooks one after the other: each a JSON object whose opening brace alone starts a line
    parts = done.stdout.split(b"\n{\n")
    texts = [(b"{\n" if i else b"") + p + (b"\n" if i < len(parts) - 1 else b"") for i, p in enumerate(parts)]
    assert len(texts) == len(NOTEBOOKS)
    return {p.name: t for p, t in zip(NOTEBOOKS, texts, strict=True)}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_notebook_is_its_own_stripped_form(path, stripped):
    assert stripped[path.name] == path.read_bytes(), \
        f"{path.name}: not byte for byte what git's filter writes (run .venv/bin/nbstripout --keep-id on it)"


@pytest.mark.skipif(shutil.which("git") is None or shutil.which("make") is None, reason="needs git and make")
def test_the_makefiles_filter_keeps_ids_and_evidence_outputs_and_a_fresh_checkout_is_clean(tmp_path):
    import json

    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.org", "-c", "init.defaultBranch=main"]
    subprocess.run([*git, "init", "-q"], cwd=tmp_path, check=True)
    shutil.copy(ROOT / ".gitattributes", tmp_path / ".gitattributes")
    (tmp_path / "notebooks").mkdir()
    for p in NOTEBOOKS[:2]:
        shutil.copy(p, tmp_path / "notebooks" / p.name)
    # an executed notebook as the paper keeps it: its outputs are the evidence
    nb = json.loads(NOTEBOOKS[0].read_text(encoding="utf-8"))
    code = next(c for c in nb["cells"] if c["cell_type"] == "code")
    code["execution_count"], code["outputs"] = 1, [{"output_type": "stream", "name": "stdout", "text": "measured\n"}]
    (tmp_path / "paper" / "evidence").mkdir(parents=True)
    (tmp_path / "paper" / "evidence" / NOTEBOOKS[0].name).write_text(json.dumps(nb, indent=1) + "\n")
    # what nbstripout --install (the Makefile before) wrote: it outranks .gitattributes and must go
    info = tmp_path / ".git" / "info" / "attributes"
    info.parent.mkdir(exist_ok=True)
    info.write_text("*.ipynb filter=nbstripout\n*.zpln filter=nbstripout\n*.ipynb diff=ipynb\n")
    subprocess.run(["make", "-f", str(ROOT / "Makefile"), "--no-print-directory", "nbfilter", f"BIN={BIN}"],
                   cwd=tmp_path, check=True, capture_output=True, timeout=120)
    clean = subprocess.run(["git", "config", "filter.nbstripout.clean"], cwd=tmp_path, capture_output=True,
                           text=True, check=True).stdout
    assert "--keep-id" in clean and str(BIN) in clean
    assert "nbstripout" not in info.read_text()
    subprocess.run([*git, "add", "-A"], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-qm", "notebooks"], cwd=tmp_path, check=True)
    for p in NOTEBOOKS[:2]:  # touched as a checkout or a run leaves them: still unmodified
        (tmp_path / "notebooks" / p.name).write_bytes(p.read_bytes())
    status = subprocess.run(["git", "status", "--porcelain"], cwd=tmp_path, capture_output=True, text=True,
                            check=True).stdout
    assert status == "", status

    def committed(path: str) -> str:
        return subprocess.run(["git", "show", f"HEAD:{path}"], cwd=tmp_path, capture_output=True, text=True,
                              check=True).stdout

    assert committed(f"notebooks/{NOTEBOOKS[0].name}") == NOTEBOOKS[0].read_text(encoding="utf-8")  # ids and all
    evidence = json.loads(committed(f"paper/evidence/{NOTEBOOKS[0].name}"))
    assert next(c for c in evidence["cells"] if c["cell_type"] == "code")["outputs"][0]["text"] == "measured\n"
    from macroarch.repro.tracking import git_commit

    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True,
                          check=True).stdout.strip()
    assert git_commit(tmp_path) == head  # what every run records: the commit, not dirty, not None


def test_the_committed_evidence_notebooks_keep_their_outputs():
    import json

    for p in sorted((ROOT / "paper" / "evidence").glob("*.ipynb")):
        outputs = [o for c in json.loads(p.read_text(encoding="utf-8"))["cells"] for o in c.get("outputs", [])]
        assert outputs, f"{p.name}: an evidence notebook without outputs (stripped by git's notebook filter?)"
