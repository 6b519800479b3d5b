"""Fused MVAS kernels from one Python source: the packed AdamW step and the weight dequantisation.

The post's MVAS (section 3.2) reads packed weights on every use and updates packed weights and moments every
step. Written as separate torch ops that is about fifty passes over each tensor; here each is one function of
plain tensor ops that runs eagerly (the reference) or compiled by ``torch.compile`` (``runner``), which fuses it
into a few loops over the bytes:

- ``dequantize(payload, scales, format, block_size, numel, dtype)``: the dense weight (``codecs.codes.decode``,
  then the cast), what ``PackedTensor.dequantize`` and so ``MVASWeight`` use in forward and backward;
- ``adamw_step(grad, weight, master, exp_avg, exp_avg_sq, counter, scalars, spec)``: decode ``m``, ``sqrt(v)``
  and the weight, run ``macroarch.optim.functional.adamw_update_`` (the one AdamW), encode the moments (round
  to nearest) and the weight (stochastic rounding, or nearest from an fp32 master) and write them back in place.

The source is written for the compiler as much as for the reader, so that every op has vector code: the codecs
round with float ops and pack fp4 nibbles as int64 lanes (``macroarch.mvas.codecs.codes``), fp4 payloads enter the
step as int32 words, the noise hash works in int32 lanes on element indices the step passes in (row starts plus
lanes), and on CPUs without AVX-512 fp8 payloads enter the kernels as their bytes (``as_bytes``).

**Equality.** Stochastic rounding draws its noise from a counter-based hash (``counter_noise``: integer
arithmetic on the element index, the tensor's key and the step), which the compiler cannot change, so the
noise is bitwise the same compiled and eager and reproducible from the seed. The float arithmetic may be
reordered by Inductor (it decomposes ``lerp`` and ``addcdiv`` and fuses ``addcmul`` into an fma), so compiled
and eager agree on the fp32 update to a few ulps: block scales within 4 ulps, and codes one grid step apart where
such an ulp crosses a rounding boundary, rare except on a first step from zero moments with bf16 gradients, whose
values sit on rounding midpoints (the guard allows 2%: ``guard.CODE_FLIPS``; ``tests/mvas/_kernels`` checks these
bounds). Everything else, decoding, block maxima, rounding and encoding, is exact: the dequantisation, and a step
whose update is exact in any order, are compiled bitwise the eager source.

Layout: a kernel sees every input as rows of one static length (whole blocks of the weight and of the moments),
the number of rows symbolic; a tensor whose length is not whole rows, and a weight with one scale for the whole
tensor, take the eager path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from macroarch.mvas._kernels import runner
from macroarch.mvas._kernels.runner import ENV, compile_enabled, compile_stats, eligible, reset_compile_stats, run
from macroarch.mvas.codecs.codes import FP8_DTYPES, cast, decode, encode, noise_bits, software_fp8
from macroarch.mvas.codecs.formats import DTYPE_FORMATS, get_format
from macroarch.mvas.codecs.noise import counter_noise
from macroarch.optim.functional import adamw_update_

__all__ = ["ENV", "MIN_COMPILED_DEQUANTIZE", "StepSpec", "adamw_step", "as_bytes", "canonical_spec", "compile_enabled",
           "compile_stats", "dequantize", "reset_compile_stats"]

MIN_COMPILED_DEQUANTIZE = 8192
"""Below this many elements a dequantisation runs eagerly unless ``compile=True``: a compiled call has a fixed cost
before any work that an eager decode of a small tensor does not. Steps compile at every size."""
_SPECS: dict[StepSpec, StepSpec] = {}


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
                exp_avg_sq: tuple, counter: torch.Tensor, positions: tuple | None, scalars: tuple | torch.Tensor,
                spec: StepSpec) -> None:
    """One packed AdamW step of a tensor (see the module docstring); ``weight``, ``exp_avg`` and ``exp_avg_sq``
    are ``(payload, scales)`` pairs, all flat or all rows of whole blocks (fp4 payloads as int32 words), written in
    place; ``positions`` None (flat), or, for rows, each row's first element index (rows, 1) and ``arange`` of the row
    length, the element indices ``counter_noise`` hashes as row start plus lane; ``scalars`` the values of
    ``functional.adamw_scalars``: Python floats (eager), or the float64 tensor of them a compiled kernel takes as an
    argument (read back as symbolic numbers: a new step or LR does not recompile)."""
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
            index = None if positions is None else positions[0] + positions[1]
            noise = counter_noise(counter, n, noise_bits(spec.weight_format), index).view(w.shape)
        payload, scales = encode(w, spec.weight_format, spec.weight_block, noise, words=_words(weight[0]))
        weight[0].copy_(_as_stored(payload, weight[0]))
        if scales is not None:
            weight[1].copy_(scales.view(weight[1].shape))
    if spec.state_format != "fp32":
        # sqrt(v)'s block maxima as the roots of v's (the same values: sqrt is monotonic, v >= +0), from the loop that
        # updates v rather than a pass of their own over the stored sqrt(v)
        root_max = None if spec.state_block is None else \
            v.view(*v.shape[:-1], -1, spec.state_block).amax(dim=-1).sqrt()
        for (payload, scales), value, absmax in ((exp_avg, m, None), (exp_avg_sq, v.sqrt(), root_max)):
            new_payload, new_scales = encode(value, spec.state_format, spec.state_block, absmax=absmax,
                                             words=_words(payload))
            payload.copy_(_as_stored(new_payload, payload))
            if new_scales is not None:
                scales.copy_(new_scales.view(scales.shape))


def _words(payload: torch.Tensor) -> bool:
    """Whether ``payload`` is an fp4 payload passed as int32 words (``adamw_step``)."""
    return payload.dtype == torch.int32


def _as_stored(codes: torch.Tensor, payload: torch.Tensor) -> torch.Tensor:
    """New fp8 ``codes`` as the bytes of a ``payload`` passed as uint8 (``as_bytes``), else as they are."""
    return codes.view(torch.uint8) if payload.dtype == torch.uint8 and codes.dtype in FP8_DTYPES else codes


def as_bytes(payload: torch.Tensor | None) -> torch.Tensor | None:
    """An fp8 payload as its bytes (a uint8 view) where the compiled kernels compute fp8 codes by integer
    arithmetic (CPUs without AVX-512, ``codecs.codes._fp8_by_arithmetic``): there Inductor bit-casts fp8 to uint8
    and back a lane at a time through memory, and the kernel then holds no fp8 value at all."""
    if payload is None or payload.dtype not in FP8_DTYPES or not software_fp8(payload):
        return payload
    return payload.view(torch.uint8)


def _whole_words(payload: torch.Tensor) -> bool:
    """Whether an fp4 payload (bytes) can be viewed as int32 words: at a 4-byte offset, whole words."""
    return payload.storage_offset() % 4 == 0 and payload.numel() % 4 == 0


_POSITIONS: dict[tuple[int, int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _positions(rows: int, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(arange(rows)[:, None] * width, arange(width))`` as int32 on ``device``, made once per size (the step's
    ``positions``): inputs the compiled loop loads, where an ``arange`` in the kernel is built one lane at a time."""
    key = (rows, width, device)
    if key not in _POSITIONS:
        _POSITIONS[key] = (torch.arange(rows, dtype=torch.int32, device=device)[:, None] * width,
                           torch.arange(width, dtype=torch.int32, device=device))
    return _POSITIONS[key]


runner.register("dequantize", _dequantize)
runner.register("adamw_step", _adamw_step)


def dequantize(payload: torch.Tensor, scales: torch.Tensor | None, fmt: str, block_size: int | None, numel: int,
               dtype: torch.dtype, *, compile: bool | None = None,
               eager_fallback: bool = True) -> torch.Tensor | None:
    """The ``numel`` stored elements as a flat tensor of ``dtype`` (compiled unless ``compile=False`` or
    ``MACROARCH_COMPILE=0``, or, with ``compile=None``, fewer than ``MIN_COMPILED_DEQUANTIZE`` elements; module
    docstring). ``eager_fallback=False``: None where no compiled kernel would run (the caller has its own eager
    path)."""
    info = get_format(fmt)
    length = math.lcm(block_size or 1 if info.block_scaled else 1, 2 if fmt == "fp4_e2m1" else 1)
    # unscaled formats (bf16, fp16) are one cast, which a compiled call does not beat
    rows = numel // length if numel % length == 0 and numel >= 2 * length and (
        block_size is not None and info.block_scaled) else None
    if rows is None or not (compile_enabled(compile) and (compile or numel >= MIN_COMPILED_DEQUANTIZE)
                            and eligible([payload, scales])):
        if not eager_fallback:
            return None
        return run("dequantize", None, (payload, scales, fmt, block_size, dtype))
    args = (as_bytes(payload).view(rows, -1), scales.view(rows, -1), fmt, block_size, dtype)
    return run("dequantize", rows, args, (payload, scales, fmt, block_size, dtype)).view(-1)


def canonical_spec(spec: StepSpec) -> StepSpec:
    """The one ``StepSpec`` object equal to ``spec`` (the compiled kernel guards on its identity)."""
    return _SPECS.setdefault(spec, spec)


def _step_rows(spec: StepSpec, n: int) -> int | None:
    """Rows of whole blocks (of the weight and the moments, and whole fp4 bytes) that ``n`` elements make, or None
    where they do not divide (the eager path)."""
    units = [8 if "fp4_e2m1" in (spec.weight_format, spec.state_format) else 1]  # fp4: whole int32 words
    if spec.weight_format != "dense" and get_format(spec.weight_format).block_scaled:
        units.append(spec.weight_block or n)
    if spec.state_format != "fp32" and get_format(spec.state_format).block_scaled:
        units.append(spec.state_block or n)
    length = math.lcm(*units)
    return n // length if n % length == 0 and n >= 2 * length else None


def adamw_step(grad: torch.Tensor, weight: tuple, master: torch.Tensor | None, exp_avg: tuple, exp_avg_sq: tuple,
               counter: torch.Tensor, scalars: tuple[float, ...], spec: StepSpec, *,
               compile: bool | None = None) -> None:
    """One AdamW step of a flat tensor in its storage, in place (``_adamw_step``; compiled unless
    ``compile=False`` or ``MACROARCH_COMPILE=0``). ``scalars``: ``functional.adamw_scalars(...)``."""
    spec = canonical_spec(spec)
    flat = (grad, weight, master, exp_avg, exp_avg_sq, counter, None, tuple(scalars), spec)
    rows = _step_rows(spec, grad.numel())
    # fp4 payloads enter as int32 words, whose nibbles the kernel packs and unpacks whole lanes at a time
    # (codecs.codes._pack_words)
    words = [p for p, fmt in ((weight[0], spec.weight_format), (exp_avg[0], spec.state_format),
                              (exp_avg_sq[0], spec.state_format)) if fmt == "fp4_e2m1"]
    if rows is None or not (compile_enabled(compile) and eligible([grad, master, *weight, *exp_avg, *exp_avg_sq])
                            and all(map(_whole_words, words))):
        return run("adamw_step", None, flat)

    def as_rows(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        return (t.view(torch.int32) if any(t is p for p in words) else as_bytes(t)).view(rows, -1)

    args = (as_rows(grad), tuple(map(as_rows, weight)), as_rows(master), tuple(map(as_rows, exp_avg)),
            tuple(map(as_rows, exp_avg_sq)), counter, _positions(rows, grad.numel() // rows, grad.device),
            torch.tensor(tuple(scalars), dtype=torch.float64), spec)
    run("adamw_step", rows, args, flat, _step_written)


def _step_written(args: tuple) -> list[tuple[torch.Tensor | None, str]]:
    """What a step (``args`` of the compiled kernel) writes in place, with the format each holds."""
    spec, weight, state = args[-1], args[1], args[-1].state_format
    weight_format = DTYPE_FORMATS.get(weight[0].dtype, "fp32") if spec.weight_format == "dense" else \
        spec.weight_format
    return [(weight[0], weight_format), (weight[1], "fp32"), (args[2], "fp32"),
            (args[3][0], state), (args[3][1], "fp32"), (args[4][0], state), (args[4][1], "fp32")]
