"""Measured memory of one training step, by category, with real tensors or fake ones.

``measure_training_step`` builds a model, runs forward (loss included), backward and an AdamW step
under torch's ``MemTracker`` (through ``macroarch._compat.memtracker``), and reports the peak of live tensor bytes,
what the peak was made of, each category's own maximum, the peak of each phase, and what was alive
when the forward pass ended (the activations that ``macroarch.measure.memory.analytic.activation_bytes``
counts). With ``fake=True`` everything runs under ``FakeTensorMode``: tensors have shapes, dtypes and
devices but no data, so GPT-3 175B or Llama-65B are measured on a laptop in seconds.

The device decides which kernels run and so what they save: on ``"cuda"`` dropout keeps a 1-byte
bool mask and LayerNorm fp32 statistics, on ``"cpu"`` both are in the activation dtype (see
``activation_terms(device_type=...)``). A fake ``"cuda"`` forward needs no GPU, but autograd's
backward engine needs a real CUDA context even for fake tensors (pytorch/pytorch#92627), so a fake
step is measured with CUDA kernels only on a machine that has a GPU; elsewhere use ``device="cpu"``.

What is measured is a *steady-state* step: AdamW's moments (and the master weights) exist before the
step starts, as in every step after the first. Precisions (``macroarch.measure.memory.analytic.PRECISIONS``):

- no master copy (``"fp32"``, ``"fp16"``, ``"post"``): the model in the policy's dtype and
  ``torch.optim.AdamW``, whose moments live in the parameter dtype (fp16 m, v for ``"post"``);
- master copy (``"bf16_mixed"``, ``"mixed"``): the model in bf16/fp16 and ``MasterWeightAdamW``, which
  holds fp32 master weights and fp32 moments and copies the update back into the 16-bit weights.

MemTracker's categories are refined so they line up with the analytic ones:

==================  ===============================================================================
parameters          MemTracker PARAM (an MVAS weight counts its packed payload and scales)
gradients           GRAD
optimizer_state     Adam's m and v (OPT tensors that exist before the step)
master_weights      the fp32 master copies (MemTracker files them under OPT)
activations         ACT: everything the forward pass allocates
temporaries         TEMP (backward's activation gradients) and OPT tensors made inside the step
other               buffers, the input ids, Adam's 0-d step counters (4 bytes per parameter tensor)
==================  ===============================================================================

Bytes are summed over devices (a CUDA run keeps Adam's step counters on the CPU). On a ``"cuda"``
device MemTracker rounds every storage up to 512 bytes, as the caching allocator does; the analytic
counts are exact, so on CUDA the two differ by less than 512 bytes per tensor.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from macroarch._compat import memtracker
from macroarch._compat.fake import fake_tensor_mode
from macroarch.measure.memory.analytic import PrecisionPolicy, get_precision
from macroarch.models.registry import get_model_spec
from macroarch.models.spec import ModelSpec
from macroarch.optim.master_adamw import MasterWeightAdamW

CATEGORIES = (
    "parameters", "gradients", "optimizer_state", "master_weights", "activations", "temporaries", "other",
)
PHASES = ("setup", "forward", "backward", "optimizer")

_FROM_MEMTRACKER = {  # MemTracker's kinds (macroarch._compat.memtracker.KINDS) -> this module's categories
    "param": "parameters",
    "buffer": "other",
    "grad": "gradients",
    "act": "activations",
    "temp": "temporaries",
    "opt": "temporaries",  # persistent optimizer tensors are labelled before the step
    "other": "other",
}


@dataclass(frozen=True)
class PhasePeak:
    """The largest total of live bytes within one phase, and what it was made of."""

    peak_bytes: int
    by_category: dict[str, int]


@dataclass(frozen=True)
class MemoryReport:
    """Live tensor bytes over one training step (see the module docstring for the categories).

    Attributes:
        model: the model's name.
        precision: the precision policy's name.
        batch_size, seq_len: the batch measured.
        device: the device the tensors were on (emulated when ``fake``).
        fake: measured under ``FakeTensorMode``.
        peak_bytes: the largest total of live bytes during the step.
        by_category: the categories at that peak (they sum to ``peak_bytes``).
        max_by_category: each category's own maximum over the step (reached at different moments).
        phases: ``"setup"`` (state in place before the step), ``"forward"``, ``"backward"``,
            ``"optimizer"``: each phase's peak.
        end_of_forward: the categories when the forward pass (loss included) returned.
        seconds: wall time of the tracked step.
    """

    model: str
    precision: str
    batch_size: int
    seq_len: int
    device: str
    fake: bool
    peak_bytes: int
    by_category: dict[str, int]
    max_by_category: dict[str, int]
    phases: dict[str, PhasePeak]
    end_of_forward: dict[str, int]
    seconds: float

    @property
    def activation_bytes(self) -> int:
        """Bytes the forward pass left alive for backward (plus its logits and loss)."""
        return self.end_of_forward["activations"]


class CategoryTracker:
    """A MemTracker that also keeps this module's categories, their maxima and per-phase peaks.

    MemTracker reports every change to a tracked storage; mirroring each change here keeps the refined totals
    exact without rescanning storages. A storage ``label`` files under a category keeps it whatever MemTracker
    files it under later.
    """

    def __init__(self) -> None:
        self._labels: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # storage key -> category
        self.current = dict.fromkeys(CATEGORIES, 0)
        self.max_by_category = dict.fromkeys(CATEGORIES, 0)
        self.peak = PhasePeak(0, dict(self.current))
        self.phase = "setup"
        self.phases: dict[str, PhasePeak] = {}  # phase -> its peak
        self._tracker = memtracker.tracker(self._on_change, defer=_is_managed_weight)

    def __enter__(self) -> CategoryTracker:
        self._tracker.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._tracker.__exit__(*exc)

    def track_external(self, *external: Any) -> None:
        self._tracker.track_external(*external)

    def _on_change(self, key: Any, old_kind: str | None, old_bytes: int, new_kind: str | None, new_bytes: int) -> None:
        label = self._labels.get(key)
        if label is not None:
            self._add(label, new_bytes - old_bytes)
            return
        if old_kind is not None:
            self._add(_FROM_MEMTRACKER[old_kind], -old_bytes)
        if new_kind is not None:
            self._add(_FROM_MEMTRACKER[new_kind], new_bytes)

    def _add(self, category: str, nbytes: int) -> None:
        self.current[category] += nbytes
        if nbytes <= 0:
            return
        self.max_by_category[category] = max(self.max_by_category[category], self.current[category])
        total = sum(self.current.values())
        if total > self.peak.peak_bytes:
            self.peak = PhasePeak(total, dict(self.current))
        phase = self.phases.get(self.phase)
        if phase is None or total > phase.peak_bytes:
            self.phases[self.phase] = PhasePeak(total, dict(self.current))

    def label(self, tensor: torch.Tensor, category: str) -> None:
        """File an already tracked tensor's storage under ``category`` from now on."""
        for key, kind, nbytes in self._tracker.storages(tensor):
            old = self._labels.get(key, _FROM_MEMTRACKER[kind])
            self._labels[key] = category
            if old != category and nbytes:
                self._add(old, -nbytes)
                self._add(category, nbytes)

    def start_phase(self, phase: str) -> None:
        """Begin ``phase``; ``"setup"`` also forgets every earlier peak (tracking and labelling churn)."""
        now = PhasePeak(sum(self.current.values()), dict(self.current))
        if phase == "setup":
            self.phases = {}
            self.peak = now
            self.max_by_category = dict(self.current)
        self.phase = phase
        self.phases[phase] = now


def _is_managed_weight(types: tuple[type, ...]) -> bool:
    """An op on an MVAS weight goes back to it: it dequantises through plain ops, which are counted."""
    from macroarch.mvas import MVASWeight

    return any(issubclass(t, MVASWeight) for t in types)


def tracker_for(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *inputs: Any) -> CategoryTracker:
    """A tracker that already knows ``model``, ``optimizer`` and ``inputs``, with the optimizer's state filed:
    ``master`` copies as master weights, ``step`` counters as other, every other state tensor (Adam's
    ``exp_avg``/``exp_avg_sq``, block scales and maps of quantised states) as optimizer state. Its ``setup``
    phase starts now. Public: the planner (:mod:`macroarch.measure.fit`) measures its phased steps with it."""
    tracker = CategoryTracker()
    tracker.track_external(model, optimizer, *inputs)
    for state in optimizer.state.values():
        for key, value in state.items():
            if not torch.is_tensor(value):
                continue
            if key == "master":
                tracker.label(value, "master_weights")
            elif key == "step":
                tracker.label(value, "other")
            else:  # Adam's m and v, and what quantised optimizers keep with them (block scales, quantisation maps)
                tracker.label(value, "optimizer_state")
    tracker.start_phase("setup")
    return tracker


def _resolve_builder(
    model: ModelSpec | str | Callable[..., torch.nn.Module],
) -> tuple[str, Callable[..., torch.nn.Module]]:
    if isinstance(model, str):
        model = get_model_spec(model)
    if isinstance(model, ModelSpec):
        return model.name, model.build
    if callable(model):
        return getattr(model, "__name__", type(model).__name__), model
    raise ValueError(f"model={model!r} must be a ModelSpec, a registered name or a builder(device=, dtype=)")


def _make_optimizer(model: torch.nn.Module, policy: PrecisionPolicy, foreach: bool) -> torch.optim.Optimizer:
    """AdamW whose state already exists, so the tracked step is a steady-state one."""
    params = [p for p in model.parameters() if p.requires_grad]
    if policy.master_dtype is not None:
        if policy.optimizer_state_dtype != policy.master_dtype:
            raise ValueError(
                f"precision={policy.name!r}: MasterWeightAdamW keeps its moments in the master dtype "
                f"({policy.master_dtype}), not {policy.optimizer_state_dtype}"
            )
        return MasterWeightAdamW(params, master_dtype=policy.master_dtype)
    if policy.optimizer_state_dtype != policy.param_dtype:
        raise ValueError(
            f"precision={policy.name!r}: torch.optim.AdamW keeps its moments in the parameter dtype "
            f"({policy.param_dtype}), not {policy.optimizer_state_dtype}"
        )
    optimizer = torch.optim.AdamW(params, foreach=foreach)
    create_optimizer_state(optimizer, params)
    return optimizer


def create_optimizer_state(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """Optimizers create their state (Adam's m, v, step) lazily in the first step: one on zero gradients."""
    for p in params:
        p.grad = torch.zeros(p.shape, dtype=p.dtype, device=p.device)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure_training_step(
    model: ModelSpec | str | Callable[..., torch.nn.Module],
    batch_size: int,
    seq_len: int,
    precision: str | PrecisionPolicy = "bf16_mixed",
    *,
    fake: bool = False,
    device: str | None = None,
    foreach: bool = False,
    prepare: Callable[[torch.nn.Module], tuple[torch.nn.Module, torch.optim.Optimizer]] | None = None,
) -> MemoryReport:
    """Peak live bytes, by category, of one AdamW training step of a causal LM.

    Args:
        model: a ``ModelSpec``, a registered model name, or a builder called as
            ``builder(device=..., dtype=...)`` that returns a model taking ``input_ids`` and ``labels``
            and returning an output with ``.loss`` (``ModelSpec.build`` is one).
        batch_size, seq_len: the batch of random token ids (labels are the ids themselves).
        precision: a policy or the name of one in ``PRECISIONS``.
        fake: run under ``FakeTensorMode`` (no memory is allocated; any size fits).
        device: ``"cpu"`` or ``"cuda"``; default ``"cuda"`` if a GPU is available, else ``"cpu"``.
            ``fake=True`` with ``"cuda"`` still needs a GPU for the backward pass (module docstring).
        foreach: for policies without a master copy, use torch.optim.AdamW's multi-tensor kernels
            (its CUDA default), whose temporaries span all parameters at once; the default ``False``
            updates one tensor at a time, as ``MasterWeightAdamW`` always does.
        prepare: instead of the policy's AdamW, ``prepare(model) -> (model to call, optimizer)`` sets up the
            step (an MVAS store and ``MVASAdamW``, a ``DGRWrapper``...); the model is built in the policy's
            dtype first, and one step on zero gradients creates the optimizer's state before the tracked step.
            The report's ``precision`` then reads ``"<policy>+<prepare's __name__>"``.
    """
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")
    policy = get_precision(precision)
    if not policy.param_dtype == policy.grad_dtype == policy.activation_dtype:
        raise ValueError(
            f"precision={policy.name!r}: a measured step runs in one dtype, so param_dtype, grad_dtype and "
            f"activation_dtype must agree (got {policy.param_dtype}, {policy.grad_dtype}, {policy.activation_dtype})"
        )
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if torch.device(device).type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device={device!r} but no GPU is available: autograd's backward needs a CUDA context even "
                "for fake tensors; measure with device='cpu' (CPU kernels) instead"
            )
        # Backward on fake CUDA tensors assumes a CUDA context exists; one real allocation creates it.
        torch.zeros(1, device=device)
    name, builder = _resolve_builder(model)
    with fake_tensor_mode() if fake else contextlib.nullcontext():
        net = builder(device=device, dtype=policy.param_dtype).train()
        vocab_size = net.get_input_embeddings().num_embeddings
        if prepare is None:
            runner, optimizer = net, _make_optimizer(net, policy, foreach)
        else:
            runner, optimizer = prepare(net)
            create_optimizer_state(optimizer, [p for p in net.parameters() if p.requires_grad])
        input_ids = torch.randint(0, vocab_size, (batch_size, seq_len), device=device)

        tracker = tracker_for(net, optimizer, input_ids)
        start = time.perf_counter()
        with tracker:
            tracker.start_phase("forward")
            output = runner(input_ids=input_ids, labels=input_ids)
            end_of_forward = dict(tracker.current)
            loss = output.loss
            del output  # a training loop keeps the loss, not the logits
            tracker.start_phase("backward")
            loss.backward()
            tracker.start_phase("optimizer")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - start

    return MemoryReport(
        model=name,
        precision=policy.name if prepare is None else f"{policy.name}+{getattr(prepare, '__name__', 'prepare')}",
        batch_size=batch_size,
        seq_len=seq_len,
        device=str(device),
        fake=fake,
        peak_bytes=tracker.peak.peak_bytes,
        by_category=tracker.peak.by_category,
        max_by_category=dict(tracker.max_by_category),
        phases=dict(tracker.phases),
        end_of_forward=end_of_forward,
        seconds=seconds,
    )


@dataclass(frozen=True)
class StepMemory:
    """Live tensor bytes over one user-defined training step (see ``measure_step``)."""

    peak_bytes: int
    by_category: dict[str, int]
    max_by_category: dict[str, int]
    seconds: float


def measure_step(step: Callable[[], Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 *inputs: Any) -> StepMemory:
    """Peak live bytes, by category, of ``step()``: any training step of ``model`` with ``optimizer``.

    For loops that ``measure_training_step`` does not build itself (a DGR optimizer stepping groups during
    backward, a probe, a custom schedule). ``model``, ``optimizer`` and ``inputs`` are tracked from before
    the step, so their bytes count from the start; optimizer state tensors other than ``step`` (Adam's moments,
    their block scales and quantisation maps) are filed as optimizer state, ``master`` copies as master
    weights, MVAS's packed weights as parameters.
    Gradients are the tensors MemTracker sees accumulated into ``.grad``.
    """
    tracker = tracker_for(model, optimizer, *inputs)
    start = time.perf_counter()
    with tracker:
        tracker.start_phase("step")
        step()
    return StepMemory(peak_bytes=tracker.peak.peak_bytes, by_category=dict(tracker.peak.by_category),
                      max_by_category=dict(tracker.max_by_category), seconds=time.perf_counter() - start)


STATE_CATEGORIES = ("parameters", "gradients", "optimizer_state", "master_weights")


def training_bytes(report: MemoryReport) -> dict[str, int]:
    """What a training step needs held at once, by category: the state (each category's maximum over the step:
    weights, gradients, optimizer state, master copies) and the activations alive when the forward pass ends."""
    out = {k: report.max_by_category[k] for k in STATE_CATEGORIES}
    out["activations"] = report.end_of_forward["activations"]
    return out


def affine_in_depth(values: Mapping[int, Mapping[str, int]], n_layers: int, what: str = "") -> dict[str, int]:
    """Each key of ``values`` (measured bytes by depth: ``{depth: {key: bytes}}``) extrapolated to ``n_layers``.

    The bytes of a stack of identical layers are affine in its depth (embeddings and head are the constant term), so
    two depths fix each key: ``b(L) = b(l1) + (L - l1) * (b(l2) - b(l1)) / (l2 - l1)``. Every further depth must
    agree (to a relative 1e-6): a ValueError naming ``what`` and the key otherwise, which checks the assumption on
    the spot. Needs two or more depths.
    """
    depths = sorted(values)
    if len(depths) < 2:
        raise ValueError(f"{what or 'affine_in_depth'} needs measurements at two or more depths; got {depths}")
    (l1, l2), out = depths[:2], {}
    prefix = f"{what}: " if what else ""
    for key in values[l1]:
        slope = (values[l2][key] - values[l1][key]) / (l2 - l1)
        for d in depths[2:]:
            predicted = values[l1][key] + (d - l1) * slope
            if abs(predicted - values[d][key]) > 1e-6 * max(1, values[d][key]):
                raise ValueError(f"{prefix}{key}: bytes are not affine in depth (predicted {predicted:.0f} at {d} "
                                 f"layers, measured {values[d][key]}): measure at larger depths")
        out[key] = round(values[l1][key] + (n_layers - l1) * slope)
    return out


def extrapolate_by_depth(reports: dict[int, MemoryReport], n_layers: int,
                         constant: tuple[str, ...] = ()) -> dict[str, int]:
    """``training_bytes`` of an ``n_layers`` model from measurements of the same model at smaller depths.

    Every category is affine in the number of identical layers (:func:`affine_in_depth`: two depths fix it, and
    with three or more the increments must agree, ValueError naming the category if not); with DGR the gradients
    of the largest group are constant once there are two layers.

    Categories in ``constant`` are a maximum over per-layer pieces instead (gradients under DGR: the largest
    group's), the same at every depth past the first: the deepest measurement is taken, and with three or more
    depths the two deepest must agree.
    """
    depths = sorted(reports)
    if len(depths) < 2:
        raise ValueError(f"extrapolate_by_depth needs reports at two or more depths; got {depths}")
    bytes_at = {d: training_bytes(reports[d]) for d in depths}
    affine = affine_in_depth({d: {k: v for k, v in b.items() if k not in constant} for d, b in bytes_at.items()},
                             n_layers)
    out = {}
    for key in bytes_at[depths[0]]:
        if key not in constant:
            out[key] = affine[key]
            continue
        deepest = bytes_at[depths[-1]][key]
        if len(depths) >= 3 and bytes_at[depths[-2]][key] != deepest:
            raise ValueError(f"{key}: not constant in depth ({bytes_at[depths[-2]][key]} at {depths[-2]} layers, "
                             f"{deepest} at {depths[-1]})")
        out[key] = deepest
    return out
