"""A :class:`~macroarch.repro.report.document.Document` as Typst source, and that source as a PDF.

The PDF is typeset by the ``typst`` Python package (the Typst compiler; no TeX): numbered headings, a table of
contents (``outline``), the figures embedded from the paper folder, and only the fonts bundled with the
compiler (``ignore_system_fonts``), which Typst embeds (subset) in the PDF, so the file reads the same on every
machine and does not depend on what fonts the building machine has. All text enters the source as Typst
string literals (``#"..."``), so no character of a claim, a metric name or a path is read as markup.
"""

from __future__ import annotations

import datetime as _dt
import json
import struct
from pathlib import Path

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
    inline_tokens,
)

_PREAMBLE = """\
#set document(title: {title})
#set page(paper: "a4", margin: (x: 2cm, y: 2.2cm), numbering: "1")
#set text(font: "Libertinus Serif", size: 10pt)
#set par(justify: true)
#set heading(numbering: "1.1")
#show raw: set text(font: "DejaVu Sans Mono", size: 0.85em)
#show link: set text(fill: rgb("#1f4e99"))
#show figure.caption: set text(size: 9pt)
#set table(stroke: 0.4pt + luma(170), inset: 3.5pt)
#show table: set text(size: 7.5pt)
#show table: set par(justify: false)
"""


# The page's text block (A4, the margins above) in mm, and what a caption line takes at 9 pt.
_TEXT_WIDTH_MM, _TEXT_HEIGHT_MM = 170.0, 252.6
_CAPTION_LINE_MM, _CAPTION_CHARS_PER_LINE = 4.4, 115


def _png_size(path: Path) -> tuple[int, int] | None:
    """Width and height of a PNG from its header, or None if ``path`` is no readable PNG."""
    try:
        with open(path, "rb") as f:
            head = f.read(24)
    except OSError:
        return None
    if len(head) < 24 or head[:8] != b"\x89PNG\r\n\x1a\n":
        return None
    return struct.unpack(">II", head[16:24])


def _caption_mm(caption: str) -> float:
    return -(-len(caption) // _CAPTION_CHARS_PER_LINE) * _CAPTION_LINE_MM


def figure_layout(path: Path | None, caption: str) -> tuple[str, str, str]:
    """``(size, caption, after)``: the image's Typst size, the caption under it and a description set as a paragraph
    after the figure. A figure cannot break across pages (Typst lets it run into the footer, over the page number),
    so where the image at the text width and its whole caption are taller than the page, the caption under the image
    is its name (up to the first ": ") and the rest follows as a paragraph, which can break; the image keeps the text
    width where that fits the page, else the height that does."""
    size = _png_size(path) if path is not None else None
    if size is None or size[0] == 0:
        return "width: 100%", caption, ""
    height = _TEXT_WIDTH_MM * size[1] / size[0]
    if height <= _TEXT_HEIGHT_MM - 12 - _caption_mm(caption):  # 12 mm: the gap above the caption, the page's slack
        return "width: 100%", caption, ""
    name, sep, rest = caption.partition(": ")
    short, after = (name, rest) if sep else (caption, "")
    room = _TEXT_HEIGHT_MM - 12 - _caption_mm(short)
    return ("width: 100%" if height <= room else f"height: {room:.0f}mm"), short, after


def _s(text: str) -> str:
    """A Typst string literal."""
    return json.dumps(str(text), ensure_ascii=False)


def inline(text: str, *, breakable: bool = False) -> str:
    """Marked-up text (see the document module) as Typst markup; ``breakable`` lets lines break after ``_``
    and ``/`` (table cells holding metric names and paths, which Typst would otherwise not break)."""
    parts = []
    for kind, t, target in inline_tokens(str(text)):
        if breakable:
            t = t.replace("_", "_\u200b").replace("/", "/\u200b")
        if kind == "text":
            parts.append(f"#{_s(t)}")
        elif kind == "strong":
            parts.append(f"#strong({_s(t)})")
        elif kind == "code":
            parts.append(f"#raw({_s(t)})")
        elif "://" in target:
            parts.append(f"#link({_s(target)})[#{_s(t)}]")
        elif target.startswith("#"):  # a section of the report: its label
            parts.append(f"#link(label({_s(target[1:])}))[#{_s(t)}]")
        else:  # a file of the paper folder: its name (the text around it says which folder)
            parts.append(f"#{_s(t)}")
    return "".join(parts)


def block(b: Block, root: Path | None = None) -> str:
    """``b`` as Typst; ``root``: the paper folder, where figures are read to size them (else each takes the text
    width)."""
    if isinstance(b, Para):
        return inline(b.text) + "\n"
    if isinstance(b, Quote):
        return f"#quote(block: true)[{inline(b.text)}]\n"
    if isinstance(b, Bullets):
        return "".join(f"- {inline(item)}\n" for item in b.items)
    if isinstance(b, Code):
        return f"#block(fill: luma(245), inset: 6pt, radius: 2pt, width: 100%)[#raw({_s(b.text)}, block: true)]\n"
    if isinstance(b, Figure):
        size, caption, after = figure_layout(None if root is None else root / b.path, b.caption or b.alt)
        out = f"#figure(image({_s(b.path)}, {size}), caption: [{inline(caption)}])\n"
        return out + (f"#text(size: 9pt)[{inline(after)}]\n" if after else "")
    if isinstance(b, Table):
        widths = ", ".join(f"{w:g}fr" for w in (b.widths or (1,) * len(b.head)))
        cells = [f"[#strong({_s(h)})]" for h in b.head]
        cells += [f"[{inline(c, breakable=True)}]" for row in b.rows for c in row]
        table = f"table(columns: ({widths},), align: left, table.header({', '.join(cells[:len(b.head)])}), " \
                f"{', '.join(cells[len(b.head):])})"
        # not a figure: a figure cannot break across pages, and these tables are long
        caption = f"#text(size: 9pt)[#strong({_s(b.caption)})]\n" if b.caption else ""
        return f"{caption}#{table}\n"
    raise TypeError(f"no Typst for block {type(b).__name__}")


def _section(s: Section, level: int, root: Path | None) -> str:
    out = [f"#heading(level: {level})[{inline(s.title)}] <{s.label()}>\n"]
    out += [block(b, root) for b in s.blocks]
    out += [_section(sub, level + 1, root) for sub in s.subsections]
    return "\n".join(out)


def to_typst(doc: Document, root: Path | None = None) -> str:
    """The report as Typst source: title, provenance header, contents (two levels), numbered sections. ``root``:
    the paper folder (figures' paths are relative to it), read to keep each figure and its caption on one page."""
    parts = [_PREAMBLE.format(title=_s(doc.title)),
             f"#align(center, text(size: 17pt, weight: \"bold\")[{inline(doc.title)}])\n"]
    parts += [block(b, root) for b in doc.header]
    parts.append("#outline(depth: 2, indent: auto)\n#pagebreak()\n")
    parts += [_section(s, 1, root) for s in doc.sections]
    return "\n".join(parts)


def write_pdf(doc: Document, paper: Path, out: Path, *, when: _dt.datetime | None = None) -> Path:
    """Typeset ``doc`` into ``out``, figure paths resolved in ``paper``. ``when`` is the date the PDF states
    (the newest run's, so rebuilding the same records gives the same file); written whole or not at all."""
    try:
        import typst
    except ImportError:
        raise RuntimeError("the PDF needs the typst package (pinned in requirements.txt: pip install typst==0.15.0); "
                           "reproduction.md is written, or build without the PDF (pdf=False)") from None

    source = to_typst(doc, paper)
    tmp_src = paper / ".reproduction.typ"
    tmp_pdf = out.with_name(f".{out.name}.partial")
    tmp_src.write_text(source, encoding="utf-8")
    try:
        typst.compile(str(tmp_src), output=str(tmp_pdf), root=str(paper), ignore_system_fonts=True,
                      timestamp=int((when or _dt.datetime(2000, 1, 1, tzinfo=_dt.UTC)).timestamp()))
    except RuntimeError as e:
        raise RuntimeError(f"typst could not typeset the report ({tmp_src} kept): {e}") from None
    tmp_src.unlink()
    tmp_pdf.chmod(0o644)
    tmp_pdf.replace(out)
    return out
