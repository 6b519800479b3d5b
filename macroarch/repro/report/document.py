"""The report as data: sections of blocks, rendered alike to Markdown and to Typst (so both outputs hold the same text).

A :class:`Document` is a title, a provenance header (paragraphs) and top-level :class:`Section` s; a section
holds blocks (:class:`Para`, :class:`Bullets`, :class:`Quote`, :class:`Table`, :class:`Figure`, :class:`Code`)
and subsections. Text inside a block may use three inline marks and nothing else:

- ``**strong**``;
- ```code``` (shown verbatim);
- ``[text](target)``: a link; a target without ``://`` is a path relative to the paper folder.

A single ``*`` or ``_`` is plain text, so metric names and formulas need no escaping. Renderers tokenise the
text with :func:`inline_tokens`, the one parser of these marks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_INLINE = re.compile(r"\*\*(?P<strong>.+?)\*\*|`(?P<code>[^`]+)`|\[(?P<text>[^\]]+)\]\((?P<target>[^)\s]+)\)")


def inline_tokens(text: str) -> list[tuple[str, str, str]]:
    """``text`` as ``(kind, text, target)`` runs, kind one of ``text``, ``strong``, ``code``, ``link``."""
    out, pos = [], 0
    for m in _INLINE.finditer(text):
        if m.start() > pos:
            out.append(("text", text[pos:m.start()], ""))
        if m.group("strong") is not None:
            out.append(("strong", m.group("strong"), ""))
        elif m.group("code") is not None:
            out.append(("code", m.group("code"), ""))
        else:
            out.append(("link", m.group("text"), m.group("target")))
        pos = m.end()
    if pos < len(text):
        out.append(("text", text[pos:], ""))
    return out


@dataclass(frozen=True)
class Para:
    text: str


@dataclass(frozen=True)
class Bullets:
    items: tuple[str, ...]


@dataclass(frozen=True)
class Quote:
    text: str


@dataclass(frozen=True)
class Code:
    """Lines shown verbatim (commands)."""

    text: str


@dataclass(frozen=True)
class Table:
    """A table; ``widths`` are relative column widths for the typeset version (Markdown ignores them)."""

    head: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    widths: tuple[float, ...] | None = None
    caption: str = ""

    def __post_init__(self) -> None:
        for row in self.rows:
            if len(row) != len(self.head):
                raise ValueError(f"table row {row!r} has {len(row)} cells; the head has {len(self.head)}")
        if self.widths is not None and len(self.widths) != len(self.head):
            raise ValueError(f"table widths {self.widths} do not match its {len(self.head)} columns")


@dataclass(frozen=True)
class Figure:
    """A PNG under the paper folder (``path`` relative to it) with its alt text and caption."""

    path: str
    alt: str
    caption: str = ""


Block = Para | Bullets | Quote | Code | Table | Figure


@dataclass
class Section:
    title: str
    blocks: list[Block] = field(default_factory=list)
    subsections: list[Section] = field(default_factory=list)
    anchor: str = ""  # a stable label (e.g. the claim id); derived from the title when empty

    def add(self, *blocks: Block) -> Section:
        self.blocks.extend(blocks)
        return self

    def label(self) -> str:
        return self.anchor or slug(self.title)


@dataclass
class Document:
    title: str
    header: list[Block]
    sections: list[Section]


def slug(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    s = re.sub(r"[^\w\- ]", "", title.lower().replace("`", ""))
    return s.replace(" ", "-")


def walk(sections: list[Section], level: int = 1):
    """Every section with its heading level, depth first."""
    for s in sections:
        yield s, level
        yield from walk(s.subsections, level + 1)
