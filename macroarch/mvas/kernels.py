"""Fused MVAS kernels from one Python source: the packed AdamW step and the weight dequantisation (issue 14).

The post's MVAS (section 3.2) reads packed weights on every use and updates packed weights and moments every
step. Written as separate torch ops that is about fifty passes over each tensor; here each is one function of
plain tensor ops that runs eagerly (the reference) or compiled by ``torch.compile`` (Inductor: C++/OpenMP on
CPU, Triton on CUDA), which fuses it into a few loops over the bytes:

- ``dequantize(payload, scales, format, block_size, numel, dtype)``: the dense weight (``formats.decode``, then
  the cast), what ``PackedTensor.dequantize`` and so ``MVASWeight`` use in forward and backward;
- ``adamw_step(grad, weight, master, exp_avg, exp_avg_sq, counter, scalars, spec)``: decode ``m``, ``sqrt(v)``
  and the weight, run ``macroarch.optim.functional.adamw_update_`` (the one AdamW), encode the moments (round
  to nearest) and the weight (stochastic rounding, or nearest from an fp32 master) and write them back in place.

**Compilation, the cache and the guard** (``macroarch.mvas.compiled``): one compiled kernel per storage
combination, not per tensor; ``compile=False`` or ``MACROARCH_COMPILE=0`` runs the eager path, as does any call a
kernel cannot take; the first compiled call of each kernel is checked against the eager path. On CPU, the step of
``MVASAdamW``'s fp8/fp4 storage runs a hand-fused loop: Inductor's bits, 1.4x faster (``macroarch.mvas.native``).

**What the compiled code is made of** (measured on one core, torch 2.14, 2^22 elements per call; the numbers
are in the notes of issue 14). Inductor turns each op into vector code only where ATen's vector library has it:

- the noise hash works in int32 lanes that wrap (int64 lanes took 1.4 of 7.4 ns per element of an fp8 step);
- fp4 codes are built and read with integer shifts and masks (``codecs._round_e2m1``, ``_e2m1_values``; a float
  select and ``torch.signbit`` ran a lane at a time): the fp4 step 246 -> 105 ms per 2^24 elements; an fp4
  dequantisation scales each nibble before interleaving (``codecs._decode_e2m1_rows``: 187 -> 89 us, 172K elements);
- bit casts between float32 and int32 (stochastic rounding, block scales, codes) are vector casts in the kernels'
  C++ (``macroarch.mvas.codegen``; Inductor makes them a lane-by-lane copy through memory): the fp8 step 5.6 ->
  4.6 ns per element, the one with fp4 weights 8.3 -> 6.3 (2^20 elements);
- AVX2's partial vector loads (bytes, bf16) go straight into the register (``codegen``): the AVX2 step 2x faster;
- fp8 conversions are vectorised for AVX-512 only; elsewhere (AVX2) the kernels compute fp8 codes with integer
  arithmetic (``codecs._fp8_codes``, ``_fp8_values``), byte for byte torch's casts (442 -> 377 ms per fp8 step
  under AVX2 here), and the fp8 payloads enter the kernels as their bytes (``_as_bytes``), so that the compiled
  code holds no fp8 value for Inductor to bit-cast a lane at a time through memory (29 -> 21 ns per element);
- Inductor's AVX2 code inverts ``torch.where`` on an int32 comparison with int32 branches (every lane takes the
  wrong branch; AVX-512 is right): the kernels select by masks there instead, and the first-call check below
  caught it before any weight was written;
- the step's new moments are stored once (``_stored_once``), not recomputed by each loop that reads them: 5-10%; so
  is a new weight without a master, as blocks: under AVX2 its block maxima then come from the loop that stores it, not
  from a loop that computed the update again (fp8 e4m3, 2^20 elements, one core: 11.3-12.6 -> 10.2-11.0 ms);
- fp4 values into bf16 are interleaved as one integer lane per pair (``codecs._decode_e2m1_rows``), into float32
  read byte ``i // 2`` for element ``i`` (``_decode_e2m1_elements``; one vector load in ``codegen``), so the step's
  weight decodes in its main loop, not a kernel of its own (fp4 weights, 2^20-2^22 elements, one core: 0.77-0.99 ->
  0.81-1.07 of foreach AdamW's speed); codes are packed by a vectorised int16 loop (``codegen``).
- fp8 e4m3 codes become floats through fp16 in the kernels' C++ (``macroarch.mvas.codegen``: ATen's conversion
  branches on subnormals, and has none from one vector of codes into two of floats, which a read into bf16 needs),
  and a stochastically rounded fp8 weight's code comes from its bits (``codecs._fp8_by_arithmetic``), its sign by
  integer ops (``codecs._round_elementwise``; Inductor called Sleef's ``copysign`` per vector): an fp8 read of a
  672 x 256 weight into bf16 51 -> 30 us, the fp8 step on 8 tensors of 2^21 elements 75-81 -> 66-67 ms (one core).
- element indices are a broadcast plus constant lanes, max/min with a constant one instruction (``codegen``), a block's
  divisor is stored once (Inductor recomputed it per vector: 0.86-0.89 -> 0.91-0.93 of foreach), sqrt(v)'s block maxima
  come from v in the loop that updates it (a pass over the stored sqrt(v) before): ``MVASAdamW``, fp8 weights, 2^20
  elements, one core of a second machine (AVX-512 without AMX), 0.78-0.81 -> 0.97-0.99 of foreach AdamW's speed.

**Equality.** Stochastic rounding draws its noise from a counter-based hash (``counter_noise``: integer
arithmetic on the element index, the tensor's key and the step), which the compiler cannot change, so the
noise is bitwise the same compiled and eager and reproducible from the seed. The float arithmetic may be
reordered by Inductor (it decomposes ``lerp`` and ``addcdiv`` and fuses ``addcmul`` into an fma), so compiled
and eager agree on the fp32 update to a few ulps: block scales within 4 ulps, and codes one grid step apart where
such an ulp crosses a rounding boundary: rare (0.2% at most on random moments), more on a first step from zero
moments with bf16 gradients (up to 0.63% of the sqrt(v) codes measured), whose values sit on rounding midpoints
(the guard allows 2%: ``guard.CODE_FLIPS``; ``tests/mvas/test_kernels.py`` checks these bounds). The
dequantisation is exact either way: compiled equals eager bitwise.

Layout: a kernel sees every input as rows of one static length (whole blocks of the weight and of the moments,
``_rows``), the number of rows symbolic; a tensor whose length is not whole rows, and a weight with one scale for
the whole tensor, take the eager path.
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from macroarch._weak import WeakById, rows_alias
from macroarch.mvas import compiled, native
from macroarch.mvas.codecs import (
    _DTYPE_FORMATS,
    _FP8_DTYPES,
    _software_fp8,
    _stored_once,
    cast,
    decode,
    encode,
    get_format,
    noise_bits,
)
from macroarch.mvas.compiled import (
    ENV,
    _eligible,
    _row_length,
    _rows,
    compile_enabled,
    compile_stats,
    reset_compile_stats,
    run,
    vec_isa,
)
from macroarch.mvas.noise import counter_noise, stream_key, stream_key_from, stream_prefix  # noqa: F401 (public here)
from macroarch.optim.functional import adamw_update_

__all__ = ["ENV", "MIN_COMPILED_DEQUANTIZE", "StepSpec", "adamw_step", "compile_enabled", "compile_stats",
           "counter_noise", "dequantize", "prepared_step", "reset_compile_stats", "vec_isa"]

MIN_COMPILED_DEQUANTIZE = 8192
"""Below this many elements a dequantisation runs eagerly unless ``compile=True``: a compiled call costs ~70 us before
any work (one core: fp8, 4096 elements 73 us compiled, 37 eager; 16384: 74, 98). Steps compile at every size."""
_SPECS: dict[StepSpec, StepSpec] = {}
_last_scalars: tuple[bytes, torch.Tensor] | None = None  # the last compiled step's scalars: ``_scalars_tensor``
# payload -> (scales, (format, block, numel, dtype), kernel key, kernel args, the verified direct call bound to them or
# None) of its last compiled dequantisation: a weight read every step skips rebuilding them (~40 us of Python a call)
_PLANNED: WeakById = WeakById()
# stored weight (payload) -> (its last compiled step's plan: scales, master, moments, spec, gradient dtype by identity,
# device and size by value; rows; stored tensors as rows; kernel key): ~30 of ~40 us of Python a step call otherwise
_STEP_PLANNED: WeakById = WeakById()
# Both are weak on the payload and hold its rows as ``rows_alias``es, never as views (a view keeps its base alive).


# --------------------------------------------------------------------------------------------- kernels
def _dequantize(payload: torch.Tensor, scales: torch.Tensor | None, fmt: str, block_size: int | None,
                dtype: torch.dtype) -> torch.Tensor:
    if scales is None and payload.is_floating_point():  # bf16 / fp16 / fp32: a cast
        return cast(payload, dtype)
    numel = payload.numel() * 2 if fmt == "fp4_e2m1" else payload.numel()
    return decode(payload, scales, fmt, block_size, numel, dtype)


@dataclass(frozen=True)
class StepSpec:
    """How one tensor's weight and moments are stored (static: each distinct spec is one compiled kernel).

    Attributes:
        weight_format: ``"dense"`` (a plain parameter, any float dtype) or an MVAS format name.
        weight_block: the weight's block size (None: unscaled, or one scale per tensor).
        stochastic: round the packed weight stochastically (else to nearest).
        master: the weight is an fp32 master copy (updated in place), packed to nearest after.
        state_format: ``"fp32"`` (dense moments) or the moments' format (``m`` and ``sqrt(v)``).
        state_block: the moments' block size.
        v_floor: smallest positive value of the moments' format at scale 1 (a ``sqrt(v)`` that underflowed
            reads back as its block's scale times this).
    """

    weight_format: str
    weight_block: int | None
    stochastic: bool
    master: bool
    state_format: str
    state_block: int | None
    v_floor: float


def _adamw_step(grad: torch.Tensor, weight: tuple, master: torch.Tensor | None, exp_avg: tuple,
                exp_avg_sq: tuple, counter: torch.Tensor, scalars: tuple | torch.Tensor, spec: StepSpec) -> None:
    """One packed AdamW step of a tensor (see the module docstring); ``weight``, ``exp_avg`` and ``exp_avg_sq``
    are ``(payload, scales)`` pairs, all flat or all rows of whole blocks (``_rows``), written in place;
    ``scalars`` the values of ``functional.adamw_scalars``: Python floats (eager), or the float64 tensor of them a
    compiled kernel takes as an argument (read back as symbolic numbers: a new step or LR does not recompile)."""
    if isinstance(scalars, torch.Tensor):
        decay, _, beta2, sq_weight, eps, neg_step_size, bias_correction2_sqrt = (scalars[i].item() for i in range(7))
        avg_weight = scalars[1].float()  # a tensor: lerp branches on its weight
    else:
        decay, avg_weight, beta2, sq_weight, eps, neg_step_size, bias_correction2_sqrt = scalars
    n = grad.numel()
    g = grad.float()
    if spec.state_format == "fp32":
        m, v = exp_avg[0], exp_avg_sq[0]  # dense fp32 moments: updated in place
    else:
        m = decode(exp_avg[0], exp_avg[1], spec.state_format, spec.state_block, n)
        root = decode(exp_avg_sq[0], exp_avg_sq[1], spec.state_format, spec.state_block, n)
        if exp_avg_sq[1] is not None and spec.state_block is not None:  # sqrt(v) underflowed: its block's floor
            lead = root.shape[:-1]  # (..., n_blocks, block)
            floor = exp_avg_sq[1].view(*lead, -1) * spec.v_floor
            root = torch.maximum(root.view(*lead, -1, spec.state_block), floor[..., None]).view(root.shape)
        v = root * root
    if master is not None:
        w = master
    elif spec.weight_format == "dense":
        w = weight[0] if weight[0].dtype == torch.float32 else weight[0].float()
    else:
        # fp4 by pairs without AVX-512 (element by element, Inductor's AVX2 step is 2x slower: codecs' docstring)
        w = decode(weight[0], weight[1], spec.weight_format, spec.weight_block, n, by_pairs=_software_fp8(grad))
    adamw_update_(w, g, m, v, decay, avg_weight, beta2, sq_weight, eps, neg_step_size, bias_correction2_sqrt)
    if spec.weight_format == "dense":
        if weight[0].dtype != torch.float32 or master is not None:
            weight[0].copy_(w)
    else:
        noise = None
        if spec.stochastic and master is None and get_format(spec.weight_format).storage_dtype != torch.float32:
            noise = counter_noise(counter, n, noise_bits(spec.weight_format)).view(w.shape)
        if master is None and spec.weight_block is not None and get_format(spec.weight_format).block_scaled:
            w = _stored_once(w.view(*w.shape[:-1], -1, spec.weight_block)).view(w.shape)
        payload, scales = encode(w, spec.weight_format, spec.weight_block, noise)
        weight[0].copy_(_as_stored(payload, weight[0]))
        if scales is not None:
            weight[1].copy_(scales.view(weight[1].shape))
    if spec.state_format != "fp32":
        # sqrt(v)'s block maxima as the roots of v's (the same values: sqrt is monotonic, v >= +0), from the loop that
        # updates v: over the stored sqrt(v) they took a pass of their own (module docstring)
        root_max = None if spec.state_block is None else \
            v.view(*v.shape[:-1], -1, spec.state_block).amax(dim=-1).sqrt()
        for (payload, scales), value, absmax in ((exp_avg, _stored_once(m), None),
                                                 (exp_avg_sq, _stored_once(v.sqrt()), root_max)):
            new_payload, new_scales = encode(value, spec.state_format, spec.state_block, absmax=absmax)
            payload.copy_(_as_stored(new_payload, payload))
            if new_scales is not None:
                scales.copy_(new_scales.view(scales.shape))


def _as_stored(codes: torch.Tensor, payload: torch.Tensor) -> torch.Tensor:
    """New fp8 ``codes`` as the bytes of a ``payload`` passed as uint8 (``_as_bytes``), else as they are."""
    return codes.view(torch.uint8) if payload.dtype == torch.uint8 and codes.dtype in _FP8_DTYPES else codes


def _as_bytes(payload: torch.Tensor | None) -> torch.Tensor | None:
    """An fp8 payload as its bytes (a uint8 view) where the compiled kernels compute fp8 codes by integer
    arithmetic (CPUs without AVX-512, ``codecs._fp8_by_arithmetic``): there Inductor bit-casts fp8 to uint8 and
    back a lane at a time through memory, and the kernel then holds no fp8 value at all (measured under AVX2, one
    core, 2^22 elements: an fp8 step 29.3 -> 21.1 ns per element, dense weights with fp8 moments 21.5 -> 15.8)."""
    if payload is None or payload.dtype not in _FP8_DTYPES or not _software_fp8(payload):
        return payload
    return payload.view(torch.uint8)


compiled.register("dequantize", _dequantize)
compiled.register("adamw_step", _adamw_step, native.step_kernel)


def dequantize(payload: torch.Tensor, scales: torch.Tensor | None, fmt: str, block_size: int | None, numel: int,
               dtype: torch.dtype, *, compile: bool | None = None,
               eager_fallback: bool = True) -> torch.Tensor | None:
    """The ``numel`` stored elements as a flat tensor of ``dtype`` (compiled unless ``compile=False`` or
    ``MACROARCH_COMPILE=0``, or, with ``compile=None``, fewer than ``MIN_COMPILED_DEQUANTIZE`` elements; module
    docstring). ``eager_fallback=False``: None where no compiled kernel would run (the caller has its own eager
    path)."""
    planned = _PLANNED.get(payload)
    if (planned is not None and planned[0] is scales and planned[1] == (fmt, block_size, numel, dtype)
            and compile_enabled(compile) and compiled._unwatched()):  # the planned tensors were _eligible
        kept = _kept_call(planned)
        if kept is not None:
            return kept.view(-1)
        return run("dequantize", planned[3][0].shape[0], planned[3], (payload, scales, fmt, block_size, dtype),
                   key=planned[2]).view(-1)
    info = get_format(fmt)
    length = _row_length(block_size or 1 if info.block_scaled else 1, 2 if fmt == "fp4_e2m1" else 1)
    # unscaled formats (bf16, fp16): one cast, faster than a compiled call (fp16 to bf16, 64K elements: 29 vs 216 us)
    rows = numel // length if numel % length == 0 and numel >= 2 * length and (
        block_size is not None and info.block_scaled) else None
    if rows is None or not (compile_enabled(compile) and (compile or numel >= MIN_COMPILED_DEQUANTIZE)
                            and _eligible([payload, scales])):
        if not eager_fallback:
            return None
        compiled._STATS["eager_calls"] += rows is not None
        return _dequantize(payload, scales, fmt, block_size, dtype)
    args = (_rows(_as_bytes(payload), rows), _rows(scales, rows), fmt, block_size, dtype)
    key = ("dequantize", compiled._signature(args))
    result = run("dequantize", rows, args, (payload, scales, fmt, block_size, dtype), key=key).view(-1)
    if numel >= MIN_COMPILED_DEQUANTIZE:  # what the next call on this storage needs (below: eager unless compile=True)
        kept = (rows_alias(_as_bytes(payload), rows), rows_alias(scales, rows), fmt, block_size, dtype)
        verdict = compiled._VERIFIED.get(key)
        direct = (verdict, verdict.bind(kept)) if isinstance(verdict, compiled._Direct) else None
        _PLANNED[payload] = (scales, (fmt, block_size, numel, dtype), key, kept, direct)
    return result


def planned_read(payload: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """``dequantize``'s kept direct call for ``payload`` (as rows), for a caller that owns the storage (an
    ``MVASWeight``: its format, block size and length go with its payload), or None where ``dequantize`` must
    decide: the shortest path of a weight read, which runs twice per layer and step (measured: 2-3 us of Python
    less a read in a tight loop, 5-6 times that between a model's matmuls)."""
    planned = _PLANNED.get(payload)
    if planned is None or planned[0] is not scales or planned[1][3] is not dtype or not compile_enabled() \
            or not compiled._unwatched():
        return None
    return _kept_call(planned)


def _kept_call(planned: tuple) -> torch.Tensor | None:
    """The result of a ``_PLANNED`` entry's bound direct call while its kernel stays verified as that call, else
    None (no call made)."""
    direct = planned[4]
    if direct is None or compiled._VERIFIED.get(planned[2]) is not direct[0]:
        return None
    compiled._STATS["compiled_calls"] += 1
    return direct[1]()


def canonical_spec(spec: StepSpec) -> StepSpec:
    """The one ``StepSpec`` object equal to ``spec`` (the compiled kernel guards on its identity)."""
    return _SPECS.setdefault(spec, spec)


def _step_rows(spec: StepSpec, n: int) -> int | None:
    """Rows of whole blocks (of the weight and the moments, and whole fp4 bytes) that ``n`` elements make, or None
    where they do not divide (the eager path)."""
    units = [2 if "fp4_e2m1" in (spec.weight_format, spec.state_format) else 1]
    if spec.weight_format != "dense" and get_format(spec.weight_format).block_scaled:
        units.append(spec.weight_block or n)
    if spec.state_format != "fp32" and get_format(spec.state_format).block_scaled:
        units.append(spec.state_block or n)
    length = _row_length(*units)
    return n // length if n % length == 0 and n >= 2 * length else None


def adamw_step(grad: torch.Tensor, weight: tuple, master: torch.Tensor | None, exp_avg: tuple, exp_avg_sq: tuple,
               counter: torch.Tensor, scalars: tuple[float, ...], spec: StepSpec, *,
               compile: bool | None = None) -> None:
    """One AdamW step of a flat tensor in its storage, in place (``_adamw_step``; compiled unless
    ``compile=False`` or ``MACROARCH_COMPILE=0``). ``scalars``: ``functional.adamw_scalars(...)``."""
    spec = canonical_spec(spec)
    flat = (grad, weight, master, exp_avg, exp_avg_sq, counter, scalars, spec)
    same = (weight[1], master, *exp_avg, *exp_avg_sq, spec, grad.dtype)  # what a kept plan must see again (identity)
    planned = _STEP_PLANNED.get(weight[0])
    key = None
    if (planned is not None and all(map(operator.is_, planned[0], same)) and planned[1] == (grad.device, grad.numel())
            and compile_enabled(compile) and compiled._unwatched() and type(grad) is torch.Tensor
            and grad.is_contiguous()):
        rows, stored, key = planned[2:]  # the same stored tensors (_eligible then) and spec: only the gradient is new
    else:
        rows = _step_rows(spec, grad.numel())
        if rows is None or not (compile_enabled(compile)
                                and _eligible([grad, master, *weight, *exp_avg, *exp_avg_sq])):
            return run("adamw_step", None, flat)
        pair = lambda p: tuple(rows_alias(_as_bytes(t), rows) for t in p)  # noqa: E731
        stored = (pair(weight), rows_alias(master, rows), pair(exp_avg), pair(exp_avg_sq))
    args = (_rows(grad, rows), *stored, counter, _scalars_tensor(tuple(scalars)), spec)
    if key is None:
        key = ("adamw_step", compiled._signature(args))
        _STEP_PLANNED[weight[0]] = (same, (grad.device, grad.numel()), rows, stored, key)
    run("adamw_step", rows, args, flat, _step_written, key=key)


def prepared_step(weight: tuple, spec: StepSpec) -> Callable[..., None] | None:
    """The compiled step that last ran on ``weight``'s storage (``adamw_step``), its stored tensors bound:
    ``call(grad_rows, counter, scalars_tensor)`` runs the next step of the same tensors straight into its direct
    call (the caller checks that the gradient is a plain contiguous tensor of ``call.grad_dtype`` and that
    ``call.current()``), skipping the planning ``adamw_step`` repeats on every call (measured: 30 fp8/fp4 tensors of
    4096 elements, one core, 3.1 ms a step against 1.2 ms for the kernel calls alone). None where that step did not
    run through a verified direct call."""
    planned = _STEP_PLANNED.get(weight[0])
    if planned is None or planned[0][-2] is not spec:
        return None
    same, _, rows, stored, key = planned
    verdict = compiled._VERIFIED.get(key)
    if isinstance(verdict, native.NativeStep):
        return native.prepared(verdict, stored, rows, same[-1], lambda: compiled._VERIFIED.get(key) is verdict)
    if not isinstance(verdict, compiled._Direct):
        return None
    leaves = compiled._leaves((None, *stored, None, None, spec))  # the leaves of adamw_step's kernel arguments
    moving = (0, len(leaves) - 3, len(leaves) - 2)  # the gradient rows, the counter, the scalars tensor
    template: list[Any] = []
    slots: list[tuple[int, int]] = []
    for position, (index, dim) in enumerate(verdict.plan):
        if dim is not None:
            template.append(rows)  # every argument has ``rows`` rows
        elif index in moving:
            template.append(None)
            slots.append((position, moving.index(index)))
        else:
            template.append(leaves[index])
    invoke, stats = verdict.invoke, compiled._STATS

    def call(*given: torch.Tensor) -> None:
        inputs = template.copy()
        for position, which in slots:
            inputs[position] = given[which]
        invoke(inputs)
        stats["compiled_calls"] += 1

    call.rows, call.grad_dtype = rows, same[-1]  # type: ignore[attr-defined]
    call.current = lambda: compiled._VERIFIED.get(key) is verdict  # type: ignore[attr-defined]
    return call


def _scalars_tensor(scalars: tuple[float, ...]) -> torch.Tensor:
    """``scalars`` as the float64 tensor a compiled step reads them from: the last call's tensor when they are the
    same bits (every tensor of a parameter group steps with the same scalars, and the kernels only read them)."""
    global _last_scalars
    key, last = struct.pack(f"{len(scalars)}d", *scalars), _last_scalars  # one read: another thread may replace it
    if last is not None and last[0] == key:
        return last[1]
    tensor = torch.tensor(scalars, dtype=torch.float64)
    _last_scalars = (key, tensor)
    return tensor


def _step_written(args: tuple) -> list[tuple[torch.Tensor | None, str]]:
    """What a step (``args`` of the compiled kernel) writes in place, with the format each holds."""
    spec, weight, state = args[-1], args[1], args[-1].state_format
    weight_format = _DTYPE_FORMATS.get(weight[0].dtype, "fp32") if spec.weight_format == "dense" else \
        spec.weight_format
    return [(weight[0], weight_format), (weight[1], "fp32"), (args[2], "fp32"),
            (args[3][0], state), (args[3][1], "fp32"), (args[4][0], state), (args[4][1], "fp32")]
