"""A plan as text (a table per device), as JSON (``Plan.to_json``) and as a bar chart (``plot``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from macroarch._table import format_table

GB = 1e9
CATEGORIES = ("weights", "gradients", "master", "optimizer", "activations")
_COLORS = {"weights": "#4c72b0", "gradients": "#55a868", "master": "#8172b2", "optimizer": "#c44e52",
           "activations": "#ccb974"}


def _gb(x: int | None) -> str:
    return "-" if x is None else f"{x / GB:.2f}"


def text(plan: Any) -> str:
    """The plan for a terminal: the model and workload, one row per combination (GB per device), the verdict and
    the notes (how each row was measured and what is counted)."""
    m, w = plan.model, plan.workload
    head = [f"{m['name']} ({m['kind']}, {m['family']}): {m['parameters'] / 1e9:.3g}B parameters, layers {m['layers']}",
            f"batch {w['batch']} x {w['seq']} {w['seq_means']} per device, {w['dtype']}, {w['devices']} device(s)"
            + (f"; budget {plan.budget_source} per device" if plan.budget_source else "")]
    rows = [["combination", *CATEGORIES, "peak", "fits", "headroom", f"largest {w['search']}", "slowdown"]]
    for c in plan.combinations:
        b = c.bytes
        cats = [_gb(None if b is None else b.categories[k]) for k in CATEGORIES]
        fits = "-" if c.fits is None else ("yes" if c.fits else "no")
        largest = "-" if c.largest is None else f"{c.largest}{'+' if c.largest_capped else ''}"
        rows.append([c.name, *cats, _gb(None if b is None else b.peak), fits, _gb(c.headroom), largest,
                     c.slowdown.text()])
    lines = [*head, "", "GB per device (1e9 bytes):", format_table(rows), "", plan.verdict, ""]
    for c in plan.combinations:
        lines.append(f"- {c.name}: {c.error or c.how}" + "".join(f"; {n}" for n in c.notes))
        if c.slowdown.measured and c.techniques:
            lines.append(f"  slowdown: {c.slowdown.source}")
    lines.append("")
    lines.extend(f"note: {n}" for n in plan.notes)
    lines.append(f"planned in {plan.seconds:.1f} s")
    return "\n".join(lines)


def plot(plan: Any, path: str | Path) -> Path:
    """A stacked bar per combination (its categories, GB per device), the measured peak as a marker and the budget
    as a line, written to ``path`` (PNG or any format matplotlib infers from the suffix)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    combos = [c for c in plan.combinations if c.bytes is not None]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(combos) + 2), 4.2))
    xs = range(len(combos))
    bottom = [0.0] * len(combos)
    for k in CATEGORIES:
        values = [c.bytes.categories[k] / GB for c in combos]
        ax.bar(xs, values, bottom=bottom, color=_COLORS[k], label=k, width=0.6)
        bottom = [a + b for a, b in zip(bottom, values, strict=True)]
    ax.scatter(xs, [c.bytes.peak / GB for c in combos], marker="_", s=900, color="black", zorder=3,
               label="measured peak")
    if plan.budget_bytes is not None:
        ax.axhline(plan.budget_bytes / GB, color="red", linestyle="--", linewidth=1, label=plan.budget_source)
    ax.set_xticks(list(xs), [c.name for c in combos], rotation=30, ha="right")
    ax.set_ylabel("GB per device")
    w = plan.workload
    ax.set_title(f"{plan.model['name']}: batch {w['batch']} x {w['seq']}, {w['dtype']}", fontsize=10)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


__all__ = ["plot", "text"]
