"""Expected slowdown of a combination of techniques: the benchmarks' measured step-time ratios, nothing else.

A ratio is a training step's time with the techniques over the reference's time, in one run of one benchmark.
Only combinations a benchmark measured have one; every other is ``None`` ("unmeasured"), never a product or
a guess. The ratios are CPU measurements at small size (the machines and sizes are named in ``source``); on a
GPU the costs differ (the dequantisation of packed weights, recomputation, all-gathers), so "cheapest" means
"least slowdown among what was measured", stated as such.

- ``mvas``, ``mvas + dgr``: ``benchmarks/mvas.py``'s training step (a 3.25M-parameter Llama, 4 layers of width
  256, one thread, AVX-512 + AMX CPU, 2026-12-03 at c225872), ``step_s`` of "MVAS" and "MVAS + DGR" over "AdamW
  bf16 + fp32 master" at 1024, 4096 and 16384 tokens, from ``benchmarks/figures/mvas_avx512.json``; the ratio
  used is the median of the three, the range is kept beside it.
- ``dgr``: ``benchmarks/dgr.py`` (256 layers of width 64, 12.8M parameters, one thread), in
  ``docs/benchmarks.md``: plain step over DGR-sync step 0.963x (median of 11, atomic steps on), so a time ratio
  of 1 / 0.963. The planner runs DGR without atomic steps, which skips their copies: an upper bound.
- ``checkpoint``, ``fsdp2``, ``master`` and every other combination: no benchmark here measures them.
"""

from __future__ import annotations

from dataclasses import dataclass

_MVAS_JSON = "benchmarks/figures/mvas_avx512.json"
_MVAS_TOKENS = (1024, 4096, 16384)
# step_s from _MVAS_JSON at 1024 / 4096 / 16384 tokens (tests/planner check them against the file)
_REFERENCE_S = (0.23373517200525384, 0.8187705820018891, 3.2544030610006303)
_MVAS_S = (0.24257874900649767, 0.7764869430102408, 2.8202351049985737)
_MVAS_DGR_S = (0.24726644999464042, 0.8064091799897142, 3.7318743329960853)
_DGR_SPEED = 0.963  # docs/benchmarks.md, DGR-sync: "median of 11: 0.963x"


@dataclass(frozen=True)
class Slowdown:
    """A measured step-time ratio (>1: slower than the reference) and where it comes from.

    Attributes:
        ratio: the ratio used for ranking (None: unmeasured).
        low, high: the range over the benchmark's sizes (equal to ``ratio`` when one was measured).
        source: the benchmark, file and run it comes from, or why there is none.
    """

    ratio: float | None
    low: float | None
    high: float | None
    source: str

    @property
    def measured(self) -> bool:
        return self.ratio is not None

    def text(self) -> str:
        if self.ratio is None:
            return "unmeasured"
        spread = f" ({self.low:.2f}-{self.high:.2f})" if self.high != self.low else ""
        return f"{self.ratio:.2f}x{spread}"


def _from_times(times: tuple[float, ...], what: str) -> Slowdown:
    ratios = sorted(t / r for t, r in zip(times, _REFERENCE_S, strict=True))
    return Slowdown(ratios[len(ratios) // 2], ratios[0], ratios[-1],
                    f"{_MVAS_JSON}: {what} over 'AdamW bf16 + fp32 master' step_s, median of "
                    f"{'/'.join(map(str, _MVAS_TOKENS))} tokens (3.25M-parameter Llama, one CPU thread, c225872)")


_TABLE: dict[frozenset[str], Slowdown] = {
    frozenset(): Slowdown(1.0, 1.0, 1.0, "the reference: the dtype recipe's AdamW"),
    frozenset({"mvas"}): _from_times(_MVAS_S, "'MVAS'"),
    frozenset({"mvas", "dgr"}): _from_times(_MVAS_DGR_S, "'MVAS + DGR'"),
    frozenset({"dgr"}): Slowdown(1 / _DGR_SPEED, 1 / _DGR_SPEED, 1 / _DGR_SPEED,
                                 "docs/benchmarks.md, benchmarks/dgr.py: DGR-sync 0.963x the plain step's speed "
                                 "(median of 11, atomic steps on: an upper bound), 12.8M parameters, one CPU thread"),
}


def slowdown(techniques: frozenset[str]) -> Slowdown:
    """The measured ratio of exactly this combination, or an unmeasured ``Slowdown`` naming why."""
    if techniques in _TABLE:
        return _TABLE[techniques]
    return Slowdown(None, None, None, "no benchmark here measures this combination")


__all__ = ["Slowdown", "slowdown"]
