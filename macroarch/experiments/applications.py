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
  every repeated block (and PointNet's two T-Nets), alone and with the stack.

"What fits" is ``macroarch.measure.fit.largest_fitting`` over fake-tensor measurements of one full step. The
folding trunk is measured at a few depths and extrapolated to 48 blocks (``extrapolate_peak``, checked on a third
depth; the notebook can also check it at full depth). The small models trained for real use the synthetic data
of ``macroarch.data.applications``.

Deviations: the MVAS plan is not re-planned during these short runs (``MVASSchedule`` is notebook 05's; its fp32
Fisher EMA would add 4 B per managed weight). Checkpointing is ``torch.utils.checkpoint`` without reentrance (one
backward pass, which DGR's per-pass bookkeeping needs; MVAS weights are tensors, so they recompute like any
other); BatchNorm statistics are updated again when a PointNet block is recomputed. The small runs compute in
``compute_dtype``; the memory measurements always in bf16, the claims' setting.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
from torch import nn

from macroarch import compose, mvas
from macroarch._progress import tqdm
from macroarch.config import DGRConfig, MacroConfig, OptimConfig
from macroarch.data.applications import SHAPES, ensure_dataset, load_dataset
from macroarch.experiments.loop import TrainLog, mvas_kernels
from macroarch.experiments.settings import COMPUTE_DTYPES, Settings
from macroarch.measure.fit import Fit, MeasureCache, extrapolate_peak, fake_module, largest_fitting, measure_training
from macroarch.measure.memory import STATE_CATEGORIES, StepMemory
from macroarch.measure.stats import Estimate, mean_interval
from macroarch.models.layers import find_repeated_layers
from macroarch.optim import MasterWeightAdamW

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
            return _build(name, dims, shapes_only=torch.device(device or "cpu").type == "meta").train()
    finally:
        torch.set_default_dtype(previous)


def _build(name: str, d: Mapping[str, Any], shapes_only: bool = False) -> nn.Module:
    if name == "esmfold_trunk":
        from macroarch.models.folding import FoldingStack, trunk_config

        small = {} if d.get("width") is None else {
            "sequence_state_dim": d["width"], "pairwise_state_dim": max(32, d["width"] // 2),
            "sequence_head_width": 16, "pairwise_head_width": 16}
        return FoldingStack(trunk_config(num_blocks=d["layers"], **small))
    if name == "pointnet":
        from macroarch.models.pointnet import PointNet

        return PointNet(num_classes=d["classes"])
    from transformers import (
        TimesformerConfig,
        TimesformerForVideoClassification,
        VideoMAEConfig,
        VideoMAEForVideoClassification,
    )

    common = {"num_frames": d["frames"], "num_hidden_layers": d["layers"], "num_labels": d["classes"],
              "image_size": d["image"]}
    if d.get("width") is not None:
        common.update(hidden_size=d["width"], num_attention_heads=max(1, d["width"] // 32),
                      intermediate_size=4 * d["width"], patch_size=8)
    if name == "timesformer":
        return TimesformerForVideoClassification(TimesformerConfig(**common))
    table = contextlib.nullcontext()
    if shapes_only:  # VideoMAE fills its sinusoidal table in a Python loop (a minute at 1000 frames): shapes suffice
        from transformers.models.videomae import modeling_videomae

        table = mock.patch.object(modeling_videomae, "get_sinusoid_encoding_table",
                                  lambda n, dim: torch.zeros(1, n, dim, dtype=torch.float32, device="meta"))
    with table:
        return VideoMAEForVideoClassification(VideoMAEConfig(**common, attn_implementation="sdpa"))


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

def full_dims(name: str, size: int, *, layers: int | None = None, video_batch: int = 1,
              base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The published dims (or ``base``) with the searched dimension at ``size`` (and ``layers`` blocks)."""
    app = get_app(name)
    dims = dict(app.full if base is None else base, **{app.searched: size})
    if layers is not None:
        dims["layers"] = layers
    if app.searched == "frames":
        dims["batch"] = video_batch
    return dims


def measure_variant(name: str, variant: str, dims: Mapping[str, Any], *, plan: mvas.PrecisionPlan | None = None,
                    group_size: int = 1, fake: bool = True) -> StepMemory:
    """Peak bytes of one training step of ``variant`` at ``dims``, under fake tensors (or, with ``fake=False``, real
    ones: the same bytes on CPU kernels, for small sizes); ``plan`` is carried over to the model by role."""
    # built outside FakeTensorMode: some __init__s read values
    meta = build_model(name, dims, device="meta") if fake else None

    def build():
        torch.manual_seed(0)
        model = fake_module(meta) if fake else build_model(name, dims)
        batch = random_batch(name, dims)
        moved = mvas.transfer_plan(plan, model, depth="uniform") if variant.endswith("mvas_dgr") else None
        runner, optimizer = setup(name, variant, model, batch, plan=moved, group_size=group_size)
        return model, runner, optimizer, batch

    return measure_training(build, loss_of, fake=fake)


class Measurements:
    """Fake-tensor measurements of one model at its published size, one ``MeasureCache`` per variant, so the
    size table, the fit searches and the plots share them.

    Args:
        name: a model of ``MODELS``.
        plan: the MVAS plan (of the small model; carried over by role) for the MVAS variants.
        group_size: DGR's blocks per group.
        depths: measure at these depths and extrapolate to the published one (``extrapolate_peak``); None
            measures the whole model.
        video_batch: clips per step of the video models.
        base: dims to measure at instead of the published ones (the ci profile's toy sizes, same code path).
        fake: measure under fake tensors (else real ones: identical bytes, faster at toy sizes).
        max_size: the fit searches stop at this size (a fit there is reported as capped).
        compile_mvas: real-tensor measurements with MVAS's kernels compiled (True) or eager (False: the
            temporaries of the eager kernels, as under fake tensors, which always run them eagerly); None leaves
            ``macroarch.mvas.COMPILE_ENV`` as it is.
    """

    def __init__(self, name: str, *, plan: mvas.PrecisionPlan | None, group_size: int = 1,
                 depths: Sequence[int] | None = None, video_batch: int = 1,
                 base: Mapping[str, Any] | None = None, fake: bool = True, max_size: int = 1 << 16,
                 compile_mvas: bool | None = None) -> None:
        self.app = get_app(name)
        self.base = dict(self.app.full if base is None else base)
        if depths is not None and (len(depths) < 2 or min(depths) < 2):
            raise ValueError(f"depths={list(depths)}: give two or more depths of at least 2 blocks (DGR's groups "
                             "need a repeated container)")
        self.name, self.plan, self.group_size, self.video_batch, self.fake = name, plan, group_size, video_batch, fake
        self.max_size, self.compile_mvas = max_size, compile_mvas
        self.depths = sorted(depths) if depths else None
        self.caches = {v: MeasureCache(functools.partial(self._measure, v)) for v in VARIANTS}
        self._by_depth: dict[tuple[str, int, int | None], StepMemory] = {}
        self.seconds = 0.0  # wall time of every measurement made

    @functools.cached_property
    def n_params(self) -> int:
        """Parameters of the measured model (at the smallest searched size, for the video models' time embedding)."""
        dims = full_dims(self.name, self.app.multiple, video_batch=self.video_batch, base=self.base)
        return sum(p.numel() for p in build_model(self.name, dims, device="meta").parameters())

    def _at_depth(self, variant: str, size: int, layers: int | None) -> StepMemory:
        key = (variant, size, layers)
        if key not in self._by_depth:
            dims = full_dims(self.name, size, layers=layers, video_batch=self.video_batch, base=self.base)
            started = time.perf_counter()
            compiled = self.compile_mvas
            with contextlib.nullcontext() if compiled is None else mvas_kernels(compiled=compiled):
                self._by_depth[key] = measure_variant(self.name, variant, dims, plan=self.plan,
                                                      group_size=self.group_size, fake=self.fake)
            self.seconds += time.perf_counter() - started
        return self._by_depth[key]

    def _measure(self, variant: str, size: int) -> StepMemory:
        if self.depths is None:
            return self._at_depth(variant, size, None)
        return extrapolate_peak({d: self._at_depth(variant, size, d) for d in self.depths}, self.base["layers"])

    def __call__(self, variant: str, size: int) -> StepMemory:
        _check_variant(variant)
        return self.caches[variant](size)

    def check_depth(self, variant: str, size: int, depth: int) -> StepMemory:
        """Measure at ``depth`` blocks and compare with the extrapolation from ``depths`` (ValueError if the
        bytes differ); ``depth`` = the published depth checks the extrapolation against the whole model."""
        if self.depths is None:
            raise ValueError("this model is measured whole: there is no extrapolation to check")
        reports = {d: self._at_depth(variant, size, d) for d in self.depths}
        measured = self._at_depth(variant, size, depth)
        extrapolate_peak({**reports, depth: measured}, depth)  # raises if the bytes are not affine in depth
        return measured

    def table(self, sizes: Sequence[int], variants: Sequence[str] = VARIANTS) -> SizeTable:
        """The step of every variant at every size, by category."""
        return SizeTable(self.name, {v: {n: self(v, n) for n in sizes} for v in variants})

    def fits(self, budgets_gb: Sequence[float], variants: Sequence[str] = VARIANTS) -> FitTable:
        """The largest size of every variant at every budget (``largest_fitting``, from ``2 * multiple`` up to
        ``max_size``)."""
        start = 2 * self.app.multiple  # PointNet's BatchNorm needs two clouds; a clip or crop of one step is moot
        fits = {}
        for v in tqdm(variants, desc=f"{self.name}: what fits", mininterval=10):
            _check_variant(v)
            fits[v] = {b: largest_fitting(self.caches[v], b * GB, start=start, multiple=self.app.multiple,
                                          max_size=self.max_size, unit=self.app.unit) for b in budgets_gb}
        return FitTable(self.name, fits, {v: self.caches[v].peaks() for v in variants})


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


def boundary_check(budget_mb: float, points: int, variants: Sequence[str] = VARIANTS, *,
                   plan: mvas.PrecisionPlan | None = None, group_size: int = 1) -> BoundaryCheck:
    """The fit search against real tensors on a small PointNet (``points`` per cloud, 8 classes): the largest
    batch found on fake tensors, then a real step at it and at one more."""
    dims = {"points": points, "classes": len(SHAPES)}
    rows = {}
    for variant in variants:
        def at(batch: int, fake: bool, variant=variant) -> StepMemory:
            return measure_variant("pointnet", variant, dict(dims, batch=batch), plan=plan, group_size=group_size,
                                   fake=fake)

        fit = largest_fitting(lambda b, at=at: at(b, True), budget_mb * 1e6, start=2, unit="cloud")
        rows[variant] = (fit.size, at(fit.size, False).peak_bytes, at(fit.size + 1, False).peak_bytes)
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
                 dtype: torch.dtype, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """``steps`` training batches (drawn with replacement, seeded) and ``eval_batches`` held-out ones from the
    synthetic dataset of ``name`` (``macroarch.data.applications``), built first if missing."""
    from macroarch.models.folding import distance_bins

    n = max(256, 4 * batch_size * max(1, eval_batches))
    if name == "esmfold_trunk":
        data = load_dataset(ensure_dataset("proteins", n=n, length=dims["crop"], seed=seed))
        xs = {"aatype": data["aatype"], "labels": distance_bins(data["coords"])}
    elif name == "pointnet":
        data = load_dataset(ensure_dataset("pointclouds", n=n, points=dims["points"], seed=seed))
        xs = {"points": data["points"].to(dtype), "labels": data["labels"]}
    else:
        data = load_dataset(ensure_dataset("videos", n=n, frames=dims["frames"], size=dims["image"], seed=seed))
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
    """The small model trained for real, baseline against MVAS + DGR."""

    name: str
    n_params: int
    logs: dict[str, TrainLog]
    eval_loss: dict[str, float]
    plan: mvas.PrecisionPlan = field(repr=False)
    eval_losses: dict[str, list[float]] = field(default_factory=dict)  # per held-out batch, in the same order

    def quality_change(self) -> Estimate:
        """MVAS + DGR's held-out loss relative to the baseline's, ``(technique - baseline) / baseline`` per
        held-out batch (both models see the same batches), with a t interval over the batches. One training seed:
        the interval holds the evaluation's spread, not the training's, and the method says so."""
        base, tech = self.eval_losses["baseline"], self.eval_losses["mvas_dgr"]
        return mean_interval([(t - b) / b for b, t in zip(base, tech, strict=True)],
                             method="paired t over held-out batches, one training seed")

    @property
    def speed_ratio(self) -> float:
        """Baseline step time over MVAS + DGR's (the post's "0.92x speed" convention: < 1 is slower)."""
        return self.logs["baseline"].step_time() / self.logs["mvas_dgr"].step_time()

    def final_loss(self, variant: str, frac: float = 0.1) -> float:
        losses = self.logs[variant].losses
        tail = losses[-max(1, int(len(losses) * frac)):]
        return sum(tail) / len(tail)

    def metrics(self) -> dict[str, float]:
        out = {f"{self.name}_speed_ratio": self.speed_ratio, f"{self.name}_train_params": self.n_params}
        for v in self.logs:
            out[f"{self.name}_{v}_first_loss"] = self.logs[v].losses[0]
            out[f"{self.name}_{v}_final_loss"] = self.final_loss(v)
            out[f"{self.name}_{v}_eval_loss"] = self.eval_loss[v]
        return out

    def log_to(self, run: Any) -> None:
        """Every step's losses as series of ``run``, and the summary metrics."""
        for step, losses in enumerate(zip(*(log.losses for log in self.logs.values()), strict=True)):
            run.log(step=step, **{f"{self.name}_{v}_loss": x for v, x in zip(self.logs, losses, strict=True)})
        run.summary(**self.metrics())

    def describe(self) -> str:
        b, m = self.logs["baseline"], self.logs["mvas_dgr"]
        return (f"{get_app(self.name).title.split(' (')[0]} small ({self.n_params / 1e6:.2f}M params), "
                f"{len(b.losses)} steps: loss {b.losses[0]:.3f} -> {self.final_loss('baseline'):.3f} (eval "
                f"{self.eval_loss['baseline']:.3f}) baseline, {m.losses[0]:.3f} -> {self.final_loss('mvas_dgr'):.3f} "
                f"(eval {self.eval_loss['mvas_dgr']:.3f}) MVAS + DGR; step {b.step_time() * 1e3:.0f} vs "
                f"{m.step_time() * 1e3:.0f} ms, speed {self.speed_ratio:.2f}x")


def train_compare(name: str, dims: Mapping[str, Any], *, steps: int, batch_size: int, lr: float,
                  compute_dtype: str, weight_bytes: float, importance_batches: int, eval_batches: int,
                  group_size: int = 1, seed: int = 0) -> TrainResult:
    """Train the small model twice from the same initial weights on the same batches, one step of each in turn:
    the baseline and MVAS + DGR (plan: Fisher diagonal at initialisation over ``importance_batches`` batches,
    ``importance_plan`` at ``weight_bytes`` per managed weight)."""
    from macroarch.measure.machine import torch_dtype

    dtype = torch_dtype(compute_dtype)
    train, evals = data_batches(name, dims, batch_size, steps, eval_batches, dtype, seed)
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
    for step, batch in enumerate(tqdm(train, desc=f"{name}: training (baseline, MVAS + DGR in turn)", mininterval=10)):
        for variant, (_, runner, optimizer) in runs.items():
            start = time.perf_counter()
            loss = loss_of(runner, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            logs[variant].seconds.append(time.perf_counter() - start)
            logs[variant].losses.append(loss.item())
            if not torch.isfinite(loss):
                raise FloatingPointError(f"{name} {variant}: loss is {loss.item()} at step {step}")
    eval_losses = {}
    with torch.no_grad():
        for variant, (model, runner, _) in runs.items():
            model.eval()
            eval_losses[variant] = [loss_of(runner, b).item() for b in evals]
            model.train()
    eval_loss = {v: sum(x) / len(x) for v, x in eval_losses.items()}
    return TrainResult(name, sum(p.numel() for p in initial.parameters()), logs, eval_loss, plan, eval_losses)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() else t


# ------------------------------------------------------------------------------------------------ claims

def quality_estimates(*trains: TrainResult) -> dict[str, Estimate]:
    """C12-C14's quality: each small run's held-out loss change (``held_out_loss_change_<model>``), and
    ``held_out_loss_change``, the worst of them (the one the claim's quality stands or falls with)."""
    per = {f"held_out_loss_change_{t.name}": t.quality_change() for t in trains}
    return {**per, "held_out_loss_change": max(per.values(), key=lambda e: e.value)}


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


def _gb(x: float) -> str:
    return f"{x / GB:.1f} GB" if x >= 0.1 * GB else f"{x / 1e6:.1f} MB"


def _train_note(m: Mapping[str, float], name: str) -> str:
    """The small run of ``name`` in one clause (empty when the metrics hold none)."""
    if f"{name}_speed_ratio" not in m:
        return ""
    f = {v: (m[f"{name}_{v}_final_loss"], m[f"{name}_{v}_eval_loss"]) for v in ("baseline", "mvas_dgr")}
    return (f"{get_app(name).title.split(' (')[0]} small run: training loss {f['baseline'][0]:.3f} vs "
            f"{f['mvas_dgr'][0]:.3f} with MVAS + DGR (held out {f['baseline'][1]:.3f} vs {f['mvas_dgr'][1]:.3f}), "
            f"speed {m[f'{name}_speed_ratio']:.2f}x")


def verdict_texts(claim_id: str, metrics: Mapping[str, float], scale: str) -> dict[str, str]:
    """``scale``, ``measured_text`` and ``note`` for ``get_claim(claim_id).grade`` of C12, C13 or C14: the figures
    that make the verdict, read from a run's metrics."""
    m = metrics
    if claim_id == "C12":
        crop = int(m["graded_crop"])
        base, stack = m[f"esmfold_trunk_baseline_{crop}_peak_bytes"], m[f"esmfold_trunk_mvas_dgr_{crop}_peak_bytes"]
        ck, ck_stack = (m[f"esmfold_trunk_{v}_{crop}_peak_bytes"] for v in ("checkpoint", "checkpoint_mvas_dgr"))
        text = (f"{_gb(base)} -> {_gb(stack)} ({-m['memory_reduction']:+.0%}) at crop {crop}; checkpointed "
                f"{_gb(ck)} -> {_gb(ck_stack)} ({-m['memory_reduction_vs_checkpoint']:+.0%})")
        note = (f"state {_gb(m[f'esmfold_trunk_baseline_{crop}_state_bytes'])} -> "
                f"{_gb(m[f'esmfold_trunk_mvas_dgr_{crop}_state_bytes'])}, activations "
                f"{_gb(m[f'esmfold_trunk_baseline_{crop}_activation_bytes'])} -> "
                f"{_gb(m[f'esmfold_trunk_mvas_dgr_{crop}_activation_bytes'])}; activation checkpointing alone "
                f"{-m.get(f'checkpoint_reduction_{crop}', float('nan')):+.0%}, with MVAS + DGR "
                f"{-m.get(f'checkpoint_mvas_dgr_reduction_{crop}', float('nan')):+.0%}")
    elif claim_id == "C13":
        cells = sorted((k, v) for k, v in m.items() if k.startswith("batch_growth_"))
        text = ", ".join(f"{k[13:-2]} GB {v:.2f}x" for k, v in cells)
        ckpt = sorted((k, v) for k, v in m.items() if k.startswith("checkpoint_batch_growth_"))
        note = ("activation checkpointing alone: " + ", ".join(f"{k[24:-2]} GB {v:.2f}x" for k, v in ckpt)
                if ckpt else "")
    elif claim_id == "C14":
        text = ", ".join(f"{k[11:]}: {v:.0f} ({m.get('baseline_frames_' + k[11:], float('nan')):.0f})"
                         for k, v in sorted(m.items()) if k.startswith("max_frames_") and k.endswith("gb")) + \
            " frames with MVAS + DGR (without)"
        note = ""
    else:
        raise ValueError(f"claim {claim_id!r} is not one of this notebook's (C12, C13, C14)")
    names = {"C12": ["esmfold_trunk"], "C13": ["pointnet"], "C14": ["timesformer", "videomae"]}[claim_id]
    note = "; ".join(x for x in (note, *(_train_note(m, n) for n in names)) if x)
    return {"scale": scale, "measured_text": text, "note": note}


# ------------------------------------------------------------------------------------------------ plots

_COLORS = {"parameters": "C0", "gradients": "C1", "optimizer_state": "C2", "master_weights": "C3",
           "activations": "C7", "temporaries": "C8", "other": "C9"}
_SHORT = {"baseline": "base", "mvas_dgr": "M+D", "checkpoint": "ckpt", "checkpoint_mvas_dgr": "ckpt+M+D"}


def plot_claim(title: str, *, tables: Sequence[SizeTable] = (), fits: Sequence[FitTable] = (),
               trains: Sequence[TrainResult] = ()) -> Any:
    """One row of panels: bytes by category (``tables``), peak against size with the budgets (``fits``),
    training loss of the small runs (``trains``)."""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    n = len(tables) + len(fits) + len(trains)
    cols = min(n, 3)
    rows = -(-n // cols)
    fig, grid = plt.subplots(rows, cols, figsize=(5.4 * cols, 4.3 * rows), squeeze=False)
    for ax in grid.flat[n:]:
        ax.set_visible(False)
    axes = iter(grid.flat)
    for table in tables:
        ax, app = next(axes), get_app(table.name)
        x, ticks = 0.0, []
        for size in next(iter(table.reports.values())):
            for v, by_size in table.reports.items():
                bottom = 0.0
                for k, color in _COLORS.items():
                    h = by_size[size].by_category[k] / GB
                    ax.bar(x, h, bottom=bottom, color=color, label=k.replace("_", " ") if x == 0 else None)
                    bottom += h
                ticks.append((x, f"{_SHORT[v]} {size}"))
                x += 1
            x += 0.6
        ax.set_xticks(*zip(*ticks))
        ax.tick_params(axis="x", labelsize=7, labelrotation=60)
        ax.set(ylabel="GB at the peak", title=f"{app.title.split(' (')[0]}: step by category ({app.searched})")
        ax.legend(fontsize=7)
    for table in fits:
        ax, app = next(axes), get_app(table.name)
        for i, (v, curve) in enumerate(table.curves.items()):
            sizes = sorted(curve)
            ax.plot(sizes, [curve[s] / GB for s in sizes], "o-", ms=3, color=f"C{i}", label=LABELS[v])
            for fit in table.fits[v].values():
                ax.plot(fit.size, fit.peak_bytes / GB, "*", ms=11, color=f"C{i}")
        for b in next(iter(table.fits.values())):
            ax.axhline(b, color="k", ls=":", lw=0.8)
        if app.searched == "frames":
            ax.axvline(128, color="r", ls="--", lw=0.8, label="the post's 128 frames")
        ax.set(xscale="log", yscale="log", xlabel=app.searched, ylabel="peak GB of one step",
               title=f"{app.title.split(' (')[0]}: what fits (stars; dotted: budgets)")
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.legend(fontsize=7)
    for r in trains:
        ax = next(axes)
        for v, log in r.logs.items():
            k = max(1, len(log.losses) // 20)
            smooth = np.convolve(log.losses, np.ones(k) / k, mode="valid")
            ax.plot(smooth, label=LABELS[v], ls="--" if "mvas" in v else "-")
        ax.set(xlabel="step", ylabel="training loss", title=f"{get_app(r.name).title.split(' (')[0]}: small run "
                                                            f"({r.n_params / 1e6:.2f}M params)")
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
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
                       "max_size", "graded_crop", "check_depth", "table_batch", "table_frames", "check_budget_mb",
                       "group_size", "weight_bytes", "lr", "video_batch")
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


def train_all(settings: ApplicationsSettings) -> dict[str, TrainResult]:
    """``train_compare`` of every model of the run, at the notebook's small sizes (MVAS kernels compiled or eager
    as ``compile_mvas`` says)."""
    s = settings
    with mvas_kernels(compiled=s.compile_mvas):
        return {m: train_compare(m, small_dims(m, **_small(s)), steps=s.train_steps, batch_size=s.train_batch,
                                 eval_batches=s.eval_batches, lr=s.lr, compute_dtype=s.compute_dtype,
                                 weight_bytes=s.weight_bytes, importance_batches=s.importance_batches,
                                 group_size=s.group_size, seed=s.seed)
                for m in models(s)}


def measurements(name: str, settings: ApplicationsSettings, plan: mvas.PrecisionPlan) -> Measurements:
    """The fake-tensor measurements of ``name`` as the notebook's settings set them up: published sizes (or,
    with ``published`` false, the small run's sizes), depths to extrapolate from, DGR group size, clips per step."""
    s, app = settings, get_app(name)
    base = None
    if not s.published:
        base = dict(small_dims(name, **_small(s)), batch=1)
    depths = {"crop": s.esm_depths, "frames": s.video_depths}.get(app.searched)
    return Measurements(name, plan=plan, group_size=s.group_size, depths=depths or None, video_batch=s.video_batch,
                        base=base, fake=s.published, max_size=s.max_size)


def scale(meas: Measurements, train: TrainResult, settings: ApplicationsSettings) -> str:
    """The verdict's scale: the measured model, how it was measured, and the small run with its hardware."""
    from macroarch.measure.machine import describe, machine_info

    s = settings
    depth = f", extrapolated from {meas.depths} blocks (checked at {s.check_depth})" if meas.depths else ""
    size = {"crop": "one protein per step", "batch": f"{meas.base.get('points')} points per cloud",
            "frames": f"{meas.video_batch} clip(s) of {meas.base.get('image')} px per step"}[meas.app.searched]
    return (f"{meas.app.title if s.published else meas.name + ' at toy size'}, {meas.n_params / 1e6:.1f}M "
            f"params, {size}, bf16, DGR groups of {meas.group_size}: fake tensors (CPU kernels){depth}; small run "
            f"{train.n_params / 1e6:.2f}M params, {len(train.logs['baseline'].losses)} steps, "
            f"{describe(machine_info(), s.compute_dtype)}")


def check(settings: ApplicationsSettings, plan: mvas.PrecisionPlan) -> BoundaryCheck:
    """``boundary_check`` of ``check_variants`` at the notebook's budget and points (the small PointNet's plan)."""
    s = settings
    return boundary_check(s.check_budget_mb, s.train_points, s.check_variants, plan=plan, group_size=s.group_size)
