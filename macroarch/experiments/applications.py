"""Harness of notebook 10_applications: what fits in 24 / 40 / 80 GB for the post's section-6 applications
(claims C12 AlphaFold2-style -55% memory, C13 PointNet 4x batch, C14 128-frame video), with and without the
techniques, on real architectures at their published sizes.

Models (``MODELS``), built from configs, nothing downloaded:

- ``esmfold_trunk``: ESMFold's folding trunk (``macroarch.models.folding``: transformers' ``TrunkConfig`` and
  blocks, 48 x (1024 / 128), 686M parameters in the blocks), one protein of ``crop`` residues per step;
- ``pointnet``: PointNet classification (``macroarch.models.pointnet``), 1024 points, 40 classes (ModelNet40);
- ``timesformer`` / ``videomae``: transformers' TimeSformer (divided space-time attention) and VideoMAE (joint
  attention, transformers' default SDPA kernel) for classification, base size (12 x 768), 224 x 224, 400 classes
  (Kinetics-400), ``video_batch`` clips per step.

Variants (``VARIANTS``), all computing in bf16:

- ``baseline``: bf16 weights and gradients, ``MasterWeightAdamW`` (fp32 master and moments: the
  ``"bf16_mixed"`` accounting of ``macroarch.measure.memory``, 16 B per parameter);
- ``mvas_dgr``: the post's stack, stacked by ``macroarch.compose.apply``: ``mvas.apply`` with a plan made from
  the Fisher diagonal of the small model at initialisation (``importance_plan`` at ``weight_bytes`` per managed
  weight, carried to the full-size model by role with ``transfer_plan(depth="uniform")``), ``DGRWrapper`` in sync
  mode (compose's default ``atomic_steps=False``: no pre-step copies, as the post's DGR) stepping
  ``MVASAdamW`` (stochastic rounding, fp8 moments) group by group during backward;
- ``checkpoint`` and ``checkpoint_mvas_dgr``: a reference the post does not mention, activation checkpointing of
  every repeated block (and PointNet's two T-Nets), alone and with the stack (transformers' own switch for the
  video models).

The full-size bytes and "what fits" come from the planner (``macroarch.planner.plan``, :class:`Measurements`): one
full training step of each variant under fake tensors, the variants as the planner's combinations (``plain``,
``mvas+dgr``, ``checkpoint``, ``mvas+dgr+checkpoint``), the MVAS plan carried over by role
(``macroarch.planner.roles``), the largest crop, batch or clip by its search (``largest_fitting``), every step
shared through one ``StepCache``. The folding trunk and the video models are measured at a few depths and
extrapolated to their full depth (each phase of the step on its own; the notebook checks a third depth, or the
whole model). The search is checked against real steps stacked by this harness (:func:`boundary_check`). The
small models trained for real use the synthetic data
of ``macroarch.data.applications``, over paired seeds (:func:`train_seeds`: per seed, both variants share the
initial weights, the batch order and the held-out batches); the graded quality is the held-out loss change taken
per seed with a t interval over the seeds (:class:`PairedSeeds`), and :func:`quality_repeated` keeps the per-seed
numbers for the notebook's leave-one-out check. The graded memory numbers are exact counts (``c1x_estimates``).
The figures take the registry's targets as arguments (the notebook passes ``get_claim(cid).targets``): the harness
does not import the grader.

Deviations: the MVAS plan is not re-planned during these short runs (``MVASSchedule`` is notebook 05's; its fp32
Fisher EMA would add 4 B per managed weight). Checkpointing is ``torch.utils.checkpoint`` without reentrance (one
backward pass, which DGR's per-pass bookkeeping needs; MVAS weights are tensors, so they recompute like any
other); BatchNorm statistics are updated again when a PointNet block is recomputed. The small runs compute in
``compute_dtype``; the memory measurements always in bf16, the claims' setting.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from macroarch import compose, mvas
from macroarch._progress import tqdm
from macroarch.config import DGRConfig, MacroConfig, OptimConfig
from macroarch.data.applications import SHAPES, ensure_dataset, load_dataset
from macroarch.experiments.loop import TrainLog, mvas_kernels
from macroarch.experiments.settings import COMPUTE_DTYPES, Settings
from macroarch.layers import find_repeated_layers
from macroarch.measure.fit import Fit, measure_training
from macroarch.measure.memory import STATE_CATEGORIES, StepMemory
from macroarch.measure.stats import Estimate, Repeated, as_estimate, exact, is_estimate_dict, mean_interval
from macroarch.optim import MasterWeightAdamW
from macroarch.planner.run import CATEGORY_NAMES

MODELS = ("esmfold_trunk", "pointnet", "timesformer", "videomae")
VARIANTS = ("baseline", "mvas_dgr", "checkpoint", "checkpoint_mvas_dgr")
LABELS = {"baseline": "bf16 + fp32 master AdamW", "mvas_dgr": "MVAS + DGR", "checkpoint": "checkpointing",
          "checkpoint_mvas_dgr": "checkpointing + MVAS + DGR"}
GB = 1e9


@dataclass(frozen=True)
class App:
    """One application model: what the fit search varies and the published sizes it is measured at."""

    name: str
    title: str
    searched: str  # the dimension "what fits" searches: "crop", "batch" or "frames"
    unit: str
    multiple: int  # sizes searched are multiples of this
    full: dict[str, Any]  # the published dims (the searched one is set per measurement)


APPS = {a.name: a for a in (
    App("esmfold_trunk", "ESMFold folding trunk (48 blocks, 1024 / 128)", "crop", "residue", 32,
        {"layers": 48, "width": None, "batch": 1}),
    App("pointnet", "PointNet (1024 points, 40 classes)", "batch", "cloud", 1, {"points": 1024, "classes": 40}),
    App("timesformer", "TimeSformer-base (12 x 768, 224 px)", "frames", "frame", 8,
        {"layers": 12, "width": None, "image": 224, "classes": 400}),
    App("videomae", "VideoMAE-base (12 x 768, 224 px)", "frames", "frame", 8,
        {"layers": 12, "width": None, "image": 224, "classes": 400}),
)}


def get_app(name: str) -> App:
    """The model of that name; a ValueError listing the known ones otherwise."""
    if name not in APPS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(APPS)}")
    return APPS[name]


def _check_variant(variant: str) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")


# ------------------------------------------------------------------------------------------------ models

def build_model(name: str, dims: Mapping[str, Any], dtype: torch.dtype = torch.bfloat16,
                device: str | torch.device | None = None) -> nn.Module:
    """The model at ``dims`` (``App.full`` plus the searched dim, or a small run's), created in ``dtype``."""
    get_app(name)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device) if device is not None else contextlib.nullcontext():
            return _build(name, dims).train()
    finally:
        torch.set_default_dtype(previous)


def _build(name: str, d: Mapping[str, Any]) -> nn.Module:
    if name == "esmfold_trunk":
        from macroarch.models.folding import FoldingStack, trunk_config

        small = {} if d.get("width") is None else {
            "sequence_state_dim": d["width"], "pairwise_state_dim": max(32, d["width"] // 2),
            "sequence_head_width": 16, "pairwise_head_width": 16}
        return FoldingStack(trunk_config(num_blocks=d["layers"], **small))
    if name == "pointnet":
        from macroarch.models.pointnet import PointNet

        return PointNet(num_classes=d["classes"])
    from transformers import TimesformerForVideoClassification, VideoMAEForVideoClassification

    cls = TimesformerForVideoClassification if name == "timesformer" else VideoMAEForVideoClassification
    return cls(video_config(name, d))


def video_config(name: str, d: Mapping[str, Any]) -> Any:
    """The transformers config of a video model at ``dims`` (base size, or a small run's width with 8-pixel
    patches); VideoMAE with transformers' default SDPA attention, TimeSformer with its own (it has no SDPA)."""
    from transformers import TimesformerConfig, VideoMAEConfig

    common = {"num_frames": d["frames"], "num_hidden_layers": d["layers"], "num_labels": d["classes"],
              "image_size": d["image"]}
    if d.get("width") is not None:
        common.update(hidden_size=d["width"], num_attention_heads=max(1, d["width"] // 32),
                      intermediate_size=4 * d["width"], patch_size=8)
    if name == "timesformer":
        return TimesformerConfig(**common)
    return VideoMAEConfig(**common, attn_implementation="sdpa")


def random_batch(name: str, dims: Mapping[str, Any], dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """A batch of the right shapes and dtypes (values are irrelevant to a fake-tensor measurement)."""
    if name == "esmfold_trunk":
        b, crop = dims["batch"], dims["crop"]
        return {"aatype": torch.randint(0, 20, (b, crop)), "labels": torch.randint(0, 64, (b, crop, crop))}
    if name == "pointnet":
        return {"points": torch.randn(dims["batch"], dims["points"], 3, dtype=dtype),
                "labels": torch.randint(0, dims["classes"], (dims["batch"],))}
    get_app(name)
    b, size = dims["batch"], dims["image"]
    return {"pixel_values": torch.randn(b, dims["frames"], 3, size, size, dtype=dtype),
            "labels": torch.randint(0, dims["classes"], (b,))}


def loss_of(runner: Callable[..., Any], batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Every model here takes its batch as keywords and returns an output with ``.loss``."""
    return runner(**batch).loss


def checkpoint_units(name: str, model: nn.Module) -> list[nn.Module]:
    """What the checkpointing variants recompute: the repeated blocks (and PointNet's T-Nets)."""
    units = [m for _, m in find_repeated_layers(model)]
    if name == "pointnet":
        units += [model.input_transform, model.feature_transform]
    return units


def checkpoint_modules(modules: Iterable[nn.Module]) -> None:
    """Recompute each module's forward in backward instead of keeping its activations (non-reentrant
    ``torch.utils.checkpoint``: one backward pass, so DGR's per-pass bookkeeping and MVAS weights work inside)."""
    for module in modules:
        module.forward = functools.partial(_checkpointed, module.forward)


def _checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)


def setup(name: str, variant: str, model: nn.Module, example: Mapping[str, torch.Tensor], *,
          plan: mvas.PrecisionPlan | None = None, group_size: int = 1, lr: float = 1e-3,
          seed: int = 0) -> tuple[Callable[..., Any], torch.optim.Optimizer]:
    """``(runner, optimizer)`` of ``variant`` around ``model`` (module docstring). The MVAS + DGR variants are
    ``macroarch.compose.apply`` with ``plan`` (for this model's tensors) and DGR groups of ``group_size`` blocks
    built from one forward on ``example``; checkpointing wraps the blocks afterwards."""
    _check_variant(variant)
    if variant.endswith("mvas_dgr"):
        if plan is None:
            raise ValueError(f"variant {variant!r} needs an MVAS plan")
        config = MacroConfig(optim=OptimConfig(lr=lr, weight_decay=0.0), dgr=DGRConfig(group_size=group_size))
        stack = compose.apply(model, config, example_inputs=dict(example), plan=plan, seed=seed)
        runner, optimizer = stack.model, stack.optimizer
    else:
        runner, optimizer = model, MasterWeightAdamW(model.parameters(), lr=lr, weight_decay=0.0)
    if variant.startswith("checkpoint"):
        checkpoint_modules(checkpoint_units(name, model))
    return runner, optimizer


# ------------------------------------------------------------------------------------------------ memory

#: each variant as the planner's combination of techniques (``macroarch.planner.plan``)
COMBINATIONS = {"baseline": "plain", "mvas_dgr": "mvas+dgr", "checkpoint": "checkpoint",
                "checkpoint_mvas_dgr": "mvas+dgr+checkpoint"}
#: what each application's fit search varies, in the planner's terms
_SEARCH = {"crop": "seq", "batch": "batch", "frames": "frames"}


def planner_model(name: str, base: Mapping[str, Any]) -> Any:
    """``name`` at ``base`` (the published dims, or a small run's) as a ``macroarch.planner`` model, nothing built:
    the folding trunk as ``custom`` (``seq``: residues per crop, searched in steps of 32, one protein per step, 48
    blocks of depth), PointNet as the planner's own (``seq``: points per cloud; its T-Nets recomputed with the
    blocks under ``checkpoint``), the video models from their transformers configs (clips searched in steps of 8
    frames)."""
    from macroarch.planner import custom
    from macroarch.planner.models import from_transformers_config, pointnet

    app = get_app(name)
    if name == "esmfold_trunk":
        def build(layers: int | None, crop: int | None, frames: int | None) -> nn.Module:
            return _build(name, {**base, "layers": base["layers"] if layers is None else layers})

        def make_batch(batch: int, crop: int, frames: int | None) -> dict[str, torch.Tensor]:
            return random_batch(name, {"batch": batch, "crop": crop})

        return custom(name, build, make_batch, loss_of, layers=base["layers"], seq_name="residues",
                      seq_multiple=app.multiple, family="ESMFold folding trunk")
    if name == "pointnet":
        return pointnet(num_classes=base["classes"])
    config = video_config(name, {**base, "frames": base.get("frames", app.multiple)})
    return dataclasses.replace(from_transformers_config(name, config), frames_multiple=app.multiple)


class Measurements:
    """Fake-tensor steps of one model at its published size (or ``base``), by the planner
    (``macroarch.planner.plan``, one ``StepCache`` for all), so the size table, the depth check and the fit
    searches share every step measured.

    Args:
        name: a model of ``MODELS``.
        plan: the MVAS plan (of the small model; carried over by role, ``macroarch.planner.roles``) for the MVAS
            variants.
        group_size: DGR's blocks per group.
        depths: measure at these depths and extrapolate to the published one (the planner's ``depths``; with two,
            not checked: ``check_depth`` checks one more); None measures the whole model.
        video_batch: clips per step of the video models.
        base: dims to measure at instead of the published ones (the ci profile's toy sizes, same code path).
        fake: fake tensors (else real ones: toy sizes, where a real step is the faster one; the same bytes).
        max_size: the fit searches stop at this size (a fit there is reported as capped).
    """

    def __init__(self, name: str, *, plan: mvas.PrecisionPlan | None, group_size: int = 1,
                 depths: Sequence[int] | None = None, video_batch: int = 1,
                 base: Mapping[str, Any] | None = None, fake: bool = True, max_size: int = 1 << 16) -> None:
        from macroarch.planner.run import StepCache

        self.app = get_app(name)
        self.base = dict(self.app.full if base is None else base)
        if depths is not None and (len(depths) < 2 or min(depths) < 2):
            raise ValueError(f"depths={list(depths)}: give two or more depths of at least 2 blocks (DGR's groups "
                             "need a repeated container)")
        self.name, self.plan, self.group_size, self.video_batch = name, plan, group_size, video_batch
        self.fake, self.max_size = fake, max_size
        self.depths = sorted(depths) if depths else None
        self.model = planner_model(name, self.base)
        self.cache = StepCache()
        self.reference: int | None = None  # the first size measured: where the fit searches' plans are made

    @property
    def seconds(self) -> float:
        """Wall time of every step measured."""
        return self.cache.seconds

    @functools.cached_property
    def n_params(self) -> int:
        """Parameters of the measured model (at the smallest searched size, for the video models' time embedding)."""
        model = self.model if self.model.frames is None else dataclasses.replace(self.model, frames=self.app.multiple)
        return sum(p.numel() for p in model.build(None, torch.bfloat16, self._sizes(self.app.multiple)[1]).parameters())

    def _sizes(self, size: int) -> tuple[int, int | None, int | None]:
        """``(batch, seq, frames)`` of a step at ``size`` of the searched dimension."""
        if self.app.searched == "crop":
            return self.base.get("batch", 1), size, None
        if self.app.searched == "batch":
            return size, self.base["points"], None
        return self.video_batch, self.base["image"], size

    def _plan(self, variants: Sequence[str], size: int, depths: tuple[int, ...] | None = None, **kwargs: Any) -> Any:
        from macroarch.planner import plan
        from macroarch.planner.roles import rules_from_plan

        for v in variants:
            _check_variant(v)
        policy = None
        if any(v.endswith("mvas_dgr") for v in variants):
            if self.plan is None:
                raise ValueError("the MVAS variants need an MVAS plan")
            policy = {"mvas": {"precision_policy": rules_from_plan(self.plan)}}
        batch, seq, frames = self._sizes(size)
        depths = tuple(self.depths or ()) if depths is None else depths
        self.reference = size if self.reference is None else self.reference
        return plan(self.model, batch, seq, frames=frames, combinations=[COMBINATIONS[v] for v in variants],
                    policy=policy, group_size=self.group_size, depths=depths, cache=self.cache,
                    search=_SEARCH[self.app.searched], max_size=self.max_size, fake=self.fake, **kwargs)

    @staticmethod
    def _step(c: Any) -> StepMemory:
        """A planned combination as measured (no GPU-kernel correction applies to these families)."""
        if c.error is not None or c.measured is None:
            raise RuntimeError(f"the planner could not measure {c.name}: {c.error or c.how}")
        b = c.measured
        return StepMemory(b.peak, dict(b.at_peak), {k: b.categories[v] for k, v in CATEGORY_NAMES.items()}, 0.0)

    def __call__(self, variant: str, size: int) -> StepMemory:
        return self._step(self._plan([variant], size).combination(COMBINATIONS[variant]))

    def check_depth(self, variant: str, size: int, depth: int) -> StepMemory:
        """The step at ``size`` extrapolated from ``depths`` and checked at ``depth`` blocks to the byte (the
        published depth: the whole model); ValueError if the bytes there are not on the line."""
        if self.depths is None:
            raise ValueError("this model is measured whole: there is no extrapolation to check")
        asked = tuple(sorted({*self.depths, depth}))
        c = self._plan([variant], size, depths=asked).combination(COMBINATIONS[variant])
        if c.depths != asked:
            raise ValueError(f"{self.name} {variant}: the bytes at {depth} blocks are not on the line through "
                             f"{self.depths} ({c.how})")
        return self._step(c)

    def table(self, sizes: Sequence[int], variants: Sequence[str] = VARIANTS) -> SizeTable:
        """The step of every variant at every size, by category."""
        reports: dict[str, dict[int, StepMemory]] = {v: {} for v in variants}
        for n in sizes:
            planned = self._plan(variants, n)
            for v in variants:
                reports[v][n] = self._step(planned.combination(COMBINATIONS[v]))
        return SizeTable(self.name, reports)

    def fits(self, budgets_gb: Sequence[float], variants: Sequence[str] = VARIANTS) -> FitTable:
        """The largest size of every variant at every budget (the planner's search, from the smallest size of the
        grid up to ``max_size``; later budgets start from what earlier ones measured)."""
        fits: dict[str, dict[float, Fit]] = {v: {} for v in variants}
        size = self.reference or 2 * self.app.multiple
        for b in tqdm(budgets_gb, desc=f"{self.name}: what fits", mininterval=10):
            planned = self._plan(variants, size, budget_gb=b)
            for v in variants:
                c = planned.combination(COMBINATIONS[v])
                if c.largest is None:
                    raise ValueError(f"{self.name} {v}: {next(n for n in c.notes if n.startswith('largest'))}")
                fits[v][b] = _fit(c, b)
        curves = {v: planned.combination(COMBINATIONS[v]).searched for v in variants}
        return FitTable(self.name, fits, curves)


def _fit(c: Any, budget_gb: float) -> Fit:
    """A planned combination's largest size as a ``Fit`` (with its peak and the next size's, from the search)."""
    above = [n for n in c.searched if n > c.largest]
    nxt = min(above) if above and not c.largest_capped else None
    return Fit(size=c.largest, peak_bytes=c.searched[c.largest], next_size=c.largest if nxt is None else nxt,
               next_peak_bytes=None if nxt is None else c.searched[nxt], budget_bytes=round(budget_gb * GB),
               measurements=len(c.searched))


@dataclass
class SizeTable:
    """Bytes of one step, by category, per variant and size."""

    name: str
    reports: dict[str, dict[int, StepMemory]]

    def reduction(self, size: int, variant: str = "mvas_dgr", against: str = "baseline") -> float:
        """``1 - peak(variant) / peak(against)`` at ``size``."""
        return 1.0 - self.reports[variant][size].peak_bytes / self.reports[against][size].peak_bytes

    def metrics(self) -> dict[str, float]:
        out = {}
        for v, by_size in self.reports.items():
            for n, r in by_size.items():
                out[f"{self.name}_{v}_{n}_peak_bytes"] = r.peak_bytes
                out[f"{self.name}_{v}_{n}_state_bytes"] = sum(r.by_category[k] for k in STATE_CATEGORIES)
                out[f"{self.name}_{v}_{n}_activation_bytes"] = r.by_category["activations"]
        return out

    def describe(self) -> str:
        app = get_app(self.name)
        peak = max(r.peak_bytes for by in self.reports.values() for r in by.values())
        unit, div = ("GB", GB) if peak >= GB else ("MB", 1e6)
        head = f"{app.searched:>7} {'variant':<28}{'peak':>9}{'state':>8}{'activ.':>8}{'temp.':>8}{'vs base':>9}"
        lines = [f"{app.title}: one training step at the peak, by category ({unit})", head]
        for n in next(iter(self.reports.values())):
            for v, by_size in self.reports.items():
                r = by_size[n]
                state = sum(r.by_category[k] for k in STATE_CATEGORIES)
                lines.append(f"{n:>7} {LABELS[v]:<28}{r.peak_bytes / div:>9.2f}{state / div:>8.2f}"
                             f"{r.by_category['activations'] / div:>8.2f}{r.by_category['temporaries'] / div:>8.2f}"
                             f"{-self.reduction(n, v) if 'baseline' in self.reports else 0:>+9.1%}")
        return "\n".join(lines)


@dataclass
class FitTable:
    """The largest size per variant and budget, and the peaks measured on the way (``curves``: size -> bytes)."""

    name: str
    fits: dict[str, dict[float, Fit]]
    curves: dict[str, dict[int, int]]

    def size(self, variant: str, budget_gb: float) -> int:
        return self.fits[variant][budget_gb].size

    def growth(self, budget_gb: float, variant: str = "mvas_dgr") -> float:
        """``variant``'s largest size over the baseline's."""
        return self.size(variant, budget_gb) / self.size("baseline", budget_gb)

    def metrics(self) -> dict[str, float]:
        what = get_app(self.name).searched
        return {f"{self.name}_{v}_{b:g}gb_max_{what}": fit.size for v, by in self.fits.items() for b, fit in by.items()}

    def describe(self) -> str:
        app = get_app(self.name)
        budgets = list(next(iter(self.fits.values())))
        measured = sum(map(len, self.curves.values()))
        lines = [f"{app.title}: largest {app.searched} whose training step fits ({measured} sizes measured; + = "
                 "search capped)", f"{'variant':<28}" + "".join(f"{f'{b:g} GB':>10}" for b in budgets)]
        for variant, by_budget in self.fits.items():
            cells = (f"{by_budget[b].size:>9}{'+' if by_budget[b].capped else ' '}" for b in budgets)
            lines.append(f"{LABELS[variant]:<28}" + "".join(cells))
        return "\n".join(lines)


@dataclass
class BoundaryCheck:
    """The fit search against real tensors: per variant, the batch it picked and the *real* peaks at that batch
    and one above it (``rows``: variant -> (batch, peak, peak at batch + 1))."""

    budget_bytes: int
    rows: dict[str, tuple[int, int, int]]

    @property
    def ok(self) -> bool:
        """Every picked batch fits for real and one more does not."""
        return all(at <= self.budget_bytes < above for _, at, above in self.rows.values())

    def metrics(self) -> dict[str, float]:
        out = {f"fit_check_{v}_batch": b for v, (b, _, _) in self.rows.items()}
        return {**out, "fit_check_ok": int(self.ok)}

    def describe(self) -> str:
        lines = [f"fit search on fake tensors vs a real step, small PointNet, budget {self.budget_bytes / 1e6:.1f} MB:"]
        for v, (b, at, above) in self.rows.items():
            right = "fits, one more does not" if at <= self.budget_bytes < above else "WRONG"
            lines.append(f"  {LABELS[v]:<28} batch {b}: real peak {at / 1e6:.2f} MB; batch {b + 1}: "
                         f"{above / 1e6:.2f} MB -> {right}")
        return "\n".join(lines)


def real_step(name: str, variant: str, dims: Mapping[str, Any], *, plan: mvas.PrecisionPlan | None = None,
              group_size: int = 1) -> StepMemory:
    """Peak bytes, by category, of one real training step of ``variant`` at ``dims`` (CPU kernels), stacked by this
    harness (:func:`setup`, as the small runs train), independently of the planner: the arbiter of
    :func:`boundary_check`. ``plan`` is carried over to the model by role."""
    def build() -> tuple:
        torch.manual_seed(0)
        model = build_model(name, dims)
        batch = random_batch(name, dims)
        moved = mvas.transfer_plan(plan, model, depth="uniform") if variant.endswith("mvas_dgr") else None
        runner, optimizer = setup(name, variant, model, batch, plan=moved, group_size=group_size)
        return model, runner, optimizer, batch

    return measure_training(build, loss_of, fake=False)


def boundary_check(budget_mb: float, points: int, variants: Sequence[str] = VARIANTS, *,
                   plan: mvas.PrecisionPlan | None = None, group_size: int = 1) -> BoundaryCheck:
    """The planner's fit search against real tensors on a small PointNet (``points`` per cloud, 8 classes): the
    largest batch the planner finds on fake tensors, then a real step (:func:`real_step`) at it and at one more."""
    dims = {"points": points, "classes": len(SHAPES)}
    meas = Measurements("pointnet", plan=plan, group_size=group_size, base=dims)
    fits = meas.fits([budget_mb / 1e3], variants)
    rows = {}
    for variant in variants:
        b = fits.size(variant, budget_mb / 1e3)
        at, above = (real_step("pointnet", variant, dict(dims, batch=n), plan=plan, group_size=group_size).peak_bytes
                     for n in (b, b + 1))
        rows[variant] = (b, at, above)
    return BoundaryCheck(int(budget_mb * 1e6), rows)


# ------------------------------------------------------------------------------------------------ training

def small_dims(name: str, *, width: int, layers: int, crop: int, points: int, frames: int, image: int) -> dict:
    """The dims of the small model trained for real (PointNet keeps its published width: it is small already)."""
    get_app(name)
    if name == "esmfold_trunk":
        return {"layers": layers, "width": width, "crop": crop}
    if name == "pointnet":
        return {"points": points, "classes": len(SHAPES)}
    return {"layers": layers, "width": width, "frames": frames, "image": image, "classes": 4}


def data_batches(name: str, dims: Mapping[str, Any], batch_size: int, steps: int, eval_batches: int,
                 dtype: torch.dtype, seed: int = 0, data_seed: int | None = None) -> tuple[list[dict], list[dict]]:
    """``steps`` training batches (drawn with replacement, in an order seeded by ``seed``) and ``eval_batches``
    held-out ones from the synthetic dataset of ``name`` (``macroarch.data.applications``, generated from
    ``data_seed``, by default ``seed``; built first if missing). The held-out batches are the dataset's last
    samples: the same for every ``seed`` of one ``data_seed``."""
    from macroarch.models.folding import distance_bins

    data_seed = seed if data_seed is None else data_seed
    n = max(256, 4 * batch_size * max(1, eval_batches))
    if name == "esmfold_trunk":
        data = load_dataset(ensure_dataset("proteins", n=n, length=dims["crop"], seed=data_seed))
        xs = {"aatype": data["aatype"], "labels": distance_bins(data["coords"])}
    elif name == "pointnet":
        data = load_dataset(ensure_dataset("pointclouds", n=n, points=dims["points"], seed=data_seed))
        xs = {"points": data["points"].to(dtype), "labels": data["labels"]}
    else:
        data = load_dataset(ensure_dataset("videos", n=n, frames=dims["frames"], size=dims["image"], seed=data_seed))
        xs = {"pixel_values": (data["clips"].float() / 127.5 - 1.0).to(dtype), "labels": data["labels"]}
    held = eval_batches * batch_size  # the last clips are held out
    g = torch.Generator().manual_seed(seed)
    train = [{k: v[idx] for k, v in xs.items()}
             for idx in torch.randint(0, n - held, (steps, batch_size), generator=g)]
    evals = [{k: v[n - held + i * batch_size: n - held + (i + 1) * batch_size] for k, v in xs.items()}
             for i in range(eval_batches)]
    return train, evals


@dataclass
class TrainResult:
    """The small model trained for real from one seed, baseline against MVAS + DGR."""

    name: str
    n_params: int
    logs: dict[str, TrainLog]
    eval_loss: dict[str, float]
    plan: mvas.PrecisionPlan = field(repr=False)
    eval_losses: dict[str, list[float]] = field(default_factory=dict)  # per held-out batch, in the same order
    seed: int = 0

    def loss_change(self) -> float:
        """MVAS + DGR's held-out loss relative to the baseline's: ``technique / baseline - 1`` (> 0: worse)."""
        return self.eval_loss["mvas_dgr"] / self.eval_loss["baseline"] - 1.0

    @property
    def speed_ratio(self) -> float:
        """Baseline step time over MVAS + DGR's (the post's "0.92x speed" convention: < 1 is slower)."""
        return self.logs["baseline"].step_time() / self.logs["mvas_dgr"].step_time()

    def final_loss(self, variant: str, frac: float = 0.1) -> float:
        losses = self.logs[variant].losses
        tail = losses[-max(1, int(len(losses) * frac)):]
        return sum(tail) / len(tail)


def train_compare(name: str, dims: Mapping[str, Any], *, steps: int, batch_size: int, lr: float,
                  compute_dtype: str, weight_bytes: float, importance_batches: int, eval_batches: int,
                  group_size: int = 1, seed: int = 0, data_seed: int | None = None) -> TrainResult:
    """Train the small model twice from the same initial weights on the same batches, one step of each in turn:
    the baseline and MVAS + DGR (plan: Fisher diagonal at initialisation over ``importance_batches`` batches,
    ``importance_plan`` at ``weight_bytes`` per managed weight). ``seed`` sets the initial weights, the batch order
    and MVASAdamW's rounding; ``data_seed`` (default ``seed``) the dataset (:func:`data_batches`)."""
    from macroarch.measure.machine import torch_dtype

    dtype = torch_dtype(compute_dtype)
    train, evals = data_batches(name, dims, batch_size, steps, eval_batches, dtype, seed, data_seed)
    torch.manual_seed(seed)
    initial = build_model(name, dims, dtype=dtype)
    probe = copy.deepcopy(initial).float()
    fisher = mvas.fisher_diagonal(probe, lambda m, b: loss_of(m, {k: _as(v, torch.float32) for k, v in b.items()}),
                                  train[:importance_batches])
    plan = mvas.importance_plan(dict(initial.named_parameters()), fisher, weight_bytes=weight_bytes)
    del probe, fisher
    runs = {}
    for variant in ("baseline", "mvas_dgr"):
        model = copy.deepcopy(initial)
        runs[variant] = (model, *setup(name, variant, model, train[0], plan=plan, group_size=group_size, lr=lr,
                                       seed=seed))
    logs = {v: TrainLog() for v in runs}
    for step, batch in enumerate(tqdm(train, desc=f"{name} seed {seed}: training (baseline, MVAS + DGR in turn)",
                                      mininterval=10)):
        for variant, (_, runner, optimizer) in runs.items():
            start = time.perf_counter()
            loss = loss_of(runner, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            logs[variant].seconds.append(time.perf_counter() - start)
            logs[variant].losses.append(loss.item())
            if not torch.isfinite(loss):
                raise FloatingPointError(f"{name} {variant}: loss is {loss.item()} at step {step} (seed {seed})")
    eval_losses = {}
    with torch.no_grad():
        for variant, (model, runner, _) in runs.items():
            model.eval()
            eval_losses[variant] = [loss_of(runner, b).item() for b in evals]
            model.train()
    eval_loss = {v: sum(x) / len(x) for v, x in eval_losses.items()}
    return TrainResult(name, sum(p.numel() for p in initial.parameters()), logs, eval_loss, plan, eval_losses, seed)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() else t


#: how C12-C14's held-out loss change is estimated (the interval's method, in the verdict)
QUALITY_METHOD = "paired t over training seeds"


@dataclass
class PairedSeeds:
    """One application's small model trained over paired seeds (:func:`train_compare` per seed): within a seed the
    baseline and MVAS + DGR share the initial weights, the batch order and the held-out batches, so the held-out
    loss change is taken per seed and its interval is over the seeds (the training draw's spread, not only the
    evaluation's)."""

    name: str
    runs: list[TrainResult]

    def __post_init__(self) -> None:
        if not self.runs:
            raise ValueError(f"{self.name}: no seeds were trained")

    @property
    def seeds(self) -> list[int]:
        return [r.seed for r in self.runs]

    @property
    def n_params(self) -> int:
        return self.runs[0].n_params

    @property
    def steps(self) -> int:
        return len(self.runs[0].logs["baseline"].losses)

    @property
    def plan(self) -> mvas.PrecisionPlan:
        """The first seed's MVAS plan: the one the memory measurements carry to the full-size model."""
        return self.runs[0].plan

    def changes(self) -> list[float]:
        """The held-out loss change of each seed (:meth:`TrainResult.loss_change`)."""
        return [r.loss_change() for r in self.runs]

    def quality_change(self) -> Estimate:
        """The graded quality number: the mean over seeds of the per-seed relative held-out loss change, with a
        90% t interval over the seeds (one seed: no interval, which cannot decide a grade)."""
        return mean_interval(self.changes(), method=QUALITY_METHOD)

    def repeated(self) -> Repeated:
        """The per-seed changes behind :meth:`quality_change`, for leaving one seed out (``Run.leave_one_out``)."""
        return Repeated(mean_interval, (tuple(self.changes()),), "seeds", {"method": QUALITY_METHOD})

    def mean(self, what: Callable[[TrainResult], float]) -> float:
        return sum(what(r) for r in self.runs) / len(self.runs)

    def eval_loss(self, variant: str) -> float:
        """Held-out loss, mean over seeds (nats)."""
        return self.mean(lambda r: r.eval_loss[variant])

    @property
    def speed_ratio(self) -> float:
        """Baseline step time over MVAS + DGR's, the median of the seeds' ratios (step pairs in one order, not
        ABBA blocks: not graded)."""
        ratios = sorted(r.speed_ratio for r in self.runs)
        return ratios[len(ratios) // 2]

    def metrics(self) -> dict[str, float]:
        """Means over seeds (losses in nats), the speed ratio, and each seed's loss change (the raw pairs behind
        the graded estimate)."""
        n = self.name
        out = {f"{n}_speed_ratio": self.speed_ratio, f"{n}_train_params": self.n_params,
               f"{n}_quality_seeds": len(self.runs)}
        for v in ("baseline", "mvas_dgr"):
            out[f"{n}_{v}_first_loss"] = self.mean(lambda r, v=v: r.logs[v].losses[0])
            out[f"{n}_{v}_final_loss"] = self.mean(lambda r, v=v: r.final_loss(v))
            out[f"{n}_{v}_eval_loss"] = self.eval_loss(v)
            out |= {f"{n}_seed{r.seed}_{v}_eval_loss": r.eval_loss[v] for r in self.runs}
        out |= {f"{n}_seed{r.seed}_loss_change": r.loss_change() for r in self.runs}
        return out

    def mean_losses(self, variant: str) -> list[float]:
        """Training loss at each step, mean over seeds (nats)."""
        return [sum(x) / len(x) for x in zip(*(r.logs[variant].losses for r in self.runs), strict=True)]

    def log_to(self, run: Any) -> None:
        """Every step's losses (each seed's and their mean) as series of ``run``, and the summary metrics."""
        means = {v: self.mean_losses(v) for v in ("baseline", "mvas_dgr")}
        for step in range(self.steps):
            row = {f"{self.name}_{v}_loss": means[v][step] for v in means}
            row |= {f"{self.name}_seed{r.seed}_{v}_loss": r.logs[v].losses[step] for r in self.runs
                    for v in ("baseline", "mvas_dgr")}
            run.log(step=step, **row)
        run.summary(**self.metrics())

    def describe(self) -> str:
        title = get_app(self.name).title.split(" (")[0]
        rows = [f"{title} small ({self.n_params / 1e6:.2f}M params), {self.steps} steps x {len(self.runs)} paired "
                f"seeds; losses in nats (training: mean of the last 10% of steps)"]
        for r in self.runs:
            b, m = r.logs["baseline"], r.logs["mvas_dgr"]
            rows.append(f"  seed {r.seed}: baseline {b.losses[0]:.3f} -> {r.final_loss('baseline'):.3f} (held out "
                        f"{r.eval_loss['baseline']:.3f}), MVAS + DGR {m.losses[0]:.3f} -> "
                        f"{r.final_loss('mvas_dgr'):.3f} (held out {r.eval_loss['mvas_dgr']:.3f}): change "
                        f"{r.loss_change():+.1%}; step {b.step_time() * 1e3:.0f} vs {m.step_time() * 1e3:.0f} ms")
        rows.append(f"  held-out loss change {self.quality_change().describe(3)}; speed {self.speed_ratio:.2f}x")
        return "\n".join(rows)


def train_seeds(name: str, dims: Mapping[str, Any], *, seeds: Sequence[int], data_seed: int,
                **kwargs: Any) -> PairedSeeds:
    """:func:`train_compare` once per seed of ``seeds``, all on the dataset of ``data_seed`` (so every seed is
    evaluated on the same held-out batches); ``kwargs`` are :func:`train_compare`'s."""
    return PairedSeeds(name, [train_compare(name, dims, seed=s, data_seed=data_seed, **kwargs) for s in seeds])


# ------------------------------------------------------------------------------------------------ claims

def worst_change(*per_model: Sequence[float], method: str = QUALITY_METHOD) -> Estimate:
    """The largest (worst) of the models' held-out loss changes, each a t interval over its seeds
    (``held_out_loss_change``: the number the claim's quality stands or falls with where no per-model one is)."""
    return max((mean_interval(c, method=method) for c in per_model), key=lambda e: e.value)


def quality_estimates(*trains: PairedSeeds) -> dict[str, Estimate]:
    """C12-C14's quality: each small model's held-out loss change over paired seeds
    (``held_out_loss_change_<model>``), and ``held_out_loss_change``, the worst of them."""
    per = {f"held_out_loss_change_{t.name}": t.quality_change() for t in trains}
    return {**per, "held_out_loss_change": worst_change(*(t.changes() for t in trains))}


def quality_repeated(*trains: PairedSeeds) -> dict[str, Repeated]:
    """The per-seed data behind :func:`quality_estimates`, for ``Run.leave_one_out``: seed i of every model is
    left out together (they share the seed's number, not its draw)."""
    per = {f"held_out_loss_change_{t.name}": t.repeated() for t in trains}
    worst = Repeated(worst_change, tuple(tuple(t.changes()) for t in trains), "seeds", {"method": QUALITY_METHOD})
    return {**per, "held_out_loss_change": worst}


def c12_metrics(table: SizeTable, crop: int) -> dict[str, float]:
    """C12: MVAS + DGR's peak reduction at the graded ``crop`` against the plain baseline
    (``memory_reduction``) and the activation-checkpointed one (``memory_reduction_vs_checkpoint``:
    checkpointing + MVAS + DGR over checkpointing alone), the same at every crop, and checkpointing's own."""
    out = {"memory_reduction": table.reduction(crop), "graded_crop": crop,
           "memory_reduction_vs_checkpoint": table.reduction(crop, "checkpoint_mvas_dgr", "checkpoint")}
    for n in table.reports["baseline"]:
        out[f"memory_reduction_{n}"] = table.reduction(n)
        for v in ("checkpoint", "checkpoint_mvas_dgr"):
            if v in table.reports:
                out[f"{v}_reduction_{n}"] = table.reduction(n, v)
        if {"checkpoint", "checkpoint_mvas_dgr"} <= set(table.reports):
            out[f"stack_over_checkpoint_reduction_{n}"] = table.reduction(n, "checkpoint_mvas_dgr", "checkpoint")
    return out


def c13_metrics(fits: FitTable) -> dict[str, float]:
    """C13: batch growth (largest batch of a variant over the baseline's) per budget; ``batch_growth`` is the
    smallest over the budgets."""
    out = {}
    for b in next(iter(fits.fits.values())):
        for v in fits.fits:
            if v != "baseline":
                out[f"{'' if v == 'mvas_dgr' else v + '_'}batch_growth_{b:g}gb"] = fits.growth(b, v)
    out["batch_growth"] = min(v for k, v in out.items() if k.startswith("batch_growth_"))
    return out


def c14_metrics(*fits: FitTable) -> dict[str, float]:
    """C14: the longest clip per model and budget with MVAS + DGR and without; ``max_frames`` is the shortest of
    the MVAS + DGR clips at the smallest budget."""
    out = {}
    for f in fits:
        for b in f.fits["baseline"]:
            out[f"max_frames_{f.name}_{b:g}gb"] = f.size("mvas_dgr", b)
            out[f"baseline_frames_{f.name}_{b:g}gb"] = f.size("baseline", b)
    smallest = min(fits[0].fits["baseline"])
    out["max_frames"] = min(f.size("mvas_dgr", smallest) for f in fits)
    return out


def c12_estimates(table: SizeTable, crop: int) -> dict[str, Estimate]:
    """C12's graded memory numbers at ``crop``: the reductions against the plain and the checkpointed baseline,
    exact byte ratios (points)."""
    m = c12_metrics(table, crop)
    return {k: exact(m[k]) for k in ("memory_reduction", "memory_reduction_vs_checkpoint")}


def c13_estimates(fits: FitTable) -> dict[str, Estimate]:
    """C13's graded batch growth per budget (and the smallest, ``batch_growth``): exact counts' ratios."""
    return {k: exact(v, "x") for k, v in c13_metrics(fits).items() if k.startswith("batch_growth")}


def c14_estimates(*fits: FitTable) -> dict[str, Estimate]:
    """C14's frames per model and budget, with and without the techniques: exact counts."""
    return {k: exact(v, "frames") for k, v in c14_metrics(*fits).items()}


def _gb(x: float) -> str:
    return f"{x / GB:.1f} GB" if x >= 0.1 * GB else f"{x / 1e6:.1f} MB"


def _estimate(m: Mapping[str, Any], key: str, unit: str = "") -> Estimate:
    """A graded number as recorded (``Run.measurements``: an estimate's dict); a bare number is an exact count."""
    x = m[key]
    return as_estimate(x) if isinstance(x, Estimate) or is_estimate_dict(x) else exact(float(x), unit)


def _value(m: Mapping[str, Any], key: str) -> float:
    x = m[key]
    return as_estimate(x).value if isinstance(x, Estimate) or is_estimate_dict(x) else float(x)


def _short_title(name: str) -> str:
    return get_app(name).title.split(" (")[0]


def _quality_text(m: Mapping[str, Any], names: Sequence[str]) -> str:
    """Each small model's graded held-out loss change, with its interval (empty when the run holds none)."""
    cells = [f"{_short_title(n)} {_estimate(m, k).describe(3)}" for n in names
             if (k := f"held_out_loss_change_{n}") in m]
    return ("small runs' held-out loss with MVAS + DGR relative to the baseline's (technique / baseline - 1): "
            + ", ".join(cells)) if cells else ""


def _train_note(m: Mapping[str, Any], name: str) -> str:
    """The small runs of ``name`` in one clause (empty when the metrics hold none)."""
    n = name
    if f"{n}_speed_ratio" not in m:
        return ""
    f = {v: (_value(m, f"{n}_{v}_final_loss"), _value(m, f"{n}_{v}_eval_loss")) for v in ("baseline", "mvas_dgr")}
    seeds = int(_value(m, f"{n}_quality_seeds")) if f"{n}_quality_seeds" in m else 1
    return (f"{_short_title(n)} small runs (mean of {seeds} paired seeds): training loss {f['baseline'][0]:.3f} vs "
            f"{f['mvas_dgr'][0]:.3f} nats with MVAS + DGR (held out {f['baseline'][1]:.3f} vs {f['mvas_dgr'][1]:.3f}), "
            f"speed {_value(m, f'{n}_speed_ratio'):.2f}x (not graded)")


def verdict_texts(claim_id: str, measurements: Mapping[str, Any], scale: str) -> dict[str, str]:
    """``scale``, ``measured_text`` and ``note`` for ``get_claim(claim_id).grade`` of C12, C13 or C14, read from a
    run's ``measurements`` (``Run.measurements``: metrics with each graded number's estimate): every graded number
    in the measured text with its interval, n and method (``Estimate.describe``; exact counts say so)."""
    m = measurements
    names = {"C12": ["esmfold_trunk"], "C13": ["pointnet"], "C14": ["timesformer", "videomae"]}.get(claim_id)
    if names is None:
        raise ValueError(f"claim {claim_id!r} is not one of this notebook's (C12, C13, C14)")
    if claim_id == "C12":
        crop = int(_value(m, "graded_crop"))
        peak = {v: _value(m, f"esmfold_trunk_{v}_{crop}_peak_bytes") for v in VARIANTS}
        text = (f"peak-memory reduction at crop {crop}: against the plain baseline "
                f"{_estimate(m, 'memory_reduction').describe(3)} ({_gb(peak['baseline'])} -> "
                f"{_gb(peak['mvas_dgr'])}), against the checkpointed one "
                f"{_estimate(m, 'memory_reduction_vs_checkpoint').describe(3)} ({_gb(peak['checkpoint'])} -> "
                f"{_gb(peak['checkpoint_mvas_dgr'])})")
        note = (f"state {_gb(_value(m, f'esmfold_trunk_baseline_{crop}_state_bytes'))} -> "
                f"{_gb(_value(m, f'esmfold_trunk_mvas_dgr_{crop}_state_bytes'))}, activations "
                f"{_gb(_value(m, f'esmfold_trunk_baseline_{crop}_activation_bytes'))} -> "
                f"{_gb(_value(m, f'esmfold_trunk_mvas_dgr_{crop}_activation_bytes'))}; activation checkpointing alone "
                f"{-m.get(f'checkpoint_reduction_{crop}', float('nan')):+.0%}, with MVAS + DGR "
                f"{-m.get(f'checkpoint_mvas_dgr_reduction_{crop}', float('nan')):+.0%}")
    elif claim_id == "C13":
        cells = sorted((k for k in m if k.startswith("batch_growth_") and k.endswith("gb")),
                       key=lambda k: float(k[13:-2]))
        text = "largest batch with MVAS + DGR over the baseline's: " + ", ".join(
            f"{k[13:-2]} GB {_estimate(m, k, 'x').describe(3)}" for k in cells)
        ckpt = sorted((k, _value(m, k)) for k in m if k.startswith("checkpoint_batch_growth_"))
        note = ("activation checkpointing alone: " + ", ".join(f"{k[24:-2]} GB {v:.2f}x" for k, v in ckpt)
                if ckpt else "")
    else:
        cells = sorted(k[len("max_frames_"):] for k in m if k.startswith("max_frames_") and k.endswith("gb"))
        text = "longest clip: " + ", ".join(
            f"{_short_title(next(n for n in names if c.startswith(n)))} {c.rsplit('_', 1)[1][:-2]} GB "
            f"{_estimate(m, f'max_frames_{c}', 'frames').describe()} with MVAS + DGR, "
            f"{_estimate(m, f'baseline_frames_{c}', 'frames').describe()} without" for c in cells)
        note = ""
    text = "; ".join(x for x in (text, _quality_text(m, names)) if x)
    note = "; ".join(x for x in (note, *(_train_note(m, n) for n in names)) if x)
    return {"scale": scale, "measured_text": text, "note": note}


# ------------------------------------------------------------------------------------------------ plots

_COLORS = {"parameters": "C0", "gradients": "C1", "optimizer_state": "C2", "master_weights": "C3",
           "activations": "C7", "temporaries": "C8", "other": "C9"}
#: tick labels of the variants (the baseline: bf16 + fp32 master AdamW; checkpointing of every block)
_SHORT = {"baseline": "baseline", "mvas_dgr": "MVAS + DGR", "checkpoint": "checkpointing",
          "checkpoint_mvas_dgr": "ckpt. + MVAS + DGR"}
_STYLE = {"baseline": ("C0", "-"), "mvas_dgr": ("C3", "--"), "checkpoint": ("C2", "-."),
          "checkpoint_mvas_dgr": ("C4", ":")}
_SEARCHED = {"crop": "crop (residues)", "batch": "batch (point clouds)", "frames": "clip length (frames)"}
_BELOW = dict(loc="upper center", fontsize=8, frameon=False)  # legends under their axes, never over the data
_TARGET = dict(color="C2", ls="--", lw=1.2)
_BAND = dict(color="0.85", zorder=0)
_WIDTH = 8.2  # inches: the report scales every figure to 6.69 in, so 8-pt text prints at 6.5 pt or more


def _targets(targets: Sequence[Any]) -> dict[str, Any]:
    """The registry's targets by metric (``get_claim(cid).targets``, passed in by the notebook)."""
    return {t.metric: t for t in targets}


def _unit(peak_bytes: float) -> tuple[str, float]:
    return ("GB", GB) if peak_bytes >= 0.1 * GB else ("MB", 1e6)


def _legend_below(ax: Any, ncol: int = 2, offset: float = -0.22) -> None:
    ax.legend(bbox_to_anchor=(0.5, offset), ncol=ncol, **_BELOW)


def _log2_ticks(axis: Any, lo: float, hi: float, most: int = 6) -> None:
    """Powers of two from ``lo`` to ``hi`` as the major ticks of a log axis (at most ``most``), written plainly."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    ticks = [2.0 ** k for k in range(math.floor(math.log2(lo)), math.ceil(math.log2(hi)) + 1)]
    ticks = ticks[::max(1, math.ceil(len(ticks) / most))]
    axis.set_major_locator(FixedLocator(ticks))
    axis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    axis.set_minor_formatter(NullFormatter())


def _category_panel(ax: Any, table: SizeTable) -> None:
    """The step's peak per variant (and size) as horizontal bars, stacked by the categories live at that moment."""
    app = get_app(table.name)
    sizes = list(next(iter(table.reports.values())))
    unit, div = _unit(max(r.peak_bytes for by in table.reports.values() for r in by.values()))
    y, ticks, labels, top = 0.0, [], [], 0.0
    for size in sizes:
        for v, by_size in table.reports.items():
            left = 0.0
            for k, color in _COLORS.items():
                w = by_size[size].by_category[k] / div
                ax.barh(y, w, 0.8, left=left, color=color, label=k.replace("_", " ") if y == 0 else None)
                left += w
            top = max(top, left)
            ticks.append(y)
            labels.append(_SHORT[v] + (f", {size}" if len(sizes) > 1 else ""))
            y -= 1
        y -= 0.6
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.set_xlim(0, top * 1.08)  # no bar runs into the frame
    at = f" and {app.searched}" if len(sizes) > 1 else ""
    ax.set(xlabel=f"{unit} at the step's peak", ylabel=f"variant{at}")
    ax.set_title(f"{_short_title(table.name)}: one step by category" +
                 ("" if len(sizes) > 1 else f" ({sizes[0]} {app.unit}s)"), fontsize=9)


def _fit_panel(ax: Any, table: FitTable) -> None:
    """Peak of one step against the searched size per variant, the budgets (dotted) and what fits (stars)."""
    app = get_app(table.name)
    budgets = list(next(iter(table.fits.values())))
    peaks = [p for c in table.curves.values() for p in c.values()] + [b * GB for b in budgets]
    unit, div = _unit(max(peaks))
    for v, curve in table.curves.items():
        color, ls = _STYLE[v]
        sizes = sorted(curve)
        ax.plot(sizes, [curve[s] / div for s in sizes], marker="o", ms=3, color=color, ls=ls, label=LABELS[v])
        for fit in table.fits[v].values():
            ax.plot(fit.size, fit.peak_bytes / div, "*", ms=10, color=color)
    for i, b in enumerate(budgets):
        ax.axhline(b * GB / div, color="k", ls=":", lw=0.8,
                   label=f"budgets ({', '.join(f'{x:g}' for x in budgets)} GB); stars: what fits" if i == 0 else None)
    if app.searched == "frames":
        ax.axvline(128, **_TARGET, label="the post's 128 frames")
    sizes = [s for c in table.curves.values() for s in c]
    ax.set(xscale="log", yscale="log", xlabel=_SEARCHED[app.searched], ylabel=f"peak {unit} of one step")
    _log2_ticks(ax.xaxis, min(sizes), max(sizes))
    ax.margins(0.1)  # a star at the largest size or budget stays inside the frame
    ax.set_title(f"{_short_title(table.name)}: what fits", fontsize=9)
    _legend_below(ax, ncol=1, offset=-0.2)


def _estimate_marks(ax: Any, x: float, samples: Sequence[float], est: Estimate, *, scale: float, first: bool) -> None:
    """Per-seed values (grey dots) and the estimate with its interval (a diamond with caps) at ``x``."""
    import numpy as np

    y = np.asarray(samples, dtype=float) * scale
    jitter = np.random.default_rng(0).uniform(-0.08, 0.08, len(y))
    ax.scatter(x - 0.15 + jitter, y, s=16, color="0.45", lw=0, label="one paired seed" if first else None)
    lo, hi = (est.low, est.high) if est.has_interval else (est.value, est.value)
    ax.errorbar([x + 0.15], [est.value * scale], yerr=[[(est.value - lo) * scale], [(hi - est.value) * scale]],
                fmt="D", color="k", ms=5, capsize=5, lw=1.5,
                label=(f"mean, {est.confidence:.0%} t interval" if est.has_interval else "mean (one seed: no "
                       "interval)") if first else None)


def _quality_panel(ax: Any, trains: Sequence[PairedSeeds], target: Any) -> None:
    """The graded held-out loss change per small model: each seed, the mean with its 90% interval, the 5% margin
    (the target) and the no-effect band."""
    for i, t in enumerate(trains):
        _estimate_marks(ax, i, t.changes(), t.quality_change(), scale=100, first=i == 0)
    ax.axhspan(*(100 * x for x in target.no_effect), **_BAND, label="no-effect band")
    ax.axhline(100 * target.hi, **_TARGET, label=f"graded margin: at most {100 * target.hi:+g}%")
    ax.set_xticks(range(len(trains)), [f"{_short_title(t.name)}\n(n={len(t.runs)})" for t in trains], fontsize=8)
    ax.set_xlim(-0.6, len(trains) - 0.4)
    ax.set(xlabel="small model (paired training seeds)", ylabel="held-out loss, MVAS + DGR\nvs baseline (%)")
    ax.set_title("graded: quality kept (held-out loss change)", fontsize=9)
    _legend_below(ax, ncol=1, offset=-0.3)


def _loss_panel(ax: Any, trains: Sequence[PairedSeeds]) -> None:
    """Training loss of the small runs, mean over seeds (a running mean over 5% of the steps)."""
    import numpy as np

    for i, t in enumerate(trains):
        for v in ("baseline", "mvas_dgr"):
            losses = t.mean_losses(v)
            k = max(1, len(losses) // 20)
            ax.plot(np.arange(k - 1, len(losses)), np.convolve(losses, np.ones(k) / k, mode="valid"),
                    color=f"C{2 * i}" if v == "baseline" else f"C{2 * i + 1}", ls=_STYLE[v][1],
                    label=f"{_short_title(t.name)}, {LABELS[v]}")
    seeds = len(trains[0].runs)
    ax.set(xlabel="step", ylabel="training loss (nats)")
    ax.set_title(f"small runs: training loss (mean of {seeds} seed{'s' * (seeds > 1)})", fontsize=9)
    _legend_below(ax, ncol=1, offset=-0.2)


def _held_out_panel(ax: Any, trains: Sequence[PairedSeeds]) -> None:
    """Each seed's held-out loss, baseline and MVAS + DGR joined: the pairs the graded change is taken from."""
    for i, t in enumerate(trains):
        for j, r in enumerate(t.runs):
            ax.plot([0, 1], [r.eval_loss["baseline"], r.eval_loss["mvas_dgr"]], "o-", color=f"C{2 * i}", ms=4,
                    lw=0.8, alpha=0.8, label=f"{_short_title(t.name)}: one line per seed" if j == 0 else None)
    ax.set_xticks([0, 1], [_SHORT["baseline"], _SHORT["mvas_dgr"]], fontsize=8)
    ax.set_xlim(-0.4, 1.4)
    ax.margins(y=0.15)
    ax.set(xlabel="variant (same initial weights, batches\nand held-out batches per seed)",
           ylabel="held-out loss (nats)")
    ax.set_title("small runs: held-out loss per paired seed", fontsize=9)
    _legend_below(ax, ncol=1, offset=-0.3)


def _graded_bars(ax: Any, labels: Sequence[str], values: Sequence[float], *, target: Any, post: float,
                 post_text: str, unit: str, scale: float = 1.0) -> None:
    """Graded exact numbers as bars (value in the tick label), the post's number (dashed), the graded threshold
    (dotted) and the no-effect band."""
    xs = range(len(values))
    ax.bar(xs, [v * scale for v in values], 0.6, color="C3", label="measured (exact count)")
    ax.axhspan(*(scale * x for x in target.no_effect), **_BAND, label="no-effect band")
    ax.axhline(post * scale, **_TARGET, label=post_text)
    ax.axhline(target.lo * scale, color="C2", ls=":", lw=1.2,
               label=f"graded threshold: at least {target.lo * scale:.3g}{unit}")
    top = max(post, target.lo, *values) * scale
    ax.set_ylim(min(0.0, *(v * scale for v in values)) - 0.05 * top, top * 1.15)
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_xlim(-0.6, len(values) - 0.4)


def _figure(rows: int, title: str, extra: float = 0.4) -> tuple[Any, list[Any]]:
    """``rows`` x 2 panels, 3.6 in a row; ``extra``: inches for the title and a figure legend."""
    import matplotlib.pyplot as plt

    fig, grid = plt.subplots(rows, 2, figsize=(_WIDTH, 3.6 * rows + extra), layout="constrained", squeeze=False)
    fig.suptitle(title, fontsize=11)
    return fig, list(grid.flat)


def _category_legend(fig: Any, ax: Any) -> None:
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncol=4, fontsize=8, frameon=False,
               title="categories (bars of the step-by-category panels)", title_fontsize=8)


def plot_c12(table: SizeTable, fits: FitTable, train: PairedSeeds, crop: int, targets: Sequence[Any]) -> Any:
    """C12: the trunk's step by category at every crop, what fits, the graded reductions at ``crop`` against the
    55% target (``targets``: ``get_claim("C12").targets``), the graded quality and the small runs' losses."""
    t = _targets(targets)
    fig, (cat, fit, graded, quality, loss, held) = _figure(3, "C12: ESMFold folding trunk with and without MVAS + DGR")
    _category_panel(cat, table)
    _fit_panel(fit, fits)
    reductions = [table.reduction(crop), table.reduction(crop, "checkpoint_mvas_dgr", "checkpoint")]
    _graded_bars(graded, [f"plain\n{reductions[0]:.1%}", f"checkpointed\n{reductions[1]:.1%}"], reductions,
                 target=t["memory_reduction"], post=0.55, post_text="the post: 55% less", unit="%", scale=100)
    graded.set(xlabel="MVAS + DGR against the baseline", ylabel=f"peak-memory reduction\nat crop {crop} (%)")
    graded.set_title("graded: memory reduction (exact byte ratios)", fontsize=9)
    _legend_below(graded, ncol=1, offset=-0.3)
    _quality_panel(quality, [train], t["held_out_loss_change"])
    _loss_panel(loss, [train])
    _held_out_panel(held, [train])
    _category_legend(fig, cat)
    return fig


def plot_c13(table: SizeTable, fits: FitTable, train: PairedSeeds, targets: Sequence[Any]) -> Any:
    """C13: PointNet's step by category, what fits, the graded batch growth per budget against 4x (``targets``:
    ``get_claim("C13").targets``), the graded quality and the small runs' losses."""
    t = _targets(targets)
    fig, (cat, fit, graded, quality, loss, held) = _figure(3, "C13: PointNet's largest batch with and without "
                                                              "MVAS + DGR")
    _category_panel(cat, table)
    _fit_panel(fit, fits)
    budgets = list(fits.fits["baseline"])
    growth = [fits.growth(b) for b in budgets]
    _graded_bars(graded, [f"{b:g} GB\n{g:.2f}x" for b, g in zip(budgets, growth, strict=True)], growth,
                 target=t["batch_growth"], post=4.0, post_text="the post: 4x", unit="x")
    graded.set(xlabel="memory budget", ylabel="largest batch, MVAS + DGR\nover the baseline's (x)")
    graded.set_title("graded: batch growth (exact counts)", fontsize=9)
    _legend_below(graded, ncol=1, offset=-0.3)
    _quality_panel(quality, [train], t["held_out_loss_change"])
    _loss_panel(loss, [train])
    _held_out_panel(held, [train])
    _category_legend(fig, cat)
    return fig


def _frames_panel(ax: Any, fits: Sequence[FitTable], target: Any) -> None:
    """C14's graded cells: the longest clip per model and budget, with and without the techniques, against 128."""
    import numpy as np

    cells = [(f, b) for f in fits for b in f.fits["baseline"]]
    x = np.arange(len(cells))
    sizes = [f.size(v, b) for f, b in cells for v in ("baseline", "mvas_dgr")] + [target.lo]
    bottom = min(sizes) / 2  # log axis: each bar starts at the axis' bottom, not at 0
    for j, v in enumerate(("baseline", "mvas_dgr")):
        ax.bar(x + (j - 0.5) * 0.38, [f.size(v, b) - bottom for f, b in cells], 0.36, bottom=bottom,
               color=_STYLE[v][0], label=f"{LABELS[v]} (exact count)")
    ax.axhline(target.lo, **_TARGET, label=f"the post: {target.lo:g} frames")
    ax.set_yscale("log", base=2)
    _log2_ticks(ax.yaxis, bottom, max(sizes) * 2)
    ax.set_ylim(bottom, max(sizes) * 2)
    first = {f.name: min(f.fits["baseline"]) for f in fits}  # the model's name under its first budget only
    ax.set_xticks(x, [f"{b:g} GB" + (f"\n{_short_title(f.name).removesuffix('-base')}" if b == first[f.name] else "")
                      for f, b in cells], fontsize=8)
    ax.set(xlabel="model and memory budget", ylabel="longest clip that fits (frames)")
    ax.set_title("graded: frames per cell (reproduced where only\nMVAS + DGR reaches 128)", fontsize=9)
    _legend_below(ax, ncol=1, offset=-0.3)


def plot_c14(tables: Sequence[SizeTable], fits: Sequence[FitTable], trains: Sequence[PairedSeeds],
             targets: Sequence[Any]) -> Any:
    """C14's memory: each video model's step by category and what fits (a row per model). The graded panels are
    :func:`plot_c14_graded`'s (one figure of both was taller than a page: the PDF shrank it past reading).
    ``trains`` and ``targets`` are :func:`plot_c14_graded`'s, taken here so both calls read alike."""
    # the categories' legend under the panels takes a row's share that one or two rows cannot spare
    fig, axes = _figure(len(tables), "C14: the video models' training step with and without MVAS + DGR", extra=1.4)
    panels = iter(axes)
    for table, fit in zip(tables, fits, strict=True):
        _category_panel(next(panels), table)
        _fit_panel(next(panels), fit)
    _category_legend(fig, axes[0])
    return fig


def plot_c14_graded(tables: Sequence[SizeTable], fits: Sequence[FitTable], trains: Sequence[PairedSeeds],
                    targets: Sequence[Any]) -> Any:
    """C14's graded numbers: the frames per cell against 128 (``targets``: ``get_claim("C14").targets``), the
    graded quality and the small runs' losses."""
    t = _targets(targets)
    fig, (frames, quality, loss, held) = _figure(2, "C14: the longest clip with and without MVAS + DGR, and quality")
    _frames_panel(frames, fits, t["max_frames"])
    _quality_panel(quality, trains, t["held_out_loss_change"])
    _loss_panel(loss, trains)
    _held_out_panel(held, trains)
    return fig


# ------------------------------------------------------------------------------------------------ settings

@dataclass(frozen=True)
class ApplicationsSettings(Settings):
    """Notebook 10's settings: its parameters cell, less ``profile`` (``ApplicationsSettings.from_params``)."""

    threads: int
    """Torch threads."""
    compute_dtype: str
    """The small runs' compute dtype (``auto`` resolved by ``resolve_parameters``)."""
    train_steps: int
    """Small runs: steps of each variant."""
    train_batch: int
    """Small runs: samples per step."""
    train_width: int
    """Small trunk (sequence state; pair state half) and video models: width."""
    train_layers: int
    """Small trunk and video models: blocks."""
    train_crop: int
    """Small trunk: residues per protein."""
    train_points: int
    """Small PointNet: points per cloud (its width stays the published one)."""
    train_frames: int
    """Small video models: frames per clip."""
    train_image: int
    """Small video models: frame size in pixels (patches of 8)."""
    importance_batches: int
    """Batches of the Fisher diagonal at initialisation (the MVAS plan)."""
    eval_batches: int
    """Held-out batches of the eval loss."""
    quality_seeds: int
    """Small runs: paired training seeds ``seed, seed + 1, ...`` (each one initialisation, batch order and MVASAdamW
    rounding for both variants; the dataset and its held-out batches are ``seed``'s for all of them)."""
    published: bool
    """The published sizes under fake tensors (false: the small runs' sizes on real tensors)."""
    budgets_gb: tuple[float, ...]
    """Memory budgets in GB (1e9 bytes)."""
    fit_variants: tuple[str, ...]
    """Variants (of ``VARIANTS``) whose largest batch / clip / crop is searched."""
    max_size: int
    """The searches stop at this batch / clip / crop (a fit there is shown capped)."""
    crops: tuple[int, ...]
    """C12: residues per crop."""
    graded_crop: int
    """C12: the crop the verdict grades (one of ``crops``)."""
    esm_depths: tuple[int, ...]
    """C12: trunk blocks measured, bytes extrapolated to the whole trunk (empty: measure it whole)."""
    check_depth: int
    """One more depth measured to check the extrapolation."""
    table_batch: int
    """C13: PointNet batch whose step is broken down by category."""
    table_frames: int
    """C14: frames at which the video steps are broken down by category."""
    video_depths: tuple[int, ...]
    """C14: layers measured, extrapolated to the whole model (empty: measure it whole)."""
    check_budget_mb: float
    """Budget of the real-tensor check of the search (small PointNet)."""
    check_variants: tuple[str, ...]
    """Variants the real-tensor check covers."""
    seed: int = 0
    """Data, initial weights, batch order, MVASAdamW's stochastic rounding."""
    group_size: int = 1
    """DGR: blocks per group, sync mode."""
    weight_bytes: float = 0.9
    """MVAS budget: mean bytes per managed weight element (bf16: 2)."""
    lr: float = 1e-3
    """AdamW learning rate of both variants, no weight decay."""
    video_models: tuple[str, ...] = ("timesformer", "videomae")
    """C14: the space-time transformers measured."""
    video_batch: int = 1
    """C14: clips per step."""
    compile_mvas: bool = False
    """The small runs' MVAS kernels compiled by ``torch.compile`` (real sizes) or eager (tiny models, short runs)."""

    def __post_init__(self) -> None:
        self._positive("threads", "train_steps", "train_batch", "train_width", "train_layers", "train_crop",
                       "train_points", "train_frames", "train_image", "importance_batches", "eval_batches",
                       "quality_seeds", "max_size", "graded_crop", "check_depth", "table_batch", "table_frames",
                       "check_budget_mb", "group_size", "weight_bytes", "lr", "video_batch")
        self._non_empty("budgets_gb", "fit_variants", "crops", "check_variants")
        for name in ("fit_variants", "check_variants"):
            if any(v not in VARIANTS for v in getattr(self, name)):
                self._fail(name, f"names from {', '.join(VARIANTS)}")
        for name in ("esm_depths", "video_depths"):
            depths = getattr(self, name)
            if depths and (len(depths) < 2 or min(depths) < 2):
                self._fail(name, "empty, or two or more depths of at least 2 blocks")
        if self.graded_crop not in self.crops:
            self._fail("graded_crop", f"one of crops {list(self.crops)}")
        self._one_of("compute_dtype", COMPUTE_DTYPES)
        videos = [name for name, app in APPS.items() if app.searched == "frames"]
        if any(m not in videos for m in self.video_models):
            self._fail("video_models", f"names from {', '.join(videos)}")


# ------------------------------------------------------------------------------------------------ from settings

def _small(s: ApplicationsSettings) -> dict[str, int]:
    return dict(width=s.train_width, layers=s.train_layers, crop=s.train_crop, points=s.train_points,
                frames=s.train_frames, image=s.train_image)


def models(settings: ApplicationsSettings) -> list[str]:
    """The models a run of the notebook covers: the folding trunk, PointNet and ``video_models``."""
    return ["esmfold_trunk", "pointnet", *settings.video_models]


def train_all(settings: ApplicationsSettings) -> dict[str, PairedSeeds]:
    """:func:`train_seeds` of every model of the run over ``quality_seeds`` paired seeds from ``seed``, at the
    notebook's small sizes (MVAS kernels compiled or eager as ``compile_mvas`` says)."""
    s = settings
    seeds = range(s.seed, s.seed + s.quality_seeds)
    with mvas_kernels(compiled=s.compile_mvas):
        return {m: train_seeds(m, small_dims(m, **_small(s)), seeds=seeds, data_seed=s.seed, steps=s.train_steps,
                               batch_size=s.train_batch, eval_batches=s.eval_batches, lr=s.lr,
                               compute_dtype=s.compute_dtype, weight_bytes=s.weight_bytes,
                               importance_batches=s.importance_batches, group_size=s.group_size)
                for m in models(s)}


def measurements(name: str, settings: ApplicationsSettings, plan: mvas.PrecisionPlan) -> Measurements:
    """The planner's measurements of ``name`` as the notebook's settings set them up: published sizes under fake
    tensors (or, with ``published`` false, the small run's sizes on real ones), depths to extrapolate from, DGR group
    size, clips per step."""
    s, app = settings, get_app(name)
    base = None
    if not s.published:
        base = dict(small_dims(name, **_small(s)), batch=1)
    depths = {"crop": s.esm_depths, "frames": s.video_depths}.get(app.searched)
    return Measurements(name, plan=plan, group_size=s.group_size, depths=depths or None, video_batch=s.video_batch,
                        base=base, fake=s.published, max_size=s.max_size)


def scale(meas: Measurements, train: PairedSeeds, settings: ApplicationsSettings) -> str:
    """The verdict's scale: the measured model, how it was measured, and the small run with its hardware."""
    from macroarch.measure.machine import describe, machine_info

    s = settings
    depth = f", extrapolated from {meas.depths} blocks (checked at {s.check_depth})" if meas.depths else ""
    size = {"crop": "one protein per step", "batch": f"{meas.base.get('points')} points per cloud",
            "frames": f"{meas.video_batch} clip(s) of {meas.base.get('image')} px per step"}[meas.app.searched]
    return (f"{meas.app.title if s.published else meas.name + ' at toy size'}, {meas.n_params / 1e6:.1f}M "
            f"params, {size}, bf16, DGR groups of {meas.group_size}: fake tensors (CPU kernels){depth}; small runs "
            f"{train.n_params / 1e6:.2f}M params, {train.steps} steps x {len(train.runs)} paired seeds, "
            f"{describe(machine_info(), s.compute_dtype)}")


def check(settings: ApplicationsSettings, plan: mvas.PrecisionPlan) -> BoundaryCheck:
    """``boundary_check`` of ``check_variants`` at the notebook's budget and points (the small PointNet's plan)."""
    s = settings
    return boundary_check(s.check_budget_mb, s.train_points, s.check_variants, plan=plan, group_size=s.group_size)
