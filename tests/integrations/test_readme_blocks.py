"""Every ```python block of README.md and of docs/usage.md (where the README sends users for the parts by hand,
other libraries' loops and torchrun) runs as written: per document, in document order, in one namespace (a block
may use what an earlier one defined, as a reader following the page would), in a fresh process whose working
directory is a temporary folder (``configs/`` reachable as in the repository). A block that is deliberately
partial (one that needs torchrun, say) carries a ``# not run`` line and is skipped; nothing else is.

``AWAITING_README`` lists, by the hash of their exact text, the blocks known to fail until README.md is edited
(issue 46): they are still run and must still fail, so the list cannot hide a regression, and any edit of such a
block takes it off the list (its hash changes) and makes it count like every other."""

import hashlib
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT

DOCUMENTS = ("README.md", "docs/usage.md")

NOT_RUN = "# not run"
AWAITING_README: dict[str, str] = {}

RUNNER = textwrap.dedent("""
    import json, sys, traceback
    blocks = json.load(open(sys.argv[1]))
    namespace, failures = {"__name__": "__main__"}, []
    for line, source in blocks:
        try:
            exec(compile(source, f"{sys.argv[3]} (block at line {line})", "exec"), namespace)
        except BaseException as exc:  # a block's SystemExit or KeyboardInterrupt is a failure of that block too
            failures.append([line, f"{type(exc).__name__}: {exc}", traceback.format_exc(limit=-3)])
    json.dump(failures, open(sys.argv[2], "w"))
""")


def digest(source):
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def python_blocks(text):
    """(line of the opening fence, source) of every ```python block."""
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in re.finditer(r"^```python\n(.*?)^```", text,
                                                                                    re.S | re.M)]


@pytest.mark.parametrize("document, at_least", [("README.md", 1), ("docs/usage.md", 5)])
def test_python_blocks_are_found(document, at_least):
    blocks = python_blocks((ROOT / document).read_text())
    assert len(blocks) >= at_least and all(source.strip() for _, source in blocks)


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_python_block_runs(tmp_path, document):
    blocks = [(line, source) for line, source in python_blocks((ROOT / document).read_text())
              if NOT_RUN not in source]
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    (tmp_path / "blocks.json").write_text(json.dumps(blocks))
    (tmp_path / "runner.py").write_text(RUNNER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "runner.py", "blocks.json", "failures.json", document], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    failures = json.loads((tmp_path / "failures.json").read_text())
    awaiting = {line for line, source in blocks if digest(source) in AWAITING_README}
    unexpected = [f for f in failures if f[0] not in awaiting]
    assert not unexpected, f"{document} blocks that fail:\n" + "\n".join(
        f"- line {line}: {error}\n{trace}" for line, error, trace in unexpected)
    assert awaiting <= {f[0] for f in failures}, "a block awaiting its README fix runs now: drop it from " \
                                                 "AWAITING_README"
