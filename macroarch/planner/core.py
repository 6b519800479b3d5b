"""``plan``: will this model's training step fit these devices, and with which techniques?

For every combination of the techniques asked for (always with the plain step as the reference), one full
training step of the model is run under fake tensors (``macroarch.planner.run``) and reported per device: bytes by
category, the measured peak, whether it fits the budget and by how much, and the largest batch (or sequence, clip
length, points per cloud) that fits, searched with ``macroarch.measure.fit.largest_fitting`` on further fake
steps. The cheapest fitting combination is the one with the least measured slowdown
(``macroarch.planner.slowdown``, read from the benchmarks' committed runs): a combination is cheaper than another
only where its measured range lies wholly below the other's; among those no fitting combination beats (their
ranges overlap: no measured difference), the one with the fewest techniques is named, the others as tied with it.
Combinations whose slowdown is unmeasured fit or not, but are never called cheapest.

What is counted, stated in every plan's notes:

- live tensor bytes of CPU kernels (MemTracker under ``FakeTensorMode``). A CUDA run also needs its context,
  cuBLAS/cuDNN workspaces and the caching allocator's rounding and fragmentation (not counted); budgets are in
  bytes as given (GB = 1e9; a card's is its memory size in the accelerator table).
- attention: transformers models are built with SDPA by default, whose CPU kernel (flash attention for CPU)
  saves the output and an fp32 log-sum-exp per query row and no score matrix, as CUDA's flash and
  memory-efficient kernels do; ``attention="eager"`` saves the scores. With attention dropout CPU SDPA falls back
  to its math kernel (score matrices saved) where CUDA's flash kernels do not, so such models are built with
  attention dropout 0 and the plan says so (``macroarch.planner.models``).
- the GPU-kernel correction of ``macroarch.measure.memory.analytic`` (``activation_terms(device_type=...)``: on
  CUDA dropout keeps 1-byte masks and LayerNorm fp32 statistics, on CPU both are in the activation dtype) is
  applied where the project has it: the Llama and GPT-2 families, eager attention, no checkpointing. Elsewhere
  the CPU kernels' bytes are reported and the plan says so.
- where a model cannot run under fake tensors, its reference step falls back to the analytic training state
  (``training_state_bytes``; activations from ``activation_bytes`` where the family has them, else not counted),
  and the plan names the error.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from macroarch.measure.memory import PhasePeak, StepMemory
from macroarch.planner.models import Model, PlanError, resolve
from macroarch.planner.report import size_text
from macroarch.planner.run import (
    TECHNIQUES,
    Bytes,
    DepthPlan,
    Measured,
    Setup,
    StepCache,
    check_depths,
    depth_plan,
    fsdp2_model,
    fsdp_units,
    measure_full,
    setup_key,
)
from macroarch.planner.slowdown import PLAIN, Slowdown, slowdown

if TYPE_CHECKING:
    from macroarch.measure.fit import MeasureCache

GB = 1e9
SEARCHES = ("batch", "seq", "frames", "points")
"""What the largest fitting size varies: the batch, ``seq`` (tokens per sample, or what a custom model's ``seq``
counts; not an image side), the clip length (video models) or the points per cloud (point-cloud models)."""
_ORDER = {t: i for i, t in enumerate(TECHNIQUES)}


def _name(techniques: Sequence[str]) -> str:
    return "+".join(sorted(techniques, key=_ORDER.__getitem__)) or "plain"


@dataclass
class Combination:
    """One combination's answer (per device).

    Attributes:
        techniques: the techniques, in ``TECHNIQUES`` order (empty: the plain step).
        bytes: bytes by category and the peak at the requested size (None when it could not be measured).
        how: how the bytes were obtained (fake tensors at which depths, modelled, analytic).
        fits: peak <= budget (None without a budget).
        headroom: budget - peak in bytes (negative: over by that much).
        largest: the largest batch (or ``search`` size) whose peak fits (None: none fits, or no budget).
        largest_capped: the search stopped at its maximum size, so larger ones may fit too.
        slowdown: the measured step-time ratio and its source, or unmeasured.
        notes: what else applies to this combination.
        error: why it could not be measured.
        depths: the depth units measured and extrapolated from (empty: the whole model was measured).
        measured: the one-device fake-tensor bytes as measured (the device's kernels), before the GPU-kernel
            correction and FSDP2's modelling that ``bytes`` holds (None where nothing was measured).
        searched: the peak (as ``bytes``) at every size the largest-size search knows, by size: its own
            measurements and those of earlier plans sharing its ``cache`` (empty without a budget).
    """

    techniques: tuple[str, ...]
    bytes: Bytes | None
    how: str
    fits: bool | None = None
    headroom: int | None = None
    largest: int | None = None
    largest_capped: bool = False
    slowdown: Slowdown = PLAIN
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    depths: tuple[int, ...] = ()
    measured: Bytes | None = None
    searched: dict[int, int] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return _name(self.techniques)

    def to_json(self) -> dict[str, Any]:
        b = self.bytes
        out: dict[str, Any] = {"name": self.name, "techniques": list(self.techniques)}
        out.update(b.categories if b is not None else dict.fromkeys(("weights", "gradients", "master", "optimizer",
                                                                     "activations")))
        out.update(peak=None if b is None else b.peak, at_peak=None if b is None else b.at_peak,
                   peak_phase=None if b is None else b.phase, fits=self.fits,
                   headroom=self.headroom, largest=self.largest, largest_capped=self.largest_capped,
                   slowdown=self.slowdown.ratio, slowdown_range=[self.slowdown.low, self.slowdown.high],
                   slowdown_source=self.slowdown.source, how=self.how, depths=list(self.depths), notes=self.notes,
                   error=self.error)
        return out


@dataclass
class Plan:
    """What ``plan`` answers (``text()`` for people, ``to_json()`` for scripts)."""

    model: dict[str, Any]
    workload: dict[str, Any]
    budget_bytes: int | None
    budget_source: str | None
    combinations: list[Combination]
    cheapest: str | None
    verdict: str
    notes: list[str]
    seconds: float

    def combination(self, name: str) -> Combination:
        for c in self.combinations:
            if c.name == name:
                return c
        raise KeyError(f"no combination {name!r}; have {[c.name for c in self.combinations]}")

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "workload": self.workload, "budget_bytes": self.budget_bytes,
                "budget_source": self.budget_source, "combinations": [c.to_json() for c in self.combinations],
                "cheapest": self.cheapest, "verdict": self.verdict, "notes": self.notes, "seconds": self.seconds}

    def text(self) -> str:
        from macroarch.planner.report import text

        return text(self)


# ----------------------------------------------------------------------------------------------- inputs
def _budget(gpu: str | None, budget_gb: float | None) -> tuple[int | None, str | None]:
    if gpu is not None and budget_gb is not None:
        raise PlanError("give --gpu or --budget, not both")
    if budget_gb is not None:
        if (isinstance(budget_gb, bool) or not isinstance(budget_gb, int | float) or not budget_gb > 0
                or not math.isfinite(budget_gb)):
            raise PlanError(f"budget={budget_gb!r} GB must be a positive, finite number")
        return round(budget_gb * GB), f"{budget_gb:g} GB"
    if gpu is None:
        return None, None
    from macroarch.measure.hardware import ACCELERATORS

    for card in ACCELERATORS.values():
        if gpu.lower() in (card.key.lower(), card.name.lower()):
            return round(card.memory_gb * GB), f"{card.name} ({card.memory_gb:g} GB, macroarch.measure.hardware)"
    known = ", ".join(f"{c.key} ({c.name})" for c in ACCELERATORS.values())
    raise PlanError(f"unknown --gpu {gpu!r}; known: {known}")


def _techniques(techniques: str | Sequence[str], devices: int) -> tuple[str, ...]:
    items = [t.strip() for t in techniques.split(",")] if isinstance(techniques, str) else list(techniques)
    items = [t for t in items if t]
    unknown = [t for t in items if t not in TECHNIQUES]
    if unknown:
        raise PlanError(f"unknown technique {unknown[0]!r}; known: {', '.join(TECHNIQUES)}")
    if "master" in items and "mvas" not in items:
        raise PlanError("technique 'master' (MVAS's fp32 master copies) needs 'mvas' too")
    if "fsdp2" in items and devices < 2:
        raise PlanError(f"technique 'fsdp2' shards over --devices; got devices={devices} (give 2 or more)")
    return tuple(sorted(set(items), key=_ORDER.__getitem__))


def _setup(policy: Any, dtype: str, group_size: int | None, devices: int, device: str = "cpu", fake: bool = True
           ) -> tuple[Setup, str]:
    from macroarch.config import ConfigError, MacroConfig, MVASConfig, load_config
    from macroarch.measure.memory import get_precision

    try:
        precision = get_precision(dtype)
    except ValueError as e:
        raise PlanError(f"--dtype: {e}") from None
    mvas, source, size = MVASConfig(precision_policy={"*": "fp8"}), "default: every packable weight in fp8", None
    if policy is not None:
        try:
            config = policy if isinstance(policy, MacroConfig) else load_config(policy)
        except (ConfigError, OSError) as e:
            raise PlanError(f"--policy {policy}: {e}") from None
        if config.uses_mvas:
            mvas, source = config.mvas, f"from {policy}" if isinstance(policy, str) else "from the given policy"
        if config.uses_dgr:
            size = config.dgr.group_size
    size = group_size if group_size is not None else (size or 1)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise PlanError(f"group_size={size!r} must be a positive int")
    return Setup(precision, mvas, size, devices, device, fake), source


def _positive(name: str, value: Any, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(f"{name}={value!r} must be a positive int")


def _device(device: str) -> None:
    """``device`` is ``"cpu"`` or a CUDA device on a machine that has one; a fake CUDA step's backward needs a real
    CUDA context, made here by one real allocation."""
    import torch

    if device == "cpu":
        return
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        kind = None
    if kind != "cuda":
        raise PlanError(f"device={device!r} must be 'cpu' or 'cuda'")
    if not torch.cuda.is_available():
        raise PlanError(f"device={device!r}, but this machine has no GPU: autograd's backward needs a CUDA context "
                        f"even for fake tensors; plan with device='cpu' (CPU kernels, with the GPU-kernel correction)")
    torch.zeros(1, device=device)


# ----------------------------------------------------------------------------------------------- per combination
def _correction(model: Model, setup: Setup, combo: frozenset[str], batch: int, seq: int | None
                ) -> tuple[int, str | None]:
    """Bytes to add to the CPU kernels' activations for CUDA's (module docstring), and what was done."""
    if model.shape is None or model.seq_name != "tokens" or setup.device != "cpu":
        return 0, None
    from macroarch.measure.memory import activation_bytes

    shape = model.shape
    cuda = activation_bytes(shape, batch, seq, setup.policy, device_type="cuda")["total"]
    cpu = activation_bytes(shape, batch, seq, setup.policy, device_type="cpu")["total"]
    delta = cuda - cpu
    if delta == 0:
        return 0, (f"GPU-kernel correction: 0 bytes ({shape.family}: CPU and CUDA kernels save the same tensors, "
                   f"macroarch.measure.memory.analytic)")
    if model.attention != "eager" or "checkpoint" in combo:
        why = "checkpointing" if "checkpoint" in combo else f"{model.attention} attention"
        return 0, (f"GPU-kernel correction not applied ({why}; the project's counts eager attention without "
                   f"recomputation): CUDA would save {-delta / GB:+.3f} GB of dropout masks and norm statistics")
    return delta, (f"GPU-kernel correction applied: {delta / GB:+.3f} GB of activations (CUDA's 1-byte dropout masks "
                   f"and fp32 LayerNorm statistics, macroarch.measure.memory.analytic.activation_terms)")


def _corrected(b: Bytes, delta: int) -> Bytes:
    """``b`` with CUDA's kernels' activations: ``delta`` more at the activations' maximum, and at every phase's peak
    in the share of the activations alive there (the masks and statistics it counts live from a layer's forward
    to its backward: none are left at the update's peak)."""
    if not delta:
        return b
    most = b.categories["activations"]

    def shifted(cats: Mapping[str, int]) -> tuple[int, dict[str, int]]:
        extra = round(delta * cats.get("activations", 0) / most) if most else 0
        return extra, dict(cats, activations=cats.get("activations", 0) + extra)

    cats = dict(b.categories, activations=most + delta)
    if not b.phases:
        extra, at_peak = shifted(b.at_peak)
        return Bytes(cats, b.peak + extra, at_peak, b.phase)
    phases = {}
    for name, p in b.phases.items():
        extra, at = shifted(p.by_category)
        phases[name] = PhasePeak(p.peak_bytes + extra, at)
    phase = max(phases, key=lambda k: phases[k].peak_bytes)
    return Bytes(cats, phases[phase].peak_bytes, dict(phases[phase].by_category), phase, phases)


def _analytic(model: Model, setup: Setup, batch: int, seq: int | None, error: Exception) -> Combination:
    from macroarch.measure.memory import activation_bytes, training_state_bytes

    meta = model.build(None, setup.policy.param_dtype, seq if model.seq_name != "tokens" else None)
    n = sum(p.numel() for p in {id(p): p for p in meta.parameters()}.values())
    state = training_state_bytes(n, setup.policy)
    act, act_note = 0, "activations not counted (no analytic count for this family)"
    if model.shape is not None and model.seq_name == "tokens":
        act = activation_bytes(model.shape, batch, seq, setup.policy, device_type="cuda")["total"]
        act_note = "activations from activation_bytes (eager attention, CUDA kernels)"
    cats = {"weights": state["parameters"], "gradients": state["gradients"], "master": state["master_weights"],
            "optimizer": state["optimizer_state"], "activations": act}
    how = (f"analytic fallback: the fake-tensor step failed ({type(error).__name__}: {str(error).splitlines()[0]}); "
           f"training_state_bytes of {n:,} parameters, {act_note}; peak = their sum (not measured)")
    return Combination((), Bytes(cats, sum(cats.values()), {}), how)


def _as_step(b: Bytes) -> StepMemory:
    return StepMemory(peak_bytes=b.peak, by_category=b.at_peak, max_by_category=b.categories, seconds=0.0)


@dataclass
class _Context:
    model: Model
    setup: Setup
    batch: int
    seq: int | None
    search: str
    budget: int | None
    units: Any = None
    dense_weights: int = 0
    depths: tuple[int, ...] | None = None
    max_size: int | None = None
    cache: StepCache = field(default_factory=StepCache)

    @property
    def size(self) -> int:
        """The requested value of what the search varies."""
        return {"batch": self.batch, "frames": self.model.frames}.get(self.search, self.seq)

    def at(self, size: int) -> tuple[Model, int, int | None]:
        """The model, batch and seq with what the search varies set to ``size``."""
        if self.search == "batch":
            return self.model, size, self.seq
        if self.search == "frames":
            return replace(self.model, frames=size), self.batch, self.seq
        return self.model, self.batch, size


def _measure_combo(ctx: _Context, combo: frozenset[str], check: bool = True) -> tuple[Measured, Any]:
    """The fake-tensor bytes of ``combo`` at the requested size, and ``at(size) -> Bytes`` for the search (each
    size extrapolated in depth from the two shallowest depths, phase by phase)."""
    depth = depth_plan(ctx.model, combo, ctx.setup, check=check, depths=ctx.depths)
    measured = measure_full(ctx.model, combo, ctx.setup, ctx.batch, ctx.seq, depth, ctx.cache)
    quick = DepthPlan(measured.depth.depths[:2], measured.depth.full)

    def at(size: int) -> Bytes:
        model, batch, seq = ctx.at(size)
        return measure_full(model, combo, ctx.setup, batch, seq, quick, ctx.cache).bytes

    return measured, at


def _derive(ctx: _Context, combo: frozenset[str], b: Bytes, size: int) -> tuple[Bytes, list[str]]:
    """The GPU-kernel correction and FSDP2's sharding applied to one-device fake-tensor bytes."""
    _, batch, seq = ctx.at(size)
    delta, note = _correction(ctx.model, ctx.setup, combo, batch, seq)
    b = _corrected(b, delta)
    notes = [note] if note else []
    if "fsdp2" in combo:
        b = fsdp2_model(b, ctx.units, ctx.dense_weights, ctx.setup.devices)
        notes.append(f"fsdp2 modelled from the one-device step (not run: no process group here): state / "
                     f"{ctx.setup.devices}, plus the unsharded root unit, two blocks' weights and one block's "
                     f"gradients (macroarch.planner.run.fsdp2_model)")
    return b, notes


_UNITS = {"batch": "sample", "frames": "frame", "points": "point"}


def _search_cache(ctx: _Context, combo: frozenset[str], at: Any) -> MeasureCache:
    """The sizes measured for ``combo``'s search so far, by every plan that shares ``ctx.cache`` and all but the
    searched size (``largest_fitting`` brackets from them: a plan per budget measures few new sizes)."""
    from macroarch.measure.fit import MeasureCache

    fixed = {"batch": ("batch",), "frames": ("frames",)}.get(ctx.search, ("seq",))
    model = ctx.cache.model_key(replace(ctx.model, frames=None) if "frames" in fixed else ctx.model)
    key = (model, combo, setup_key(ctx.setup, combo), None if "batch" in fixed else ctx.batch,
           None if "seq" in fixed else ctx.seq, ctx.search, ctx.depths)

    def measure(size: int) -> StepMemory:
        return _as_step(_derive(ctx, combo, at(size), size)[0])

    return ctx.cache.searches.setdefault(key, MeasureCache(measure))


def _largest(ctx: _Context, combo: frozenset[str], at: Any) -> tuple[int | None, bool, str | None]:
    """The largest size that fits (``largest_fitting`` on the shared search cache), whether the search stopped at
    its maximum, and why none fits."""
    from macroarch.measure.fit import largest_fitting

    sizes = _search_cache(ctx, combo, at)
    multiple = {"batch": 1, "frames": ctx.model.frames_multiple}.get(ctx.search, ctx.model.seq_multiple)
    start = ctx.model.min_batch if ctx.search == "batch" else multiple
    max_size = ctx.max_size or (1 << 16 if ctx.search in ("batch", "frames") else 1 << 20)
    try:
        fit = largest_fitting(sizes, ctx.budget, start=start, multiple=multiple, max_size=max_size,
                              unit=_UNITS.get(ctx.search, ctx.model.seq_name.rstrip("s")))
    except ValueError as e:
        return None, False, str(e)
    return fit.size, fit.capped, None


def _combination(ctx: _Context, combo: frozenset[str], base: dict[frozenset[str], tuple[Measured, Any]]
                 ) -> Combination:
    one = combo - {"fsdp2"}
    measured, at = base[one]
    b, notes = _derive(ctx, combo, measured.bytes, ctx.size)
    how = f"{'fake' if ctx.setup.fake else 'real'} tensors ({ctx.setup.device.upper()} kernels), " + measured.how
    c = Combination(tuple(sorted(combo, key=_ORDER.__getitem__)), b, how,
                    slowdown=slowdown(combo, ctx.setup.policy.name), notes=notes, depths=measured.depth.depths,
                    measured=measured.bytes)
    _search_cache(ctx, combo, at).reports.setdefault(ctx.size, _as_step(b))  # a later search starts from it
    if ctx.budget is not None:
        c.fits, c.headroom = b.peak <= ctx.budget, ctx.budget - b.peak
        c.largest, c.largest_capped, why = _largest(ctx, combo, at)
        c.searched = _search_cache(ctx, combo, at).peaks()
        if why:
            c.notes.append(f"largest {ctx.search}: none fits ({why})")
    return c


def cheapest(fitting: Sequence[Combination]) -> tuple[Combination | None, list[Combination]]:
    """The cheapest of ``fitting`` by measured slowdown, and the combinations tied with it.

    One combination is cheaper than another only where its measured range lies wholly below the other's
    (``Slowdown.faster_than``). Of those that no other beats, whose ranges overlap (no measured difference), the one
    with the fewest techniques is named (then the lower median, then the lower peak); the rest are tied with it.
    Unmeasured combinations take no part. ``(None, [])`` when none is measured."""
    ranked = [c for c in fitting if c.slowdown.measured]
    unbeaten = [c for c in ranked if not any(o.slowdown.faster_than(c.slowdown) for o in ranked)]
    if not unbeaten:
        return None, []
    best = min(unbeaten, key=lambda c: (len(c.techniques), c.slowdown.ratio, c.bytes.peak))
    return best, [c for c in unbeaten if c is not best]


def _verdict(combos: list[Combination], budget: int | None, search: str) -> tuple[str | None, str]:
    if budget is None:
        return None, "no budget given (--gpu or --budget): bytes only"
    measured = [c for c in combos if c.bytes is not None]
    fitting = [c for c in measured if c.fits]
    if not fitting:
        closest = min(measured, key=lambda c: c.bytes.peak)
        return None, (f"fits nowhere: the closest is {closest.name} at {size_text(closest.bytes.peak)}, "
                      f"{size_text(-closest.headroom)} over the {size_text(budget)} budget")
    best, tied = cheapest(fitting)
    if best is None:
        simplest = min(fitting, key=lambda c: (len(c.techniques), c.bytes.peak))
        return None, (f"fits with {', '.join(c.name for c in fitting)}; none of them has a measured slowdown, so "
                      f"none is called cheapest (fewest techniques: {simplest.name})")
    largest = f"{best.largest}{'+' if best.largest_capped else ''}" if best.largest is not None else "-"
    cost = ("the reference step" if not best.techniques
            else f"expected slowdown {best.slowdown.text()}, measured")
    text = (f"cheapest that fits: {best.name} ({cost}; {size_text(best.headroom)} to spare, largest {search} "
            f"{largest})")
    if tied:
        text += ("; tied with it (measured ranges overlap, so no measured difference): "
                 + ", ".join(f"{c.name} {c.slowdown.text()}" for c in tied))
    return best.name, text


# ----------------------------------------------------------------------------------------------- plan
def plan(model: str | Model, batch: int = 1, seq: int | None = None, *, frames: int | None = None,
         points: int | None = None, gpu: str | None = None, budget_gb: float | None = None, devices: int = 1,
         techniques: str | Sequence[str] = (), policy: Any = None, dtype: str = "bf16_mixed",
         group_size: int | None = None, attention: str = "sdpa", search: str = "batch",
         combinations: Sequence[str | Sequence[str]] | None = None, depths: Sequence[int] | None = None,
         device: str = "cpu", max_size: int | None = None, cache: StepCache | None = None, fake: bool = True
         ) -> Plan:
    """Plan one training step of ``model`` (module docstring).

    Args:
        model: a model spec (``macroarch.planner.models``: a config.json or its directory, a project builder, an
            open_clip or timm name, ``module:fn``), or a resolved ``Model``.
        batch: samples per device per step.
        seq: tokens per sample (text), the image side (vision; default: the model's) or the points per cloud
            (point clouds; default: the model's).
        frames: a video model's clip length (default: its config's).
        points: a point-cloud model's points per cloud (the same as ``seq`` for such a model).
        gpu, budget_gb: the per-device budget: an accelerator-table key or name, or GB (1e9 bytes).
        devices: the device count (``fsdp2`` shards over it; the batch stays per device).
        techniques: ``mvas``, ``master`` (MVAS's fp32 master copies), ``dgr``, ``checkpoint``, ``fsdp2``, as a list
            or comma-separated; every combination of them is planned, the plain step too.
        policy: a technique config (a YAML file, as ``configs/clip_post.yaml``, the mapping it would hold, or a loaded
            ``MacroConfig``): its MVAS policy (rules, or a target reduction: ``macroarch.planner.target``) and DGR
            group size.
        dtype: the dtype recipe, a name in ``macroarch.measure.memory.PRECISIONS`` (``bf16_mixed``, ``fp32``,
            ``post``, ``fp16``, ``mixed``).
        group_size: DGR's blocks per group (default: the policy's, else 1).
        attention: transformers models' attention implementation (``"sdpa"`` or ``"eager"``).
        search: what the largest fitting size varies (``SEARCHES``).
        combinations: plan only these (each ``"plain"``, ``"mvas+dgr"`` or a list of techniques; the plain step is
            always planned too) instead of every combination of ``techniques`` (which may then be left empty).
        depths: the depth units measured (``macroarch.planner.run``): None, the planner's own; two or more
            increasing ones, the first two extrapolated from and every further one (the full depth too) checked to
            the byte, else the whole model is measured and the combination says why; ``()``, the whole model.
        device: whose kernels the fake step runs: ``"cpu"``, or ``"cuda"`` on a machine with a GPU (autograd's
            backward needs a CUDA context even for fake tensors); with CUDA's kernels no GPU-kernel correction is
            applied.
        max_size: where the largest-size search stops (default: 2^16 samples or frames, 2^20 tokens or points);
            a combination that fits there is ``largest_capped``.
        cache: a ``StepCache`` shared by plans of the same model (one per budget, per size): no step is measured
            twice, and a search starts from the sizes earlier ones measured.
        fake: False runs every step on real tensors instead (a small model: the same bytes on CPU kernels, in less
            time where its many small kernels cost more to dispatch under fake tensors than to run).

    Raises ``PlanError`` (a ``ValueError``) naming any bad input.
    """
    start = time.perf_counter()
    _positive("batch", batch)
    _positive("seq", seq, optional=True)
    _positive("frames", frames, optional=True)
    _positive("points", points, optional=True)
    _positive("devices", devices)
    _positive("max_size", max_size, optional=True)
    if search not in SEARCHES:
        raise PlanError(f"search={search!r} must be one of {SEARCHES}")
    if attention not in ("sdpa", "eager"):
        raise PlanError(f"attention={attention!r} must be 'sdpa' or 'eager'")
    _device(device)
    budget, budget_source = _budget(gpu, budget_gb)
    wanted = _techniques(techniques, devices)
    requested = _combinations(wanted, combinations, devices)
    wanted = tuple(sorted(set(wanted).union(*requested), key=_ORDER.__getitem__))
    if not isinstance(fake, bool):
        raise PlanError(f"fake={fake!r} must be True or False")
    setup, mvas_source = _setup(policy, dtype, group_size, devices, device, fake)
    m = model if isinstance(model, Model) else resolve(model, attention=attention)
    model = m.name
    seq = _sizes(m, seq, frames, points, search)
    if frames is not None:
        m = replace(m, frames=frames)
    if batch < m.min_batch:
        raise PlanError(f"{model}: batch={batch}, but a training step needs {m.min_batch} samples at least")
    try:
        depths = check_depths(m, depths)
    except ValueError as e:
        raise PlanError(str(e)) from None
    ctx = _Context(m, setup, batch, seq, search, budget, depths=depths, max_size=max_size,
                   cache=StepCache() if cache is None else cache)
    meta = m.build(None, setup.policy.param_dtype, seq if m.seq_name != "tokens" else None)
    n_params = sum(p.numel() for p in {id(p): p for p in meta.parameters()}.values())
    if "mvas" in wanted and setup.mvas.target_reduction is not None:
        from macroarch.planner.target import policy_for_target

        try:
            mvas, mvas_source = policy_for_target(meta, setup.mvas)
        except ValueError as e:
            raise PlanError(str(e)) from None
        setup = ctx.setup = replace(setup, mvas=mvas)
    del meta
    if "fsdp2" in wanted:
        ctx.units = fsdp_units(m, setup.policy.param_dtype, seq if m.seq_name != "tokens" else None)
        ctx.dense_weights = n_params * setup.policy.param_dtype.itemsize
    combos = list(dict.fromkeys(c - {"fsdp2"} for c in requested))  # what runs on one device, plain first
    base: dict[frozenset[str], tuple[Measured, Any]] = {}
    results: list[Combination] = []
    for combo in combos:
        try:
            base[combo] = _measure_combo(ctx, combo)
        except PlanError:
            raise
        except Exception as e:  # a module that cannot run under fake tensors, or a technique that refuses it
            if not combo:
                results.append(_analytic(m, setup, batch, seq, e))
            else:
                results.append(Combination(tuple(sorted(combo, key=_ORDER.__getitem__)), None, "not measured",
                                           slowdown=slowdown(combo, setup.policy.name),
                                           error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
    results += [_combination(ctx, combo, base) for combo in requested if combo - {"fsdp2"} in base]
    results.sort(key=lambda c: (len(c.techniques), [_ORDER[t] for t in c.techniques]))
    cheapest_name, verdict = _verdict(results, budget, search)
    notes = [
        "bytes per device: live tensors of one steady-state training step (forward with the loss, backward, "
        f"optimizer step), MemTracker {'under FakeTensorMode' if fake else 'on real tensors'} with {device.upper()} "
        "kernels; not counted: the CUDA context, cuBLAS/cuDNN workspaces, the caching allocator's rounding and "
        "fragmentation",
        "peak: the largest total over the step (temporaries, inputs and buffers included); the categories are "
        "each one's own maximum and do not add up to it",
        f"attention: {m.attention}" + (" (CPU flash kernel: output and an fp32 log-sum-exp per row, no score "
                                       "matrix, as CUDA's flash kernels)" if m.attention == "sdpa" else ""),
        *m.notes,
        f"dtype recipe {setup.policy.name}: {setup.policy.description}",
    ]
    if any("mvas" in c.techniques for c in results):
        notes.append(f"MVAS policy {mvas_source}; moments in {setup.mvas.state_format}")
    if any("dgr" in c.techniques for c in results):
        notes.append(f"DGR-sync, groups of {setup.group_size} block(s)")
    if budget is not None:
        notes.append("cheapest: the least expected slowdown among combinations with a measured ratio (read from "
                     "the benchmarks' committed runs, each row's source below); ratios whose measured ranges overlap "
                     "are tied, and of tied ones the fewest techniques is named")
    if m.shape is None and device == "cpu":
        notes.append("no GPU-kernel correction for this family: CPU kernels' bytes (on CUDA, dropout masks are "
                     "1 byte per element and LayerNorm statistics fp32; on CPU both are in the activation dtype)")
    if device != "cpu":
        notes.append(f"kernels: {device}'s own, measured (fake tensors need no GPU memory, but its backward needs a "
                     f"CUDA context); MVAS's stood-in update temporaries, where stood in, were measured on the CPU")
    if devices > 1 and "fsdp2" not in wanted:
        notes.append(f"--devices {devices} without fsdp2: every device holds the whole step (data parallel)")
    layers = "+".join(map(str, m.full_layers)) if m.scalable else "fixed"
    workload = {"batch": batch, "seq": seq, "seq_means": m.seq_name, "dtype": setup.policy.name,
                "devices": devices, "search": search, "group_size": setup.group_size}
    if m.frames is not None:
        workload["frames"] = m.frames
    return Plan(
        model={"name": model, "kind": m.kind, "family": m.family, "parameters": n_params, "layers": layers,
               "attention": m.attention},
        workload=workload, budget_bytes=budget, budget_source=budget_source, combinations=results,
        cheapest=cheapest_name, verdict=verdict, notes=notes, seconds=time.perf_counter() - start)


def _combinations(wanted: tuple[str, ...], given: Sequence[str | Sequence[str]] | None, devices: int
                  ) -> list[frozenset[str]]:
    """The combinations to plan, the plain step first: every one of ``wanted`` (``master`` only with ``mvas``;
    ``fsdp2`` on top of each one-device combination), or those ``given``."""
    if given is None:
        one = [t for t in wanted if t != "fsdp2"]
        combos = [frozenset(s) for r in range(len(one) + 1) for s in itertools.combinations(one, r)
                  if "master" not in s or "mvas" in s]
        return [c for combo in combos for c in ((combo, combo | {"fsdp2"}) if "fsdp2" in wanted else (combo,))]
    if isinstance(given, str):
        given = [given]
    out = [frozenset()]
    for item in given:
        parts = item.replace("+", ",") if isinstance(item, str) else item
        combo = frozenset(_techniques("" if parts == "plain" else parts, devices))
        if combo not in out:
            out.append(combo)
    return out


def _sizes(m: Model, seq: int | None, frames: int | None, points: int | None, search: str) -> int:
    """``seq`` resolved against the model (``points`` is a point cloud's seq), with every size checked against
    what the model takes."""
    if points is not None:
        if m.seq_name != "points":
            raise PlanError(f"{m.name}: points={points} is for point-cloud models; this model's seq is its "
                            f"{m.seq_name}")
        if seq is not None and seq != points:
            raise PlanError(f"{m.name}: give the points per cloud once (seq={seq}, points={points})")
        seq = points
    if frames is not None:
        if m.frames is None:
            raise PlanError(f"{m.name}: frames={frames} is for video models (a config with num_frames)")
        if frames % m.frames_multiple:
            raise PlanError(f"{m.name}: frames={frames} must be a multiple of {m.frames_multiple} (its tubelet)")
    if seq is None and m.default_seq is None:
        raise PlanError(f"{m.name}: give --seq (the number of {m.seq_name})")
    wrong = {"seq": m.seq_name == "image side", "points": m.seq_name != "points", "frames": m.frames is None}
    if wrong.get(search):
        raise PlanError(f"{m.name}: search={search!r} does not apply: this model's seq is its {m.seq_name}"
                        + ("" if m.frames is None else f" and it takes clips of {m.frames} frames"))
    return m.default_seq if seq is None else seq


__all__ = ["Combination", "Plan", "PlanError", "SEARCHES", "cheapest", "plan"]
