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

**Compilation.** Shapes are dynamic (``torch.compile(dynamic=True)``): one kernel serves every tensor length, so
a model compiles one kernel per storage combination (weight format and block size, moment format, gradient
dtype, rounding), a handful, not one per tensor; the scalars (learning rate, bias corrections) are graph
inputs, so a new step or LR schedule never recompiles. ``compile_stats()`` reports the seconds spent compiling
(first calls that compiled) apart from the calls that ran. Inductor's on-disk cache (FX graph and C++ code)
makes a second process start fast. ``compile=False`` on a call, or the environment variable
``MACROARCH_COMPILE=0``, runs the eager path. The eager path also runs where a compiled kernel cannot: fake or
meta tensors (memory measurements), under a dispatch mode (memory tracker, op counters), inside a
``torch.compile`` of the model (the same code is traced into the model's graph), on other devices.

**Equality.** Stochastic rounding draws its noise from a counter-based hash (``counter_noise``: integer
arithmetic on the element index, the tensor's key and the step), which the compiler cannot change, so the
noise is bitwise the same compiled and eager and reproducible from the seed. The float arithmetic may be
reordered by Inductor (it decomposes ``lerp`` and ``addcdiv`` and fuses ``addcmul`` into an fma), so compiled
and eager agree on the fp32 update to a few ulps: block scales within 4 ulps, and at most 0.2% of the codes one
grid step apart, where such an ulp crosses a rounding boundary (``tests/mvas/test_kernels.py`` checks these
bounds). The dequantisation is exact either way: compiled equals eager bitwise.

Layout: a kernel sees every input as rows of one static length (whole blocks of the weight and of the moments,
``_rows``), the number of rows symbolic; a tensor whose length is not whole rows, and a weight with one scale for
the whole tensor, take the eager path.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from macroarch.mvas.formats import decode, encode, get_format, noise_bits
from macroarch.optim.functional import adamw_update_

__all__ = ["ENV", "StepSpec", "adamw_step", "compile_enabled", "compile_stats", "counter_noise", "dequantize",
           "reset_compile_stats"]

ENV = "MACROARCH_COMPILE"
"""Set to ``0`` (or ``false``) to run every kernel eagerly."""
_MASK = 0xFFFFFFFF
_RECOMPILE_LIMIT = 64  # storage combinations a process may compile (torch's default of 8 is per function)
_STATS = {"compile_seconds": 0.0, "compiles": 0, "compiled_calls": 0, "eager_calls": 0}
_COMPILED: dict[str, Any] = {}
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
        _STATS[key] = 0.0 if key == "compile_seconds" else 0


# --------------------------------------------------------------------------------------------- noise
def counter_noise(counter: torch.Tensor, numel: int, bits: int) -> torch.Tensor:
    """Uniform int32 noise in ``[0, 2^bits)`` for elements ``counter[1] + i``, i < ``numel``, of the stream
    ``counter[0]`` (int64, a 32-bit key): a hash of the key and the element index (Wellons' lowbias32 with
    multipliers below 2^31, so every product fits in int64). Pure integer arithmetic: bitwise the same eager,
    compiled, on any device, and for any split of a tensor into chunks."""
    index = (torch.arange(numel, dtype=torch.int64, device=counter.device) + counter[1]) & _MASK
    x = (index * 0x61C88647 + counter[0]) & _MASK
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _MASK
    x = x ^ (x >> 16)
    return (x >> (32 - bits)).to(torch.int32)


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
        weight[0].copy_(payload)
        if scales is not None:
            weight[1].copy_(scales.view(weight[1].shape))
    if spec.state_format != "fp32":
        for (payload, scales), value in ((exp_avg, m), (exp_avg_sq, v.sqrt())):
            new_payload, new_scales = encode(value, spec.state_format, spec.state_block)
            payload.copy_(new_payload)
            if new_scales is not None:
                scales.copy_(new_scales.view(scales.shape))


_SOURCES = {"dequantize": _dequantize, "adamw_step": _adamw_step}


# --------------------------------------------------------------------------------------------- dispatch
def _eligible(tensors: list[torch.Tensor | None]) -> bool:
    """Whether a compiled kernel may run on ``tensors`` now (module docstring: where the eager path runs)."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return False
    for t in tensors:
        if t is not None and (t.device.type not in ("cpu", "cuda") or type(t) is not torch.Tensor
                              and not isinstance(t, torch.nn.Parameter) or not t.is_contiguous()):
            return False
    return True


def _rows(t: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """``t`` (contiguous) as ``rows`` rows: every input of a kernel has the same symbolic first dimension and a
    static second one, so the compiled loops see whole blocks without index arithmetic."""
    return None if t is None else t.view(rows, -1)


def _run(name: str, compile: bool | None, tensors: list[torch.Tensor | None], rows: int | None, *args: Any) -> Any:
    source = _SOURCES[name]
    if rows is None or not compile_enabled(compile) or not _eligible(tensors):
        _STATS["eager_calls"] += 1
        return source(*args)
    if name not in _COMPILED:
        _COMPILED[name] = torch.compile(source, dynamic=False, fullgraph=True)
    for t in torch.utils._pytree.tree_leaves(args[:-1]):  # the number of rows is symbolic (one kernel for every
        if isinstance(t, torch.Tensor) and t.dim() == 2:  # size); formats, blocks and row lengths are static
            torch._dynamo.maybe_mark_dynamic(t, 0)
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    start = time.perf_counter()
    # Kernels never need autograd nor tensor subclasses. The same global state for every caller (forward inside
    # MVASWeight's dispatch runs below autograd with subclass torch functions off, backward without grad) keeps
    # one compiled kernel valid for all of them.
    with torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT, capture_scalar_outputs=True,
                                    accumulated_recompile_limit=4 * _RECOMPILE_LIMIT), torch.no_grad(), \
            torch._C._AutoDispatchBelowADInplaceOrView(), torch._C.DisableTorchFunctionSubclass():
        result = _COMPILED[name](*args)
    if counters["stats"]["unique_graphs"] != before:
        _STATS["compile_seconds"] += time.perf_counter() - start
        _STATS["compiles"] += counters["stats"]["unique_graphs"] - before
    _STATS["compiled_calls"] += 1
    return result


def _row_length(*units: int) -> int:
    length = 1
    for unit in units:
        length = math.lcm(length, unit)
    return length


def dequantize(payload: torch.Tensor, scales: torch.Tensor | None, fmt: str, block_size: int | None, numel: int,
               dtype: torch.dtype, *, compile: bool | None = None,
               eager_fallback: bool = True) -> torch.Tensor | None:
    """The ``numel`` stored elements as a flat tensor of ``dtype`` (compiled unless ``compile=False`` or
    ``MACROARCH_COMPILE=0``; module docstring). ``eager_fallback=False``: None where no compiled kernel would
    run (the caller has its own eager path)."""
    info = get_format(fmt)
    length = _row_length(block_size or 1 if info.block_scaled else 1, 2 if fmt == "fp4_e2m1" else 1)
    rows = numel // length if numel % length == 0 and numel >= 2 * length and (
        block_size is not None or not info.block_scaled) else None
    if rows is None or not eager_fallback and not (compile_enabled(compile) and _eligible([payload, scales])):
        return _dequantize(payload, scales, fmt, block_size, dtype) if eager_fallback else None
    return _run("dequantize", compile, [payload, scales], rows, _rows(payload, rows), _rows(scales, rows), fmt,
                block_size, dtype).view(-1)


def adamw_step(grad: torch.Tensor, weight: tuple, master: torch.Tensor | None, exp_avg: tuple, exp_avg_sq: tuple,
               counter: torch.Tensor, scalars: tuple[float, ...], spec: StepSpec, *,
               compile: bool | None = None) -> None:
    """One AdamW step of a flat tensor in its storage, in place (``_adamw_step``; compiled unless
    ``compile=False`` or ``MACROARCH_COMPILE=0``). ``scalars``: ``functional.adamw_scalars(...)``."""
    spec = _SPECS.setdefault(spec, spec)  # one object per storage combination: the compiled kernel's guard
    n = grad.numel()
    units = [2 if "fp4_e2m1" in (spec.weight_format, spec.state_format) else 1]
    if spec.weight_format != "dense" and get_format(spec.weight_format).block_scaled:
        units.append(spec.weight_block or n)
    if spec.state_format != "fp32" and get_format(spec.state_format).block_scaled:
        units.append(spec.state_block or n)
    length = _row_length(*units)
    rows = n // length if n % length == 0 and n >= 2 * length else None
    tensors = [grad, master, *weight, *exp_avg, *exp_avg_sq]
    if rows is None:
        return _run("adamw_step", False, tensors, None, grad, weight, master, exp_avg, exp_avg_sq, counter,
                    scalars, spec)
    if not (compile_enabled(compile) and _eligible(tensors)):
        return _run("adamw_step", False, tensors, None, grad, weight, master, exp_avg, exp_avg_sq, counter,
                    scalars, spec)
    pair = lambda p: tuple(_rows(t, rows) for t in p)  # noqa: E731
    _run("adamw_step", compile, tensors, rows, _rows(grad, rows), pair(weight), _rows(master, rows), pair(exp_avg),
         pair(exp_avg_sq), counter, torch.tensor(scalars, dtype=torch.float64), spec)
