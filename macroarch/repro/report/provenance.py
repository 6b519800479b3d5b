"""Which code the paper's numbers belong to, and what each claim's committed grades were before.

- :data:`CODE_PATHS`: per claim, the files and packages its numbers come from: the notebook, its harness in
  ``macroarch/experiments/``, the technique and measurement packages the harness calls, and what every claim
  shares (the training loop, the run settings, the cpu profile's sizes and the grader). A path ending in ``/``
  is a folder.
- :func:`changed_since`: the files of those paths that differ between the measured commit and ``HEAD``
  (``git diff --name-only <commit>..HEAD``); a commit the clone does not have is reported as such.
- :func:`grade_history`: every committed version of a paper record (``git log -- <paper>/data/<claim>.json``),
  oldest first, with the grade, the commit it was measured at and when its run started; :func:`earlier` leaves
  out the versions that hold the record the paper shows now (in a clean checkout the newest commit holds it).

Git is read, never written; a folder outside any repository (a paper built into a temporary folder) has no
history, which is said, not guessed.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

_SHARED = ("macroarch/experiments/loop.py", "macroarch/experiments/settings.py", "macroarch/measure/machine.py",
           "macroarch/repro/claims.py", "macroarch/measure/stats.py", "macroarch/measure/workload.py",
           "papermill_runs/cpu.yaml")
_MVAS_DGR = ("macroarch/mvas/", "macroarch/dgr/", "macroarch/optim/", "macroarch/compose.py", "macroarch/config.py",
             "macroarch/layers.py")
# the notebooks that size full models do it through the planner (02, 05, 10, 11)
_PLANNER = ("macroarch/planner/", "macroarch/measure/fit.py")
# notebook 01's harness serves C2, C3 and R1: what it imports belongs to all three
_GRADIENTS = ("macroarch/measure/gradients.py", "macroarch/measure/clipping.py", "macroarch/models/", "macroarch/data/")

CODE_PATHS: dict[str, tuple[str, ...]] = {
    "C1": ("notebooks/05_mvas_llama.ipynb", "macroarch/experiments/mvas_llama.py", *_MVAS_DGR, *_PLANNER,
           "macroarch/measure/memory/", "macroarch/models/", "macroarch/data/"),
    "C2": ("notebooks/01_gradient_explosion.ipynb", "macroarch/experiments/gradient_explosion.py", *_GRADIENTS),
    "C3": ("notebooks/01_gradient_explosion.ipynb", "macroarch/experiments/gradient_explosion.py", *_GRADIENTS),
    "C4": ("notebooks/02_memory_wall.ipynb", "macroarch/experiments/memory_wall.py", "macroarch/measure/memory/",
           *_PLANNER, "macroarch/models/"),
    "C5": ("notebooks/03_zero3_communication.ipynb", "macroarch/experiments/zero3_communication.py",
           "macroarch/measure/calibrate.py", "macroarch/measure/comm_bench.py", "macroarch/measure/fsdp_bytes.py",
           "macroarch/measure/zero3.py", "macroarch/measure/memory/", "macroarch/mvas/", "macroarch/comm/",
           "macroarch/models/"),
    "C6": ("notebooks/04_dgr_variance.ipynb", "macroarch/experiments/dgr_variance.py", "macroarch/dgr/",
           "macroarch/measure/gradients.py", "macroarch/measure/memory/", "macroarch/models/", "macroarch/data/"),
    "C7": ("notebooks/05_mvas_llama.ipynb", "macroarch/experiments/mvas_llama.py", *_MVAS_DGR, *_PLANNER,
           "macroarch/measure/memory/", "macroarch/models/", "macroarch/data/"),
    "C8": ("notebooks/06_mixed_precision.ipynb", "macroarch/experiments/mixed_precision.py", "macroarch/optim/",
           "macroarch/models/", "macroarch/data/"),
    "C9": ("notebooks/07_comm_bucketing.ipynb", "macroarch/experiments/comm_bucketing.py", "macroarch/comm/",
           "macroarch/measure/comm_bench.py", "macroarch/measure/workload.py"),
    "C10": ("notebooks/08_convergence_recipe.ipynb", "macroarch/experiments/convergence_recipe.py", *_MVAS_DGR,
            "macroarch/models/", "macroarch/data/"),
    "C11": ("notebooks/09_hardware_speedups.ipynb", "macroarch/experiments/hardware_speedups.py",
            "macroarch/measure/__init__.py", "macroarch/measure/step_time.py", "macroarch/measure/hardware.py",
            "macroarch/measure/memory/",
            *_MVAS_DGR, "macroarch/models/"),
    "C12": ("notebooks/10_applications.ipynb", "macroarch/experiments/applications.py", *_MVAS_DGR,
            *_PLANNER, "macroarch/measure/memory/", "macroarch/models/", "macroarch/data/"),
    "C13": ("notebooks/10_applications.ipynb", "macroarch/experiments/applications.py", *_MVAS_DGR,
            *_PLANNER, "macroarch/measure/memory/", "macroarch/models/", "macroarch/data/"),
    "C14": ("notebooks/10_applications.ipynb", "macroarch/experiments/applications.py", *_MVAS_DGR,
            *_PLANNER, "macroarch/measure/memory/", "macroarch/models/", "macroarch/data/"),
    "C15": ("notebooks/11_clip.ipynb", "macroarch/experiments/clip.py", *_MVAS_DGR, *_PLANNER,
            "macroarch/experiments/mvas_llama.py", "macroarch/measure/memory/", "macroarch/models/", "macroarch/data/"),
    "R1": ("notebooks/01_gradient_explosion.ipynb", "macroarch/experiments/gradient_explosion.py", *_GRADIENTS),
}
CODE_PATHS = {cid: (*paths, *_SHARED) for cid, paths in CODE_PATHS.items()}


def _git(repo: Path, *args: str) -> str | None:
    """Git's output, or None where ``repo`` is no repository or git fails (an unknown commit)."""
    try:
        done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def repo_root(path: Path) -> Path | None:
    """The repository ``path`` lies in, or None."""
    out = _git(path if path.is_dir() else path.parent, "rev-parse", "--show-toplevel")
    return Path(out.strip()) if out else None


def head(repo: Path) -> str | None:
    out = _git(repo, "rev-parse", "HEAD")
    return out.strip() if out else None


def plain_commit(commit: str | None) -> str:
    """A run's ``git_commit`` without its ``+dirty`` mark."""
    return (commit or "").split("+")[0]


@dataclass(frozen=True)
class Changes:
    """What changed between a measured commit and HEAD: all files, or None where it cannot be told."""

    commit: str
    head: str | None
    files: tuple[str, ...] | None
    why_unknown: str = ""

    def in_paths(self, paths: tuple[str, ...]) -> tuple[str, ...] | None:
        if self.files is None:
            return None
        return tuple(f for f in self.files if any(f == p or (p.endswith("/") and f.startswith(p)) for p in paths))


def changed_since(repo: Path | None, commit: str) -> Changes:
    if repo is None:
        return Changes(commit, None, None, "the paper is not in a git repository")
    now = head(repo)
    if now is None:
        return Changes(commit, None, None, "the repository has no HEAD")
    if _git(repo, "cat-file", "-e", f"{commit}^{{commit}}") is None:
        return Changes(commit, now, None, f"commit {commit[:7]} is not in this clone")
    out = _git(repo, "diff", "--name-only", f"{commit}..{now}")
    return Changes(commit, now, tuple(sorted(out.split())) if out is not None else None,
                   "" if out is not None else "git diff failed")


@dataclass(frozen=True)
class PastGrade:
    commit: str  # the commit that committed this version of the record
    date: str
    grade: str
    measured_at: str  # the commit the numbers were measured at
    started: str = ""  # when the run started (with measured_at, which run this version holds)


def grade_history(repo: Path | None, record: Path) -> list[PastGrade] | None:
    """The committed versions of ``record`` (a ``data/<claim>.json``), oldest first; None outside a repository."""
    if repo is None:
        return None
    try:
        rel = record.resolve().relative_to(repo.resolve()).as_posix()
    except ValueError:
        return None
    log = _git(repo, "log", "--format=%H %cs", "--", rel)
    if log is None:
        return None
    found = []
    for line in reversed(log.splitlines()):
        sha, date = line.split()
        text = _git(repo, "show", f"{sha}:{rel}")
        if text is None:  # the commit deleted it
            continue
        try:
            d = json.loads(text)
        except ValueError:
            continue
        v = d.get("verdict") or {}
        found.append(PastGrade(sha, date, v.get("grade") or d.get("state", "?"), plain_commit(d.get("git_commit")),
                               str(d.get("started") or "")))
    return found


def earlier(history: list[PastGrade], started: str | None, git_commit: str | None) -> list[PastGrade]:
    """The versions of ``history`` that hold another run than the one that started at ``started`` at commit
    ``git_commit`` (the record shown now)."""
    now = (plain_commit(git_commit), started or "")
    return [h for h in history if (h.measured_at, h.started) != now]
