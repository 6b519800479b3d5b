"""The MVAS store (post section 3.2, "memory virtualisation"): parameters held packed in fp16/fp8/fp4, dense
only while their module runs.

``store = mvas.apply(model, plan)`` turns every tensor the ``PrecisionPlan`` stores in another format than
its own dtype into a *managed* parameter:

- **Storage.** The packed payload (and its fp32 block scales) become buffers of the module that owns the
  parameter, ``<attr>__mvas_payload`` and ``<attr>__mvas_scales``, so ``model.state_dict()``, ``.to()``
  and ``torch.save`` see the packed form and nothing else. The ``nn.Parameter`` itself stays registered
  (optimizers, LR schedulers, DGR's gradient hooks, ``clip_grad_norm_`` all keep working) but holds one
  element of storage, expanded to the full shape with zero strides: its shape, dtype and ``.grad`` are
  real, its *values* are not. Read weights with ``store.dense(name)``, never from the parameter.
- **Just in time.** A forward pre-hook on each owning module (on its parent for an ``nn.MultiheadAttention``,
  which reads ``out_proj.weight`` without calling ``out_proj``) dequantises the weight to the compute dtype
  and puts it in place of the parameter for the duration of that module's forward; a forward hook
  (``always_call``, so also after an exception) puts the parameter back. The dense weight is then
  referenced by nothing but what autograd saved for backward.
- **Re-materialised in backward.** While a managed module runs, ``torch.autograd.graph.saved_tensors_hooks``
  replace every saved tensor that is the dense weight or a view of it (``F.linear`` saves ``weight.t()``)
  by a small token; backward dequantises again from the packed storage when it needs the weight. So the
  dense weight lives for one module's forward and one op's backward, never across the step.
- **Gradients.** The dense weight is the output of an autograd function of the parameter whose backward
  passes the gradient through, so ``param.grad`` is the ordinary dense gradient of the loss with respect
  to the (dequantised) weight and ``post_accumulate_grad`` hooks fire as usual.

Updates go through ``MVASAdamW`` (``macroarch.mvas.optim``), which writes the new weight back with
``store.write(name, w)``: stochastic rounding for every low-precision tier by default, or round-to-nearest
from an fp32 master copy. ``store.replan(plan)`` re-packs tensors into new formats (``schedule.py``).

``state_dict()`` holds the packed tensors bit for bit; ``load_state_dict`` checks, before copying anything,
that every packed tensor of the checkpoint has this store's format, and raises naming each difference if not
(``store.plan_from_state_dict(sd)`` + ``store.replan`` adopt the checkpoint's plan first). A dense checkpoint
(``<attr>`` present, no payload) is packed into the current plan on load.

Limitations: apply after moving the model to its device and dtype (``.to()`` of an expanded parameter would
allocate it densely); activation checkpointing inside a managed module is shadowed by the store's saved-tensor
hooks (correct, but the checkpointed activations are kept); writing into a managed parameter in place raises.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from macroarch.mvas.formats import FORMATS, PackedTensor, dtype_format, get_format, pack, write_range
from macroarch.mvas.policy import PrecisionPlan, TensorPlan

PAYLOAD_SUFFIX = "__mvas_payload"
SCALES_SUFFIX = "__mvas_scales"


def is_packed_buffer(name: str) -> bool:
    """Whether a buffer name is one of the store's payload or scale buffers."""
    return name.endswith(PAYLOAD_SUFFIX) or name.endswith(SCALES_SUFFIX)


# Modules whose forward reads a child's parameters without calling the child (nn.MultiheadAttention passes
# out_proj.weight to F.multi_head_attention_forward): their children's weights are served for the parent's forward.
_REACHES_INTO: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)


def _scope(module: nn.Module, parents: dict[int, nn.Module]) -> nn.Module:
    """The module whose forward a parameter of ``module`` must be materialised for."""
    parent = parents.get(id(module))
    return parent if isinstance(parent, _REACHES_INTO) else module


def _placeholder(shape: torch.Size, dtype: torch.dtype, device: torch.device, requires_grad: bool) -> nn.Parameter:
    """A parameter of ``shape`` backed by a single NaN (zero strides): shape and grad real, values not. NaN, so
    that code reading the weight outside the store's scope poisons its output instead of silently using zeros."""
    return nn.Parameter(torch.full((), float("nan"), dtype=dtype, device=device).expand(shape),
                        requires_grad=requires_grad)


class _Materialize(torch.autograd.Function):
    """``placeholder -> dense weight``; the gradient passes through to the placeholder unchanged."""

    @staticmethod
    def forward(ctx, placeholder: torch.Tensor, entry: _Entry) -> torch.Tensor:  # type: ignore[override]
        return entry.dense()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


@dataclass(frozen=True)
class _SavedWeight:
    """What autograd keeps instead of a dense weight (or a view of it): enough to rebuild it in backward."""

    entry: _Entry
    version: int
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class _Entry:
    """One managed parameter: its placeholder, the modules holding it, and its packed storage."""

    def __init__(self, name: str, param: nn.Parameter, owners: list[tuple[nn.Module, str]], plan: TensorPlan,
                 compute_dtype: torch.dtype) -> None:
        self.name, self.param, self.owners, self.plan = name, param, owners, plan
        self.compute_dtype = compute_dtype
        self.keys: list[str] = []  # state-dict keys of the parameter, one per owner (tied weights: several)
        self.version = 0  # bumped by every write; a token saved for backward must see the same version

    @property
    def module(self) -> nn.Module:
        return self.owners[0][0]

    @property
    def attr(self) -> str:
        return self.owners[0][1]

    def packed(self) -> PackedTensor:
        payload = self.module._buffers[self.attr + PAYLOAD_SUFFIX]
        scales = self.module._buffers.get(self.attr + SCALES_SUFFIX)
        block = self.plan.block_size if get_format(self.plan.format).block_scaled else None
        return PackedTensor(self.plan.format, tuple(self.param.shape), self.compute_dtype, block, payload, scales)

    def dense(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.packed().dequantize(self.compute_dtype if dtype is None else dtype)

    def set_packed(self, packed: PackedTensor) -> None:
        """Make ``packed`` the storage: in place when payload and scales keep their dtype and shape (the buffers
        stay the same tensors), else re-registered."""
        module, attr = self.owners[0]
        old = module._buffers.get(attr + PAYLOAD_SUFFIX)
        if old is not None and old.dtype == packed.payload.dtype and old.shape == packed.payload.shape:
            old.copy_(packed.payload)
        else:
            module._buffers[attr + PAYLOAD_SUFFIX] = packed.payload
        key = attr + SCALES_SUFFIX
        old_scales = module._buffers.get(key)
        if packed.scales is None:
            module._buffers.pop(key, None)
        elif old_scales is not None and old_scales.shape == packed.scales.shape:
            old_scales.copy_(packed.scales)
        else:
            module._buffers[key] = packed.scales
        self.version += 1


    def write_range(self, start: int, stop: int, values: torch.Tensor, rounding: str = "nearest",
                    generator: torch.Generator | None = None) -> None:
        """Re-pack elements ``start:stop`` of the flattened weight in place; the range must cover whole blocks
        (and whole bytes of fp4), so its scales are its own."""
        packed = pack(values, self.plan.format, self.plan.block_size, rounding, generator)
        module, attr = self.owners[0]
        write_range(module._buffers[attr + PAYLOAD_SUFFIX], module._buffers.get(attr + SCALES_SUFFIX), packed,
                    start, stop)
        self.version += 1


class MVASStore:
    """Packed parameters of one model (module docstring). Made by ``apply(model, plan)``."""

    def __init__(self, model: nn.Module, plan: PrecisionPlan, *, compute_dtype: torch.dtype | None = None,
                 generator: torch.Generator | None = None) -> None:
        self.model = model
        self.plan = plan
        self.entries: dict[str, _Entry] = {}
        self._by_param: dict[int, _Entry] = {}
        self._live: dict[int, tuple[torch.Tensor, _Entry]] = {}  # id(dense weight) -> (it, entry), while in forward
        self._depth = 0
        self._saved_hooks: contextlib.AbstractContextManager | None = None
        self._handles: list[Any] = []
        self._swapped: dict[int, list[tuple[list, bool]]] = {}  # id(scope) -> stack of (weights put in place, grad on)
        self._generator = generator
        self._attach(compute_dtype)

    # ------------------------------------------------------------------------------------------- set-up
    def _attach(self, compute_dtype: torch.dtype | None) -> None:
        owners: dict[int, list[tuple[nn.Module, str]]] = {}
        module_names = {}
        for mname, module in self.model.named_modules(remove_duplicate=False):
            module_names.setdefault(id(module), mname)
            for attr, p in module._parameters.items():
                if p is not None and (module, attr) not in owners.setdefault(id(p), []):
                    owners[id(p)].append((module, attr))
        names = dict(self.model.named_parameters())
        unknown = [t.name for t in self.plan.tensors if t.name not in names]
        if unknown:
            raise ValueError(f"the plan names tensors the model does not have: {unknown[:5]}"
                             f"{' ...' if len(unknown) > 5 else ''}; plan from this model's named_parameters()")
        # everything is checked and packed before the model is touched, so a bad plan leaves it as it was
        staged = []
        for t in self.plan.tensors:
            p = names[t.name]
            if t.format == _own_format(p):
                continue  # stored in its own dtype: an ordinary parameter
            if getattr(p, "_mvas_entry", None) is not None:
                raise ValueError(f"parameter {t.name!r} is already managed by an MVAS store; apply once per model")
            if t.numel != p.numel():
                raise ValueError(f"the plan's {t.name!r} has {t.numel} elements, the model's {p.numel()}")
            staged.append((t, p, pack(p.detach(), t.format, t.block_size)))
        parents = {id(child): m for m in self.model.modules() for child in m.children()}
        scopes: dict[int, tuple[nn.Module, list[tuple[nn.Module, str, _Entry]]]] = {}
        owning: dict[int, nn.Module] = {}
        for t, p, packed in staged:
            dtype = compute_dtype or p.dtype
            placeholder = _placeholder(p.shape, dtype, p.device, p.requires_grad)
            entry = _Entry(t.name, placeholder, owners[id(p)], t, dtype)
            entry.keys = [(module_names[id(m)] + "." if module_names[id(m)] else "") + a for m, a in entry.owners]
            for module, attr in entry.owners:
                module._parameters[attr] = placeholder
                scope = _scope(module, parents)
                scopes.setdefault(id(scope), (scope, []))[1].append((module, attr, entry))
                owning[id(module)] = module
            entry.set_packed(packed)
            placeholder._mvas_entry = entry  # MVASAdamW finds the storage of a parameter through this
            self.entries[t.name] = entry
            self._by_param[id(placeholder)] = entry
        for scope, held in scopes.values():
            self._handles.append(scope.register_forward_pre_hook(self._pre_forward(held)))
            self._handles.append(scope.register_forward_hook(self._post_forward(), always_call=True))
        for module in owning.values():
            self._handles.append(module.register_load_state_dict_pre_hook(self._check_load))
            self._handles.append(module.register_state_dict_post_hook(_drop_placeholders))
        self._handles.append(self.model.register_load_state_dict_pre_hook(self._check_whole_load))
        self._handles.append(self.model.register_load_state_dict_post_hook(self._forgive_placeholders))

    # ------------------------------------------------------------------------------------ forward/backward
    def _pre_forward(self, held: list[tuple[nn.Module, str, _Entry]]):
        def hook(scope: nn.Module, args: Any) -> None:
            grad = torch.is_grad_enabled()
            swapped = []
            for owner, attr, entry in held:
                w = _Materialize.apply(entry.param, entry) if grad and entry.param.requires_grad else entry.dense()
                owner._parameters[attr] = w
                root = _root(w)  # dequantize returns a view of a flat buffer; saved views share that root
                self._live[id(root)] = (root, entry)
                swapped.append((owner, attr, w, entry))
            self._swapped.setdefault(id(scope), []).append((swapped, grad))
            if grad:
                if self._depth == 0:
                    self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
                    self._saved_hooks.__enter__()
                self._depth += 1
        return hook

    def _post_forward(self):
        def hook(scope: nn.Module, args: Any, output: Any) -> None:
            stack = self._swapped.get(id(scope))
            if not stack:
                return  # the pre-hook did not run (an exception before it)
            swapped, grad = stack.pop()
            for owner, attr, w, entry in swapped:
                self._live.pop(id(_root(w)), None)
                owner._parameters[attr] = entry.param
            if not stack:
                del self._swapped[id(scope)]
            if grad:
                self._depth -= 1
                if self._depth == 0:
                    self._saved_hooks.__exit__(None, None, None)
                    self._saved_hooks = None
        return hook

    def _pack(self, t: torch.Tensor) -> Any:
        base = _root(t)
        live = self._live.get(id(base))
        if live is None or live[0] is not base:
            return t
        entry = live[1]
        return _SavedWeight(entry, entry.version, t.size(), t.stride(), t.storage_offset())

    @staticmethod
    def _unpack(saved: Any) -> torch.Tensor:
        if not isinstance(saved, _SavedWeight):
            return saved
        entry = saved.entry
        if entry.version != saved.version:
            raise RuntimeError(f"MVAS: {entry.name!r} was updated between the forward pass and the backward pass "
                               "that needs it (step the optimizer after backward)")
        return entry.dense().as_strided(saved.size, saved.stride, saved.offset)

    # ------------------------------------------------------------------------------------------- access
    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def packed(self, name: str) -> PackedTensor:
        return self._entry(name).packed()

    def dense(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight as the model computes with it (dequantised, in the compute dtype or ``dtype``)."""
        return self._entry(name).dense(dtype)

    def weights(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Every parameter by name, dense: managed ones dequantised, the others as they are."""
        out = {}
        for name, p in self.model.named_parameters():
            entry = self._by_param.get(id(p))
            out[name] = entry.dense(dtype) if entry is not None else (p.detach() if dtype is None else
                                                                        p.detach().to(dtype))
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
        entry.set_packed(pack(value, entry.plan.format, entry.plan.block_size, rounding, generator or self._generator))

    def packed_bytes(self) -> int:
        """Bytes of every managed tensor's storage (payloads and scales), as held now."""
        return sum(e.packed().nbytes for e in self.entries.values())

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
            value = entry.dense(torch.float32)
            entry.plan = plan[name]
            entry.set_packed(pack(value, entry.plan.format, entry.plan.block_size))
        self.plan = plan
        return changes

    def plan_from_state_dict(self, state_dict: Mapping[str, torch.Tensor], prefix: str = "") -> PrecisionPlan:
        """This store's plan with each managed tensor in the format the checkpoint holds it in."""
        tensors = []
        for t in self.plan.tensors:
            entry = self.entries.get(t.name)
            if entry is None:
                tensors.append(t)
                continue
            key = self._key(entry, prefix)
            if key + PAYLOAD_SUFFIX not in state_dict:
                raise ValueError(f"the checkpoint has no packed tensor {key + PAYLOAD_SUFFIX!r}")
            fmt, block = _format_of(state_dict[key + PAYLOAD_SUFFIX], state_dict.get(key + SCALES_SUFFIX), t.numel)
            tensors.append(TensorPlan(t.name, t.numel, t.dtype, fmt, block, "checkpoint"))
        return PrecisionPlan(tuple(tensors))

    @staticmethod
    def _key(entry: _Entry, prefix: str = "") -> str:
        return prefix + entry.keys[0]

    def _forgive_placeholders(self, module: nn.Module, incompatible: Any) -> None:
        """load_state_dict post-hook: a managed parameter is not missing when its packed buffers were loaded."""
        keys = {k for e in self.entries.values() for k in e.keys}
        for key in list(incompatible.missing_keys):
            if any(key == k or key.endswith("." + k) for k in keys):
                incompatible.missing_keys.remove(key)

    # ------------------------------------------------------------------------------------------- checkpoints
    def _check_whole_load(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """Before anything is copied: every packed tensor of the checkpoint must have this store's format."""
        problems = []
        for entry in self.entries.values():
            key = self._key(entry, prefix)
            payload = state_dict.get(key + PAYLOAD_SUFFIX)
            if payload is None:
                continue  # a dense checkpoint (packed in _check_load) or a missing key (reported by torch)
            fmt, block = _format_of(payload, state_dict.get(key + SCALES_SUFFIX), entry.plan.numel)
            if (fmt, block) != (entry.plan.format, entry.plan.block_size):
                problems.append(f"{entry.name}: checkpoint {_describe(fmt, block)}, model "
                                f"{_describe(entry.plan.format, entry.plan.block_size)}")
        if problems:
            raise ValueError(
                f"the checkpoint was saved with another MVAS plan ({len(problems)} tensors differ: "
                + "; ".join(problems[:5]) + (" ..." if len(problems) > 5 else "")
                + "). Nothing was loaded. Adopt its plan first: store.replan(store.plan_from_state_dict(sd))")

    def _check_load(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """A dense checkpoint (``<attr>`` and no payload): pack it into the current plan."""
        for entry in self.entries.values():
            for owner, attr in entry.owners:
                if owner is not module:
                    continue
                dense = state_dict.get(prefix + attr)
                if dense is None or prefix + attr + PAYLOAD_SUFFIX in state_dict:
                    state_dict.pop(prefix + attr, None)
                    continue
                packed = pack(dense.to(entry.param.device), entry.plan.format, entry.plan.block_size)
                state_dict.pop(prefix + attr)
                if owner is entry.module:
                    state_dict[prefix + attr + PAYLOAD_SUFFIX] = packed.payload
                    if packed.scales is not None:
                        state_dict[prefix + attr + SCALES_SUFFIX] = packed.scales

    # ------------------------------------------------------------------------------------------- removal
    @torch.no_grad()
    def remove(self) -> nn.Module:
        """Undo ``apply``: dense parameters (dequantised, compute dtype) back in place, hooks and buffers gone."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for entry in self.entries.values():
            dense = nn.Parameter(entry.dense(), requires_grad=entry.param.requires_grad)
            module, attr = entry.owners[0]
            module._buffers.pop(attr + PAYLOAD_SUFFIX, None)
            module._buffers.pop(attr + SCALES_SUFFIX, None)
            for m, a in entry.owners:
                m._parameters[a] = dense
            entry.param._mvas_entry = None
        self.entries.clear()
        self._by_param.clear()
        return self.model



def _drop_placeholders(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """state_dict post-hook: a managed parameter is saved as its packed buffers, not as its placeholder."""
    for attr, p in module._parameters.items():
        if p is not None and getattr(p, "_mvas_entry", None) is not None:
            state_dict.pop(prefix + attr, None)


def _root(t: torch.Tensor) -> torch.Tensor:
    return t._base if t._base is not None else t


def _own_format(p: torch.Tensor) -> str | None:
    try:
        return dtype_format(p.dtype).name
    except (KeyError, ValueError):
        return None


def _format_of(payload: torch.Tensor, scales: torch.Tensor | None, numel: int) -> tuple[str, int | None]:
    """The (format, block size) a packed payload was stored in, from its dtype and the number of scales."""
    for fmt in FORMATS.values():
        if fmt.storage_dtype == payload.dtype:
            if not fmt.block_scaled:
                return fmt.name, None
            n_scales = 0 if scales is None else scales.numel()
            block = None if n_scales <= 1 else numel // n_scales
            return fmt.name, block
    raise ValueError(f"a packed payload of dtype {payload.dtype} matches no MVAS format")


def _describe(fmt: str, block: int | None) -> str:
    return fmt if not get_format(fmt).block_scaled else f"{fmt} (block {block if block else 'tensor'})"


def apply(model: nn.Module, plan: PrecisionPlan, *, compute_dtype: torch.dtype | None = None,
          generator: torch.Generator | None = None) -> MVASStore:
    """Pack ``model``'s parameters as ``plan`` says and serve them just in time (module docstring).

    Tensors the plan keeps in their own dtype stay ordinary parameters. ``compute_dtype`` is the dtype the
    weights are dequantised to (default: each parameter's own). ``generator`` drives the stochastic rounding
    of ``store.write``. Apply after ``model.to(device, dtype)``.
    """
    if not isinstance(plan, PrecisionPlan):
        raise TypeError(f"plan must be a PrecisionPlan (plan_from_rules / plan_for_budget); got {type(plan).__name__}")
    if compute_dtype is not None and compute_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"compute_dtype={compute_dtype} must be float32, bfloat16 or float16")
    return MVASStore(model, plan, compute_dtype=compute_dtype, generator=generator)
