"""The benchmarks' results as figures: what their tables say, drawn, one column per run.

    .venv/bin/python benchmarks/optimizer_step.py --out step.json
    ATEN_CPU_CAPABILITY=avx2 .venv/bin/python benchmarks/optimizer_step.py --out step_avx2.json
    .venv/bin/python benchmarks/plot.py step.json step_avx2.json -o optimizer_step.png --labels "native,as AVX2"

    .venv/bin/python benchmarks/mvas.py --json mvas.json
    .venv/bin/python benchmarks/plot.py mvas.json -o mvas.png

Each file's kind is read from it (``optimizer_step.py --out`` or ``mvas.py --json``); the files of one figure are
all of one kind, and each becomes a column titled by the machine it ran on (CPU model, the vector capability torch
dispatched to, bf16 native or emulated). Speeds are ratios against the run's own reference, as in the tables
(the reference's median step over the row's: above 1 is faster), so runs on different machines can sit side by
side without comparing their clocks.

- **Optimizer step** (``optimizer_step.py``): above, each optimizer's speed relative to torch's foreach AdamW at
  the same size and threads, against the elements per step (one line per optimizer: solid on the fewest threads,
  dashed on more); below, the share of the run's bandwidth limit its bytes reached (its achieved GB/s over the
  limit the run measured). Issue 14's question is whether the MVAS lines stay above 1: an optimizer that moves a
  third of the bytes is faster where the reference is held up by memory, and elsewhere only if its arithmetic is.
- **Training step** (``mvas.py``): above, each variant's speed relative to the bf16 + fp32-master reference against
  the tokens per step, with the target the run recorded for MVAS + DGR (issue 14: 0.9x); below, each variant's
  bytes per parameter against that speed at the first tokens count, the target corner (at most the bytes, at least
  the speed) shaded, each point labelled with its eval loss relative to the reference's.

The figure is written whole or not at all (a temporary file, then a rename); its format is the output's suffix.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _common import BF16_REFERENCE, FOREACH_REFERENCE, format_size
from matplotlib.backend_bases import FigureCanvasBase
from matplotlib.figure import Figure  # not pyplot: no window, no global figure registry
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, PercentFormatter

THREAD_STYLES = ("-", "--", ":", "-.")
_RATIO_TICKS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)


def load(path: str | Path) -> tuple[str, dict[str, Any]]:
    """``(kind, data)`` of one benchmark's JSON; ValueError naming the file if it is not one."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    results = data.get("results") if isinstance(data, dict) else None
    if isinstance(results, list) and "limit_gb_per_s" in data:
        return "optimizer step", data
    if isinstance(results, dict) and all(isinstance(r, dict) and "step_s" in r for r in results.values()):
        return "training step", data
    raise ValueError(f"{path}: neither benchmarks/optimizer_step.py --out nor benchmarks/mvas.py --json output")


def reference_of(kind: str, data: dict[str, Any]) -> str:
    """The run's reference, as it recorded it (runs before it did: the benchmark's own)."""
    return data.get("reference", FOREACH_REFERENCE if kind == "optimizer step" else BF16_REFERENCE)


def machine_title(data: dict[str, Any], label: str | None = None) -> str:
    """The column title: ``label`` if given, the CPU model, torch's dispatch capability, bf16 native or emulated,
    and the settings that made the CPU pose as a lesser one, where the run recorded them."""
    m = data.get("machine", {})
    bf16 = "bf16 native" if m.get("native_bf16") else "bf16 emulated"
    lines = [label] if label else []
    lines += [m.get("cpu_model", "unknown CPU"), f"{m.get('cpu_capability', '?')}, {bf16}"]
    if m.get("emulating"):
        lines.append("posing as: " + " ".join(f"{k}={v}" for k, v in m["emulating"].items()))
    return "\n".join(lines)


def step_speeds(data: dict[str, Any], path: str = "") -> dict[str, dict[int, dict[int, tuple[float, float]]]]:
    """``{optimizer: {threads: {elements: (speed vs the reference, share of the bandwidth limit)}}}`` of an
    optimizer-step run, in the run's order; skipped rows are left out. ValueError if a measured size lacks the
    reference (run it with ``--only`` including it)."""
    reference = reference_of("optimizer step", data)
    rows = [r for r in data["results"] if not r.get("skipped")]
    ref = {(int(r["threads"]), r["numel"]): r["step_s"] for r in rows if r["optimizer"] == reference}
    limits = {int(t): gbs for t, gbs in data["limit_gb_per_s"].items()}
    out: dict[str, dict[int, dict[int, tuple[float, float]]]] = {}
    for r in rows:
        threads = int(r["threads"])
        if (threads, r["numel"]) not in ref:
            raise ValueError(f"{path}: no {reference!r} row at {format_size(r['numel'])} elements and {threads} "
                             f"thread(s): every speed is relative to it (keep it in --only)")
        speed = ref[threads, r["numel"]] / r["step_s"]
        share = r["gb_per_s"] / limits[threads]
        out.setdefault(r["optimizer"], {}).setdefault(threads, {})[r["numel"]] = (speed, share)
    return out


def train_speeds(data: dict[str, Any], path: str = "") -> dict[str, dict[int, float]]:
    """``{variant: {tokens: speed vs the reference}}`` of a training-step run; ValueError without the reference."""
    reference = reference_of("training step", data)
    results = data["results"]
    if reference not in results:
        raise ValueError(f"{path}: no {reference!r} variant: every speed is relative to it (keep it in --only)")
    base = {int(t): s for t, s in results[reference]["step_s"].items()}
    return {v: {int(t): base[int(t)] / s for t, s in r["step_s"].items() if int(t) in base}
            for v, r in results.items()}


def _label(labels: Sequence[str | None], col: int) -> str | None:
    return labels[col] if col < len(labels) else None


def _ratio_axis(ax: Any, values: list[float]) -> None:
    """A log axis of speed ratios with ticks at round ratios around ``values``."""
    ax.set_yscale("log")
    lo, hi = min(values + [1.0]) / 1.15, max(values + [1.0]) * 1.15
    ax.set_ylim(lo, hi)
    ax.set_yticks([t for t in _RATIO_TICKS if lo <= t <= hi])
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}x"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda y, _: ""))


def _size_axis(ax: Any, sizes: list[int], label: str) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [format_size(s) for s in sizes])
    ax.minorticks_off()
    ax.set_xlabel(label)


def _colors(names: Sequence[str], reference: str) -> dict[str, str]:
    """One color per name across every column; the reference black."""
    others = [n for n in names if n != reference]
    return {reference: "black", **{n: f"C{i % 10}" for i, n in enumerate(others)}}


def figure_optimizer_step(runs: Sequence[tuple[str, dict[str, Any]]], labels: Sequence[str | None] = ()) -> Figure:
    """Speed against foreach AdamW (above) and share of the bandwidth limit (below), a column per run."""
    speeds = [step_speeds(data, path) for path, data in runs]
    names = list(dict.fromkeys(n for s in speeds for n in s))
    reference = reference_of("optimizer step", runs[0][1])
    colors = _colors(names, reference)
    threads_all = sorted({t for s in speeds for per in s.values() for t in per})
    fig = Figure(figsize=(5.2 * len(runs), 7.5))
    axes = fig.subplots(2, len(runs), squeeze=False, sharex="col")
    for col, ((_path, data), speed) in enumerate(zip(runs, speeds)):
        top, bottom = axes[0][col], axes[1][col]
        sizes = sorted({n for per in speed.values() for pts in per.values() for n in pts})
        for name, per in speed.items():
            for threads, pts in sorted(per.items()):
                xs = sorted(pts)
                style = dict(color=colors[name], ls=THREAD_STYLES[threads_all.index(threads) % len(THREAD_STYLES)],
                             marker="o", ms=3.5, lw=2.2 if name == reference else 1.4)
                if name != reference:
                    top.plot(xs, [pts[x][0] for x in xs], **style)
                bottom.plot(xs, [pts[x][1] for x in xs], **style)
        top.axhline(1.0, color="black", lw=1.2)
        _ratio_axis(top, [pts[x][0] for per in speed.values() for pts in per.values() for x in pts])
        top.set(title=machine_title(data, _label(labels, col)),
                ylabel=f"speed vs {reference}\n(its step time / this one's)")
        bottom.set_ylim(0, max(1.0, max(pts[x][1] for per in speed.values() for pts in per.values() for x in pts)))
        bottom.yaxis.set_major_formatter(PercentFormatter(1.0))
        bottom.set_ylabel("bytes moved: share of the\nrun's bandwidth limit")
        _size_axis(bottom, sizes, "elements per step (one tensor)" if data["config"].get("tensors", 1) == 1
                   else f"elements per step ({data['config']['tensors']} tensors)")
        for ax in (top, bottom):
            ax.grid(True, which="major", alpha=0.3)
    handles = [Line2D([], [], color=colors[n], lw=2, label=n) for n in names]
    handles += [Line2D([], [], color="gray", ls=THREAD_STYLES[i % len(THREAD_STYLES)], label=f"{t} thread(s)")
                for i, t in enumerate(threads_all)]
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle("Optimizer step alone (benchmarks/optimizer_step.py): speed and bytes, against foreach AdamW",
                 fontsize=11)
    fig.tight_layout(rect=(0, 0.04 + 0.022 * ((len(handles) + 2) // 3), 1, 0.97))
    return fig


def figure_training_step(runs: Sequence[tuple[str, dict[str, Any]]], labels: Sequence[str | None] = ()) -> Figure:
    """Speed against the reference by tokens per step (above); bytes per parameter against speed (below)."""
    speeds = [train_speeds(data, path) for path, data in runs]
    names = list(dict.fromkeys(n for s in speeds for n in s))
    reference = reference_of("training step", runs[0][1])
    colors = _colors(names, reference)
    fig = Figure(figsize=(6.0 * len(runs), 9.5))
    axes = fig.subplots(2, len(runs), squeeze=False)
    for col, ((_path, data), speed) in enumerate(zip(runs, speeds)):
        top, bottom = axes[0][col], axes[1][col]
        targets = data.get("targets", {})
        tokens = sorted({t for pts in speed.values() for t in pts})
        for name, pts in speed.items():
            if name != reference:
                xs = sorted(pts)
                top.plot(xs, [pts[x] for x in xs], color=colors[name], marker="o", ms=3.5, lw=1.4, label=name)
        top.axhline(1.0, color="black", lw=1.2)
        if "speed" in targets:
            top.axhline(targets["speed"], color="black", ls=":", lw=1)
        _ratio_axis(top, [v for pts in speed.values() for v in pts.values()])
        _size_axis(top, tokens, "tokens per step")
        fair = data.get("fair_reference", reference)
        title = machine_title(data, _label(labels, col))
        top.set(title=title + ("" if fair == reference else f"\nthe fair reference here: {fair}"),
                ylabel=f"speed vs {reference}")
        first = tokens[0]
        ref_loss = data["results"][reference]["eval_loss"]
        points = [(r["bytes_per_param"], speed[name][first], name,
                   f"{name}\neval loss {r['eval_loss'] / ref_loss - 1:+.1%}")
                  for name, r in data["results"].items() if first in speed[name]]
        for x, y, name, _ in points:
            bottom.scatter(x, y, color=colors[name], s=30, zorder=3)
        _ratio_axis(bottom, [y for _, y, _, _ in points])
        bottom.set_xlim(0, max([x for x, *_ in points] + [targets.get("bytes_per_param", 0)]) * 1.3)
        if "bytes_per_param" in targets and "speed" in targets:
            bottom.fill_between([0, targets["bytes_per_param"]], targets["speed"], bottom.get_ylim()[1],
                                color="green", alpha=0.08)
        _label_points(bottom, [(x, y, text) for x, y, _, text in points])
        bottom.set(xlabel="training state: bytes per parameter", ylabel=f"speed at {format_size(first)} tokens")
        for ax in (top, bottom):
            ax.grid(True, which="major", alpha=0.3)
    handles = [Line2D([], [], color=colors[n], marker="o", ms=3.5, lw=1.4, label=n) for n in names if n != reference]
    handles.append(Line2D([], [], color="black", lw=1.2, label=f"{reference} (the reference)"))
    targets = runs[0][1].get("targets", {})
    if "speed" in targets:
        handles.append(Line2D([], [], color="black", ls=":", lw=1, label=f"target for MVAS + DGR: "
                                                                          f"{targets['speed']:g}x"))
    if "bytes_per_param" in targets:
        handles.append(Patch(color="green", alpha=0.15, label=f"the target's corner: <= {targets['bytes_per_param']:g} "
                                                              f"bytes/param, >= {targets.get('speed', 0):g}x"))
    fig.legend(handles=handles, loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.suptitle("Training step (benchmarks/mvas.py): speed, bytes per parameter, eval loss", fontsize=11)
    fig.tight_layout(rect=(0, 0.03 + 0.025 * ((len(handles) + 1) // 2), 1, 0.97))
    return fig


def _label_points(ax: Any, points: Sequence[tuple[float, float, str]], fontsize: float = 7) -> None:
    """Each point's text to its right, moved down where it would overlap a label placed before (top first)."""
    dpi, placed = ax.figure.dpi, []
    for x, y, text in sorted(points, key=lambda p: -p[1]):
        px, py = (v * 72 / dpi for v in ax.transData.transform((x, y)))  # in points
        lines = text.split("\n")
        w, h = 0.6 * fontsize * max(map(len, lines)), 1.3 * fontsize * len(lines)
        dy = 3.0
        while any(px + 5 < bx1 and bx0 < px + 5 + w and py + dy < by1 and by0 < py + dy + h
                  for bx0, by0, bx1, by1 in placed):
            dy -= 2.0
        placed.append((px + 5, py + dy, px + 5 + w, py + dy + h))
        ax.annotate(text, (x, y), xytext=(5, dy), textcoords="offset points", fontsize=fontsize, va="bottom",
                    arrowprops=None if dy > -h / 2 else dict(arrowstyle="-", lw=0.5, color="gray"))


def figure_format(path: str | Path) -> str:
    """The format ``path``'s suffix names; ValueError if matplotlib cannot write it."""
    fmt = Path(path).suffix.lstrip(".").lower()
    known = FigureCanvasBase.get_supported_filetypes()
    if fmt not in known:
        raise ValueError(f"{path}: {fmt or 'no suffix'} is not a figure format; use one of {', '.join(sorted(known))}")
    return fmt


def save(fig: Figure, path: str | Path) -> Path:
    """Write ``fig`` to ``path`` whole or not at all, in the format its suffix names."""
    path = Path(path)
    fmt = figure_format(path)
    tmp = path.with_name(f".{path.name}.partial")
    try:
        fig.savefig(tmp, format=fmt, dpi=130, bbox_inches="tight")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def only(kind: str, data: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """``data`` with only the optimizers or variants ``names`` and its reference (which every speed needs)."""
    keep = {*names, reference_of(kind, data)}
    results = data["results"]
    if kind == "optimizer step":
        return {**data, "results": [r for r in results if r["optimizer"] in keep]}
    return {**data, "results": {v: r for v, r in results.items() if v in keep}}


def figure(paths: Sequence[str | Path], labels: Sequence[str | None] = (), names: Sequence[str] = ()) -> Figure:
    """The figure of the runs in ``paths`` (all of one kind), columns titled ``labels`` first where given; ``names``:
    only these optimizers or variants (and the reference), every one measured otherwise."""
    if not paths:
        raise ValueError("no result files given")
    if len(labels) > len(paths):
        raise ValueError(f"{len(labels)} labels for {len(paths)} result files")
    loaded = [(str(p), *load(p)) for p in paths]
    kinds = {kind for _, kind, _ in loaded}
    if len(kinds) > 1:
        raise ValueError("one figure shows one kind of run; got " + ", ".join(f"{p}: {k}" for p, k, _ in loaded))
    runs = [(p, data) for p, _, data in loaded]
    if names:
        known = {r["optimizer"] if isinstance(r, dict) else r for _, data in runs for r in data["results"]}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ValueError(f"--only: {unknown} not in these runs; they have: {', '.join(sorted(known))}")
        runs = [(p, only(next(iter(kinds)), data, names)) for p, data in runs]
    draw = figure_optimizer_step if kinds == {"optimizer step"} else figure_training_step
    return draw(runs, labels)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="JSON files of optimizer_step.py --out or mvas.py --json")
    parser.add_argument("-o", "--output", required=True, help="the figure file (.png, .svg, .pdf)")
    parser.add_argument("--labels", default=None, help="comma-separated column titles, one per file, in order")
    parser.add_argument("--only", default=None, help="comma-separated optimizers or variants to draw (and the "
                                                      "reference); all by default")
    args = parser.parse_args(argv)
    labels = [v.strip() or None for v in args.labels.split(",")] if args.labels else []
    names = [v.strip() for v in args.only.split(",") if v.strip()] if args.only else []
    try:
        figure_format(args.output)  # before the work, not after
        print(save(figure(args.results, labels, names), args.output))
    except ValueError as e:
        parser.error(str(e))


if __name__ == "__main__":
    main()
