"""``MVASWeight``: a managed weight that *is* a tensor (post section 3.2): packed storage, dense on every read.

``mvas.apply`` puts an ``MVASWeight`` in place of each parameter its plan packs. It is a ``torch.Tensor``
wrapper subclass (``_make_wrapper_subclass``, the design of torchao's float8 and quantised weights): the outer
tensor has the weight's shape and its *compute* dtype and no storage of its own; it holds

- ``payload``: the packed codes, flat (fp8 one byte per element, fp4 two per byte, bf16/fp16 casts), and
- ``scales``: fp32 block scales (``None`` for unscaled formats), with ``format`` and ``block_size``
  (``macroarch.mvas.codecs``).

**Dispatch** (``__torch_dispatch__``, below autograd). Every op that reads the weight gets the dense weight,
dequantised for that op alone and dropped with its result, so any read is right: inside or outside the owning
module (a tied head written as ``F.linear(h, emb.weight)``), under ``torch.autocast``, activation checkpointing
and ``torch.compile`` (``__tensor_flatten__`` / ``__tensor_unflatten__`` let AOTAutograd trace through it).
Exceptions, all cheap:

- a view that is a contiguous run of whole blocks (and whole fp4 bytes) of the flat storage (``chunk``,
  ``split``, ``narrow`` or ``slice`` on dim 0 at block boundaries, ``view`` / ``reshape`` / ``as_strided`` of
  the whole weight) is a weight on that run of the payload and scales: no views to replay, and writable (a
  ``copy_`` into it writes the weight's storage). This is what FSDP2 shards (``macroarch.mvas.interop.fsdp``);
- other *views* (``t``, ``transpose``, slices inside blocks ...) and ``detach`` return another
  ``MVASWeight`` on the same storage that remembers the view ops and replays them after dequantising. So the
  tensor autograd saves for backward (``F.linear`` saves ``weight.t()``) is a packed view, and backward
  dequantises again: the dense weight lives for one op, never across the step;
- a dtype cast (``.to(bf16)``, which autocast makes) is such a view too; a device move moves the storage;
  ``clone`` (``copy.deepcopy``) copies the packed storage;
- ``copy_`` into a weight packs the source (round to nearest; a weight of the same format is copied bit for
  bit): ``load_state_dict`` and checkpoint restores use it;
- ``*_like`` / ``new_*`` factories read only the shape;
- any other write (``mul_``, ``_foreach_add_``, ``_fused_adamw_``, ``out=``) raises a ``TypeError`` naming
  ``MVASAdamW``: packed weights are updated by the optimizer that knows their storage. A global optimizer-step
  pre-hook raises the same error before a ``torch.optim.Optimizer`` that does not declare
  ``supports_mvas_weights = True`` touches anything (torch's AdamW for-loop/foreach/fused, timm's
  ``create_optimizer_v2``, HF Trainer's default).

Gradients are ordinary dense tensors in the compute dtype (``param.grad``), accumulated by autograd as usual.
``F.linear`` (``nn.Linear``) on a weight that is no view takes a shorter road to the same bits: one autograd node
(``macroarch.mvas.packed.linear``) that dequantises once in forward and once in backward, without the view wrappers;
under autocast, a dispatch mode or ``torch.compile`` it goes through dispatch as above.

**Torch-function level** (what Python code asks of a tensor before writing its bytes): ``contiguous()`` returns
the dense weight, so ``save_pretrained`` (which calls it) writes dense weights in the training dtype;
``is_contiguous()`` is False, as no dense memory exists to read in place (``safetensors.torch.save_file`` on the
raw state dict then refuses it and asks for ``.contiguous()``; its ``save_model`` refuses too, as the storage
does not cover a dense tensor: write ``save_file(mvas.dense_state_dict(model), path)``);
``untyped_storage()`` and ``data_ptr()`` are the payload's (storage identity, for tied-weight detection).
Kernels are unaffected: they see the wrapper's own (contiguous) strides.

**Serialisation**: ``torch.save`` pickles the packed form (payload, scales, format) exactly; the class is
registered with ``torch.serialization.add_safe_globals``, so ``torch.load(weights_only=True)`` reads it back in a
process that imported ``macroarch.mvas``. Loading (``torch.load``, ``from_packed``) validates the sizes, the scales
(finite, >= 0) and the payload (no code that decodes to NaN or infinity: ``packed_tensor.nonfinite_codes``).

**Public storage API** (``MVASAdamW``, the store, and later a fused optimizer step): ``payload``, ``scales``,
``format``, ``block_size``, ``packed()``, ``dequantize()``, ``dequantize_range()``, ``write()``,
``write_range()``, ``write_unit``, ``repack()``, ``validate()``, and ``mark_written()`` after writing the payload
directly. An optimizer that writes through it declares ``supports_mvas_weights = True``.
**FSDP2** (the tensor-subclass protocol, as torchao's float8 weights implement it; ``macroarch.mvas.interop.fsdp``
wraps ``fully_shard``): ``fsdp_pre_all_gather`` returns the local shard's ``(payload, scales)`` and
``(format, block_size, shape)`` as metadata, ``fsdp_post_all_gather`` wraps the gathered payload and scales in an
``MVASWeight`` (dequantised on use as here); dim-0 shards must be whole blocks of the flat payload
(``shard_problem``). While ``sharding()`` is on (``interop.fsdp.fully_shard``), ``is_contiguous()`` is True for a
weight that is no view
and ``new_zeros`` / ``new_empty`` give packed zero weights (FSDP2's shard buffers); otherwise both are as above.
The optimizer-step pre-hook also looks inside DTensors (a sharded weight's local tensor).

Dispatch modes (``MemTracker``, op counters) see the outer op with an ``MVASWeight`` argument; one that returns
``NotImplemented`` for it sees the dequantisation and the dense op instead, as they run (the memory accounting
of ``macroarch.measure.memory.measured`` does, so the transient dense weight is counted).

Limitations: a weight must be the first argument of a view op to stay packed (other reads are dense); writes
through a view that replays view ops raise. Weights on a run of another's storage (whole-block slices) have their
own autograd version counter: a write through one does not stop a backward that saved the other.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from macroarch._compat.subclass import (
    make_wrapper_subclass,
    modes_disabled,
    private_aten_ops,
    torch_function_disabled,
    writes,
    written_arguments,
)
from macroarch.mvas import _kernels
from macroarch.mvas.codecs.formats import FORMATS, get_format
from macroarch.mvas.packed.linear import linear
from macroarch.mvas.packed.packed_tensor import PackedTensor, bad_scales, nonfinite_codes, pack, write_range
from macroarch.optim.functional import local

__all__ = ["MVASWeight", "shard_problem", "sharding"]

aten = torch.ops.aten
_LINEAR = torch.nn.functional.linear  # the builtin torch._C._nn.linear, as __torch_function__ receives it

_SHARE = {aten.detach.default, aten.alias.default, aten.lift_fresh.default}
_LIKE = {"empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "randint_like",
         "new_empty", "new_zeros", "new_ones", "new_full", "new_empty_strided"}
# views that may land on whole blocks of the flat storage (dim-0 shards, flattening): FSDP2's chunk, narrow, view,
# and reshape's private-named twin (``private_aten_ops().unsafe_view``, looked up on the first dispatch)
_STORAGE_VIEWS = {aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default, aten.view.default,
                  aten.as_strided.default}
_PACKED_FACTORIES = {aten.new_zeros.default, aten.new_empty.default}
_SHARDING = False  # set by ``sharding()`` while FSDP2 shards managed weights


def _unaware_message(what: str, weight: MVASWeight) -> str:
    return (f"{what} cannot update an MVAS-managed weight: it is stored packed ({weight.format}, "
            f"{tuple(weight.shape)}) and read dense on use. Train it with macroarch.mvas.MVASAdamW (under DGR: "
            "DGRWrapper.optimizer(MVASAdamW, ...); with HF Trainer: optimizers=(MVASAdamW(model.parameters()), "
            "None)); write a new value with weight.copy_(value) or store.write(name, value)")


class MVASWeight(torch.Tensor):
    """A weight stored packed and dequantised on use (module docstring). Build with ``from_dense`` /
    ``from_packed``; ``mvas.apply`` does it for a whole model."""

    payload: torch.Tensor
    scales: torch.Tensor | None
    format: str
    block_size: int | None

    @staticmethod
    def __new__(cls, payload: torch.Tensor, scales: torch.Tensor | None, format: str, block_size: int | None,
                shape: tuple[int, ...], dtype: torch.dtype, views: tuple = (), requires_grad: bool = False,
                outer: tuple[Any, Any] | None = None):
        if outer is None:  # (size, stride) of the outer tensor: the packed shape after the views
            meta = _view_meta(shape, dtype, views)
            outer = (meta.shape, meta.stride())
        return make_wrapper_subclass(cls, outer[0], strides=outer[1], dtype=dtype, device=payload.device,
                                     requires_grad=requires_grad)

    def __init__(self, payload: torch.Tensor, scales: torch.Tensor | None, format: str, block_size: int | None,
                 shape: tuple[int, ...], dtype: torch.dtype, views: tuple = (), requires_grad: bool = False,
                 outer: tuple[Any, Any] | None = None) -> None:
        self.payload, self.scales, self.format, self.block_size = payload, scales, format, block_size
        self._packed_shape = tuple(int(s) for s in shape)
        self._views = tuple(views)
        # ``dtype`` as a plain attribute: reading ``self.dtype`` calls ``__torch_function__``, and every weight read and
        # linear layer needs it
        self._dtype = dtype

    # ------------------------------------------------------------------------------------- construction
    @classmethod
    def from_packed(cls, packed: PackedTensor, dtype: torch.dtype | None = None,
                    requires_grad: bool = False) -> MVASWeight:
        """Wrap ``packed`` (its tensors are used, not copied) as a weight computing in ``dtype`` (default: the
        dtype it was packed from). Raises ValueError if its payload, scales or sizes are inconsistent."""
        _check_packed(packed.format, packed.block_size, packed.shape, packed.payload, packed.scales)
        return cls(packed.payload, packed.scales, packed.format, packed.block_size, tuple(packed.shape),
                   packed.dtype if dtype is None else dtype, requires_grad=requires_grad)

    @classmethod
    def from_dense(cls, tensor: torch.Tensor, format: str, block_size: int | None = 32, *,
                   dtype: torch.dtype | None = None, rounding: str = "nearest",
                   generator: torch.Generator | None = None) -> MVASWeight:
        """``tensor`` packed in ``format`` (``formats.pack``), computing in ``dtype`` (default its own)."""
        return cls.from_packed(pack(tensor, format, block_size, rounding, generator),
                               tensor.dtype if dtype is None else dtype)

    # ------------------------------------------------------------------------------------- storage API
    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the weight reads as (``dtype``, without a ``__torch_function__`` call)."""
        return self._dtype

    @property
    def is_view(self) -> bool:
        """Whether this is a view of a weight (view ops replayed after dequantising): read-only."""
        return bool(self._views)

    def packed(self) -> PackedTensor:
        """The packed storage as a ``PackedTensor`` (its payload and scales are this weight's, not copies)."""
        return PackedTensor(self.format, self._packed_shape, self._dtype, self.block_size, self.payload, self.scales)

    @property
    def packed_nbytes(self) -> int:
        """Bytes of the storage: payload plus scales."""
        return self.packed().nbytes

    @property
    def write_unit(self) -> int:
        """The smallest piece ``write_range`` can re-pack alone: a whole block and whole fp4 bytes; the whole
        tensor when one scale covers it."""
        numel = math.prod(self._packed_shape)
        if get_format(self.format).block_scaled and self.block_size is None:
            return numel
        block = self.block_size if get_format(self.format).block_scaled else 1
        return math.lcm(block, 2 if self.format == "fp4_e2m1" else 1)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dense value (a plain tensor, no autograd history) in ``dtype`` (default: the compute dtype)."""
        dtype = self._dtype if dtype is None else dtype
        if self.scales is not None and not self._views:  # read every step: straight to the compiled kernel
            shape = self._packed_shape  # what packed() has (self.shape and numel() would go through torch function)
            dense = _kernels.dequantize(self.payload, self.scales, self.format, self.block_size, math.prod(shape),
                                        dtype, eager_fallback=False)
            return dense.view(shape) if dense is not None else self.packed().decoded(dtype)
        dense = self.packed().dequantize(dtype)
        for func, args, kwargs, index in self._views:
            dense = func(dense, *args, **kwargs)
            if index is not None:
                dense = dense[index]
        return dense

    def dequantize_range(self, start: int, stop: int) -> torch.Tensor:
        """Elements ``start:stop`` of the flattened (unviewed) weight as float32; ``start`` a multiple of
        ``write_unit``."""
        return self.packed().dequantize_range(start, stop)

    @torch.no_grad()
    def write(self, value: torch.Tensor, rounding: str = "nearest", generator: torch.Generator | None = None) -> None:
        """Store ``value`` (this shape) in place, in this weight's format."""
        self._writable()
        if tuple(value.shape) != self._packed_shape:
            raise ValueError(f"write: shape {tuple(value.shape)} != the weight's {self._packed_shape}")
        packed = pack(value, self.format, self.block_size, rounding, generator)
        self.payload.copy_(packed.payload)
        if self.scales is not None:
            self.scales.copy_(packed.scales)
        _bump(self)

    @torch.no_grad()
    def write_range(self, start: int, stop: int, values: torch.Tensor, rounding: str = "nearest",
                    generator: torch.Generator | None = None) -> None:
        """Re-pack elements ``start:stop`` of the flattened weight in place from ``values`` (``stop - start``
        elements); the range must be whole ``write_unit``s (or end at the last element)."""
        self._writable()
        numel = math.prod(self._packed_shape)
        unit = self.write_unit
        if not (0 <= start < stop <= numel) or start % unit or (stop % unit and stop != numel):
            raise ValueError(f"write_range({start}, {stop}): the range must lie in [0, {numel}] and cut the "
                             f"storage at multiples of {unit} elements (whole blocks and bytes)")
        packed = pack(values.reshape(-1), self.format, self.block_size, rounding, generator)
        write_range(self.payload, self.scales, packed, start, stop)
        _bump(self)

    @torch.no_grad()
    def repack(self, format: str, block_size: int | None) -> None:
        """Re-pack in place into another format (round to nearest from the current values): the weight stays the
        same Python object (optimizer state, hooks and tied modules keep it)."""
        self._writable()
        packed = pack(self.dequantize(torch.float32), format, block_size)
        self.payload, self.scales = packed.payload, packed.scales
        self.format, self.block_size = packed.format, packed.block_size
        _bump(self)

    def validate(self) -> None:
        """Raise ValueError unless the storage is what the format stores for the shape and every value is usable
        (finite non-negative scales, no payload code that decodes to NaN or infinity), as ``from_packed`` and
        ``torch.load`` check: for loaders that fill the payload and scales in place (``interop.dcp``)."""
        _check_packed(self.format, self.block_size, self._packed_shape, self.payload, self.scales)

    def mark_written(self) -> None:
        """Record a write made straight into ``payload`` / ``scales`` (a fused optimizer kernel): a backward that
        saved this weight before then raises instead of using stale values, as after ``write``."""
        _bump(self)

    def _writable(self) -> None:
        if self._views:
            raise TypeError("a view of an MVAS weight is read-only; write to the weight itself")

    # ----------------------------------------------------------------------------- tensor subclass protocol
    def __tensor_flatten__(self) -> tuple[list[str], tuple]:
        inner = ["payload"] if self.scales is None else ["payload", "scales"]
        return inner, (self.format, self.block_size, self._packed_shape, self.dtype, self._views)

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], ctx: tuple, outer_size: Any, outer_stride: Any):
        fmt, block, shape, dtype, views = ctx
        return MVASWeight(inner["payload"], inner.get("scales"), fmt, block, shape, dtype, views,
                          outer=(outer_size, outer_stride))

    def _stable_hash_for_caching(self) -> str:
        return repr(self.__tensor_flatten__()[1])

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        block = "" if not get_format(self.format).block_scaled else f", block {self.block_size or 'tensor'}"
        view = ", view" if self._views else ""
        return (f"MVASWeight({self.format}{block}, shape {tuple(self.shape)}, dtype {self.dtype}, "
                f"device {self.device}{view}{', requires_grad' if self.requires_grad else ''})")

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickling (``torch.load``): the state is checked before the weight can be used."""
        self.__dict__.update(state)
        if "_dtype" not in state:  # saved before the attribute existed
            self._dtype = self.dtype
        _check_packed(self.format, self.block_size, self._packed_shape, self.payload, self.scales)

    def __reduce_ex__(self, proto: int):
        if self._views:
            raise TypeError("a view of an MVAS weight cannot be saved; save the weight (or .contiguous())")
        return super().__reduce_ex__(proto)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is _LINEAR and len(args) > 1 and type(args[1]) is MVASWeight:
            out = linear(args[1], args, kwargs)  # one autograd node (macroarch.mvas.packed.linear), where it applies
            if out is not None:
                return out
        if args and isinstance(args[0], MVASWeight):
            if func is torch.Tensor.contiguous:
                return _Dense.apply(args[0])
            if func is torch.Tensor.is_contiguous:
                # no dense memory to read in place: raw writers (safetensors) ask for .contiguous(); FSDP2 shards the
                # storage itself (``sharding``)
                return _SHARDING and not args[0]._views
            if func is torch.Tensor.untyped_storage:
                return args[0].payload.untyped_storage()
            if func is torch.Tensor.data_ptr:
                return args[0].payload.data_ptr()
        with torch_function_disabled():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        first = args[0] if args else None
        if isinstance(first, MVASWeight):
            private = private_aten_ops()  # _compat.subclass: ops with private names (cast, reshape)
            if func in _SHARE:
                return first._derived(first.payload, first.scales, first.dtype, first._views, first)
            if func.is_view or func is private.unsafe_view:  # reshape's op is not flagged as a view
                return first._view(func, args[1:], kwargs)
            if _SHARDING and func in _PACKED_FACTORIES and not first._views:
                packed = first._packed_factory(args[1], kwargs)
                if packed is not None:
                    return packed
            if func is aten.clone.default and not first._views:
                scales = None if first.scales is None else first.scales.clone()
                return first._derived(first.payload.clone(), scales, first.dtype, (), first)
            if func is private.to_copy:
                moved = first._to_copy(kwargs)
                if moved is not None:
                    return moved
            if func is aten.copy_.default:
                return first._copy_from(args[1])
        if func.overloadpacket.__name__ in _LIKE:
            return func(*_map_weights(_shape_only, args), **_map_weights(_shape_only, kwargs))
        if writes(func):
            for value in written_arguments(func, args, kwargs):
                if isinstance(value, MVASWeight):
                    raise TypeError(_unaware_message(f"{func} (an in-place write)", value))
        if not kwargs and not any(isinstance(a, list | tuple) for a in args):  # the common case, without pytree
            return func(*(a.dequantize() if type(a) is MVASWeight else a for a in args))
        return func(*_map_weights(MVASWeight.dequantize, args), **_map_weights(MVASWeight.dequantize, kwargs))

    # ------------------------------------------------------------------------------------ dispatch helpers
    def _derived(self, payload: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype, views: tuple,
                 like: torch.Tensor) -> MVASWeight:
        """Another weight on ``payload`` / ``scales`` whose outer size and strides are ``like``'s."""
        return MVASWeight(payload, scales, self.format, self.block_size, self._packed_shape, dtype, views,
                          outer=(like.shape, like.stride()))

    def _view(self, func: Any, args: tuple, kwargs: dict) -> MVASWeight | list[MVASWeight]:
        # whole blocks of the storage: a weight on a slice of it
        if (func in _STORAGE_VIEWS or func is private_aten_ops().unsafe_view) and not self._views:
            sliced = self._storage_slices(func, args, kwargs)
            if sliced is not None:
                return sliced
        if func is aten.t.default and self.dim() == 2:  # F.linear's, forward and backward: no meta op needed
            view = (func, args, kwargs, None)
            return MVASWeight(self.payload, self.scales, self.format, self.block_size, self._packed_shape,
                              self.dtype, (*self._views, view), outer=(self.shape[::-1], self.stride()[::-1]))
        with modes_disabled():  # shape arithmetic on meta tensors, not ops of the program (tracers, counters)
            meta = func(torch.empty_strided(self.shape, self.stride(), dtype=self.dtype, device="meta"), *args,
                        **kwargs)
        if isinstance(meta, torch.Tensor):
            return self._derived(self.payload, self.scales, self.dtype, (*self._views, (func, args, kwargs, None)),
                                 meta)
        return [self._derived(self.payload, self.scales, self.dtype, (*self._views, (func, args, kwargs, i)), m)
                for i, m in enumerate(meta)]

    def _storage_slices(self, func: Any, args: tuple, kwargs: dict) -> MVASWeight | list[MVASWeight] | None:
        """A view that is a contiguous run of whole blocks (and whole fp4 bytes) of the flat storage, as a weight
        on that run of the payload and scales (writable, no views to replay); None if any piece is not."""
        with modes_disabled():
            meta = func(torch.empty(self._packed_shape, dtype=self.dtype, device="meta"), *args, **kwargs)
        metas = [meta] if isinstance(meta, torch.Tensor) else list(meta)
        pieces = []
        for m in metas:
            start = m.storage_offset()
            piece = self._storage_range(start, start + m.numel(), tuple(m.shape)) if m.is_contiguous() else None
            if piece is None:
                return None
            pieces.append(piece)
        return pieces[0] if isinstance(meta, torch.Tensor) else pieces

    def _storage_range(self, start: int, stop: int, shape: tuple[int, ...]) -> MVASWeight | None:
        """Elements ``start:stop`` of the flat storage as a weight of ``shape`` sharing it; None unless the range
        is whole ``write_unit`` s (the whole tensor when one scale covers it)."""
        numel = math.prod(self._packed_shape)
        if (start, stop) != (0, numel) and (start % self.write_unit or (stop % self.write_unit and stop != numel)
                                            or self.write_unit == numel):
            return None
        fp4 = self.format == "fp4_e2m1"
        payload = self.payload[start // 2:(stop + 1) // 2] if fp4 else self.payload[start:stop]
        scales = self.scales
        if scales is not None and self.block_size is not None:
            scales = scales[start // self.block_size:stop // self.block_size]
        return MVASWeight(payload, scales, self.format, self.block_size, shape, self.dtype)

    def _packed_factory(self, size: Any, kwargs: dict) -> MVASWeight | None:
        """``new_zeros`` / ``new_empty`` while FSDP2 shards (``_SHARDING``): a zero weight of ``size`` in this
        format, or None if ``size`` is not whole blocks (or asks for another dtype or device)."""
        shape = tuple(int(s) for s in size)
        numel = math.prod(shape)
        fmt = get_format(self.format)
        if kwargs.get("dtype") not in (None, self.dtype) or kwargs.get("device") not in (None, self.device):
            return None
        if fmt.block_scaled and (self.block_size is None or numel % self.block_size):
            return None
        payload = torch.zeros((numel + 1) // 2 if fmt.name == "fp4_e2m1" else numel, dtype=fmt.storage_dtype,
                              device=self.device)
        scales = torch.zeros(numel // self.block_size, device=self.device) if fmt.block_scaled else None
        return MVASWeight(payload, scales, self.format, self.block_size, shape, self.dtype)

    # ------------------------------------------------------------------------------------------ FSDP2 hooks
    def fsdp_pre_all_gather(self, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...], module: Any,
                            mp_policy: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        """FSDP2 all-gathers what this returns: the shard's flat payload and (for scaled formats) scales, and the
        metadata ``fsdp_post_all_gather`` needs (format, block size, the unsharded shape)."""
        if self._views:
            raise TypeError(f"FSDP2 all-gathers a view of an MVAS weight ({self!r}); the sharded parameter must be "
                            "the shard itself (shard with macroarch.mvas.interop.fsdp.fully_shard)")
        problem = shard_problem("(sharded)", _unsharded_meta(self, outer_size), mesh.size())
        if problem is not None:  # reached only by sharding through torch's fully_shard without the checks
            raise ValueError(problem)
        inputs = (self.payload,) if self.scales is None else (self.payload, self.scales)
        return inputs, (self.format, self.block_size, tuple(outer_size))

    def fsdp_post_all_gather(self, all_gather_outputs: tuple[torch.Tensor, ...], metadata: Any,
                             param_dtype: torch.dtype, *, out: torch.Tensor | None = None) -> Any:
        """The unsharded weight on the gathered payload and scales (FSDP2 owns their storage: it frees it after use
        and re-fills it at the next all-gather, which the weight, built once, then reads; ``out`` is that weight)."""
        fmt, block, shape = metadata
        if out is not None:
            inner = getattr(out, "payload", None)
            gathered = all_gather_outputs[0].untyped_storage().data_ptr()
            if inner is None or inner.untyped_storage().data_ptr() != gathered:
                raise RuntimeError("FSDP2 re-gathered an MVAS weight into storage the unsharded weight does not read")
            return None
        payload = all_gather_outputs[0].reshape(-1)
        scales = all_gather_outputs[1].reshape(-1) if len(all_gather_outputs) > 1 else None
        unsharded = MVASWeight(payload, scales, fmt, block, shape, param_dtype)
        return unsharded, tuple(t for t in (payload, scales) if t is not None)

    def _to_copy(self, kwargs: dict) -> MVASWeight | None:
        """A cast is a view (same storage, another compute dtype); a device move moves the storage; a copy to
        the same dtype and device copies it. None: not expressible as a weight (a non-float dtype, a layout)."""
        dtype = kwargs.get("dtype") or self.dtype
        device = torch.device(kwargs["device"]) if kwargs.get("device") is not None else self.device
        if not dtype.is_floating_point or kwargs.get("layout") not in (None, torch.strided):
            return None
        if device != self.device:
            scales = None if self.scales is None else self.scales.to(device)
            return self._derived(self.payload.to(device), scales, dtype, self._views, self)
        if dtype != self.dtype:
            return self._derived(self.payload, self.scales, dtype, self._views, self)
        if self._views:
            return None
        scales = None if self.scales is None else self.scales.clone()
        return self._derived(self.payload.clone(), scales, dtype, (), self)

    def _copy_from(self, src: Any) -> MVASWeight:
        self._writable()
        if (isinstance(src, MVASWeight) and not src._views and src.format == self.format
                and _same_blocks(src.block_size, self.block_size, src.numel())
                and src.payload.shape == self.payload.shape):
            self.payload.copy_(src.payload)
            if self.scales is not None:
                self.scales.copy_(src.scales.reshape(self.scales.shape))
            _bump(self)
            return self
        value = src.dequantize(torch.float32) if isinstance(src, MVASWeight) else src
        if not torch.is_tensor(value):
            value = torch.full(self._packed_shape, float(value))
        self.write(value.expand(self.shape).to(self.device), rounding="nearest")
        return self


class _Dense(torch.autograd.Function):
    """``weight -> dense weight``, the gradient passed through (``contiguous()`` of a weight)."""

    @staticmethod
    def forward(ctx: Any, weight: MVASWeight) -> torch.Tensor:  # type: ignore[override]
        return weight.dequantize()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad


def _view_meta(shape: tuple[int, ...], dtype: torch.dtype, views: tuple) -> torch.Tensor:
    with modes_disabled():
        meta = torch.empty(shape, dtype=dtype, device="meta")
        for func, args, kwargs, index in views:
            meta = func(meta, *args, **kwargs)
            if index is not None:
                meta = meta[index]
    return meta


def _shape_only(weight: MVASWeight) -> torch.Tensor:
    return torch.empty_strided(weight.shape, weight.stride(), dtype=weight.dtype, device=weight.device)


def _map_weights(fn: Any, tree: Any) -> Any:
    """``tree`` (an op's arguments: tuples, lists and dicts of values) with ``fn`` applied to every ``MVASWeight``."""
    if type(tree) is MVASWeight:
        return fn(tree)
    if isinstance(tree, tuple | list):
        return type(tree)(_map_weights(fn, x) for x in tree)
    if isinstance(tree, dict):
        return {k: _map_weights(fn, v) for k, v in tree.items()}
    return tree


def _same_blocks(a: int | None, b: int | None, numel: int) -> bool:
    """Whether two block sizes cut ``numel`` elements the same way (one block of ``numel`` is one per tensor)."""
    return (None if a is None or a >= numel else a) == (None if b is None or b >= numel else b)


def _bump(weight: MVASWeight) -> None:
    """Count a write in autograd's version counter: a backward that saved the old value then raises."""
    torch.autograd.graph.increment_version(weight)


def _check_packed(fmt_name: str, block_size: int | None, shape: tuple[int, ...], payload: torch.Tensor,
                  scales: torch.Tensor | None) -> None:
    """Raise ValueError unless payload and scales are what ``format`` stores for ``shape`` (dtypes, sizes, finite
    non-negative scales, no payload code that decodes to NaN or infinity; fake tensors are checked for sizes
    only)."""
    if fmt_name not in FORMATS:
        raise ValueError(f"unknown MVAS format {fmt_name!r}; known: {', '.join(FORMATS)}")
    fmt = FORMATS[fmt_name]
    numel = math.prod(shape)
    payload_numel = (numel + 1) // 2 if fmt.name == "fp4_e2m1" else numel
    if payload.dtype != fmt.storage_dtype or payload.numel() != payload_numel:
        raise ValueError(f"a {fmt.name} weight of shape {tuple(shape)} needs a {fmt.storage_dtype} payload of "
                         f"{payload_numel} elements; got {payload.dtype} with {payload.numel()}")
    if not fmt.block_scaled:
        if scales is not None:
            raise ValueError(f"{fmt.name} stores no scales; got {scales.numel()}")
        _check_codes(fmt.name, shape, payload)
        return
    n_scales = 1 if block_size is None else numel // block_size
    if scales is None or scales.dtype != torch.float32 or scales.numel() != n_scales or (
            block_size is not None and numel % block_size):
        got = "none" if scales is None else f"{scales.numel()} {scales.dtype}"
        raise ValueError(f"a {fmt.name} weight of {numel} elements in blocks of {block_size or numel} needs "
                         f"{n_scales} float32 scales; got {got}")
    bad = bad_scales(scales)
    if bad:
        raise ValueError(f"{bad} of the {n_scales} block scales of a {fmt.name} weight of shape {tuple(shape)} "
                         "are NaN, infinite or negative: the checkpoint is corrupt (refused)")
    _check_codes(fmt.name, shape, payload)


def _check_codes(fmt: str, shape: tuple[int, ...], payload: torch.Tensor) -> None:
    """Raise ValueError if a payload element decodes to NaN or infinity (``nonfinite_codes``)."""
    bad = nonfinite_codes(payload)
    if bad:
        raise ValueError(f"{bad} of the {payload.numel()} payload codes of a {fmt} weight of shape {tuple(shape)} "
                         "decode to NaN or infinity: the checkpoint is corrupt (refused)")


def _refuse_unaware_optimizers(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global step pre-hook: an optimizer that does not declare ``supports_mvas_weights`` must not touch a
    managed weight (it would write dense values into packed storage, or crash in a fused kernel)."""
    if getattr(optimizer, "supports_mvas_weights", False):
        return
    with torch.no_grad():  # a DTensor's to_local() then returns its shard as it is, no autograd node
        shards = [local(p) for group in optimizer.param_groups for p in group["params"]]
    for p in shards:
        if type(p) is MVASWeight:  # a DTensor (FSDP2) holds its shard locally
            raise TypeError(_unaware_message(f"{type(optimizer).__module__}.{type(optimizer).__name__}", p))


@contextlib.contextmanager
def sharding() -> Iterator[None]:
    """While FSDP2 shards managed weights: they report ``is_contiguous()`` (the storage is what is sharded) and
    ``new_zeros`` / ``new_empty`` give packed zero weights (FSDP2's padded shard buffers)."""
    global _SHARDING
    previous = _SHARDING
    _SHARDING = True
    try:
        yield
    finally:
        _SHARDING = previous


def shard_problem(name: str, weight: MVASWeight, world_size: int) -> str | None:
    """Why ``weight`` cannot be sharded on dim 0 over ``world_size`` ranks at whole blocks, or None if it can."""
    what = f"MVAS weight {name!r} ({weight.format}, block {weight.block_size}, shape {tuple(weight.shape)})"
    if weight.is_view:
        return f"{what} is a view; shard the weight itself"
    if weight.dim() == 0 or weight.shape[0] % world_size:
        return (f"{what}: dim 0 must divide evenly over the {world_size} ranks (packed shards cannot be padded); "
                "pick a world size that divides it, or keep this tensor dense in the plan")
    numel = weight.numel()
    shard = numel // world_size
    unit = weight.write_unit
    if world_size > 1 and (unit == numel or shard % unit):
        block = weight.block_size or numel
        return (f"{what}: each rank's shard of {shard} elements must be whole blocks of {block}"
                f"{' and whole bytes' if weight.format == 'fp4_e2m1' else ''}; pick a block size that divides "
                f"{shard} (the shard's row count x row length), or keep this tensor dense in the plan")
    return None


def _unsharded_meta(weight: MVASWeight, shape: torch.Size) -> MVASWeight:
    """A stand-in of the unsharded weight (meta storage) for the shard checks."""
    fmt = get_format(weight.format)
    numel = math.prod(shape)
    payload = torch.empty((numel + 1) // 2 if fmt.name == "fp4_e2m1" else numel, dtype=fmt.storage_dtype,
                          device="meta")
    scales = None
    if fmt.block_scaled:
        scales = torch.empty(1 if weight.block_size is None else numel // weight.block_size, device="meta")
    return MVASWeight(payload, scales, weight.format, weight.block_size, tuple(shape), weight.dtype)


torch.serialization.add_safe_globals([MVASWeight])
_STEP_HOOK = register_optimizer_step_pre_hook(_refuse_unaware_optimizers)
