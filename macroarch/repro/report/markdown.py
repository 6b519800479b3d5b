"""A :class:`~macroarch.repro.report.document.Document` as GitHub Markdown (``paper/reproduction.md``)."""

from __future__ import annotations

from macroarch.repro.report.document import (
    Block,
    Bullets,
    Code,
    Document,
    Figure,
    Para,
    Quote,
    Section,
    Table,
    slug,
    walk,
)


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ").strip() or "-"


def block(b: Block) -> list[str]:
    if isinstance(b, Para):
        return [b.text, ""]
    if isinstance(b, Quote):
        return [f"> {b.text}", ""]
    if isinstance(b, Bullets):
        return [*(f"- {item}" for item in b.items), ""]
    if isinstance(b, Code):
        return ["```", b.text, "```", ""]
    if isinstance(b, Figure):
        lines = [f"![{b.alt}]({b.path})", ""]
        return lines + ([f"*{b.caption}*", ""] if b.caption else [])
    if isinstance(b, Table):
        lines = ["| " + " | ".join(_cell(h) for h in b.head) + " |", "|" + "---|" * len(b.head)]
        lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in b.rows]
        return ([f"**{b.caption}**", ""] if b.caption else []) + lines + [""]
    raise TypeError(f"no Markdown for block {type(b).__name__}")


def _section(s: Section, level: int) -> list[str]:
    lines = [f"{'#' * (level + 1)} {s.title}", ""]
    for b in s.blocks:
        lines += block(b)
    for sub in s.subsections:
        lines += _section(sub, level + 1)
    return lines


def to_markdown(doc: Document) -> str:
    """The whole report: title, provenance header, contents (top two levels), sections."""
    lines = [f"# {doc.title}", ""]
    for b in doc.header:
        lines += block(b)
    lines += ["## Contents", ""]
    for s, level in walk(doc.sections):
        if level <= 2:
            lines.append(f"{'  ' * (level - 1)}- [{s.title}](#{slug(s.title)})")
    lines.append("")
    for s in doc.sections:
        lines += _section(s, 1)
    return "\n".join(lines).rstrip() + "\n"
