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

**Compilation.** The number of rows is dynamic (``maybe_mark_dynamic``): one kernel serves every tensor length, so
a model compiles one kernel per storage combination (weight format and block size, moment format, gradient
dtype, rounding), a handful, not one per tensor; the scalars (learning rate, bias corrections) are graph
inputs, so a new step or LR schedule never recompiles. ``compile_stats()`` reports the seconds spent compiling
(first calls that compiled) apart from the calls that ran. Inductor's on-disk cache (FX graph and C++ code)
makes a second process start fast. ``compile=False`` on a call, or the environment variable
``MACROARCH_COMPILE=0``, runs the eager path. The eager path also runs where a compiled kernel cannot: fake or
meta tensors (memory measurements), under a dispatch mode (memory tracker, op counters), inside a
``torch.compile`` of the model (the same code is traced into the model's graph), on other devices. A
dequantisation of fewer than ``MIN_COMPILED_DEQUANTIZE`` elements runs eagerly too, where that is faster.

**What the compiled code is made of** (measured on one core, torch 2.14, 2^22 elements per call; the numbers
are in the notes of issue 14). Inductor turns each op into vector code only where ATen's vector library has it:

- the noise hash works in int32 lanes that wrap (int64 lanes took 1.4 of 7.4 ns per element of an fp8 step);
- fp4 codes are built and read with integer shifts and masks (``formats._round_e2m1``, ``_e2m1_bits``): a
  select on floats and ``torch.signbit`` were evaluated a lane at a time, 9.2 ns per element for the encoding
  alone, now 1.3; the fp4 step went from 246 to 105 ms per 2^24 elements, the fp8 one's speed;
- fp8 conversions are vectorised for AVX-512 only; elsewhere (AVX2) the kernels compute fp8 codes with integer
  arithmetic (``formats._fp8_codes``, ``_fp8_values``), byte for byte torch's casts (442 -> 377 ms per fp8 step
  under AVX2 here);
- Inductor's AVX2 code inverts ``torch.where`` on an int32 comparison with int32 branches (every lane takes the
  wrong branch; AVX-512 is right): the kernels select by masks there instead, and the first-call check below
  caught it before any weight was written.

**Equality.** Stochastic rounding draws its noise from a counter-based hash (``counter_noise``: integer
arithmetic on the element index, the tensor's key and the step), which the compiler cannot change, so the
noise is bitwise the same compiled and eager and reproducible from the seed. The float arithmetic may be
reordered by Inductor (it decomposes ``lerp`` and ``addcdiv`` and fuses ``addcmul`` into an fma), so compiled
and eager agree on the fp32 update to a few ulps: block scales within 4 ulps, and at most 0.2% of the codes one
grid step apart, where such an ulp crosses a rounding boundary (``tests/mvas/test_kernels.py`` checks these
bounds). The dequantisation is exact either way: compiled equals eager bitwise.

**The cache and the CPU's vector ISA.** Inductor's FX graph cache stores the generated C++ source, whose loops
are tiled for the vector width ``pick_vec_isa()`` chose at code generation (a step of 16 floats for AVX-512, 8 for
AVX2), but on CPU its key holds no ISA (``CacheBase.get_system`` hashes only GPU properties; torch 2.14). The source
is then built with the flags of the loading process's ISA. AVX-512 code built for AVX2 stores one 8-lane
``Vectorized<float>`` per 16-element step: half the output is never written (measured: elements 8-15 of every 16,
garbage or NaN: the non-finite weights of notebook 05 under ``ATEN_CPU_CAPABILITY=avx2`` with a cache filled by
an AVX-512 run); AVX2 code built for AVX-512 stores 16 lanes per 8-element step, past the end of the buffer
(measured: ``malloc(): unaligned tcache chunk detected``). No op of ``decode`` is miscompiled: with a fresh cache
the compiled kernels are exact under either ISA. The same class of omission, for the thread count, is pytorch
issues #160812 and #167463 (fixed by PRs #184444, #185312); PR #195354 gates ``aot_compile`` artifacts on the
resolved ISA for this reason; PR #123514 made ``pick_vec_isa`` honour ``ATEN_CPU_CAPABILITY``. Fix: the kernels
compile with ``cpp.simdlen`` pinned to the picked ISA's width (``_inductor_options``), a config value that is part
of the cache key and selects the same ISA, so each width gets its own entry. Other ``torch.compile`` calls in a
process (a compiled model) keep the exposure: one cache directory per ISA avoids it.

**Guard.** A miscompile on some other ISA, compiler or torch version must not corrupt a user's weights silently:
the first compiled call of each kernel (``_signature``: static arguments, dtypes, row lengths) in a process is
checked against the eager path on the same inputs. The dequantisation compares bitwise; the step runs compiled
on copies of what it writes and eagerly on the caller's tensors (written once, by the reference), and compares
within the bounds above (fp32 within 2^-16, codes: at most 1 in 500 one grid step apart). On a mismatch it warns
once, naming the kernel, ``vec_isa()`` and what differed, and that kernel runs eagerly for the rest of the process.
Cost, once per kernel: an eager run, copies and a comparison (measured at 2^20 elements, one loaded core: 0.18 s
for an fp8 step, against 7 ms compiled; 9 ms for an fp8 dequantisation); ``compile_stats()`` reports
``checks``, ``check_seconds`` and ``mismatches``.

Layout: a kernel sees every input as rows of one static length (whole blocks of the weight and of the moments,
``_rows``), the number of rows symbolic; a tensor whose length is not whole rows, and a weight with one scale for
the whole tensor, take the eager path.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from macroarch.mvas.formats import (_DTYPE_FORMATS, _FP8_DTYPES, _NATIVE_FP8, _e2m1_byte_table, cast, decode, encode,
                                    get_format, noise_bits)
from macroarch.optim.functional import adamw_update_

__all__ = ["ENV", "StepSpec", "adamw_step", "compile_enabled", "compile_stats", "counter_noise", "dequantize",
           "reset_compile_stats", "vec_isa"]

ENV = "MACROARCH_COMPILE"
"""Set to ``0`` (or ``false``) to run every kernel eagerly."""
MIN_COMPILED_DEQUANTIZE = 8192
"""Below this many elements a dequantisation runs eagerly unless ``compile=True``: a compiled call costs about 70 us
before any work (dynamo's guards and Inductor's wrapper; measured, one core: fp8 4096 elements 73 us compiled
against 37 eager, 16384: 74 against 98). The step is compiled at every size (4096 elements: 170 against 503 us)."""
_MASK = 0xFFFFFFFF
_GOLDEN = 0x61C88647  # 2^32 / golden ratio (negated): spreads consecutive indices over the 32 bits
_LOWBIAS = (0x7FEB352D, 0x846CA68B - (1 << 32))  # lowbias32's multipliers, the second as a signed int32
_RECOMPILE_LIMIT = 64  # storage combinations a process may compile (torch's default of 8 is per function)
_STATS = {"compile_seconds": 0.0, "compiles": 0, "compiled_calls": 0, "eager_calls": 0, "checks": 0,
          "check_seconds": 0.0, "mismatches": 0}
_GUARD = True  # check the first compiled call of each kernel against the eager path (``_check``)
_VERIFIED: dict[tuple, bool] = {}  # kernel (``_signature``) -> its first compiled call matched eager
_COMPILED: dict[str, Any] = {}
_DEVICES = ("cpu", "cuda")
_SPECS: dict[StepSpec, StepSpec] = {}


def compile_enabled(compile: bool | None = None) -> bool:
    """``compile`` if given, else whether ``MACROARCH_COMPILE`` allows it (default: yes)."""
    if compile is not None:
        return bool(compile)
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def compile_stats() -> dict[str, float]:
    """Seconds spent in calls that compiled (``compile_seconds``), how many compiled (``compiles``), and the
    calls that ran compiled or eager since the process started (or ``reset_compile_stats``)."""
    return dict(_STATS)


def reset_compile_stats() -> None:
    for key in _STATS:
        _STATS[key] = 0.0 if key.endswith("_seconds") else 0


# --------------------------------------------------------------------------------------------- noise
def counter_noise(counter: torch.Tensor, numel: int, bits: int) -> torch.Tensor:
    """Uniform int32 noise in ``[0, 2^bits)`` for elements ``counter[1] + i``, i < ``numel``, of the stream
    ``counter[0]`` (int64, a 32-bit key): Wellons' lowbias32 hash of the key and the element index, in int32
    arithmetic that wraps (two's complement, as torch's int32 ops and the compiled loops both do; the logical
    shifts are arithmetic shifts masked). Pure integer arithmetic: bitwise the same eager, compiled, on any device,
    and for any split of a tensor into chunks. Int32, not int64: a vector of int32 lanes multiplies in one
    instruction (64-bit lanes need three, or a scalar loop on AVX2), which made this hash a fifth of the step."""
    key = counter.to(torch.int32)  # (stream key, first element index), wrapped to int32
    x = (torch.arange(numel, dtype=torch.int32, device=counter.device) + key[1]) * _GOLDEN + key[0]
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * _LOWBIAS[0]
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * _LOWBIAS[1]
    x = x ^ ((x >> 16) & 0xFFFF)
    return (x >> (32 - bits)) & ((1 << bits) - 1)


def stream_key(*parts: int) -> int:
    """A 32-bit stream key from integers (seed, tensor index, step): splitmix64 over them."""
    h = 0
    for part in parts:
        h = (h + 0x9E3779B97F4A7C15 + (int(part) & 0xFFFFFFFFFFFFFFFF)) & 0xFFFFFFFFFFFFFFFF
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & _MASK


# --------------------------------------------------------------------------------------------- kernels
def _dequantize(payload: torch.Tensor, scales: torch.Tensor | None, fmt: str, block_size: int | None,
                dtype: torch.dtype) -> torch.Tensor:
    if scales is None and payload.is_floating_point():  # bf16 / fp16 / fp32: a cast
        return cast(payload, dtype)
    numel = payload.numel() * 2 if fmt == "fp4_e2m1" else payload.numel()
    return decode(payload, scales, fmt, block_size, numel).to(dtype)


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
        w = decode(weight[0], weight[1], spec.weight_format, spec.weight_block, n)
    adamw_update_(w, g, m, v, decay, avg_weight, beta2, sq_weight, eps, neg_step_size, bias_correction2_sqrt)
    if spec.weight_format == "dense":
        if weight[0].dtype != torch.float32 or master is not None:
            weight[0].copy_(w)
    else:
        noise = None
        if spec.stochastic and master is None and get_format(spec.weight_format).storage_dtype != torch.float32:
            noise = counter_noise(counter, n, noise_bits(spec.weight_format)).view(w.shape)
        payload, scales = encode(w, spec.weight_format, spec.weight_block, noise)
        weight[0].copy_(_as_stored(payload, weight[0]))
        if scales is not None:
            weight[1].copy_(scales.view(weight[1].shape))
    if spec.state_format != "fp32":
        for (payload, scales), value in ((exp_avg, m), (exp_avg_sq, v.sqrt())):
            new_payload, new_scales = encode(value, spec.state_format, spec.state_block)
            payload.copy_(_as_stored(new_payload, payload))
            if new_scales is not None:
                scales.copy_(new_scales.view(scales.shape))


def _as_stored(codes: torch.Tensor, payload: torch.Tensor) -> torch.Tensor:
    """New fp8 ``codes`` as the bytes of a ``payload`` passed as uint8 (``_as_bytes``), else as they are."""
    return codes.view(torch.uint8) if payload.dtype == torch.uint8 and codes.dtype in _FP8_DTYPES else codes


def _as_bytes(payload: torch.Tensor | None) -> torch.Tensor | None:
    """An fp8 payload as its bytes (a uint8 view) where the compiled kernels compute fp8 codes by integer
    arithmetic (CPUs without AVX-512, ``formats._fp8_by_arithmetic``): there Inductor bit-casts fp8 to uint8 and
    back a lane at a time through memory, and the kernel then holds no fp8 value at all (measured under AVX2, one
    core, 2^22 elements: an fp8 step 24.2 -> 19.4 ns per element, dense weights with fp8 moments 18.5 -> 15.4)."""
    if payload is None or payload.dtype not in _FP8_DTYPES or _NATIVE_FP8 or payload.device.type != "cpu":
        return payload
    return payload.view(torch.uint8)


_SOURCES = {"dequantize": _dequantize, "adamw_step": _adamw_step}


# --------------------------------------------------------------------------------------------- dispatch
def _eligible(tensors: list[torch.Tensor | None]) -> bool:
    """Whether a compiled kernel may run on ``tensors`` now (module docstring: where the eager path runs)."""
    if torch._C._len_torch_dispatch_stack() or torch.compiler.is_compiling():
        return False
    for t in tensors:
        if t is None:
            continue
        kind = type(t)
        if kind is not torch.Tensor and kind is not torch.nn.Parameter or t.device.type not in _DEVICES \
                or not t.is_contiguous():
            return False
    return True


def _rows(t: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """``t`` (contiguous) as ``rows`` rows: every input of a kernel has the same symbolic first dimension and a
    static second one, so the compiled loops see whole blocks without index arithmetic."""
    return None if t is None else t.view(rows, -1)


def _inductor_options() -> dict[str, Any]:
    """Inductor options for the kernels: ``cpp.simdlen`` pinned to the vector width Inductor picks in this process
    (the user's own ``cpp.simdlen`` if set), so that it is part of the FX graph cache key (module docstring:
    the cache and the CPU's vector ISA). It changes no generated code: Inductor picks the same ISA by that width."""
    from torch._inductor import config as inductor_config
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    if inductor_config.cpp.simdlen is not None:
        return {"cpp.simdlen": inductor_config.cpp.simdlen}
    isa = pick_vec_isa()
    return {"cpp.simdlen": isa.bit_width() if isa else 1}  # 1: no vectorisation (no vector ISA here)


def vec_isa() -> str:
    """The CPU vector ISA Inductor compiles the kernels for in this process (``pick_vec_isa``, which honours
    ``ATEN_CPU_CAPABILITY``)."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return str(pick_vec_isa()) or "none"


def _signature(args: tuple) -> tuple:
    """What makes a distinct compiled kernel: the static arguments, and the dtype, device and row length (not the
    number of rows, which is symbolic) of every tensor (args are tensors, None, static values and tuples of them)."""
    parts: list[Any] = []
    for a in args:
        for leaf in a if type(a) is tuple else (a,):
            if isinstance(leaf, torch.Tensor):
                parts.append((leaf.dtype, leaf.device.type, leaf.shape[1] if leaf.dim() == 2 else tuple(leaf.shape)))
            else:
                parts.append(leaf)
    return tuple(parts)


@functools.cache
def _dynamo_patch() -> Any:
    """The dynamo config the kernels compile under, built once (building one costs a class) and entered on every
    call (a ContextVar stack: re-entrant and thread-safe)."""
    return torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT, capture_scalar_outputs=True,
                                      accumulated_recompile_limit=4 * _RECOMPILE_LIMIT)


def _compiled(name: str, args: tuple, mark: bool = True) -> Any:
    """Call the compiled kernel ``name``; ``mark``: mark the row dimensions dynamic (needed until the kernel of this
    signature has compiled: after that its graph's row count is symbolic and any tensor passes its guards), and
    run under the dynamo config patch. The dequantisation's graph has no ``.item()``, so once its signature has
    compiled it runs without the patch (entering it is a fifth of a small kernel's call: 27 of 165 us measured)."""
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(_SOURCES[name], dynamic=False, fullgraph=True, options=_inductor_options())
    if mark:
        for t in torch.utils._pytree.tree_leaves(args[:-1]):  # the number of rows is symbolic (one kernel for every
            if isinstance(t, torch.Tensor) and t.dim() == 2:  # size); formats, blocks and row lengths are static
                torch._dynamo.maybe_mark_dynamic(t, 0)
    from torch._dynamo.utils import counters

    graphs = counters["stats"]
    before = graphs["unique_graphs"]
    start = time.perf_counter()
    # Kernels never need autograd nor tensor subclasses. The same global state for every caller (forward inside
    # MVASWeight's dispatch runs below autograd with subclass torch functions off, backward without grad) keeps
    # one compiled kernel valid for all of them.
    with _dynamo_patch() if mark or name != "dequantize" else contextlib.nullcontext(), torch.no_grad(), \
            torch._C._AutoDispatchBelowADInplaceOrView(), torch._C.DisableTorchFunctionSubclass():
        result = _COMPILED[name](*args)
    if graphs["unique_graphs"] != before:
        _STATS["compile_seconds"] += time.perf_counter() - start
        _STATS["compiles"] += graphs["unique_graphs"] - before
    _STATS["compiled_calls"] += 1
    return result


def _run(name: str, rows: int | None, args: tuple, eager_args: tuple | None = None, written: Any = None) -> Any:
    """Run kernel ``name`` compiled on ``args`` (rows), or, ``rows`` None (the caller found that no compiled kernel
    may run: ``compile_enabled``, ``_eligible``), eagerly on ``eager_args`` (default ``args``). The first compiled
    call of each kernel (``_signature``) in a process is checked against the eager path (``_check``); ``written``: a
    function of ``args`` giving the tensors the step writes in place with their formats, None for the
    dequantisation."""
    source = _SOURCES[name]
    eager_args = args if eager_args is None else eager_args
    if rows is None:
        _STATS["eager_calls"] += 1
        return source(*eager_args)
    key = (name, _signature(args))
    verdict = _VERIFIED.get(key)
    if verdict:
        return _compiled(name, args, mark=False)
    if verdict is False:  # this kernel differed from the eager path in this process: eager from then on
        _STATS["eager_calls"] += 1
        return source(*eager_args)
    if _GUARD:
        return _check(name, key, args, eager_args, None if written is None else written(args))
    return _compiled(name, args)


def _check(name: str, key: tuple, args: tuple, eager_args: tuple, written: list[tuple[Any, str]] | None) -> Any:
    """The first compiled call of a kernel: the compiled kernel runs on copies of what it writes, the eager path on
    the caller's tensors (so they are written once, by the reference), and the two results are compared (the
    dequantisation bitwise, the step within the bounds of the module docstring). A mismatch warns once and
    sends this kernel to the eager path for the rest of the process."""
    start = time.perf_counter()
    if written is None:
        result = _compiled(name, args)
        start = time.perf_counter()  # the compiled call is the caller's own; the check costs the rest
        expected = _SOURCES[name](*eager_args).view(result.shape)
        problem = _bitwise_difference(result, expected)
        result = expected
    else:
        copies = {id(t): t.clone() for t, _ in written if t is not None}
        swap = lambda t: copies.get(id(t), t) if isinstance(t, torch.Tensor) else t  # noqa: E731
        compiled_args = torch.utils._pytree.tree_map(swap, args)
        lap = time.perf_counter()
        _compiled(name, compiled_args)
        start += time.perf_counter() - lap
        result = _SOURCES[name](*eager_args)
        _STATS["eager_calls"] += 1
        problem = None
        for t, fmt in written:
            if t is not None and problem is None:
                problem = _step_difference(copies[id(t)], t, fmt)
    _STATS["check_seconds"] += time.perf_counter() - start
    _STATS["checks"] += 1
    _VERIFIED[key] = problem is None
    if problem is not None:
        _STATS["mismatches"] += 1
        spec = args[-1] if name == "adamw_step" else "format {}, block {}, {}".format(*args[2:5])
        warnings.warn(f"macroarch.mvas.kernels: the compiled {name} kernel for {spec} differs from the eager path "
                      f"on vector ISA {vec_isa()!r} ({problem}); this process runs that kernel eagerly from now on. "
                      "A stale Inductor cache (TORCHINDUCTOR_CACHE_DIR) written under another ISA is one cause.",
                      RuntimeWarning, stacklevel=4)
    return result


def _bitwise_difference(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """None if ``got`` is ``want`` bit for bit (any NaN matching any NaN), else what differs."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"got {got.dtype} {tuple(got.shape)}, expected {want.dtype} {tuple(want.shape)}"
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    same = (got.view(ints) == want.view(ints)) | (got.isnan() & want.isnan())
    if bool(same.all()):
        return None
    bad = (~same).view(-1).nonzero()[0, 0]
    return (f"{int((~same).sum())} of {same.numel()} values not bitwise equal, the first at index {int(bad)}: "
            f"{float(got.view(-1)[bad])!r} instead of {float(want.view(-1)[bad])!r}")


def _grid_values(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    """Stored codes as the (unscaled) values they stand for, float32: fp4 bytes as their two nibbles, fp8 bytes
    (``_as_bytes``) as fp8."""
    if fmt == "fp4_e2m1":
        return _e2m1_byte_table(codes.device)[codes.long()].view(-1)
    if codes.dtype == torch.uint8 and get_format(fmt).storage_dtype in _FP8_DTYPES:
        codes = codes.view(get_format(fmt).storage_dtype)
    return codes.float().view(-1)


def _step_difference(got: torch.Tensor, want: torch.Tensor, fmt: str) -> str | None:
    """None if what the compiled step wrote (``got``) matches the eager step (``want``) within the bounds of the
    module docstring, else what differs. fp32 (masters, scales, dense moments): within 2^-16 of the value or of
    the tensor's largest magnitude; codes: at most 1 in 500 (and 2) differ, each by at most one grid step."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{fmt}: got {got.dtype} {tuple(got.shape)}, expected {want.dtype} {tuple(want.shape)}"
    if fmt == "fp32":
        g, w = got.view(-1), want.view(-1)
        finite = w.isfinite()
        scale = float(w[finite].abs().max()) if bool(finite.any()) else 0.0
        ok = ((g - w).abs() <= 2.0 ** -16 * (w.abs() + scale)) | (g.isnan() & w.isnan()) | (g == w)
        if bool(ok.all()):
            return None
        bad = (~ok).nonzero()[0, 0]
        return (f"fp32: {int((~ok).sum())} of {ok.numel()} values beyond 2^-16 relative, the first at index "
                f"{int(bad)}: {float(g[bad])!r} instead of {float(w[bad])!r}")
    info = get_format(fmt)
    g, w = _grid_values(got, fmt), _grid_values(want, fmt)
    differ = (g.view(torch.int32) != w.view(torch.int32)) & ~(g.isnan() & w.isnan())
    count = int(differ.sum())
    if count == 0:
        return None
    floor = 2.0 ** (2 - 2 ** (info.exponent_bits - 1))  # the smallest normal: the subnormals' spacing below it
    spacing = torch.minimum(g.abs(), w.abs()).clamp(min=floor) * 2.0 ** -info.mantissa_bits
    far = differ & ~((g - w).abs() <= spacing * 1.0001)
    if count <= 2e-3 * differ.numel() + 2 and not bool(far.any()):
        return None
    bad = (far if bool(far.any()) else differ).nonzero()[0, 0]
    return (f"{fmt}: {count} of {differ.numel()} codes differ ({int(far.sum())} by more than one grid step), the "
            f"first at element {int(bad)}: {float(g[bad])!r} instead of {float(w[bad])!r}")


def _row_length(*units: int) -> int:
    length = 1
    for unit in units:
        length = math.lcm(length, unit)
    return length


def dequantize(payload: torch.Tensor, scales: torch.Tensor | None, fmt: str, block_size: int | None, numel: int,
               dtype: torch.dtype, *, compile: bool | None = None,
               eager_fallback: bool = True) -> torch.Tensor | None:
    """The ``numel`` stored elements as a flat tensor of ``dtype`` (compiled unless ``compile=False`` or
    ``MACROARCH_COMPILE=0``, or, with ``compile=None``, fewer than ``MIN_COMPILED_DEQUANTIZE`` elements; module
    docstring). ``eager_fallback=False``: None where no compiled kernel would run (the caller has its own eager
    path)."""
    info = get_format(fmt)
    length = _row_length(block_size or 1 if info.block_scaled else 1, 2 if fmt == "fp4_e2m1" else 1)
    # unscaled formats (bf16, fp16) are one cast, which torch runs faster than a compiled call (measured: fp16 to
    # bf16, 64K elements, 29 us against 216 us; Inductor converts fp16 to bf16 a lane at a time)
    rows = numel // length if numel % length == 0 and numel >= 2 * length and (
        block_size is not None and info.block_scaled) else None
    if rows is None or not (compile_enabled(compile) and (compile or numel >= MIN_COMPILED_DEQUANTIZE)
                            and _eligible([payload, scales])):
        if not eager_fallback:
            return None
        _STATS["eager_calls"] += rows is not None
        return _dequantize(payload, scales, fmt, block_size, dtype)
    return _run("dequantize", rows, (_rows(_as_bytes(payload), rows), _rows(scales, rows), fmt, block_size, dtype),
                (payload, scales, fmt, block_size, dtype)).view(-1)


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
    rows = _step_rows(spec, grad.numel())
    flat = (grad, weight, master, exp_avg, exp_avg_sq, counter, scalars, spec)
    if rows is None or not (compile_enabled(compile) and _eligible([grad, master, *weight, *exp_avg, *exp_avg_sq])):
        return _run("adamw_step", None, flat)
    pair = lambda p: tuple(_rows(_as_bytes(t), rows) for t in p)  # noqa: E731
    args = (_rows(grad, rows), pair(weight), _rows(master, rows), pair(exp_avg), pair(exp_avg_sq), counter,
            torch.tensor(scalars, dtype=torch.float64), spec)
    _run("adamw_step", rows, args, flat, _step_written)


def _step_written(args: tuple) -> list[tuple[torch.Tensor | None, str]]:
    """What a step (``args`` of the compiled kernel) writes in place, with the format each holds."""
    spec, weight, state = args[-1], args[1], args[-1].state_format
    weight_format = _DTYPE_FORMATS.get(weight[0].dtype, "fp32") if spec.weight_format == "dense" else \
        spec.weight_format
    return [(weight[0], weight_format), (weight[1], "fp32"), (args[2], "fp32"),
            (args[3][0], state), (args[3][1], "fp32"), (args[4][0], state), (args[4][1], "fp32")]
