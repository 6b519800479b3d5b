"""The Inductor workarounds the kernels still apply name their upstream issue drafts, and those drafts exist."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import macroarch
from macroarch.mvas._kernels import runner

ROOT = Path(macroarch.__file__).resolve().parent.parent
DRAFT = re.compile(r"docs/upstream/[\w.-]+\.md")


def test_every_draft_the_package_names_exists():
    named = {m for path in (ROOT / "macroarch").rglob("*.py") for m in DRAFT.findall(path.read_text())}
    assert named, "no module names an upstream draft"
    missing = sorted(name for name in named if not (ROOT / name).is_file())
    assert not missing, missing


def test_each_inductor_option_of_the_runner_names_its_draft():
    """``_options`` sets each option to work around an Inductor problem: its docstring names the draft of each."""
    doc = inspect.getdoc(runner._options)
    options = set(re.findall(r"cpp\.\w+", inspect.getsource(runner._options).split('"""')[-1]))
    assert options == {"cpp.simdlen", "cpp.dynamic_threads"}, options
    for option, draft in (("cpp.simdlen", "inductor-cpu-cache-key-isa.md"),
                          ("cpp.dynamic_threads", "inductor-threads-baked-in.md")):
        assert option in doc and f"docs/upstream/{draft}" in doc, (option, draft)
