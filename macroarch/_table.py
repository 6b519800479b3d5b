"""Plain-text tables for the terminal: columns padded to their widest cell, a rule under the header."""

from __future__ import annotations

from collections.abc import Sequence


def format_table(rows: Sequence[Sequence[object]]) -> str:
    """``rows[0]`` is the header; every row has the same number of cells."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    lines = []
    for j, r in enumerate(cells):
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
