"""The element arithmetic of the MVAS storage formats: rounding (nearest and stochastic), fp8 and fp4 codes, and
``encode`` / ``decode``, pure functions of tensors that ``macroarch.mvas.packed`` runs eagerly and
``macroarch.mvas._kernels`` compiles with ``torch.compile`` (one source for both).

**Stochastic rounding** (``rounding="stochastic"``): a value between the two neighbouring representable values
lo < x < hi goes to hi with probability (x - lo) / (hi - lo), so E[q(x)] = x for every x in range. It is
floor(x / s + u) * s, with s the format's spacing at x (a power of two) and u = noise / 2^k a uniform number of k
bits, the float32 mantissa bits the format drops: exact in float32, and bit for bit adding the noise below the kept
mantissa bits of x's float32 pattern and clearing them (``_stochastic_magnitude``). The result is a value the format
represents, then cast. Values beyond bf16/fp16's finite range round to nearest (torch's cast: inf); scaled formats
never exceed their range. ``pack`` draws the noise from an explicit ``torch.Generator``; the compiled step draws it
from a counter-based hash (``macroarch.mvas.codecs.noise``).

**Written for the compiler.** Each function is plain tensor ops that ``torch.compile``'s CPU backend turns into
vector code, and gives the bytes of torch's own casts or of the table it stands for (``tests/mvas/codecs`` checks
every code and the rounding boundaries), so results never depend on the path: the spacing at x from float ops
(``_unit``), not from its exponent bits, and signs by ``copysign``, not by bit masks (the backend runs float <->
int32 bit-casts a lane at a time through memory); fp4 nibbles packed and unpacked as int64 lanes of eight codes
(``_pack_words``), not by stride-2 access or int16 lanes (both a lane at a time); codes narrowed to int8, not uint8
(a lane at a time on AVX-512 and AVX2). On CPUs without AVX-512, where ATen's vector library converts fp8 a lane at a
time, fp8 codes are computed from the float32 bits instead (``_fp8_codes``, ``_fp8_values``).
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


_PHI = 2.0 ** 23 + 1  # 1 + 2^(p - 1) for float32's p = 24 significant bits (``_unit``)


def _unit(a: torch.Tensor) -> torch.Tensor:
    """2^floor(log2 a), the unit in the first place of float32 ``a`` in [2^-126, 2^104) (0 for 0, at most 2^-126
    below): ``fl(phi a) - fl((1 - 2^-24) fl(phi a))``, Rump's ufp (Rump, "Ultimately fast accurate summation", SIAM
    J. Sci. Comput. 2009). Three float ops, exact in IEEE arithmetic; reading the exponent from the bits instead
    (``a.view(torch.int32)``) compiles to a bit-cast that ``torch.compile``'s CPU backend runs a lane at a time
    through memory (``docs/upstream/inductor-vector-bitcast.md``)."""
    q = a * _PHI
    return q - q * (1.0 - 2.0 ** -24)


def _spacing(a: torch.Tensor, mantissa_bits: int, min_exponent: int, max_normal: float) -> torch.Tensor:
    """The spacing of a format with ``mantissa_bits`` bits of mantissa and exponents down to ``min_exponent`` at
    float32 ``a`` >= 0: ``2^(floor(log2 a) - mantissa_bits)``, fixed below ``2^min_exponent`` (subnormals), a power
    of two. Formats whose range reaches past 2^104 (bf16) take the unit of large ``a`` scaled down by 2^100."""
    unit = _unit(a)
    if max_normal >= 2.0 ** 104:
        unit = torch.where(a >= 2.0 ** 100, _unit(a * 2.0 ** -100) * 2.0 ** 100, unit)
    return unit.clamp(min=2.0 ** min_exponent) * 2.0 ** -mantissa_bits


def _stochastic_magnitude(a: torch.Tensor, mantissa_bits: int, min_exponent: int, noise: torch.Tensor,
                          max_normal: float) -> torch.Tensor:
    """``a`` (float32, >= 0) rounded stochastically to ``mantissa_bits`` bits of mantissa, exponents down to
    ``min_exponent`` (below it the spacing is fixed, as for subnormals): the result is one of the two
    neighbouring representable values, the upper one with probability (a - lo) / (hi - lo).

    With ``s`` the format's spacing at ``a`` (``_spacing``) and ``noise`` a uniform integer in [0, 2^k),
    k = 23 - mantissa_bits: ``floor(a / s + noise / 2^k) * s``. Every step is exact in float32 (``a / s`` has
    mantissa_bits + 1 integer bits and at most k fractional ones), so this is, bit for bit, adding the noise to
    the float32 bit pattern below the kept bits and clearing them: it rounds up exactly when the noise carries
    past the kept bits, with probability (dropped bits) / 2^k = (a - lo) / (hi - lo), and a carry into the next
    binade gives the next power of two, the correct upper neighbour. Written with float ops only: those compile to
    vector code (``_unit``)."""
    spacing = _spacing(a, mantissa_bits, min_exponent, max_normal)
    return torch.floor(a / spacing + noise.float() * 2.0 ** (mantissa_bits - 23)) * spacing


def _nearest_magnitude(a: torch.Tensor, mantissa_bits: int, min_exponent: int) -> torch.Tensor:
    """``a`` (float32, >= 0, below 2^104) rounded to nearest, ties to even, on the grid of ``_stochastic_magnitude``:
    ``round(a / s) * s`` (``torch.round`` rounds half to even; a tie to the next binade gives its power of two)."""
    spacing = _spacing(a, mantissa_bits, min_exponent, 0.0)
    return torch.round(a / spacing) * spacing


def _round_elementwise(y: torch.Tensor, fmt: Format, noise: torch.Tensor | None) -> torch.Tensor:
    """``y`` (float32) rounded to ``fmt.storage_dtype``: torch's cast (``noise`` None), or stochastic between
    the neighbours (``_stochastic_magnitude``, then torch's cast of a value it represents exactly)."""
    dtype = fmt.storage_dtype
    if dtype in FP8_DTYPES and _fp8_by_arithmetic(y):
        return _fp8_codes(y, fmt, noise).view(dtype)
    if noise is None or dtype == torch.float32:
        return y.to(dtype)
    a = y.abs()
    min_exponent = 2 - 2 ** (fmt.exponent_bits - 1)  # 1 - bias
    q = _stochastic_magnitude(a, fmt.mantissa_bits, min_exponent, noise, fmt.max_normal)
    if not fmt.block_scaled:  # out of range (bf16/fp16; scaled formats' blocks never are): torch's cast
        q = torch.where(a > fmt.max_normal, a, q)
    return torch.copysign(q, y).to(dtype)  # y's sign, -0.0's included


# ------------------------------------------------------------------------------------------------ fp8 by arithmetic
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# the CPU capability ATen dispatches to (it honours ATEN_CPU_CAPABILITY, as Inductor's vector ISA does), read once
# here: the check runs while torch.compile traces, where it must be a constant
_NATIVE_FP8 = "AVX512" in torch.backends.cpu.get_cpu_capability()
_SIGN = -(1 << 31)  # the float32 sign bit, as an int32


def software_fp8(t: torch.Tensor) -> bool:
    """Whether ``t`` lives where ATen's vector library has no fp8 conversion: a CPU without AVX-512."""
    return t.device.type == "cpu" and not _NATIVE_FP8


def _fp8_by_arithmetic(t: torch.Tensor) -> bool:
    """Whether fp8 codes are computed with integer arithmetic (``_fp8_codes``, ``_fp8_values``) instead of torch's
    casts: only while ``torch.compile`` traces, for a CPU whose vector ISA has no fp8 conversion in ATen's vector
    library (AVX-512 has one). Both give the same bytes, so results do not depend on the choice."""
    return torch.compiler.is_compiling() and software_fp8(t)


def _fp8_codes(y: torch.Tensor, fmt: Format, noise: torch.Tensor | None) -> torch.Tensor:
    """``y`` (float32, |y| <= the format's max) as fp8 codes (uint8): the bytes of torch's cast (round to nearest,
    ties to even; NaN to 0x7F with y's sign), or rounded stochastically (``_stochastic_magnitude``): a representable
    magnitude q has the code ``(bits(q) >> (23 - m)) - ((127 - bias) << m)`` (normal) or ``q / spacing``."""
    m, bias = fmt.mantissa_bits, 2 ** (fmt.exponent_bits - 1) - 1
    shift, spacing = 23 - m, 2.0 ** (1 - bias - m)
    a = y.abs()
    if noise is None:
        q = _nearest_magnitude(a, m, 1 - bias)
    else:
        q = _stochastic_magnitude(a, m, 1 - bias, noise, fmt.max_normal)
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


# ------------------------------------------------------------------------------------------------ fp4 (e2m1)
def _round_e2m1(y: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
    """``y`` (float32, |y| <= 6) as e2m1 codes (int8, 0..15; bit 3 the sign). e2m1 is a float with 1 mantissa bit,
    exponents 0..2 and subnormal spacing 0.5, so rounding is that of ``_stochastic_magnitude`` (or, ``noise`` None,
    ``_nearest_magnitude``: half to even on the same grid). A grid value q's code, from t = 2q (0, 1, 2, 3, 4, 6, 8,
    12), is t up to 4, t / 2 + 2 up to 8, t / 4 + 4 above; the sign is y's sign bit (-0.0's included, which
    ``copysign`` reads and a comparison does not). Float ops and selects only, which compile to vector code."""
    a = y.abs()
    q = _nearest_magnitude(a, 1, 0) if noise is None else _stochastic_magnitude(a, 1, 0, noise, 6.0)
    t = q.clamp(max=6.0) * 2.0
    code = torch.where(t <= 4.0, t, torch.where(t <= 8.0, t * 0.5 + 2.0, t * 0.25 + 4.0))
    # y's sign bit; not copysign(ones_like(y), y): a compiled fp4 step then failed in Inductor (a second symbol for
    # the rows in the codes' layout, which its loop splitting asserts against;
    # docs/upstream/inductor-loop-split-copysign.md)
    negative = torch.copysign(a + 1.0, y) < 0
    return torch.where(negative, code + 8.0, code).to(torch.int8)


def _pack_words(codes: torch.Tensor) -> torch.Tensor:
    """Codes (int8 or uint8, 0..15; the last dimension a multiple of 8, contiguous) two per byte, low nibble first,
    as int32 words of four bytes (little-endian): each 8 codes read as one int64 lane and folded, (c_2i | c_2i+1 << 4)
    into byte i, by shifts and masks. Whole lanes only: a stride-2 access and int16 lanes, the other ways to pair the
    codes, compile to a loop of one lane at a time."""
    t = codes.view(torch.int64)
    t = (t | (t >> 4)) & 0x00FF00FF00FF00FF
    t = (t | (t >> 8)) & 0x0000FFFF0000FFFF
    t = (t | (t >> 16)) & 0xFFFFFFFF
    return t.to(torch.int32)


def _unpack_words(words: torch.Tensor) -> torch.Tensor:
    """The inverse of ``_pack_words``: int32 words of packed nibbles as one code per element (int8, 0..15), eight per
    word, each word spread over one int64 lane (a byte's nibbles to two bytes) and read back as bytes."""
    t = words.to(torch.int64) & 0xFFFFFFFF
    t = (t | (t << 16)) & 0x0000FFFF0000FFFF
    t = (t | (t << 8)) & 0x00FF00FF00FF00FF
    t = (t & 0x000F000F000F000F) | ((t & 0x00F000F000F000F0) << 4)
    return t.view(torch.int8)


def _words_fit(payload: torch.Tensor) -> bool:
    """Whether packed nibbles ``payload`` (bytes, or int32 words) go through ``_pack_words`` / ``_unpack_words``:
    contiguous, rows of whole words, on a little-endian machine."""
    whole = payload.dtype == torch.int32 or (payload.dtype == torch.uint8 and payload.shape[-1] % 4 == 0)
    return whole and payload.dim() > 0 and payload.is_contiguous() and sys.byteorder == "little"


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Two codes per byte along the last dimension, low nibble first (a flat tensor of odd length gets one zero
    nibble): uint8."""
    if codes.dim() == 1 and codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    if codes.shape[-1] % 8 == 0 and codes.is_contiguous() and sys.byteorder == "little":
        return _pack_words(codes).view(torch.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).view(torch.uint8)


def encode(x: torch.Tensor, fmt: str | Format, block_size: int | None, noise: torch.Tensor | None = None,
           absmax: torch.Tensor | None = None, *, words: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The storage of ``x`` (float32, finite for scaled formats) in ``fmt``: ``(payload, scales)``, blocks cut
    along the last dimension (flat for ``pack``; rows of whole blocks in ``macroarch.mvas._kernels``).

    The arithmetic of ``pack`` without its checks, so that ``macroarch.mvas._kernels`` compiles the same code:
    ``noise`` (int32 in ``[0, 2^noise_bits(fmt))``, one per element) rounds stochastically, None to nearest.
    ``block_size`` must divide the last dimension (None: one scale for all of a flat ``x``). ``absmax``: each
    block's largest magnitude, where the caller has it (the same values as the blocks' own; None: computed here).
    ``words``: an fp4 payload as int32 words of four bytes (the last dimension a multiple of 8), the layout the
    compiled kernels read and write (``_pack_words``)."""
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
        codes = _round_e2m1(y, noise)
        return (_pack_words(codes) if words else _pack_nibbles(codes)), scales.to(SCALE_DTYPE)
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
           numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``numel`` elements stored as ``payload`` and ``scales`` in ``fmt``, as a new tensor of ``dtype`` (the
    arithmetic of ``PackedTensor.dequantize_range`` in float32, then the cast; compiled by
    ``macroarch.mvas._kernels``): flat, or, for a payload of rows (whole blocks each, ``numel`` elements in all),
    rows with ``scales`` of rows too. An fp8 payload may be given as its bytes (uint8), as the compiled kernels pass
    it on CPUs without AVX-512, and an fp4 payload as int32 words (``encode``'s ``words``)."""
    fmt = get_format(fmt)
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
    """Packed e2m1 (bytes, or int32 words) as float32 values, low nibble first: by the byte table eagerly, by
    arithmetic where compiled (a table would be captured as a constant, and a gather is a lane at a time), one code
    per element through ``_unpack_words`` where the payload is whole words."""
    if payload.dtype == torch.int32 or (torch.compiler.is_compiling() and _words_fit(payload)):
        words = payload if payload.dtype == torch.int32 else payload.view(torch.int32)
        values = _e2m1_values(_unpack_words(words).to(torch.int32))
        return values if payload.dim() > 1 else values[:numel]
    if torch.compiler.is_compiling():
        codes = payload.to(torch.int32)
        values = torch.stack([_e2m1_values(codes & 0xF), _e2m1_values(codes >> 4)], dim=-1)
    else:
        table = e2m1_byte_table(payload.device) if not is_fake(payload) else torch.zeros(256, 2, device=payload.device)
        values = table[payload.long()]
    if payload.dim() > 1:
        return values.view(*payload.shape[:-1], -1)
    return values.reshape(-1)[:numel]


def _e2m1_values(code: torch.Tensor) -> torch.Tensor:
    """The float32 value of e2m1 ``code`` (int32, 0..15) by integer arithmetic, one conversion and a select:
    magnitude code c = 2e + m is (2 + m) << e halves for c >= 2, c halves below; ((2 + m) << e) >> 1 is that for
    every c but 0, which the minimum with c << 4 puts right (0; 16 and more for the others). Bit 3 of the code is the
    sign (code 8 is -0.0, as the table)."""
    magnitude = code & 7
    halves = torch.minimum(((2 | (magnitude & 1)) << (magnitude >> 1)) >> 1, magnitude << 4)
    value = halves.to(torch.float32) * 0.5
    return torch.where((code & 8) != 0, -value, value)
