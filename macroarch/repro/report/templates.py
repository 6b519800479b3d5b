"""The hand-written prose of the report: ``templates/<section>.md``, with every number and number-like name a
placeholder.

A template is paragraphs separated by blank lines, ``- `` bullet lists and ``### `` subheadings, in the inline
marks of :mod:`macroarch.repro.report.document`. Everything in braces is a placeholder, filled from the
context the report builds (the registry, the results, the profile): ``{C10}`` (a claim id), ``{C10.grade}``,
``{confidence}``, ``{fp16}``. Names that contain digits (claim ids, number formats, models) are placeholders
too, so that a template holds no digit at all outside braces: a test checks it, and a number can only enter
the prose from a result. An unknown placeholder is an error that names the template and the placeholder.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from macroarch.repro.report.document import Block, Bullets, Para

TEMPLATES = Path(__file__).with_name("templates")
PLACEHOLDER = re.compile(r"\{([^{}]+)\}")

#: names that contain digits, written once here so the prose can name them without typing a digit
NAMES = {"fp16": "fp16", "fp8": "fp8", "fp4": "fp4", "bf16": "bf16", "fp32": "fp32", "zero3": "ZeRO-3"}


class TemplateError(KeyError):
    pass


def fill(name: str, text: str, context: Mapping[str, str]) -> str:
    def sub(m: re.Match) -> str:
        key = m.group(1)
        if key not in context:
            raise TemplateError(f"template {name}: unknown placeholder {{{key}}}")
        return str(context[key])

    return PLACEHOLDER.sub(sub, text)


def read(name: str) -> str:
    return (TEMPLATES / f"{name}.md").read_text(encoding="utf-8")


def blocks(name: str, context: Mapping[str, str]) -> list[tuple[str | None, list[Block]]]:
    """The template ``name`` filled, as ``(subheading or None, blocks)`` runs in order."""
    out: list[tuple[str | None, list[Block]]] = [(None, [])]
    for chunk in re.split(r"\n\s*\n", fill(name, read(name), context).strip()):
        lines = chunk.strip().splitlines()
        if lines and lines[0].startswith("### "):
            out.append((lines[0][4:].strip(), []))
            lines = lines[1:]
        if not lines:
            continue
        if all(line.startswith("- ") or line.startswith("  ") for line in lines):
            items: list[str] = []
            for line in lines:
                if line.startswith("- "):
                    items.append(line[2:].strip())
                else:
                    items[-1] += " " + line.strip()
            out[-1][1].append(Bullets(tuple(items)))
        else:
            out[-1][1].append(Para(" ".join(line.strip() for line in lines)))
    return [(h, b) for h, b in out if h is not None or b]
