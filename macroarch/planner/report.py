"""A plan as text (a table per device), as JSON (``Plan.to_json``) and as a bar chart (``plot``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from macroarch._table import format_table

CATEGORIES = ("weights", "gradients", "master", "optimizer", "activations")
_COLORS = {"weights": "#4c72b0", "gradients": "#55a868", "master": "#8172b2", "optimizer": "#c44e52",
           "activations": "#ccb974"}


UNITS = (("GB", 1e9), ("MB", 1e6), ("kB", 1e3))


def unit_for(nbytes: int) -> tuple[str, float]:
    """The decimal unit a table of sizes up to ``nbytes`` reads best in (GB down to kB)."""
    return next(((name, size) for name, size in UNITS if nbytes >= size), UNITS[-1])


def size_text(nbytes: int) -> str:
    """``nbytes`` in the unit that suits it, three significant digits (``45.0 GB``, ``812 kB``)."""
    name, size = unit_for(abs(nbytes))
    return f"{nbytes / size:.3g} {name}"


def text(plan: Any) -> str:
    """The plan for a terminal: the model and workload, one row per combination (bytes per device, in GB, MB or
    kB), the verdict and the notes (how each row was measured and what is counted)."""
    m, w = plan.model, plan.workload
    head = [f"{m['name']} ({m['kind']}, {m['family']}): {m['parameters'] / 1e9:.3g}B parameters, layers {m['layers']}",
            f"batch {w['batch']} x {w['seq']} {w['seq_means']}"
            + (f" x {w['frames']} frames" if w.get("frames") is not None else "")
            + f" per device, {w['dtype']}, {w['devices']} device(s)"
            + (f"; budget {plan.budget_source} per device" if plan.budget_source else "")]
    unit, size = unit_for(max((c.bytes.peak for c in plan.combinations if c.bytes is not None), default=0))

    def amount(x: int | None) -> str:
        return "-" if x is None else f"{x / size:.2f}"

    rows = [["combination", *CATEGORIES, "peak", "peak in", "fits", "headroom", f"largest {w['search']}",
             "slowdown"]]
    for c in plan.combinations:
        b = c.bytes
        cats = [amount(None if b is None else b.categories[k]) for k in CATEGORIES]
        fits = "-" if c.fits is None else ("yes" if c.fits else "no")
        largest = "-" if c.largest is None else f"{c.largest}{'+' if c.largest_capped else ''}"
        rows.append([c.name, *cats, amount(None if b is None else b.peak),
                     (b.phase if b is not None else None) or "-", fits, amount(c.headroom), largest,
                     c.slowdown.text()])
    lines = [*head, "", f"{unit} per device (1e{round(math.log10(size))} bytes):", format_table(rows), "",
             plan.verdict, ""]
    for c in plan.combinations:
        lines.append(f"- {c.name}: {c.error or c.how}" + "".join(f"; {n}" for n in c.notes))
        if c.techniques:
            lines.append(f"  slowdown: {c.slowdown.source}")
    lines.append("")
    lines.extend(f"note: {n}" for n in plan.notes)
    lines.append(f"planned in {plan.seconds:.1f} s")
    return "\n".join(lines)


def _short(name: str) -> str:
    """A model spec for a title: a config path by its folder (or file) name."""
    path = Path(name)
    if len(path.parts) > 1:
        return path.parent.name if path.name == "config.json" else path.name
    return name


def figure(plan: Any) -> Any:
    """The bar chart of ``plan``: a stacked horizontal bar per combination (its categories per device; names on
    the y axis, so any number of combinations reads), the measured peak as a black tick and the budget as a dashed
    line; the legend sits below the axes, off the bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    combos = [c for c in plan.combinations if c.bytes is not None][::-1]  # the plain step on top
    unit, size = unit_for(max([c.bytes.peak for c in combos] + [plan.budget_bytes or 0]))
    fig, ax = plt.subplots(figsize=(7.5, 2.4 + 0.4 * len(combos)))
    ys = list(range(len(combos)))
    left = [0.0] * len(combos)
    handles = []
    for k in CATEGORIES:
        values = [c.bytes.categories[k] / size for c in combos]
        handles.append(ax.barh(ys, values, left=left, color=_COLORS[k], label=k, height=0.6))
        left = [a + b for a, b in zip(left, values, strict=True)]
    ax.scatter([c.bytes.peak / size for c in combos], ys, marker="|", s=500, linewidths=2, color="black", zorder=3)
    handles.append(Line2D([], [], color="black", marker="|", markersize=12, markeredgewidth=2, linestyle="none",
                          label="measured peak"))
    if plan.budget_bytes is not None:
        ax.axvline(plan.budget_bytes / size, color="red", linestyle="--", linewidth=1)
        handles.append(Line2D([], [], color="red", linestyle="--", linewidth=1,
                              label=f"budget {plan.budget_bytes / size:.3g} {unit}"))
    ax.set_yticks(ys, [c.name for c in combos])
    ax.set_ylabel("combination")
    ax.set_xlabel(f"{unit} per device (1e{round(math.log10(size))} bytes)")
    ax.set_xlim(0, 1.05 * max([*left, *(c.bytes.peak / size for c in combos), (plan.budget_bytes or 0) / size]))
    w = plan.workload
    ax.set_title(f"{_short(plan.model['name'])}: batch {w['batch']} x {w['seq']} {w['seq_means']}, {w['dtype']}",
                 fontsize=10)
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=9, frameon=False)
    rows = -(-len(handles) // 4)
    fig.tight_layout(rect=(0, (0.1 + 0.28 * rows) / fig.get_figheight(), 1, 1))  # inches kept for the legend
    return fig


def plot(plan: Any, path: str | Path) -> Path:
    """``figure(plan)`` written to ``path`` (PNG or any format matplotlib infers from the suffix)."""
    import matplotlib.pyplot as plt

    fig = figure(plan)
    path = Path(path)
    try:
        fig.savefig(path, dpi=120, bbox_inches="tight")
    finally:
        plt.close(fig)
    return path


__all__ = ["figure", "plot", "text"]
