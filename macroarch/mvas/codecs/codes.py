"""The element arithmetic of the MVAS storage formats: rounding (nearest and stochastic), fp8 and fp4 codes, and
``encode`` / ``decode``, pure functions of tensors that ``macroarch.mvas.packed`` runs eagerly and
``macroarch.mvas._kernels`` compiles with ``torch.compile`` (one source for both).

**Stochastic rounding** (``rounding="stochastic"``): a value between the two neighbouring representable values
lo < x < hi goes to hi with probability (x - lo) / (hi - lo), so E[q(x)] = x for every x in range. It is done on
float32 bit patterns: a uniform integer added below the kept mantissa bits carries into them with exactly that
probability (the subnormal range uses floor(x / spacing + u)); the result is a value the format represents, then
cast. Values beyond bf16/fp16's finite range round to nearest (torch's cast: inf); scaled formats never exceed their
range. ``pack`` draws the noise from an explicit ``torch.Generator``; the compiled step draws it from a counter-based
hash (``macroarch.mvas.codecs.noise``).

**Why integer arithmetic.** Several codes are computed from float32 bit patterns with shifts and masks instead of
torch's casts, selects or ``torch.signbit``: those compile to vector code on every CPU, where the others do not
(ATen's vector library converts fp8 a lane at a time without AVX-512). Each such path gives the bytes of torch's own
cast (``tests/mvas/codecs`` checks every code and the rounding boundaries), so results never depend on the path.
"""

from __future__ import annotations

import sys

import torch

from macroarch.mvas.codecs.formats import SCALE_DTYPE, Format, get_format, is_fake

__all__ = ["FP8_DTYPES", "cast", "decode", "draw_noise", "e2m1_byte_table", "encode", "noise_bits", "software_fp8"]

_E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# ------------------------------------------------------------------------------------------------ rounding
def noise_bits(fmt: str | Format) -> int:
    """Random bits one stochastic rounding into ``fmt`` uses per element: the float32 mantissa bits it drops."""
    return 23 - get_format(fmt).mantissa_bits


def draw_noise(numel: int, fmt: str | Format, generator: torch.Generator | None,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """Uniform int32 noise in ``[0, 2^noise_bits(fmt))`` for ``numel`` elements, drawn from ``generator``."""
    return torch.randint(0, 1 << noise_bits(fmt), (numel,), generator=generator, device=device, dtype=torch.int32)


def _stochastic_magnitude(a: torch.Tensor, mantissa_bits: int, min_exponent: int, noise: torch.Tensor) -> torch.Tensor:
    """``a`` (float32, >= 0) rounded stochastically to ``mantissa_bits`` bits of mantissa, exponents down to
    ``min_exponent`` (below it the spacing is fixed, as for subnormals): the result is one of the two
    neighbouring representable values, the upper one with probability (a - lo) / (hi - lo).

    In the normal range, adding a uniform integer in [0, 2^k) (``noise``, int32), k = 23 - mantissa_bits, to the
    float32 bit pattern and clearing the low k bits rounds up exactly when the noise carries past the kept bits,
    which happens with probability (dropped bits) / 2^k = (a - lo) / (hi - lo); a carry into the exponent gives
    the next power of two, the correct upper neighbour. Below 2^min_exponent the spacing is
    2^(min_exponent - mantissa_bits): floor(a / spacing + u) * spacing, u uniform in [0, 1), with the same noise.
    """
    shift = 23 - mantissa_bits
    bits = a.view(torch.int32)
    q = ((bits + noise) & ~((1 << shift) - 1)).view(torch.float32)
    spacing = 2.0 ** (min_exponent - mantissa_bits)
    # a / spacing, as a product where 1 / spacing is a float32 (a power of two: exactly the same value, and a
    # multiply is a fraction of a divide's cost); bf16's 2^133 is not, so it divides
    scaled = a * (1.0 / spacing) if spacing > 2.0 ** -126 else a / spacing
    small = torch.floor(scaled + noise.float() * (1.0 / (1 << shift))) * spacing
    return torch.where(a < 2.0 ** min_exponent, small, q)


_SIGN = -(1 << 31)  # the float32 sign bit, as an int32


def _round_half_even(bits: torch.Tensor, shift: int) -> torch.Tensor:
    """Float32 bit patterns (int32, finite, >= 0 but for ``_bf16_bits``' sign) rounded to nearest, ties to even, at
    ``shift`` dropped mantissa bits: add half a step less one plus the kept lowest bit, clear the dropped bits (a carry
    into the exponent is the next binade)."""
    return (bits + ((1 << (shift - 1)) - 1) + ((bits >> shift) & 1)) & ~((1 << shift) - 1)


def _round_elementwise(y: torch.Tensor, fmt: Format, noise: torch.Tensor | None) -> torch.Tensor:
    """``y`` (float32) rounded to ``fmt.storage_dtype``: torch's cast (``noise`` None), or stochastic between
    the neighbours (``_stochastic_magnitude``, then torch's cast of a value it represents exactly)."""
    dtype = fmt.storage_dtype
    if dtype in FP8_DTYPES and _fp8_by_arithmetic(y, stochastic=noise is not None):
        return _fp8_codes(y, fmt, noise).view(dtype)
    if noise is None or dtype == torch.float32:
        return y.to(dtype)
    a = y.abs()
    min_exponent = 2 - 2 ** (fmt.exponent_bits - 1)  # 1 - bias
    q = _stochastic_magnitude(a, fmt.mantissa_bits, min_exponent, noise)
    q = torch.where(a > fmt.max_normal, a, q)  # out of range (bf16/fp16 only): torch's cast
    # y's sign on q (>= 0) by two integer ops (torch.copysign's bits), which compile to plain vector code
    return (q.view(torch.int32) | (y.view(torch.int32) & _SIGN)).view(torch.float32).to(dtype)


# ------------------------------------------------------------------------------------------------ fp8 by arithmetic
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# the CPU capability ATen dispatches to (it honours ATEN_CPU_CAPABILITY, as Inductor's vector ISA does), read once
# here: the check runs while torch.compile traces, where it must be a constant
_NATIVE_FP8 = "AVX512" in torch.backends.cpu.get_cpu_capability()


def software_fp8(t: torch.Tensor) -> bool:
    """Whether ``t`` lives where ATen's vector library has no fp8 conversion: a CPU without AVX-512."""
    return t.device.type == "cpu" and not _NATIVE_FP8


def _fp8_by_arithmetic(t: torch.Tensor, stochastic: bool = False) -> bool:
    """Whether fp8 codes are computed with integer arithmetic (``_fp8_codes``, ``_fp8_values``) instead of torch's
    casts: only while ``torch.compile`` traces, for a CPU whose vector ISA has no fp8 conversion in ATen's vector
    library (AVX-512 has one), and on every CPU for a ``stochastic`` rounding, whose value is already on the fp8 grid,
    so the code is a shift of its bits. Both give the same bytes, so results do not depend on the choice."""
    return torch.compiler.is_compiling() and (software_fp8(t) or (stochastic and t.device.type == "cpu"))


def _fp8_codes(y: torch.Tensor, fmt: Format, noise: torch.Tensor | None) -> torch.Tensor:
    """``y`` (float32, |y| <= the format's max) as fp8 codes (uint8): the bytes of torch's cast (round to nearest,
    ties to even; NaN to 0x7F with y's sign), or rounded stochastically (``_stochastic_magnitude``), from the bits:
    the magnitude is rounded on the float32 pattern (normal range) or on the subnormal spacing, and a representable
    magnitude q has the code ``(bits(q) >> (23 - m)) - ((127 - bias) << m)`` (normal) or ``q / spacing``."""
    m, bias = fmt.mantissa_bits, 2 ** (fmt.exponent_bits - 1) - 1
    shift, spacing = 23 - m, 2.0 ** (1 - bias - m)
    a = y.abs()
    if noise is None:
        bits = a.view(torch.int32)
        q = _round_half_even(bits, shift).view(torch.float32)
        q = torch.where(a < 2.0 ** (1 - bias), torch.round(a * (1.0 / spacing)) * spacing, q)
    else:
        q = _stochastic_magnitude(a, m, 1 - bias, noise)
    qbits = q.view(torch.int32)
    code = torch.where(q < 2.0 ** (1 - bias), (q * (1.0 / spacing)).to(torch.int32),
                       (qbits >> shift) - ((127 - bias) << m))
    sign = (y.view(torch.int32) >> 24) & 0x80
    return torch.where(y != y, sign | 0x7F, code | sign).to(torch.uint8)  # NaN (never stored: inputs are finite)


def _fp8_values(codes: torch.Tensor, fmt: Format) -> torch.Tensor:
    """fp8 ``codes`` (uint8) as float32, the values of torch's cast: normal codes by placing the exponent and
    mantissa bits, subnormal ones as code * spacing; e4m3fn's 0x7F is NaN, e5m2's top exponent inf and NaN."""
    m, bias = fmt.mantissa_bits, 2 ** (fmt.exponent_bits - 1) - 1
    c = codes.to(torch.int32)
    magnitude = c & 0x7F
    normal = ((magnitude << (23 - m)) + ((127 - bias) << 23)).view(torch.float32)
    value = torch.where(magnitude < (1 << m), magnitude.to(torch.float32) * 2.0 ** (1 - bias - m), normal)
    if fmt.name == "fp8_e4m3":
        value = torch.where(magnitude == 0x7F, float("nan"), value)
    else:
        value = torch.where(magnitude > 0x7C, float("nan"), torch.where(magnitude == 0x7C, float("inf"), value))
    return torch.where(c >= 0x80, -value, value)


def _round_e2m1(y: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
    """``y`` (float32, |y| <= 6) as e2m1 codes (uint8, 0..15; bit 3 the sign). e2m1 is a float with 1 mantissa bit,
    exponents 0..2 and subnormal spacing 0.5, so rounding is that of ``_stochastic_magnitude`` (or, ``noise`` None,
    half to even on the same grid); a grid value q's code is 2q below 1, else 2 * (exponent + 1) + mantissa bit."""
    a = y.abs()
    if noise is None:
        q = _round_half_even(a.view(torch.int32), 22).view(torch.float32)  # 1 mantissa bit
        q = torch.where(a < 1.0, torch.round(a * 2.0) * 0.5, q)  # spacing 0.5 below 1; torch.round: half to even
    else:
        q = _stochastic_magnitude(a, 1, 0, noise)
    qbits = q.clamp(max=6.0).view(torch.int32)
    # from the bits, no float select: for q >= 1 the exponent and the mantissa bit, (qbits >> 22) - 252, is the code
    # (1 -> 2, ..., 6 -> 7); below, that is negative (clamped to 0) and q = 0.5, the one other value, is code 1.
    # The sign: bit 31 of y, moved to bit 3 (an arithmetic shift keeps it). Integer lanes only, which compile to vector
    # code (float selects and torch.signbit do not).
    code = ((qbits >> 22) - 252).clamp(min=0) | ((qbits >> 23) == 126).to(torch.int32)
    return (code | ((y.view(torch.int32) >> 28) & 8)).to(torch.uint8)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Two codes per byte along the last dimension (a flat tensor of odd length gets one zero nibble)."""
    if codes.dim() == 1 and codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    if codes.is_contiguous() and sys.byteorder == "little":
        # the pair (2i, 2i + 1) read as one int16 is code_2i + 256 * code_2i+1: no stride-2 access (which a
        # compiled loop cannot vectorise), the same bytes as codes[0::2] | codes[1::2] << 4
        pairs = codes.view(torch.int16)
        return ((pairs & 0x0F) | ((pairs >> 4) & 0xF0)).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def encode(x: torch.Tensor, fmt: str | Format, block_size: int | None, noise: torch.Tensor | None = None,
           absmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The storage of ``x`` (float32, finite for scaled formats) in ``fmt``: ``(payload, scales)``, blocks cut
    along the last dimension (flat for ``pack``; rows of whole blocks in ``macroarch.mvas._kernels``).

    The arithmetic of ``pack`` without its checks, so that ``macroarch.mvas._kernels`` compiles the same code:
    ``noise`` (int32 in ``[0, 2^noise_bits(fmt))``, one per element) rounds stochastically, None to nearest.
    ``block_size`` must divide the last dimension (None: one scale for all of a flat ``x``). ``absmax``: each
    block's largest magnitude, where the caller has it (the same values as the blocks' own; None: computed here)."""
    fmt = get_format(fmt)
    if not fmt.block_scaled:
        return _round_elementwise(x, fmt, noise), None
    lead = x.shape[:-1]
    blocks = x.view(*lead, 1, -1) if block_size is None else x.view(*lead, -1, block_size)  # (..., n_blocks, block)
    if blocks.numel():
        scales = (blocks.abs().amax(dim=-1) if absmax is None else absmax.view(blocks.shape[:-1])) / fmt.max_normal
    else:
        scales = torch.zeros(blocks.shape[:-1], device=x.device)
    divisor = torch.where(scales > 0, scales, 1.0)  # an all-zero block stays zero
    y = (blocks / divisor[..., None]).clamp(-fmt.max_normal, fmt.max_normal).view(x.shape)
    if fmt.name == "fp4_e2m1":
        return _pack_nibbles(_round_e2m1(y, noise)), scales.to(SCALE_DTYPE)
    return _round_elementwise(y, fmt, noise), scales.to(SCALE_DTYPE)


def cast(payload: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An unscaled payload (fp32, bf16, fp16) as a new tensor of ``dtype``; between 16-bit dtypes through float32 (the
    same values; torch's direct fp16-to-bf16 cast is not vectorised)."""
    if payload.dtype == dtype:
        return payload.clone()
    if payload.element_size() == 2 and dtype.itemsize == 2:
        return payload.to(torch.float32).to(dtype)
    return payload.to(dtype)


def decode(payload: torch.Tensor, scales: torch.Tensor | None, fmt: str | Format, block_size: int | None,
           numel: int, dtype: torch.dtype = torch.float32, *, by_pairs: bool = False) -> torch.Tensor:
    """``numel`` elements stored as ``payload`` and ``scales`` in ``fmt``, as a new tensor of ``dtype`` (the
    arithmetic of ``PackedTensor.dequantize_range`` in float32, then the cast; compiled by
    ``macroarch.mvas._kernels``): flat, or, for a payload of rows (whole blocks each, ``numel`` elements in all),
    rows with ``scales`` of rows too. An fp8 payload may be given as its bytes (uint8), as the compiled kernels pass
    it on CPUs without AVX-512. ``by_pairs``: compiled fp4 rows into float32 as pairs (``_decode_e2m1_rows``)."""
    fmt = get_format(fmt)
    if (fmt.name == "fp4_e2m1" and payload.dim() > 1 and scales is not None and block_size is not None
            and block_size % 2 == 0 and torch.compiler.is_compiling()):
        if dtype == torch.float32 and not by_pairs:
            return _decode_e2m1_elements(payload, scales, block_size)
        return _decode_e2m1_rows(payload, scales, block_size, dtype)
    if fmt.name == "fp4_e2m1":
        values = _decode_e2m1(payload, numel)
    elif payload.dtype in FP8_DTYPES and _fp8_by_arithmetic(payload):
        values = _fp8_values(payload.view(torch.uint8), fmt)
    elif payload.dtype == torch.uint8 and fmt.storage_dtype in FP8_DTYPES:  # fp8 codes as their bytes
        values = _fp8_values(payload, fmt)
    else:
        values = payload.to(torch.float32, copy=True)
    if scales is not None and values.numel():
        if block_size is None:
            values = values * scales[0]
        else:
            lead = values.shape[:-1]  # (..., n_blocks, block)
            values = (values.view(*lead, -1, block_size) * scales.view(*lead, -1)[..., None]).view(values.shape)
    return values if dtype == torch.float32 else values.to(dtype)


_E2M1_BYTES: dict[torch.device, torch.Tensor] = {}


def e2m1_byte_table(device: torch.device) -> torch.Tensor:
    """(256, 2) float32: the two values (low nibble first) of every byte of packed e2m1."""
    if device not in _E2M1_BYTES:
        grid = torch.tensor(_E2M1_GRID)
        nibble = torch.cat([grid, -grid])  # codes 0..15: bit 3 the sign
        byte = torch.arange(256)
        _E2M1_BYTES[device] = torch.stack([nibble[byte & 0xF], nibble[byte >> 4]], dim=1).to(device)
    return _E2M1_BYTES[device]


def _decode_e2m1(payload: torch.Tensor, numel: int) -> torch.Tensor:
    if torch.compiler.is_compiling():  # traced: arithmetic, as a table would be captured as a (fake) constant
        return _decode_e2m1_arithmetic(payload, numel)
    table = e2m1_byte_table(payload.device) if not is_fake(payload) else torch.zeros(256, 2, device=payload.device)
    if payload.dim() > 1:
        return table[payload.long()].view(*payload.shape[:-1], -1)
    return table[payload.long()].reshape(-1)[:numel]


def _decode_e2m1_arithmetic(payload: torch.Tensor, numel: int) -> torch.Tensor:
    """The byte table's values from the codes (``_e2m1_values``; compiled, arithmetic beats a gather), low nibble
    first."""
    codes = payload.to(torch.int32)
    values = torch.stack([_e2m1_values(codes & 0xF), _e2m1_values(codes >> 4)], dim=-1)
    if payload.dim() == 1:
        return values.reshape(-1)[:numel]
    return values.view(*payload.shape[:-1], -1)


def _decode_e2m1_rows(payload: torch.Tensor, scales: torch.Tensor, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """``decode`` of fp4 rows (bytes) with an even ``block_size``, compiled: each nibble scaled on its own and the two
    interleaved last, pairs as one integer lane each (int32 of bf16, int64 of float32), so the result is written in
    one pass of vector code rather than a lane at a time. The same values as ``decode``'s other path."""
    codes = payload.to(torch.int32)
    lead = payload.shape[:-1]
    per_block = scales.view(*lead, -1)[..., None]  # (..., n_blocks, 1): both nibbles of a byte share a block

    def half(nibbles: torch.Tensor) -> torch.Tensor:
        values = _e2m1_values(nibbles).view(*lead, -1, block_size // 2) * per_block
        return values.view(nibbles.shape)

    low, high = half(codes & 0xF), half(codes >> 4)
    if dtype == torch.float32:  # each pair as one int64 lane, low value first (little-endian)
        pairs = (low.view(torch.int32).to(torch.int64) & 0xFFFFFFFF) | (high.view(torch.int32).to(torch.int64) << 32)
        return pairs.view(torch.float32).view(*lead, -1)
    if dtype == torch.bfloat16:  # each pair of bf16 bit patterns as one int32 lane
        pairs = (_bf16_bits(low) & 0xFFFF) | (_bf16_bits(high) << 16)
        return pairs.view(torch.bfloat16).view(*lead, -1)
    return torch.stack([low.to(dtype), high.to(dtype)], dim=-1).view(*lead, -1)


def _decode_e2m1_elements(payload: torch.Tensor, scales: torch.Tensor, block_size: int) -> torch.Tensor:
    """``decode`` of fp4 rows into float32, compiled: element ``i`` reads byte ``i // 2`` and shifts its nibble down,
    so the step decodes its weight inside its main loop. Not used into bf16, nor in the step on CPUs without AVX-512
    (``by_pairs``), where the pairs' layout compiles better."""
    lead = payload.shape[:-1]
    codes = payload[..., None].expand(*payload.shape, 2).reshape(*lead, -1).to(torch.int32)
    shift = (torch.arange(codes.shape[-1], dtype=torch.int32, device=codes.device) & 1) << 2
    values = _e2m1_values((codes >> shift) & 0xF)
    return (values.view(*lead, -1, block_size) * scales.view(*lead, -1)[..., None]).view(values.shape)


def _bf16_bits(x: torch.Tensor) -> torch.Tensor:
    """The bf16 bit pattern of finite float32 ``x`` (int32, in the low 16 bits; the high ones are the sign's copies):
    torch's cast, round to nearest even on the float32 bits (a carry into the exponent is the next binade, or inf)."""
    return _round_half_even(x.view(torch.int32), 16) >> 16


def _e2m1_values(code: torch.Tensor) -> torch.Tensor:
    """The float32 value of e2m1 ``code`` (int32, 0..15) by integer arithmetic and one conversion: magnitude code
    c = 2e + m is (2 + m) << e halves for c >= 2, c halves below; ((2 + m) << e) >> 1 is that for every c but 0,
    which the minimum with c << 4 puts right (0; 16 and more for the others). Bit 3 of the code is the float's sign
    bit (code 8 is -0.0, as the table). Fewer vector instructions than a select by masks and a -1/+1 sign."""
    magnitude = code & 7
    halves = torch.minimum(((2 | (magnitude & 1)) << (magnitude >> 1)) >> 1, magnitude << 4)
    return (halves.to(torch.float32).view(torch.int32) | ((code << 28) & _SIGN)).view(torch.float32) * 0.5
