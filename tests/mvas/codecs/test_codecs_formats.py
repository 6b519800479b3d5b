"""Storage formats against independent references: torch's own casts and float8 dtypes, the e2m1 grid by brute
force, byte counts derived from the format widths, and the mean of many stochastic draws."""

from __future__ import annotations

import io
import math

import pytest
import torch

from macroarch.mvas import (
    FORMATS,
    PackedTensor,
    bytes_per_element,
    get_format,
    pack,
    quantization_error,
    storage_bytes,
    unpack,
)

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _sample(shape=(8, 64), seed=0):
    """Gaussian values with an outlier, a tiny block and an all-zero block (blocks of 32)."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    x.view(-1)[5] = 40.0
    x.view(-1)[32:64] *= 1e-3
    x.view(-1)[64:96] = 0.0
    return x


def test_unknown_format_names_it_and_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"'fp7'.*fp32, bf16, fp16, fp8_e4m3, fp8_e5m2, fp4_e2m1"):
        get_format("fp7")
    assert get_format("fp8").name == "fp8_e4m3" and get_format("fp4").name == "fp4_e2m1"


@pytest.mark.parametrize("block_size", [32, None])
@pytest.mark.parametrize("name", sorted(FP8))
def test_fp8_equals_torch_float8_conversion_bit_for_bit(name, block_size):
    x = _sample()
    dtype = FP8[name]
    fmax = torch.finfo(dtype).max
    blocks = x.reshape(-1, block_size or x.numel())
    scale = blocks.abs().amax(1) / fmax
    ref = (blocks / torch.where(scale > 0, scale, 1.0)[:, None]).clamp(-fmax, fmax).to(dtype).reshape(-1)
    p = pack(x, name, block_size)
    assert p.payload.dtype == dtype
    assert torch.equal(p.payload.view(torch.uint8), ref.view(torch.uint8))
    assert torch.equal(p.scales, scale)
    expected = (ref.float().reshape(blocks.shape) * scale[:, None]).reshape(x.shape)
    assert torch.equal(p.dequantize(), expected)


@pytest.mark.parametrize("name,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_bf16_and_fp16_are_plain_casts(name, dtype):
    x = _sample()
    p = pack(x, name, block_size=32)
    assert p.scales is None and p.nbytes == 2 * x.numel()
    assert torch.equal(p.payload.view(torch.int16), x.reshape(-1).to(dtype).view(torch.int16))
    assert torch.equal(p.dequantize(), x.to(dtype).float())


def _e2m1_nearest(y):
    """Brute force: the nearest grid magnitude, ties to the even code; the sign of y."""
    dist = (y.abs()[:, None] - E2M1[None, :]).abs()
    best = dist.min(1, keepdim=True).values
    candidates = (dist == best) * (torch.arange(8) % 2 == 0) * 2 + (dist == best)  # even codes win ties
    return E2M1[candidates.argmax(1)] * torch.where(torch.signbit(y), -1.0, 1.0)


def test_fp4_values_lie_on_the_grid_and_match_brute_force_nearest():
    x = _sample()
    p = pack(x, "fp4_e2m1", 32)
    blocks = x.reshape(-1, 32)
    scale = blocks.abs().amax(1) / 6.0
    assert torch.equal(p.scales, scale)
    y = (blocks / torch.where(scale > 0, scale, 1.0)[:, None]).clamp(-6, 6).reshape(-1)
    codes = p.dequantize().reshape(-1, 32) / torch.where(scale > 0, scale, 1.0)[:, None]
    assert torch.isin(codes.abs(), E2M1).all()
    assert torch.equal(codes.reshape(-1), _e2m1_nearest(y))
    assert p.payload.dtype == torch.uint8 and p.nbytes == x.numel() // 2 + 4 * (x.numel() // 32)


def test_fp4_ties_go_to_the_even_code_and_nibbles_are_low_first():
    # absmax 6 makes the per-tensor scale exactly 1, so these are the e2m1 values themselves
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, 6.0, 0.5, -0.5])
    p = pack(x, "fp4", block_size=None)
    assert p.dequantize().tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -4.0, 6.0, 0.5, -0.5]
    # codes: 0.5 -> 1, -0.5 -> 8 | 1; element 2i in the low nibble; the odd tail is padded with a zero nibble
    assert p.payload[4].item() == 7 | (1 << 4) and p.payload[5].item() == 9
    assert p.nbytes == math.ceil(11 / 2) + 4


def test_fp4_codes_decode_by_arithmetic_to_the_bits_of_the_grid():
    # the compiled kernels' decode (codecs._e2m1_values) against the MX spec's table, signs and -0.0 included
    from macroarch.mvas.codecs.codes import _e2m1_values
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    table = torch.tensor(grid + [-g for g in grid])
    values = _e2m1_values(torch.arange(16, dtype=torch.int32))
    assert values.dtype == torch.float32
    assert torch.equal(values.view(torch.int32), table.view(torch.int32))


@pytest.mark.parametrize("name", ["bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1"])
def test_stochastic_rounding_is_unbiased(name):
    k, n = 16, 20000
    x = torch.linspace(-0.97, 0.93, k) ** 3 * 3.3 + 0.011  # values off every grid
    x[0] = -3.5  # the absmax, fixed, so every copy has the same scale
    f = get_format(name)
    scale = 3.5 / f.max_normal if f.block_scaled else 1.0
    min_normal = 2.0 ** (2 - 2 ** (f.exponent_bits - 1))
    x[1:4] = torch.tensor([0.37, -0.61, 0.88]) * min_normal * scale  # in the subnormal range of the format
    data = x.repeat(n)  # n copies, one block each
    gen = torch.Generator().manual_seed(1)
    draws = pack(data, name, block_size=k, rounding="stochastic", generator=gen).dequantize().view(n, k).double()
    mean, var = draws.mean(0), draws.var(0)
    tol = 5 * (var / n).sqrt() + 1e-12  # five standard errors of the mean
    assert ((mean - x.double()).abs() <= tol).all()
    assert ((draws == draws.min(0).values) | (draws == draws.max(0).values)).all()  # two neighbours only
    nearest = pack(x, name, block_size=k).dequantize().double()
    assert ((nearest - x.double()).abs() > tol).any()  # the test can tell rounding to nearest apart
    again = pack(data, name, block_size=k, rounding="stochastic", generator=torch.Generator().manual_seed(1))
    assert torch.equal(again.dequantize().view(n, k).double(), draws)


@pytest.mark.parametrize("block_size", [32, 128, None])
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_nbytes_is_the_real_storage(name, block_size):
    x = _sample((4, 256))
    p = pack(x, name, block_size)
    bits = {"fp32": 32, "bf16": 16, "fp16": 16, "fp8_e4m3": 8, "fp8_e5m2": 8, "fp4_e2m1": 4}[name]
    n_scales = 0 if name in ("fp32", "bf16", "fp16") else (1 if block_size is None else x.numel() // block_size)
    expected = x.numel() * bits // 8 + 4 * n_scales
    held = p.payload.untyped_storage().nbytes() + (0 if p.scales is None else p.scales.untyped_storage().nbytes())
    assert p.nbytes == expected == held == storage_bytes(x.numel(), name, block_size)
    if block_size is not None:
        assert bytes_per_element(name, block_size) * x.numel() == expected


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_round_trip_through_torch_save_is_exact(name):
    x = _sample().to(torch.bfloat16)
    p = pack(x, name, 32, rounding="stochastic", generator=torch.Generator().manual_seed(0))
    d = p.to_dict()
    assert all(isinstance(v, torch.Tensor | str | int | list | type(None)) for v in d.values())
    buf = io.BytesIO()
    torch.save(d, buf)
    buf.seek(0)
    q = PackedTensor.from_dict(torch.load(buf, weights_only=True))
    assert (q.format, q.shape, q.dtype, q.block_size, q.nbytes) == (p.format, p.shape, p.dtype, p.block_size, p.nbytes)
    assert torch.equal(q.payload.view(torch.uint8), p.payload.view(torch.uint8))
    assert (q.scales is None and p.scales is None) or torch.equal(q.scales, p.scales)
    assert torch.equal(unpack(q), unpack(p)) and unpack(q).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="the fp8_e4m3 payload is torch.float8_e4m3fn with scales"):
        PackedTensor.from_dict({**pack(x, "fp8_e4m3").to_dict(), "scales": None})


def test_block_size_that_does_not_divide_is_an_error():
    with pytest.raises(ValueError, match=r"block_size 32 does not divide the tensor's 100 elements"):
        pack(torch.randn(100), "fp8_e4m3", 32)
    assert pack(torch.randn(100), "fp8_e4m3", None).scales.numel() == 1  # one scale per tensor
    assert pack(torch.randn(100), "fp16", 32).nbytes == 200  # unscaled formats ignore the block size
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        pack(torch.randn(64), "fp8_e4m3", 0)


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError, match="rounding must be one of nearest, stochastic"):
        pack(torch.randn(32), "fp8", rounding="up")
    with pytest.raises(ValueError, match="inf or NaN"):
        pack(torch.tensor([1.0, float("inf")] * 16), "fp8")
    with pytest.raises(ValueError, match="floating-point"):
        pack(torch.arange(32), "fp8")


def test_fp32_is_the_identity_and_never_aliases():
    x = torch.randn(64)
    p = pack(x, "fp32")
    assert torch.equal(p.dequantize(), x) and p.payload.data_ptr() != x.data_ptr()
    assert p.dequantize().data_ptr() != p.payload.data_ptr()


def test_quantization_error_is_the_squared_error_of_round_to_nearest():
    x = _sample()
    errors = {name: quantization_error(x, name) for name in ("fp16", "fp8_e4m3", "fp4_e2m1")}
    assert errors["fp16"] < errors["fp8_e4m3"] < errors["fp4_e2m1"]
    ref = (pack(x, "fp8_e4m3").dequantize().double() - x.double()).square().sum().item()
    assert errors["fp8_e4m3"] == pytest.approx(ref, rel=1e-12)
    assert quantization_error(x, "fp32") == 0.0


@pytest.mark.parametrize("name", ["bf16", "fp8_e4m3", "fp4_e2m1"])
@pytest.mark.parametrize("block_size", [32, None])
def test_chunked_decoding_and_writing_equal_the_whole_tensor(name, block_size, monkeypatch):
    from macroarch.mvas.packed import packed_tensor as formats
    from macroarch.mvas.packed.packed_tensor import write_range

    x = _sample((6, 160))  # 960 elements: 30 blocks of 32
    whole = pack(x, name, block_size)
    monkeypatch.setattr(formats, "CHUNK_NUMEL", 64)
    assert whole.chunk_numel() == 64
    assert torch.equal(whole.dequantize(), pack(x, name, block_size).dequantize())
    monkeypatch.undo()
    expected = whole.dequantize()
    monkeypatch.setattr(formats, "CHUNK_NUMEL", 64)
    assert torch.equal(whole.dequantize(), expected)  # decoded in 15 chunks
    if block_size is None and get_format(name).block_scaled:
        return  # one scale per tensor: written whole only
    target = pack(torch.zeros_like(x), name, block_size)
    flat = x.reshape(-1)
    for start in range(0, flat.numel(), 64):
        write_range(target.payload, target.scales, pack(flat[start:start + 64], name, block_size), start, start + 64)
    assert torch.equal(target.dequantize(), expected)


@pytest.mark.parametrize("name", ["bf16", "fp16", "fp8_e4m3", "fp8_e5m2"])
def test_stochastic_rounding_keeps_every_sign_and_rounds_the_magnitude(name):
    """The sign goes onto the rounded magnitude by bit operations (codecs._round_elementwise): each result has its
    input's sign bit (both zeros included) and the magnitude of the same rounding of ``|y|``; NaN stays NaN (its sign
    is the cast's: torch's float32 to bf16 gives 0xFFFF for either NaN)."""
    from macroarch.mvas.codecs.codes import _round_elementwise, noise_bits

    f = get_format(name)
    y = torch.tensor([0.0, -0.0, 1.3, -1.3, 0.011, -0.011, 3e-3, -3e-3, float("nan"), -float("nan"), 200.0, -200.0])
    y = y.repeat(64)
    noise = torch.randint(0, 1 << noise_bits(name), y.shape, generator=torch.Generator().manual_seed(3),
                          dtype=torch.int32)
    got = _round_elementwise(y, f, noise).float()
    magnitude = _round_elementwise(y.abs(), f, noise).float()
    number = ~y.isnan()
    assert torch.equal(got[number].signbit(), y[number].signbit())
    assert torch.equal(got[number].abs(), magnitude[number]) and got[~number].isnan().all()


# --------------------------------------------------------------------------- the element arithmetic, bit for bit
def _patterns(count: int, top: float) -> torch.Tensor:
    """About ``count`` evenly spaced non-negative float32 bit patterns up to ``top`` (zero, subnormals, every
    binade), plus each binade's first and last pattern (the edges where a rounding carries into the next binade)."""
    last = int(torch.tensor(top, dtype=torch.float32).view(torch.int32))
    every = torch.arange(0, last + 1, max(1, last // count), dtype=torch.int64)
    edges = torch.arange(1, 255, dtype=torch.int64) << 23
    bits = torch.cat([every, edges, edges - 1, torch.tensor([last])]).to(torch.int32)
    values = bits.view(torch.float32)
    return values[values <= top]


def _stochastic_by_bits(a, mantissa_bits, min_exponent, noise):
    """Stochastic rounding written on the float32 bits (an independent reference): the noise added below the kept
    mantissa bits, which are then cleared; below 2^min_exponent, floor(a / spacing + noise / 2^k) * spacing."""
    shift = 23 - mantissa_bits
    normal = ((a.view(torch.int32) + noise) & ~((1 << shift) - 1)).view(torch.float32)
    spacing = 2.0 ** (min_exponent - mantissa_bits)
    small = torch.floor(a / spacing + noise.float() / (1 << shift)) * spacing
    return torch.where(a < 2.0 ** min_exponent, small, normal)


def test_the_unit_in_the_first_place_is_the_leading_power_of_two_of_every_float():
    from macroarch.mvas.codecs.codes import _unit

    a = _patterns(1 << 22, 2.0 ** 104 - 1)
    a = a[a >= 2.0 ** -126]  # normal values: the range ``_unit`` is exact on
    want = ((a.view(torch.int32) >> 23) << 23).view(torch.float32)  # the exponent bits alone
    assert torch.equal(_unit(a).view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("name", ["bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1"])
def test_stochastic_rounding_by_float_ops_is_the_bit_pattern_rounding(name):
    """``_stochastic_magnitude`` (float ops only, which compile to vector code) is bit for bit the rounding on the
    float32 bit pattern, for every binade of the format, its subnormals and zero, with the noise at random and at
    both extremes (no carry, and a carry into the next binade)."""
    from macroarch.mvas.codecs.codes import _stochastic_magnitude, noise_bits

    f = get_format(name)
    min_exponent = 2 - 2 ** (f.exponent_bits - 1)
    a = _patterns(1 << 22, f.max_normal)
    gen = torch.Generator().manual_seed(0)
    k = noise_bits(name)
    for noise in (torch.randint(0, 1 << k, a.shape, generator=gen, dtype=torch.int32),
                  torch.zeros(a.shape, dtype=torch.int32), torch.full(a.shape, (1 << k) - 1, dtype=torch.int32)):
        got = _stochastic_magnitude(a, f.mantissa_bits, min_exponent, noise, f.max_normal)
        want = _stochastic_by_bits(a, f.mantissa_bits, min_exponent, noise)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_nearest_rounding_by_float_ops_is_torchs_fp8_cast(name):
    from macroarch.mvas.codecs.codes import _nearest_magnitude

    f = get_format(name)
    a = _patterns(1 << 22, f.max_normal)
    got = _nearest_magnitude(a, f.mantissa_bits, 2 - 2 ** (f.exponent_bits - 1))
    assert torch.equal(got.view(torch.int32), a.to(FP8[name]).float().view(torch.int32))


def test_fp4_codes_are_the_nearest_and_stochastic_grid_values_with_every_sign_bit():
    """e2m1 codes from float ops: each decodes (by the byte table) to the rounding of ``|y|`` on the grid, nearest
    (ties to even, the brute-force grid) or stochastic (the bit-pattern reference), with ``y``'s sign bit, -0.0's
    included (code 8)."""
    from macroarch.mvas.codecs.codes import _round_e2m1, e2m1_byte_table, noise_bits

    a = _patterns(1 << 22, 6.0)
    y = torch.cat([a, -a])
    table = e2m1_byte_table(torch.device("cpu"))[:16, 0]  # code c (low nibble of byte c) -> its value
    nearest = _round_e2m1(y, None).long()
    assert torch.equal(table[nearest].abs(), _brute_force_e2m1(y.abs()))
    noise = torch.randint(0, 1 << noise_bits("fp4_e2m1"), y.shape, generator=torch.Generator().manual_seed(1),
                          dtype=torch.int32)
    stochastic = _round_e2m1(y, noise).long()
    assert torch.equal(table[stochastic].abs(), _stochastic_by_bits(y.abs(), 1, 0, noise))
    for codes in (nearest, stochastic):
        assert torch.equal(table[codes].signbit(), y.signbit())  # -0.0 -> code 8, -0.0


def _brute_force_e2m1(a):
    """The nearest grid value of each ``a`` in [0, 6], ties to the even code (the lower one's mantissa bit is 0)."""
    d = (a[:, None] - E2M1[None, :]).abs()
    best = d.min(dim=1, keepdim=True).values
    candidates = d == best
    index = torch.where(candidates.sum(1) > 1, (candidates * (torch.arange(8) % 2 == 0)).float().argmax(1),
                        candidates.float().argmax(1))
    return E2M1[index]


def test_nibbles_packed_and_unpacked_by_whole_words_are_the_byte_layout():
    """``_pack_words`` / ``_unpack_words`` (int64 lanes folding or spreading eight codes) against the stride-2
    layout (low nibble first) they replace, for every byte value, and flat tensors of odd length."""
    from macroarch.mvas.codecs.codes import _pack_nibbles, _pack_words, _unpack_words

    codes = torch.randint(0, 16, (32, 64), generator=torch.Generator().manual_seed(2), dtype=torch.uint8)
    codes[0] = torch.arange(64) % 16
    reference = codes[:, 0::2] | (codes[:, 1::2] << 4)
    assert torch.equal(_pack_words(codes).view(torch.uint8), reference)
    assert torch.equal(_pack_words(codes.view(torch.int8)).view(torch.uint8), reference)
    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(2).view(2, 256)
    unpacked = _unpack_words(every_byte.view(torch.int32)).view(torch.uint8)
    assert torch.equal(unpacked[:, 0::2], every_byte & 0xF) and torch.equal(unpacked[:, 1::2], every_byte >> 4)
    flat = codes.view(-1)[:37]  # odd: one zero nibble after the last code
    padded = torch.cat([flat, flat.new_zeros(1)]).view(-1, 2)
    assert torch.equal(_pack_nibbles(flat), padded[:, 0] | (padded[:, 1] << 4))


def test_fp4_payloads_as_words_decode_and_encode_as_bytes():
    """``decode`` of an fp4 payload given as int32 words, and ``encode(..., words=True)``, are the byte payload's."""
    from macroarch.mvas.codecs.codes import decode, encode

    x = _sample((16, 128))
    payload, scales = encode(x, "fp4_e2m1", 32)
    words, same_scales = encode(x, "fp4_e2m1", 32, words=True)
    assert words.dtype == torch.int32 and torch.equal(words.view(torch.uint8), payload)
    assert torch.equal(same_scales, scales)
    values = decode(payload, scales, "fp4_e2m1", 32, x.numel())
    assert torch.equal(decode(words, scales, "fp4_e2m1", 32, x.numel()).view(torch.int32), values.view(torch.int32))
