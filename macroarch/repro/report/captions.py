"""A figure's caption from what the figure itself says: its title, each panel's title and axes, its legend.

The report prints each figure under a caption. A caption typed by hand would drift from the figure as harnesses
change, and the file name (``C4_bytes_by_category``) says little, so the caption is read off the figure when the
run saves it: :func:`describe_figure` writes the figure's title, then each panel in reading order (top to
bottom, left to right) as "title: y label against x label", then the legend's entries. Every word comes from the
figure, so a caption holds exactly the numbers the figure's own titles hold.
"""

from __future__ import annotations

#: legend entries named in a caption at most (a legend of many seeds says "and N more")
MAX_SERIES = 8


def _clean(text: str) -> str:
    return " ".join(str(text).split()).rstrip(" .:;")


def _panel(ax) -> str:
    title = _clean(ax.get_title() or ax.get_title(loc="left") or ax.get_title(loc="right"))
    x, y = _clean(ax.get_xlabel()), _clean(ax.get_ylabel())
    axes = f"{y} against {x}" if x and y else (y or x)
    return ": ".join(p for p in (title, axes) if p)


def _series(fig) -> list[str]:
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes)]
    names: list[str] = []
    for legend in legends:
        if legend is None or not legend.get_visible():
            continue
        for t in legend.get_texts():
            name = _clean(t.get_text())
            if name and name not in names:
                names.append(name)
    return names


def describe_figure(fig) -> str:
    """The caption of a matplotlib figure, from its own texts ("" for a figure that has none)."""
    parts = []
    suptitle = fig._suptitle  # noqa: SLF001 (matplotlib has no getter)
    if suptitle is not None and suptitle.get_visible() and _clean(suptitle.get_text()):
        parts.append(_clean(suptitle.get_text()) + ".")
    axes = [ax for ax in fig.axes if ax.get_visible() and ax.axison and ax.get_label() != "<colorbar>"]
    # reading order: rows from the top (larger y first), then left to right
    axes.sort(key=lambda ax: (-round(ax.get_position().y1, 2), round(ax.get_position().x0, 2)))
    panels = [p for p in (_panel(ax) for ax in axes) if p]
    if len(panels) == 1:
        parts.append(panels[0] + ".")
    elif panels:
        parts.append(" ".join(f"Panel {i}: {p}." for i, p in enumerate(panels, 1)))
    series = _series(fig)
    if series:
        more = f" and {len(series) - MAX_SERIES} more" if len(series) > MAX_SERIES else ""
        parts.append("Series: " + ", ".join(series[:MAX_SERIES]) + more + ".")
    return " ".join(parts)
