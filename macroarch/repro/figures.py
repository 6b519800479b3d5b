"""Mechanical checks of a matplotlib figure's layout, as the report will show it.

The paper embeds every figure at the text width of its PDF page (``TEXT_WIDTH_IN``, A4 with 2 cm margins), so a
figure's text shrinks by ``TEXT_WIDTH_IN / width`` there: a 25-inch figure's 10 pt tick labels print at 2.7 pt.
:func:`figure_problems` draws the figure (nothing is saved) and returns, as sentences, what a reader would trip
over:

- text smaller than :data:`MIN_PRINTED_PT` once the figure is scaled to the text width;
- overlapping tick labels on one axis (``24`` and ``25`` printed as ``2425``);
- an axis with tick labels but no label (the unit lives in the label);
- overlapping texts: titles, axis labels, annotations and legends of the whole figure, pairwise;
- a legend drawn over plotted lines, markers or bars of its axes, an annotation over lines or markers.

Figures are saved with ``bbox_inches="tight"``, so no text falls off the saved canvas: a title that runs past
its panel widens the saved figure instead, and the size check above catches what that costs. The checks look at
what matplotlib draws (text extents, line paths in display space, bar rectangles), so they
hold for any figure; they cannot judge whether a plot shows the right thing. :meth:`Run.figure
<macroarch.repro.tracking.Run.figure>` records the problems in the result file and warns; the ci notebooks'
test fails on any.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

#: the report's text width (A4, 2 cm side margins): every figure is scaled to it
TEXT_WIDTH_IN = (21.0 - 4.0) / 2.54
#: the smallest text size, in printed points, a figure may have at the text width
MIN_PRINTED_PT = 6.5
#: pixels of overlap tolerated (antialiasing, rounding of extents)
_SLACK_PX = 1.0


def _visible_text(t) -> bool:
    return t.get_visible() and bool(t.get_text().strip()) and t.get_alpha() != 0


def _shrunk(bbox, px: float = _SLACK_PX):
    from matplotlib.transforms import Bbox

    return Bbox.from_extents(bbox.x0 + px, bbox.y0 + px, bbox.x1 - px, bbox.y1 - px)


def _overlap(a, b) -> bool:
    a, b = _shrunk(a), _shrunk(b)
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def _name(ax, i: int) -> str:
    title = ax.get_title() or ax.get_title(loc="left") or ax.get_title(loc="right")
    return f"panel {i + 1}" + (f" ({title!r})" if title else "")


def _axis_texts(ax):
    """(what, text artist) for the titles and axis labels of one axes."""
    out = [(f"title {loc}", ax.title if loc == "center" else getattr(ax, f"_{loc}_title"))
           for loc in ("center", "left", "right")]
    out += [("x label", ax.xaxis.label), ("y label", ax.yaxis.label)]
    return [(w, t) for w, t in out if _visible_text(t)]


def _tick_labels(axis):
    """The tick labels matplotlib draws: ticks outside the view limits have labels but are not drawn."""
    lo, hi = sorted(axis.get_view_interval())
    span = (hi - lo) * 1e-9
    out = []
    for tick in axis.get_major_ticks() + axis.get_minor_ticks():
        if lo - span <= tick.get_loc() <= hi + span:
            out += [t for t in (tick.label1, tick.label2) if _visible_text(t)]
    return out


def _data_paths(ax):
    """Display-space paths of what ``ax`` plots: lines (with markers), filled areas, bars."""
    import numpy as np
    from matplotlib.collections import PathCollection, PolyCollection
    from matplotlib.lines import Line2D
    from matplotlib.patches import Rectangle

    shapes = []
    for line in ax.get_lines():
        if not isinstance(line, Line2D) or not line.get_visible() or line.get_label().startswith("_child"):
            continue
        path = line.get_transform().transform_path(line.get_path())
        if line.get_linestyle() not in ("None", "none", "", " "):
            shapes.append(("line", line.get_label(), path))
        if line.get_marker() not in (None, "None", "none", "", " "):
            shapes.append(("points", line.get_label(), path.vertices))
    for coll in ax.collections:
        if not coll.get_visible():
            continue
        if isinstance(coll, PathCollection):  # scatter
            shapes.append(("points", coll.get_label(), coll.get_offset_transform().transform(coll.get_offsets())))
        elif isinstance(coll, PolyCollection):  # fill_between: a band is allowed behind text, not checked
            continue
    for patch in ax.patches:
        if isinstance(patch, Rectangle) and patch.get_visible() and patch.get_height() != 0 \
                and patch.get_width() != 0 and patch.get_fill():
            shapes.append(("bar", patch.get_label(), patch.get_window_extent()))
    return [(kind, label, np.asarray(geom) if kind == "points" else geom) for kind, label, geom in shapes]


def _covers(bbox, shapes, *, bars: bool = True) -> str | None:
    """What plotted thing ``bbox`` (a legend, an annotation) is drawn over, if any (``bars=False``: a value
    written inside its bar is a label, not a defect)."""
    from matplotlib.transforms import Bbox

    box = _shrunk(bbox, 2.0)
    for kind, label, geom in shapes:
        if kind == "line":
            if geom.intersects_bbox(box, filled=False):
                return f"a line ({label})" if not label.startswith("_") else "a line"
        elif kind == "points":
            if len(geom) and ((geom[:, 0] > box.x0) & (geom[:, 0] < box.x1)
                              & (geom[:, 1] > box.y0) & (geom[:, 1] < box.y1)).any():
                return f"markers ({label})" if not label.startswith("_") else "markers"
        elif kind == "bar" and bars and isinstance(geom, Bbox) and _overlap(box, geom):
            return "a bar"
    return None


def figure_problems(fig, *, text_width_in: float = TEXT_WIDTH_IN, min_pt: float = MIN_PRINTED_PT) -> list[str]:
    """What is wrong with ``fig``'s layout, one sentence per problem (empty when nothing is)."""
    fig.draw_without_rendering()
    renderer = fig.canvas.get_renderer()
    problems: list[str] = []

    tight = fig.get_tightbbox(renderer)  # inches: what bbox_inches="tight" saves
    scale = text_width_in / tight.width
    all_texts = [t for t in fig.findobj(lambda a: hasattr(a, "get_text") and hasattr(a, "get_fontsize"))
                 if _visible_text(t)]
    small = sorted({round(t.get_fontsize() * scale, 1) for t in all_texts if t.get_fontsize() * scale < min_pt})
    if small:
        problems.append(f"text prints at {small[0]} pt at the report's text width ({text_width_in:.2f} in; the figure "
                        f"is {tight.width:.1f} in wide): make it at most "
                        f"{text_width_in * min(t.get_fontsize() for t in all_texts) / min_pt:.1f} in wide or its "
                        f"text larger (at least {min_pt} pt printed)")

    axes = [ax for ax in fig.axes if ax.get_visible() and ax.axison and ax.get_label() != "<colorbar>"]
    named: list[tuple[str, object]] = []  # (who, bbox): titles, labels, legends, annotations of the whole figure
    if fig._suptitle is not None and _visible_text(fig._suptitle):  # noqa: SLF001 (matplotlib has no getter)
        named.append(("the figure's title", fig._suptitle.get_window_extent(renderer)))
    for i, ax in enumerate(axes):
        who = _name(ax, i)
        for axis, letter in ((ax.xaxis, "x"), (ax.yaxis, "y")):
            if not axis.get_visible():
                continue
            ticks = _tick_labels(axis)
            boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in ticks]
            for (ta, a), (tb, b) in itertools.combinations(boxes, 2):
                if _overlap(a, b):
                    problems.append(f"{who}: {letter} tick labels {ta!r} and {tb!r} overlap")
                    break
            if ticks and not axis.label.get_text().strip():
                problems.append(f"{who}: the {letter} axis has tick labels but no label (name the quantity and "
                                "its unit)")
        shapes = _data_paths(ax)
        for what, t in _axis_texts(ax):
            named.append((f"{who} {what}", t.get_window_extent(renderer)))
        for t in ax.texts:
            if _visible_text(t):
                box = t.get_window_extent(renderer)
                named.append((f"{who} text {t.get_text()!r}", box))
                hit = _covers(box, shapes, bars=False)
                if hit:
                    problems.append(f"{who}: text {t.get_text()!r} is drawn over {hit}")
        legend = ax.get_legend()
        if legend is not None and legend.get_visible():
            box = legend.get_window_extent(renderer)
            named.append((f"{who} legend", box))
            hit = _covers(box, shapes)
            if hit:
                problems.append(f"{who}: the legend covers {hit}")
        for axis in (ax.xaxis, ax.yaxis):
            if axis.get_visible():
                named.extend((f"{who} tick label {t.get_text()!r}", t.get_window_extent(renderer))
                             for t in _tick_labels(axis))
    for legend in fig.legends:
        if legend.get_visible():
            named.append(("the figure's legend", legend.get_window_extent(renderer)))
    problems.extend(_overlaps(named))
    return problems


def _overlaps(named: Iterable[tuple[str, object]]) -> list[str]:
    out = []
    items = list(named)
    for (a, ba), (b, bb) in itertools.combinations(items, 2):
        if " tick label " in a and " tick label " in b:
            continue  # tick labels against each other: per axis, above
        if _overlap(ba, bb):
            out.append(f"{a} and {b} overlap")
    return out
