"""docs/usage.md's "With HF Trainer / accelerate / timm" section (where the README sends users) runs as written:
its python blocks, in order, in one namespace."""

import re

from conftest import ROOT

HEADING = "## With HF Trainer / accelerate / timm"


def test_the_readme_snippets_run(tmp_path, monkeypatch):
    text = (ROOT / "docs" / "usage.md").read_text()
    assert HEADING in text
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) >= 3
    monkeypatch.chdir(tmp_path)  # the snippets write under ./out
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "docs/usage.md", "exec"), namespace)  # noqa: S102
    assert (tmp_path / "out" / "final" / "model.safetensors").exists()
