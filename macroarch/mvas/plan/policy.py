"""Precision allocation for MVAS (post section 3.2: "key parameters FP16, secondary FP8 or even FP4"): which
tensor is stored in which format, by explicit rules or under a memory budget.

- **Rules** ``[(pattern, format), ...]``: ``fnmatch`` globs on parameter names, case-sensitive, first match
  wins. A pattern also covers everything under a module it names exactly (``"visual.transformer"`` matches
  ``"visual.transformer.resblocks.0.attn.in_proj_weight"``). Note that ``*`` crosses dots and ``[0-5]`` is
  one character. Unmatched tensors keep their own dtype.
- **Precision policies** (``{text: fp16, image: [fp8, fp16]}``, the post's CLIP policy, or ``{part: [shallow,
  deep]}`` for any model): rules made by ``macroarch.mvas.plan.precision_policy``.
- **Budget** (``plan_for_budget``): choose a format per tensor to minimise the total sensitivity (HAWQ:
  the loss increase of storing it in that format, from ``importance.sensitivity``) subject to
  ``bytes <= target``: a multiple-choice knapsack. Solved greedily: each tensor's options are reduced to
  their lower convex hull in (bytes saved, sensitivity), the hull's steps from all tensors are taken in order
  of sensitivity per byte saved until the target is met, then steps no longer needed are undone, latest
  first. The greedy total exceeds the optimum by at most the sensitivity of the last step taken; the plan
  records its total (``sensitivity``) and the LP-relaxation lower bound (``sensitivity_bound``), so the gap
  of every plan is known. Without a sensitivity the proxy is each tensor's squared round-to-nearest error
  ``||q(w) - w||^2`` (HAWQ with H = I: numel-weighted mean squared error).

In both modes norms and biases (``keep_patterns``) and tensors of fewer than ``min_numel = 4096`` elements
(torchao's low-bit optimizer threshold) keep their own dtype: they cost little and matter much. Embeddings
and output heads are large, so they are not kept by default: name them in ``keep_patterns`` (own dtype) or,
for budgets, ``keep_high`` (the highest candidate format) to treat them as the post's key parameters. Block-scaled
formats use ``block_size``; a tensor whose element count it does not divide gets one scale per tensor.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from macroarch._table import format_table
from macroarch.mvas.codecs.formats import dtype_format, get_format, storage_bytes
from macroarch.mvas.packed.packed_tensor import quantization_error

Rule = tuple[str, str]
# norms as transformers (``input_layernorm``, ``LayerNorm``, ``norm``), timm (``norm1``) and open_clip / GPT-2
# (``ln_1``, ``ln_final``) name them, and every bias
DEFAULT_KEEP_PATTERNS = ("*norm*", "*Norm*", "*ln_*", "*bias")
MIN_NUMEL = 4096
NamedTensors = nn.Module | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class TensorPlan:
    """One tensor's storage: ``format`` with ``block_size`` (None: unscaled format, or one scale per tensor)."""

    name: str
    numel: int
    dtype: torch.dtype
    format: str
    block_size: int | None
    reason: str

    @property
    def nbytes(self) -> int:
        return storage_bytes(self.numel, self.format, self.block_size)


@dataclass(frozen=True)
class PrecisionPlan:
    """A format for every tensor; ``sensitivity``/``sensitivity_bound`` are set by budget planning."""

    tensors: tuple[TensorPlan, ...]
    sensitivity: float | None = None
    sensitivity_bound: float | None = None
    _index: dict[str, TensorPlan] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError(f"a plan names a tensor twice: {sorted({n for n in names if names.count(n) > 1})}")
        object.__setattr__(self, "_index", {t.name: t for t in self.tensors})

    def __getitem__(self, name: str) -> TensorPlan:
        if name not in self._index:
            raise KeyError(f"the plan has no tensor {name!r}")
        return self._index[name]

    def formats(self) -> dict[str, str]:
        return {t.name: t.format for t in self.tensors}

    def bytes(self) -> int:
        """Exact storage of every tensor in its planned format, scales included."""
        return sum(t.nbytes for t in self.tensors)

    def dense_bytes(self, dtype: torch.dtype | None = None) -> int:
        """Storage of the same tensors all in ``dtype`` (None: each in the dtype it was planned from)."""
        return sum(t.numel * (t.dtype.itemsize if dtype is None else dtype.itemsize) for t in self.tensors)

    def reduction(self, baseline: torch.dtype | None = None) -> float:
        """Predicted memory reduction, ``1 - bytes / dense_bytes(baseline)``."""
        dense = self.dense_bytes(baseline)
        return 1.0 - self.bytes() / dense if dense else 0.0

    def describe(self, per_tensor: bool = False) -> str:
        """A table by format (and by tensor with ``per_tensor=True``), with totals and reductions."""
        total = self.bytes()
        groups: dict[tuple[str, str], list[TensorPlan]] = {}
        for t in self.tensors:
            groups.setdefault((t.format, "tensor" if t.block_size is None else str(t.block_size)), []).append(t)
        rows: list[list[object]] = [["format", "block", "tensors", "elements", "bytes", "share"]]
        for (fmt, block), ts in sorted(groups.items()):
            nbytes = sum(t.nbytes for t in ts)
            rows.append([fmt, block if get_format(fmt).block_scaled else "-", len(ts), sum(t.numel for t in ts),
                         nbytes, f"{nbytes / total:.1%}" if total else "-"])
        lines = [format_table(rows), f"total {total} bytes; reduction vs own dtypes {self.reduction():.1%}, "
                 f"vs bf16 {self.reduction(torch.bfloat16):.1%}, vs fp32 {self.reduction(torch.float32):.1%}"]
        if self.sensitivity is not None:
            lines.append(f"sensitivity {self.sensitivity:.6g} (lower bound {self.sensitivity_bound:.6g})")
        if per_tensor:
            lines.append(format_table([["tensor", "elements", "format", "bytes", "why"]] + [
                [t.name, t.numel, t.format, t.nbytes, t.reason] for t in self.tensors]))
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------- helpers
def named_tensors(tensors: NamedTensors) -> list[tuple[str, torch.Tensor]]:
    items = list(tensors.named_parameters() if isinstance(tensors, nn.Module)
                 else tensors.items() if isinstance(tensors, Mapping) else tensors)
    for name, t in items:
        if not isinstance(t, torch.Tensor) or t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"tensor {name!r}: plans cover fp32, bf16 and fp16 tensors; got "
                             f"{getattr(t, 'dtype', type(t).__name__)}")
    return items


def _kept(name: str, numel: int, min_numel: int, keep_patterns: Sequence[str]) -> str | None:
    """Why ``name`` keeps its own dtype, or None."""
    if numel < min_numel:
        return f"kept: {numel} < min_numel {min_numel}"
    pattern = next((p for p in keep_patterns if matches(name, p)), None)
    return None if pattern is None else f"kept: matches {pattern!r}"


def matches(name: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, pattern + ".*")


def block_for(numel: int, fmt: str, block_size: int | None) -> int | None:
    """``block_size`` if it divides ``numel`` (and the format has scales), else one scale per tensor."""
    if not get_format(fmt).block_scaled or block_size is None or block_size == -1 or numel % block_size:
        return None
    return block_size


def _entry(name: str, t: torch.Tensor, fmt: str, block_size: int | None, reason: str) -> TensorPlan:
    fmt = get_format(fmt).name
    return TensorPlan(name, t.numel(), t.dtype, fmt, block_for(t.numel(), fmt, block_size), reason)


def _keep_entry(name: str, t: torch.Tensor, reason: str) -> TensorPlan:
    return TensorPlan(name, t.numel(), t.dtype, dtype_format(t.dtype).name, None, reason)


def packable(tensors: NamedTensors, min_numel: int = MIN_NUMEL,
             keep_patterns: Sequence[str] = DEFAULT_KEEP_PATTERNS) -> tuple[dict[str, torch.Tensor], int]:
    """The tensors a plan may store in another format (not kept by ``min_numel``/``keep_patterns``), and the
    bytes of the others in their own dtype: what a budget stated per packable weight is computed from."""
    items = named_tensors(tensors)
    eligible = {n: t for n, t in items if _kept(n, t.numel(), min_numel, keep_patterns) is None}
    kept = sum(t.numel() * t.element_size() for n, t in items if n not in eligible)
    return eligible, kept


# ----------------------------------------------------------------------------------------------- rules
def plan_from_rules(tensors: NamedTensors, rules: Sequence[Rule], *, block_size: int | None = 32,
                    min_numel: int = MIN_NUMEL, keep_patterns: Sequence[str] = DEFAULT_KEEP_PATTERNS
                    ) -> PrecisionPlan:
    """The first rule whose pattern matches a tensor's name gives its format; unmatched tensors keep their dtype."""
    for i, rule in enumerate(rules):
        if not (isinstance(rule, tuple | list) and len(rule) == 2 and isinstance(rule[0], str)):
            raise ValueError(f"rule {i} must be (pattern, format); got {rule!r}")
        try:
            get_format(rule[1])
        except ValueError as e:
            raise ValueError(f"rule {i} {tuple(rule)!r}: {e}") from None
    entries = []
    for name, t in named_tensors(tensors):
        if (why := _kept(name, t.numel(), min_numel, keep_patterns)) is not None:
            entries.append(_keep_entry(name, t, why))
        elif (rule := next((r for r in rules if matches(name, r[0])), None)) is not None:
            entries.append(_entry(name, t, rule[1], block_size, f"rule {rule[0]!r}"))
        else:
            entries.append(_keep_entry(name, t, "no rule"))
    return PrecisionPlan(tuple(entries))


# ---------------------------------------------------------------------------------------------- budget
def _hull_steps(options: list[tuple[int, float, str]]) -> tuple[tuple[int, float, str], list[tuple]]:
    """Start (least sensitive, then smallest) and the lower-convex-hull steps towards fewer bytes.

    ``options`` are ``(bytes, sensitivity, format)``; steps are ``(slope, saved, dsens, format)``, slopes rising.
    """
    start = min(options, key=lambda o: (o[1], o[0]))
    steps, here = [], start
    while True:
        cheaper = [o for o in options if o[0] < here[0]]
        if not cheaper:
            return start, steps
        nxt = min(cheaper, key=lambda o: ((o[1] - here[1]) / (here[0] - o[0]), o[0]))
        steps.append(((nxt[1] - here[1]) / (here[0] - nxt[0]), here[0] - nxt[0], nxt[1] - here[1], nxt[2]))
        here = nxt


def plan_for_budget(tensors: NamedTensors, sensitivity: Mapping[str, Mapping[str, float]] | None = None, *,
                    target_reduction: float | None = None, target_bytes: int | None = None,
                    formats: Sequence[str] = ("fp16", "fp8_e4m3", "fp4_e2m1"), baseline: torch.dtype | None = None,
                    keep_high: Sequence[str] = (), block_size: int | None = 32, min_numel: int = MIN_NUMEL,
                    keep_patterns: Sequence[str] = DEFAULT_KEEP_PATTERNS) -> PrecisionPlan:
    """Formats from ``formats`` (highest first) meeting ``target_bytes``, or ``target_reduction`` of the
    ``baseline`` bytes (None: the tensors' own dtypes), at the least total sensitivity (module docstring).

    ``sensitivity[name][format]`` must cover every candidate tensor and format; None uses the squared-error
    proxy. ``keep_high`` patterns pin tensors to ``formats[0]``. Raises ValueError if the target is below the
    smallest achievable bytes, and says what that minimum is.
    """
    if (target_reduction is None) == (target_bytes is None):
        raise ValueError("give exactly one of target_reduction and target_bytes")
    if target_reduction is not None and not 0.0 <= target_reduction < 1.0:
        raise ValueError(f"target_reduction must be in [0, 1); got {target_reduction}")
    formats = [get_format(f).name for f in formats]
    if not formats or len(set(formats)) != len(formats):
        raise ValueError(f"formats must be distinct and non-empty; got {formats}")
    items = named_tensors(tensors)
    if target_bytes is None:
        dense = sum(t.numel() * (t.dtype if baseline is None else baseline).itemsize for _, t in items)
        target_bytes = int((1.0 - target_reduction) * dense)
    fixed, candidates = [], []
    for name, t in items:
        if (why := _kept(name, t.numel(), min_numel, keep_patterns)) is not None:
            fixed.append(_keep_entry(name, t, why))
        elif (pin := next((p for p in keep_high if matches(name, p)), None)) is not None:
            fixed.append(_entry(name, t, formats[0], block_size, f"keep_high {pin!r}"))
        else:
            candidates.append((name, t))
    options = {}
    for name, t in candidates:
        sens = _sensitivities(name, t, formats, sensitivity, block_size)
        options[name] = [(storage_bytes(t.numel(), f, block_for(t.numel(), f, block_size)), sens[f], f)
                         for f in formats]
    fixed_bytes = sum(e.nbytes for e in fixed)
    smallest = fixed_bytes + sum(min(o[0] for o in opts) for opts in options.values())
    if target_bytes < smallest:
        raise ValueError(f"target of {target_bytes} bytes is below the minimum achievable {smallest} bytes (every "
                         f"eligible tensor in its smallest format, {len(fixed)} tensors kept or pinned); raise the "
                         "target, add a smaller format, or lower min_numel / keep_patterns")
    # every candidate starts at its least sensitive format (position 0 of its hull); steps are taken by
    # sensitivity per byte saved, which keeps each tensor's steps in hull order (their slopes rise)
    path, steps, cost, total = {}, [], 0.0, fixed_bytes
    for order, (name, opts) in enumerate(options.items()):
        start, hull = _hull_steps(opts)
        path[name] = [start[2]] + [fmt for *_, fmt in hull]
        cost, total = cost + start[1], total + start[0]
        steps += [(slope, order, k, name, saved, dsens) for k, (slope, saved, dsens, _) in enumerate(hull)]
    steps.sort()
    position = dict.fromkeys(options, 0)
    bound, taken = cost, []
    for step in steps:
        if total <= target_bytes:
            break
        *_, name, saved, dsens = step
        bound = cost + dsens * min(1.0, (total - target_bytes) / saved)  # the LP relaxation stops mid-step
        taken.append(step)
        total, cost, position[name] = total - saved, cost + dsens, position[name] + 1
    # fix-up: undo steps the target no longer needs, latest first; only a tensor's last step can be undone
    for _, _, k, name, saved, dsens in reversed(taken):
        if position[name] == k + 1 and total + saved <= target_bytes and dsens > 0:
            total, cost, position[name] = total + saved, cost - dsens, k
    plans = {e.name: e for e in fixed}
    for name, t in candidates:
        plans[name] = _entry(name, t, path[name][position[name]], block_size, "budget")
    return PrecisionPlan(tuple(plans[name] for name, _ in items), sensitivity=cost, sensitivity_bound=min(bound, cost))


def _sensitivities(name: str, t: torch.Tensor, formats: Sequence[str],
                   sensitivity: Mapping[str, Mapping[str, float]] | None, block_size: int | None) -> dict[str, float]:
    if sensitivity is None:
        if t.device.type == "meta" or type(t).__name__ == "FakeTensor":
            raise ValueError(f"tensor {name!r} has no values (meta/fake): the squared-error proxy needs real "
                             "tensors; pass sensitivity (e.g. measured on a smaller model)")
        return {f: quantization_error(t, f, block_for(t.numel(), f, block_size)) for f in formats}
    if name not in sensitivity:
        raise ValueError(f"sensitivity has no entry for tensor {name!r}")
    given = {get_format(f).name: float(v) for f, v in sensitivity[name].items()}
    missing = [f for f in formats if f not in given]
    if missing:
        raise ValueError(f"sensitivity[{name!r}] has no value for format(s) {missing}")
    return given


# -------------------------------------------------------------------------------------------- transfer
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def transfer_plan(plan: PrecisionPlan, tensors: NamedTensors, *, depth: str = "relative", min_numel: int = MIN_NUMEL,
                  keep_patterns: Sequence[str] = DEFAULT_KEEP_PATTERNS) -> PrecisionPlan:
    """``plan`` (made for a small model) carried over to a deeper/wider model of the same family, by role.

    A tensor of the layer stack (a name with a ``.<i>.`` index) takes the format of the same tensor of the plan:
    with ``depth="relative"``, of layer ``round(i * (l - 1) / (L - 1))`` of the plan's ``l`` layers (``L`` the
    target's); with ``depth="uniform"``, the format holding most elements of that role over all the plan's
    layers, the same in every layer (so bytes grow by the same amount per layer, which ``extrapolate_by_depth``
    needs). Tensors outside the stack (embeddings, head) take the format of the tensor of the same name. Used to
    size a full-scale model (Llama-65B under fake tensors, where no importance can be measured) with the
    precision mix measured on a small one. Tensors that ``min_numel``/``keep_patterns`` keep, or that the plan
    keeps in their own dtype, keep theirs.
    """
    if depth not in ("relative", "uniform"):
        raise ValueError(f"depth={depth!r} must be 'relative' or 'uniform'")
    by_name = {t.name: t for t in plan.tensors}
    source_layers = sorted({int(m.group(1)) for t in plan.tensors if (m := _LAYER_INDEX.search(t.name))})
    roles: dict[str, dict[tuple[str, int | None, bool], int]] = {}  # role -> (format, block, kept) -> elements
    for t in plan.tensors:
        if m := _LAYER_INDEX.search(t.name):
            role = t.name[:m.start()] + ".*." + t.name[m.end():]
            key = (t.format, t.block_size, t.format == dtype_format(t.dtype).name)
            roles.setdefault(role, {}).setdefault(key, 0)
            roles[role][key] += t.numel
    items = named_tensors(tensors)
    target_layers = sorted({int(m.group(1)) for name, _ in items if (m := _LAYER_INDEX.search(name))})
    entries = []
    for name, t in items:
        if (why := _kept(name, t.numel(), min_numel, keep_patterns)) is not None:
            entries.append(_keep_entry(name, t, why))
            continue
        m = _LAYER_INDEX.search(name)
        if m and depth == "uniform":
            role = name[:m.start()] + ".*." + name[m.end():]
            if role not in roles:
                raise ValueError(f"transfer_plan: the plan has no tensor of role {role!r} (for {name!r})")
            (fmt, block, kept), _ = max(roles[role].items(), key=lambda kv: kv[1])
            entries.append(_keep_entry(name, t, f"as most of {role}") if kept else
                           _entry(name, t, fmt, block, f"as most of {role}"))
            continue
        source_name = name
        if m and source_layers and target_layers:
            i, n_target, n_source = int(m.group(1)), len(target_layers), len(source_layers)
            j = source_layers[round(target_layers.index(i) * (n_source - 1) / max(1, n_target - 1))]
            source_name = name[:m.start()] + f".{j}." + name[m.end():]
        source = by_name.get(source_name)
        if source is None:
            raise ValueError(f"transfer_plan: no tensor {source_name!r} in the plan for {name!r}: the plan must come "
                             "from a model of the same family (same names outside the layer index)")
        if source.format == dtype_format(source.dtype).name:
            entries.append(_keep_entry(name, t, f"as {source_name}"))
        else:
            entries.append(_entry(name, t, source.format, source.block_size, f"as {source_name}"))
    return PrecisionPlan(tuple(entries))
