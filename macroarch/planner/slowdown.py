"""Expected slowdown of a combination of techniques: the benchmarks' measured step-time ratios, read from their
committed output, nothing else.

A ratio is a training step's time with the techniques over the plain step's time, in one run of one benchmark,
read from the JSON that run wrote (``benchmarks/figures/``, in a source checkout). Only combinations a committed
run measured have one; every other is unmeasured, never a product or a guess. The runs are CPU measurements at
small size (the JSON names the machine and the model); on a GPU the costs differ (the dequantisation of packed
weights, recomputation, all-gathers), so "cheapest" means "least slowdown among what was measured", stated as such.

- ``mvas``, ``mvas + dgr``: ``benchmarks/mvas.py``'s training step, ``benchmarks/figures/mvas_avx512.json``:
  ``step_s`` of its "MVAS" and "MVAS + DGR" runs over the plain step of the dtype recipe (``bf16_mixed``: "AdamW
  bf16 + fp32 master", ``fp32``: "AdamW fp32"; any other recipe: the run's own reference, said so) at each of its
  sizes; the ratio is the median over the sizes and the range over them is kept beside it.
- ``dgr`` alone, ``checkpoint``, ``fsdp2``, ``master`` and every other combination: no committed run measures them
  (``benchmarks/dgr.py`` prints its ratio but writes no JSON), so they are unmeasured.

Two ratios are told apart only where their ranges do not overlap (:meth:`Slowdown.faster_than`): MVAS's 0.95x over a
range of 0.87-1.04 is not measurably faster than the plain step's 1.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MVAS_RUNS = "benchmarks/figures/mvas_avx512.json"
"""The committed output of ``benchmarks/mvas.py`` (relative to the project root)."""
_VARIANTS = {frozenset({"mvas"}): "MVAS", frozenset({"mvas", "dgr"}): "MVAS + DGR"}
_REFERENCES = {"bf16_mixed": "AdamW bf16 + fp32 master", "fp32": "AdamW fp32"}


@dataclass(frozen=True)
class Slowdown:
    """A measured step-time ratio (>1: slower than the plain step) and where it comes from.

    Attributes:
        ratio: the ratio used for ranking (None: unmeasured).
        low, high: the range over the benchmark's sizes (equal to ``ratio`` when one was measured).
        source: the run it was read from (file, runs compared, sizes, model, machine), or why there is none.
    """

    ratio: float | None
    low: float | None
    high: float | None
    source: str

    @property
    def measured(self) -> bool:
        return self.ratio is not None

    def faster_than(self, other: Slowdown) -> bool:
        """Measurably faster: this whole range lies below ``other``'s (overlapping ranges are a tie)."""
        return self.measured and other.measured and self.high < other.low

    def text(self) -> str:
        if self.ratio is None:
            return "unmeasured"
        spread = f" ({self.low:.2f}-{self.high:.2f})" if self.high != self.low else ""
        return f"{self.ratio:.2f}x{spread}"


PLAIN = Slowdown(1.0, 1.0, 1.0, "the reference: the dtype recipe's AdamW")


def _root() -> Path:
    from macroarch.paths import project_root

    return project_root()


@functools.cache
def _runs(path: Path) -> dict[str, Any] | str:
    """The benchmark's JSON, or why it cannot be read."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return f"{MVAS_RUNS} is not here (a source checkout of the project has it)"
    except (OSError, json.JSONDecodeError) as e:
        return f"{MVAS_RUNS} cannot be read ({e})"


def _from_runs(data: dict[str, Any], variant: str, recipe: str) -> Slowdown:
    results = data.get("results", {})
    reference = _REFERENCES.get(recipe) if _REFERENCES.get(recipe) in results else None
    caveat = ""
    if reference is None:
        reference = data.get("reference")
        caveat = f"; the run has no plain step of the {recipe} recipe, so its own reference"
    if variant not in results or reference not in results:
        return Slowdown(None, None, None, f"{MVAS_RUNS} has no {variant!r} or {reference!r} run")
    times, base = results[variant]["step_s"], results[reference]["step_s"]
    sizes = sorted(set(times) & set(base), key=int)
    ratios = sorted(times[k] / base[k] for k in sizes)
    config, machine = data.get("config", {}), data.get("machine", {})
    model = (f"{data['n_params'] / 1e6:.2f}M-parameter Llama, {config.get('layers')} layers of width "
             f"{config.get('width')}" if "n_params" in data else "the benchmark's model")
    where = ", ".join(str(x) for x in (machine.get("cpu_model"), machine.get("cpu_capability"),
                                       f"{machine.get('threads')} thread(s)", f"torch {machine.get('torch')}")
                      if x is not None)
    return Slowdown(ratios[len(ratios) // 2], ratios[0], ratios[-1],
                    f"{MVAS_RUNS}: {variant!r} step_s over {reference!r}{caveat}, median over "
                    f"{'/'.join(sizes)} tokens per step ({model}; {where})")


def slowdown(techniques: frozenset[str], recipe: str = "bf16_mixed") -> Slowdown:
    """The measured ratio of exactly this combination under the dtype ``recipe``, or an unmeasured ``Slowdown``
    naming why."""
    if not techniques:
        return PLAIN
    variant = _VARIANTS.get(frozenset(techniques))
    if variant is None:
        return Slowdown(None, None, None, "no committed benchmark run measures this combination")
    data = _runs(_root() / MVAS_RUNS)
    if isinstance(data, str):
        return Slowdown(None, None, None, data)
    return _from_runs(data, variant, recipe)


__all__ = ["MVAS_RUNS", "PLAIN", "Slowdown", "slowdown"]
