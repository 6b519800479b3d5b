"""A run's metrics for the appendix: grouped by what they measure, each with its unit.

A metric's unit is read from its name, the convention the harnesses follow (``*_bytes`` bytes, ``*_seconds``
seconds, ``*_loss`` nats, ...); a name that says nothing gets no unit rather than a guessed one. Groups are the
name's first word (``analytic_*``, ``measured_*``, ``plain_*``), so a claim's variants or phases read as
blocks; a word that only one metric starts with goes to the group "other".
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from macroarch.measure.stats import is_estimate_dict

# (regex on the name, unit); the first that matches wins, so the specific rules come before the general ones
_UNITS: tuple[tuple[str, str], ...] = (
    (r"_rate(_stderr)?(_sigma\w+)?$", "log-growth per layer"),  # a fitted rate and its standard error
    # a standard error has the unit of what it is the error of, which such a name does not state
    (r"(^|_)(standard_error|std_error|stderr)$", ""),
    # a largest difference between gradients: the gradients' own unit, not a ratio (``_vs_``) or a fraction
    (r"(^|_)grad_error(_|$)", "gradient units"),
    (r"_bytes(_gpu|_cpu)?$|_bytes_", "bytes"),
    # a reduction is a fraction saved, also when it is one stack's over another's (``a_over_b_reduction_256``)
    (r"_reduction(_\d+)?$|(^|_)overhead(_|$)", "fraction"),
    (r"(^|_)seconds$|_s$|_time$", "s"),
    (r"_ms$", "ms"),
    (r"_us$|latency_us", "us"),
    (r"(^|_)loss(_gain)?$|_loss_|_nats$", "nats"),
    (r"(_ratio|_speedup|_multiplier|_factor|_growth|_shift)(_\d+gb)?$|_over_", "x"),
    (r"(_share|_reduction|_fraction|_accuracy|_recall(_at_1)?|_rel_error|_error)(_\d+)?$|_reduction_", "fraction"),
    (r"frames", "frames"),
    (r"(^|_)params$", "parameters"),
    (r"(^|_)steps$", "steps"),
    (r"(^|_)batch(_\w+)?$", "samples"),
    (r"triggers$|_runs_with_", "count"),
    (r"_share_at_|_share$", "fraction"),
    (r"_s_at_", "s"),
    (r"diverged", "runs"),
    (r"_peak_gain$|_throughput_gain$|_vs_|speedup", "x"),
    (r"_gap(_r5)?$|_gap_(lo|hi)$|_gap_per_seed_(max|min)$|_r1$|_r5$|recall1$", "fraction"),
    (r"_gbps$|_gbs$", "GB/s"),
    (r"_tflops$", "TFLOP/s"),
    (r"_mb$", "MiB"),
    (r"_crop$", "residues"),
    (r"collectives|_moves$|failures|seeds$|_blocks$|_points$|_extensions$|_layers$", "count"),
    (r"_equals_|_ok$|_identical$|_exact$|at_grid_edge", "1 = yes"),
    (r"_cosine$", "cosine"),
    (r"warmup_extension_gain$", "nats"),
    (r"_ratio_(max|min)$|slowdown$", "x"),
    (r"_share_(measured|model)$|_error_mean$", "fraction"),
    (r"cards_needed$", "cards"),
    (r"(^|_)steps_|_k$", "steps"),
    (r"_final_scale$", "loss scale"),
    (r"block_size$", "elements"),
    (r"_gb$", "GB"),
)


def unit_of(name: str) -> str:
    """The unit a metric's name states ("" where it states none); ``<metric>_lo``/``_hi`` share ``<metric>``'s."""
    name = re.sub(r"_(lo|hi)$", "", name)
    for pattern, unit in _UNITS:
        if re.search(pattern, name.lower()):
            return unit
    return ""


def value_text(name: str, v: Any) -> str:
    """A metric's value as recorded; bytes also in decimal GB (as the post counts), fractions also in %."""
    if is_estimate_dict(v):
        lo, hi = v.get("low"), v.get("high")
        text = f"{v['value']:.6g}" + (f" [{lo:.4g}, {hi:.4g}]" if lo is not None and hi is not None else "")
        return text + f" ({v.get('method')}, n={v.get('n')})"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    text = f"{v:.6g}" if isinstance(v, float) else str(v)
    unit = unit_of(name)
    if unit == "bytes" and abs(v) >= 1e6:
        text += f" ({v / 1e9:,.2f} GB)"
    elif unit == "fraction" and -10 < v < 10 and not name.endswith("error"):
        text += f" ({v:.1%})"
    return text


def groups(metrics: Mapping[str, Any]) -> list[tuple[str, list[str]]]:
    """``(group, names)`` in name order, the one-member groups gathered under "other" (last)."""
    by: dict[str, list[str]] = {}
    for name in sorted(metrics):
        by.setdefault(name.split("_", 1)[0], []).append(name)
    out, other = [], []
    for g, names in by.items():
        (out.append((g, names)) if len(names) > 1 else other.extend(names))
    if other:
        out.append(("other", sorted(other)))
    return out
