"""The MVAS store (post section 3.2, "memory virtualisation"): parameters held packed in fp16/fp8/fp4, dense
only while an op reads them.

``store = mvas.apply(model, plan)`` turns every tensor the ``PrecisionPlan`` stores in another format than its
own dtype into a *managed* parameter: an ``MVASWeight`` (``macroarch.mvas.packed.weight``), a tensor subclass that
holds the packed payload and its block scales and dequantises on every read. The parameter stays registered
where it was (tied weights stay tied: one object), so optimizers, LR schedulers, DGR's gradient hooks,
``clip_grad_norm_``, ``torch.compile`` and activation checkpointing see an ordinary parameter whose ``.grad`` is
the dense gradient in the compute dtype. Memory: the dense weight exists for one op in forward and again for
one op in backward (autograd saves the packed tensor, never the dense one); ``MemTracker`` counts the
parameter at its packed bytes.

Updates go through ``MVASAdamW`` (``macroarch.mvas.optim``), which writes the new weight with the weight's own
``write_range`` (stochastic rounding for every low-precision tier by default, or round-to-nearest from an fp32
master copy); ``store.write(name, w)`` writes one directly. An optimizer that does not know packed storage
raises a ``TypeError`` naming ``MVASAdamW`` before it changes anything. ``store.replan(plan)`` re-packs tensors
into new formats (``schedule.py``).

Checkpoints: ``model.state_dict()`` holds the ``MVASWeight`` s themselves, so ``torch.save`` /
``torch.load`` round-trip the packed form bit for bit. ``load_state_dict`` takes such a checkpoint, a dense one
(packed into the current plan on load), or the flat packed form of ``mvas.packed_state_dict`` (``<key>`` +
``__mvas_payload`` / ``__mvas_scales``, for safetensors). Before anything is copied it checks, in this order,
that every tensor has the model's shape (a checkpoint of another model size is refused as such), that its
packed tensors have this store's formats (``store.replan(store.plan_from_state_dict(sd))`` adopts a checkpoint's
plan), and that values are usable (finite dense weights, finite non-negative scales, no payload code that decodes to
NaN or infinity); a failed check raises naming each tensor and loads nothing. Dense checkpoints for
``save_pretrained`` / safetensors: ``macroarch.mvas.interop.checkpoint``.

``apply`` is all or nothing: every tensor is packed before the model is touched, and a failure while the weights
are registered (any exception, ``KeyboardInterrupt`` included) puts the model's own parameter objects back, bit for
bit. ``store.remove()`` undoes a store with dense copies (dequantised); ``store.remove(restore=registered)`` puts
back the very objects ``registered_parameters(model)`` listed before ``apply`` (how ``load_packed`` undoes a refused
load); ``TensorSnapshot`` copies what a loader writes in place, to put it back.

Limitations: apply after moving the model to its device (``model.to(dtype)`` afterwards changes the compute
dtype and keeps the storage); writing into a managed parameter with anything but ``copy_`` raises.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from macroarch.mvas.codecs.formats import dtype_format, get_format, is_fake
from macroarch.mvas.interop.state_dict import (
    PAYLOAD_SUFFIX,
    SCALES_SUFFIX,
    TensorSnapshot,
    format_of,
    is_packed_buffer,
    registered_parameters,
    restore_parameters,
)
from macroarch.mvas.packed.packed_tensor import PackedTensor, pack
from macroarch.mvas.packed.weight import MVASWeight
from macroarch.mvas.plan.policy import PrecisionPlan, TensorPlan

# the flat packed form and the parameter snapshots live below the store (``interop.state_dict``), where the loaders
# import them from; they stay importable from here
__all__ = ["PAYLOAD_SUFFIX", "SCALES_SUFFIX", "MVASStore", "TensorSnapshot", "apply", "format_of",
           "is_packed_buffer", "registered_parameters", "restore_parameters"]


class _Entry:
    """One managed parameter: the ``MVASWeight`` (``param``), its plan entry and its state-dict keys."""

    def __init__(self, name: str, param: MVASWeight, owners: list[tuple[nn.Module, str]], plan: TensorPlan,
                 keys: list[str]) -> None:
        self.name, self.param, self.owners, self.plan, self.keys = name, param, owners, plan, keys

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.param.dtype

    def packed(self) -> PackedTensor:
        return self.param.packed()

    def dense(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.param.dequantize(dtype)


class MVASStore:
    """Packed parameters of one model (module docstring). Made by ``apply(model, plan)``."""

    def __init__(self, model: nn.Module, plan: PrecisionPlan, *, compute_dtype: torch.dtype | None = None,
                 generator: torch.Generator | None = None) -> None:
        self.model = model
        self.plan = plan
        self.entries: dict[str, _Entry] = {}
        self._generator = generator
        self._handles: list[Any] = []
        self._attach(compute_dtype)

    def _attach(self, compute_dtype: torch.dtype | None) -> None:
        owners: dict[int, list[tuple[nn.Module, str]]] = {}
        module_names: dict[int, str] = {}
        for mname, module in self.model.named_modules(remove_duplicate=False):
            module_names.setdefault(id(module), mname)
            for attr, p in module.named_parameters(recurse=False, remove_duplicate=False):
                if (module, attr) not in owners.setdefault(id(p), []):
                    owners[id(p)].append((module, attr))
        names = dict(self.model.named_parameters())
        unknown = [t.name for t in self.plan.tensors if t.name not in names]
        if unknown:
            raise ValueError(f"the plan names tensors the model does not have: {unknown[:5]}"
                             f"{' ...' if len(unknown) > 5 else ''}; plan from this model's named_parameters()")
        staged = []  # everything is checked and packed before the model is touched: a bad plan leaves it as it was
        for t in self.plan.tensors:
            p = names[t.name]
            if t.format == _own_format(p):
                continue  # stored in its own dtype: an ordinary parameter
            if isinstance(p, MVASWeight):
                raise ValueError(f"parameter {t.name!r} is already managed by an MVAS store; apply once per model")
            if t.numel != p.numel():
                raise ValueError(f"the plan's {t.name!r} has {t.numel} elements, the model's {p.numel()}")
            weight = MVASWeight.from_packed(pack(p.detach(), t.format, t.block_size), compute_dtype or p.dtype)
            staged.append((t, p, nn.Parameter(weight, requires_grad=p.requires_grad)))
        registered = registered_parameters(self.model)
        try:  # plain assignments from here on; whatever fails puts the model's own parameter objects back
            for t, p, weight in staged:
                keys = [(module_names[id(m)] + "." if module_names[id(m)] else "") + a for m, a in owners[id(p)]]
                for module, attr in owners[id(p)]:
                    module.register_parameter(attr, weight)
                self.entries[t.name] = _Entry(t.name, weight, owners[id(p)], t, keys)
            self._handles.append(self.model.register_load_state_dict_pre_hook(self._check_load))
        except BaseException:
            self.remove(restore=registered)
            raise

    # ------------------------------------------------------------------------------------------- access
    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def parameter(self, name: str) -> MVASWeight:
        """The managed parameter called ``name`` (an ``MVASWeight``)."""
        return self._entry(name).param

    def packed(self, name: str) -> PackedTensor:
        return self._entry(name).packed()

    def dense(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight as the model computes with it (dequantised, in the compute dtype or ``dtype``)."""
        return self._entry(name).dense(dtype)

    def weights(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Every parameter by name, dense: managed ones dequantised, the others as they are."""
        out = {}
        for name, p in self.model.named_parameters():
            if isinstance(p, MVASWeight):
                out[name] = p.dequantize(dtype)
            else:
                out[name] = p.detach() if dtype is None else p.detach().to(dtype)
        return out

    def _entry(self, name: str) -> _Entry:
        if name not in self.entries:
            raise KeyError(f"{name!r} is not managed by this MVAS store (managed: {len(self.entries)} tensors)")
        return self.entries[name]

    @torch.no_grad()
    def write(self, name: str, value: torch.Tensor, rounding: str = "stochastic",
              generator: torch.Generator | None = None) -> None:
        """Store ``value`` as the new weight of ``name`` in its planned format (``generator``: default the
        store's)."""
        entry = self._entry(name)
        if tuple(value.shape) != tuple(entry.param.shape):
            raise ValueError(f"write({name!r}): shape {tuple(value.shape)} != {tuple(entry.param.shape)}")
        entry.param.write(value, rounding, generator or self._generator)

    def packed_bytes(self) -> int:
        """Bytes of every managed tensor's storage (payloads and scales), as held now."""
        return sum(e.param.packed_nbytes for e in self.entries.values())

    # ------------------------------------------------------------------------------------------- re-planning
    @torch.no_grad()
    def replan(self, plan: PrecisionPlan) -> list[tuple[str, str, str]]:
        """Re-pack managed tensors whose format or block size ``plan`` changes, from their current values.

        Returns ``[(name, old format, new format), ...]``. The set of managed tensors is fixed at ``apply``:
        ``plan`` must keep every other tensor in its own dtype and name every managed one.
        """
        changes = []
        for name, entry in self.entries.items():
            try:
                new = plan[name]
            except KeyError:
                raise ValueError(f"replan: the new plan has no entry for managed tensor {name!r}") from None
            if (new.format, new.block_size) != (entry.plan.format, entry.plan.block_size):
                changes.append((name, entry.plan.format, new.format))
        params = dict(self.model.named_parameters())
        for t in plan.tensors:
            if t.name not in self.entries and t.name in params and t.format != _own_format(params[t.name]):
                raise ValueError(f"replan: {t.name!r} is not managed (kept in its own dtype at apply); a store "
                                 "cannot start managing tensors later, apply a plan that packs it from the start")
        for name, _, _ in changes:
            entry = self.entries[name]
            entry.plan = plan[name]
            entry.param.repack(entry.plan.format, entry.plan.block_size)
        self.plan = plan
        return changes

    def plan_from_state_dict(self, state_dict: Mapping[str, Any], prefix: str = "") -> PrecisionPlan:
        """This store's plan with each managed tensor in the format the checkpoint holds it in."""
        tensors = []
        for t in self.plan.tensors:
            entry = self.entries.get(t.name)
            if entry is None:
                tensors.append(t)
                continue
            key = prefix + entry.keys[0]
            value = state_dict.get(key)
            if isinstance(value, MVASWeight):
                fmt, block = value.format, value.block_size
            elif key + PAYLOAD_SUFFIX in state_dict:
                fmt, block = format_of(state_dict[key + PAYLOAD_SUFFIX], state_dict.get(key + SCALES_SUFFIX),
                                        t.numel)
            else:
                raise ValueError(f"the checkpoint holds no packed tensor {key!r}")
            tensors.append(TensorPlan(t.name, t.numel, t.dtype, fmt, block, "checkpoint"))
        return PrecisionPlan(tuple(tensors))

    # ------------------------------------------------------------------------------------------- checkpoints
    def _check_load(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """load_state_dict pre-hook of the model: flat packed pairs become weights, then shapes, plans and values
        are checked before anything is copied (module docstring)."""
        for entry in self.entries.values():
            _unflatten_packed(state_dict, [prefix + k for k in entry.keys], entry)
        shapes = []
        expected = {prefix + k: v for k, v in module.state_dict(keep_vars=True).items()}
        for key, value in state_dict.items():
            if key in expected and torch.is_tensor(value) and value.shape != expected[key].shape:
                shapes.append(f"{key}: checkpoint {tuple(value.shape)}, model {tuple(expected[key].shape)}")
        if shapes:
            raise ValueError(f"the checkpoint is of a model of another shape ({len(shapes)} tensors differ: "
                             + "; ".join(shapes[:5]) + (" ..." if len(shapes) > 5 else "")
                             + "). Nothing was loaded: load it into a model built with the same configuration")
        formats, values, corrupt = [], [], []
        for entry in self.entries.values():
            key = prefix + entry.keys[0]
            value = state_dict.get(key)
            if isinstance(value, MVASWeight):
                if not _same_plan(value.format, value.block_size, entry.plan, entry.param.numel()):
                    formats.append(f"{entry.name}: checkpoint {_describe(value.format, value.block_size)}, model "
                                   f"{_describe(entry.plan.format, entry.plan.block_size)}")
                elif not value.is_view:  # built in memory, not through torch.load or from_packed: checked here
                    try:
                        value.validate()
                    except ValueError as exc:
                        corrupt.append(f"{entry.name}: {exc}")
            elif torch.is_tensor(value) and get_format(entry.plan.format).block_scaled and (
                    value.is_floating_point() and not is_fake(value) and not torch.isfinite(value).all()):
                values.append(f"{entry.name}: the dense value has inf or NaN elements")
        if formats:
            raise ValueError(
                f"the checkpoint was saved with another MVAS plan ({len(formats)} tensors differ: "
                + "; ".join(formats[:5]) + (" ..." if len(formats) > 5 else "")
                + "). Nothing was loaded. Adopt its plan first: store.replan(store.plan_from_state_dict(sd)), "
                  "then load")
        if values:
            raise ValueError("the checkpoint cannot be packed: " + "; ".join(values[:5]) + ". Nothing was loaded")
        if corrupt:
            raise ValueError("the checkpoint is corrupt: " + "; ".join(corrupt[:5]) + ". Nothing was loaded")

    # ------------------------------------------------------------------------------------------- removal
    @torch.no_grad()
    def remove(self, restore: list[tuple[nn.Module, str, nn.Parameter]] | None = None) -> nn.Module:
        """Undo ``apply``: the load hook gone and dense parameters back in place, dequantised in the compute dtype;
        or, with ``restore`` (what ``registered_parameters(model)`` returned before ``apply``), those parameter
        objects themselves, bit for bit as they were (for loaders that undo a refused load)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if restore is not None:
            restore_parameters(restore)
        else:
            for entry in self.entries.values():
                dense = nn.Parameter(entry.dense(), requires_grad=entry.param.requires_grad)
                for m, a in entry.owners:
                    m.register_parameter(a, dense)
        self.entries.clear()
        return self.model


def _unflatten_packed(state_dict: dict[str, Any], keys: list[str], entry: _Entry) -> None:
    """``<key>__mvas_payload`` / ``__mvas_scales`` (``packed_state_dict``) -> an ``MVASWeight`` under every tied
    ``key``; checked (``MVASWeight.from_packed``) as it is built."""
    source = next((k for k in keys if k + PAYLOAD_SUFFIX in state_dict), None)
    if source is None:
        return
    payload = state_dict.pop(source + PAYLOAD_SUFFIX)
    scales = state_dict.pop(source + SCALES_SUFFIX, None)
    fmt, block = format_of(payload, scales, entry.param.numel())
    packed = PackedTensor(fmt, tuple(entry.param.shape), entry.param.dtype,
                          block if get_format(fmt).block_scaled else None, payload, scales)
    try:
        weight = MVASWeight.from_packed(packed, entry.param.dtype)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}. Nothing was loaded") from None
    for key in keys:
        state_dict[key] = weight


def _own_format(p: torch.Tensor) -> str | None:
    try:
        return dtype_format(p.dtype).name
    except (KeyError, ValueError):
        return None


def _same_plan(fmt: str, block: int | None, plan: TensorPlan, numel: int) -> bool:
    """Whether a stored (format, block) is ``plan``'s; a block of ``numel`` elements is one scale per tensor."""
    if get_format(fmt).name != get_format(plan.format).name:
        return False
    if not get_format(fmt).block_scaled:
        return True
    return (None if block is None or block >= numel else block) == (
        None if plan.block_size is None or plan.block_size >= numel else plan.block_size)


def _describe(fmt: str, block: int | None) -> str:
    return fmt if not get_format(fmt).block_scaled else f"{fmt} (block {block if block else 'tensor'})"


def apply(model: nn.Module, plan: PrecisionPlan, *, compute_dtype: torch.dtype | None = None,
          generator: torch.Generator | None = None) -> MVASStore:
    """Pack ``model``'s parameters as ``plan`` says and serve them on use (module docstring).

    Tensors the plan keeps in their own dtype stay ordinary parameters. ``compute_dtype`` is the dtype the
    weights are dequantised to (default: each parameter's own). ``generator`` drives the stochastic rounding
    of ``store.write``. Apply after ``model.to(device)``.
    """
    if not isinstance(plan, PrecisionPlan):
        raise TypeError(f"plan must be a PrecisionPlan (plan_from_rules / plan_for_budget); got {type(plan).__name__}")
    if compute_dtype is not None and compute_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"compute_dtype={compute_dtype} must be float32, bfloat16 or float16")
    return MVASStore(model, plan, compute_dtype=compute_dtype, generator=generator)
