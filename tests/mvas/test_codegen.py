"""mvas.codegen: the kernels' Inductor options and vector bit casts, checked on the C++ Inductor generates.

Each test compiles a small function with a fresh Inductor cache (a few seconds of C++ compilation): marked slow."""

import re

import pytest
import torch
from torch._inductor.codegen.cpp import CppVecKernel, CppVecOverrides
from torch._inductor.utils import fresh_cache, run_and_get_code

from macroarch.mvas import codegen
from macroarch.mvas.noise import counter_noise

pytestmark = pytest.mark.slow


def _bits(x):  # the stochastic rounding's pattern: float bits as int32, integer arithmetic, back to float
    return ((x.view(torch.int32) + 0x1000) & ~0xFFF).view(torch.float32) * 0.5


def _generated(fn, x, options):  # x: the argument, or a tuple of them
    torch._dynamo.reset()
    with fresh_cache():
        args = x if isinstance(x, tuple) else (x,)
        out, code = run_and_get_code(torch.compile(fn, options=options, dynamic=False), *args)
    return out, "\n".join(code)


def _plain_options():  # the kernels' options without the fix's cache-key pass (compiled outside the context)
    return {k: v for k, v in codegen.options().items() if k != "post_grad_custom_post_pass"}


def test_inside_the_context_bit_casts_are_vector_casts_with_the_same_bits_and_the_patch_is_undone():
    x = torch.randn(4096)
    original = vars(CppVecOverrides)["to_dtype_bitcast"]
    plain_out, plain = _generated(_bits, x, _plain_options())
    with codegen.vector_bitcasts():
        assert vars(CppVecOverrides)["to_dtype_bitcast"] is not original
        out, code = _generated(_bits, x, codegen.options())
    assert vars(CppVecOverrides)["to_dtype_bitcast"] is original
    assert "at::vec::cast<int32_t>" in code and "at::vec::cast<float>" in code and "tmpbuf_out" not in code
    assert "tmpbuf_out" in plain  # torch 2.14 without the fix: a lane-by-lane copy through memory
    expected = _bits(x)
    assert torch.equal(out.view(torch.int32), expected.view(torch.int32))
    assert torch.equal(plain_out.view(torch.int32), expected.view(torch.int32))
    with pytest.raises(RuntimeError, match="inside"), codegen.vector_bitcasts():
        raise RuntimeError("inside")
    assert vars(CppVecOverrides)["to_dtype_bitcast"] is original


def test_the_options_key_the_cache_by_the_fix_and_the_vector_width_and_follow_the_thread_count():
    options = codegen.options()
    assert isinstance(options["cpp.simdlen"], int) and options["cpp.dynamic_threads"] is True
    assert "vector bit casts" in options["post_grad_custom_post_pass"].uuid()
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:  # compiled under one thread, the loops still ask OpenMP for the caller's thread count at run time
        with codegen.vector_bitcasts():
            _, code = _generated(_bits, torch.randn(1 << 16), options)
    finally:
        torch.set_num_threads(old)
    assert "#pragma omp parallel" in code and "num_threads(1)" not in code


def _codes(x):  # fp4-like codes: int32 lanes narrowed to bytes, and pairs of bytes packed through int16 (two loops)
    codes = ((x.view(torch.int32) >> 20) & 0x8F).to(torch.uint8)
    pairs = codes.view(torch.int16)
    return codes, ((pairs & 0x0F) | ((pairs >> 4) & 0xF0)).to(torch.uint8)


@pytest.mark.skipif(codegen.vec_isa().split()[0] not in ("avx512", "avx2"), reason="AVX-512 and AVX2 only")
def test_narrowing_to_bytes_is_vector_code_with_the_same_bytes():
    """AVX-512: ATen's int8 conversion reinterpreted as uint8; AVX2: saturating packs of the masked low bytes. Run
    under ``ATEN_CPU_CAPABILITY=avx2`` too (tests/mvas/test_kernels.py's AVX2 test compiles the kernels that way)."""
    x = torch.randn(1 << 14) * 1e3
    original = vars(CppVecKernel)["get_to_dtype_expr"]
    plain_out, plain = _generated(_codes, x, _plain_options())
    with codegen.vector_bitcasts():
        out, code = _generated(_codes, x, codegen.options())
    if codegen.vec_isa().startswith("avx512"):
        assert "at::vec::cast<uint8_t>(at::vec::convert<int8_t>(" in code
    else:
        assert "_mm_packus_epi32(" in code and "_mm_packus_epi16(" in code
    assert "at::vec::convert<uint8_t>(" in plain  # torch 2.14 without the fix: ATen's generic, scalar conversion
    assert "at::vec::convert<uint8_t>(" not in code
    # the packing loop reads int16 pairs: a loop of vectors inside the context, a lane at a time without it
    assert "at::vec::Vectorized<int16_t>::loadu(" in code and "Vectorized<int16_t>" not in plain
    assert torch.int16 not in torch._inductor.codegen.cpp.VECTORIZABLE_DTYPES  # undone after the context
    assert vars(CppVecKernel)["get_to_dtype_expr"] is original
    expected = _codes(x)
    for got in (out, plain_out):
        assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))


def _fp8_as_float(codes, scales):  # float32 lanes: one vector of codes to one of floats
    return codes.float() * 1.0


def _fp8_as_bf16(codes, scales):  # a dequantisation into bf16: one vector of codes to two of floats
    return (codes.float() * scales).to(torch.bfloat16)


@pytest.mark.skipif(not codegen.vec_isa().startswith("avx512"), reason="AVX-512 only")
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_to_float_is_vector_code_with_the_bits_of_torchs_cast_for_every_code(dtype):
    """Every fp8 code (NaN's bits and both zeros included), in both loop widths: e4m3 through fp16, e5m2 by ATen's
    conversion of 16 lanes, where ATen's generic conversion of 32 lanes runs a lane at a time."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(64)[torch.randperm(256 * 64)].view(dtype)
    scales = torch.full((codes.numel(),), 2.0 ** -3)
    fp8 = str(dtype).removeprefix("torch.").replace("float8", "at::Float8")
    for fn, bits in ((_fp8_as_float, torch.int32), (_fp8_as_bf16, torch.int16)):
        plain_out, plain = _generated(fn, (codes, scales), _plain_options())
        with codegen.vector_bitcasts():
            out, code = _generated(fn, (codes, scales), codegen.options())
        if fn is _fp8_as_bf16:  # torch 2.14 without the fix: ATen's generic, scalar conversion
            assert f"at::vec::convert<float,2,{fp8},1>(" in plain and "at::vec::convert<float,2," not in code
        if dtype == torch.float8_e4m3fn:  # ATen's own e4m3 conversion is replaced in both widths
            assert "_mm512_srai_epi16(" in code and f"at::vec::convert<float>(at::vec::Vectorized<{fp8}>" not in code
        expected = fn(codes, scales)
        assert torch.equal(out.view(bits), expected.view(bits))
        # ATen's own vector conversion gives e4m3's NaN other bits (0x7FC00000) than the cast (0x7FF00000)
        number = ~expected.isnan()
        assert torch.equal(plain_out[number].view(bits), expected[number].view(bits))
        assert plain_out[~number].isnan().all()


def _bytes_as_fp8(x, payload):  # codes computed as uint8, written into an fp8 payload (the stochastic fp8 weight)
    return payload.copy_(((x.view(torch.int32) >> 20) & 0xFF).to(torch.uint8).view(payload.dtype))


@pytest.mark.skipif(not codegen.vec_isa().startswith("avx512"), reason="AVX-512 only")
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_bit_casts_between_byte_types_are_vector_code_with_the_same_bytes(dtype):
    x = torch.randn(1 << 14) * 1e3
    plain_out, plain = _generated(_bytes_as_fp8, (x, torch.empty(x.shape, dtype=dtype)), _plain_options())
    with codegen.vector_bitcasts():
        out, code = _generated(_bytes_as_fp8, (x, torch.empty(x.shape, dtype=dtype)), codegen.options())
    fp8 = str(dtype).removeprefix("torch.").replace("float8", "at::Float8")
    assert f"c10::bit_cast<{fp8}>" in plain  # torch 2.14 without the fix: a lane-by-lane copy through memory
    assert f"at::vec::Vectorized<{fp8}>(__m512i(" in code and "bit_cast" not in code
    expected = _bytes_as_fp8(x, torch.empty(x.shape, dtype=dtype)).view(torch.uint8)
    assert torch.equal(out.view(torch.uint8), expected) and torch.equal(plain_out.view(torch.uint8), expected)


def _indices(counter):  # the stochastic rounding's noise (int32 element indices), and int64 indices with stride 3
    wide = torch.arange(0, 3 * 4096, 3, dtype=torch.int64) + counter[1]
    return counter_noise(counter, 4096, 20), wide * 0x9E3779B1 ^ (wide >> 7)


def test_integer_indices_are_a_broadcast_plus_constant_lanes_with_the_same_values():
    """Inductor builds a vector of element indices from one scalar per lane (16 ``lea`` and inserts per vector in
    ``perf annotate`` of the fp8 step); inside the context it is the first index broadcast plus the constant lanes
    ``arange(0, stride)``. Indices near int32's limits wrap alike."""
    for counter in (torch.tensor([0x12345678, 1 << 20]), torch.tensor([7, (1 << 31) - 100])):
        expected = _indices(counter)
        plain_out, plain = _generated(_indices, counter, _plain_options())
        with codegen.vector_bitcasts():
            out, code = _generated(_indices, counter, codegen.options())
        assert "::arange(0, 1))" in code and "::arange(0, 3))" in code
        assert "::arange(0, " not in plain  # torch 2.14 without the fix: arange(first index, stride), lane by lane
        for got in (out, plain_out):
            assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))


def _clamped(x):  # a clamp to constants (every encode), a maximum with zero (left as Inductor writes it), a maximum
    return x.clamp(-448.0, 448.0), torch.maximum(x, torch.zeros(())), torch.maximum(x, x.flip(0))  # of two tensors


def test_max_and_min_with_a_nonzero_constant_are_one_instruction_that_keeps_nan_and_signed_zeros():
    """IEEE maximum/minimum are four instructions each in ATen's vector code (max, an unordered compare, a mask to a
    vector, an or: NaN from either side). With a constant that is not NaN only the other side can be NaN, and
    ``clamp_min``/``clamp_max`` (the constant first: the instruction returns its second operand, the tensor's value,
    on NaN) give eager's bits in one, NaN's too; with a zero constant -0.0 and +0.0 could differ, so that stays."""
    x = torch.randn(1 << 12) * 1000
    x[:6] = torch.tensor([float("nan"), -float("nan"), 0.0, -0.0, 448.0, -448.0])
    x[6:9] = torch.tensor([float("inf"), -float("inf"), 448.00003])
    expected = _clamped(x)
    plain_out, plain = _generated(_clamped, x, _plain_options())
    with codegen.vector_bitcasts():
        out, code = _generated(_clamped, x, codegen.options())
    assert "at::vec::clamp_min(" in code and "at::vec::clamp_max(" in code and "clamp_m" not in plain
    assert code.count("at::vec::maximum(") == 2  # the zero constant and the two tensors
    assert all(torch.equal(g.view(torch.int32), e.view(torch.int32)) for g, e in zip(out, expected, strict=True))
    for g, e in zip(plain_out, expected, strict=True):  # the same values; ATen's NaN is all ones (0xFFFFFFFF), where
        torch.testing.assert_close(g, e, rtol=0, atol=0, equal_nan=True)  # the clamp and eager keep x's NaN


def _nibbles(payload, scales):  # fp4 bytes read element by element (the step's weight: codecs._decode_e2m1_elements),
    shifted = payload[..., None].expand(*payload.shape, 2).reshape(payload.shape[0], -1).to(torch.int32)  # and a byte
    odd = torch.arange(shifted.shape[-1], dtype=torch.int32) & 1  # read at an index that is not i // 2 (left alone)
    values = ((shifted >> (odd << 2)) & 0xF).float().view(payload.shape[0], -1, 32) * scales[..., None]
    return values.view(payload.shape[0], -1), payload.flip(-1).to(torch.int32)


@pytest.mark.skipif(codegen.vec_isa().split()[0] not in ("avx512", "avx2"), reason="AVX-512 and AVX2 only")
def test_bytes_read_by_two_elements_each_are_one_vector_load_with_the_same_values():
    """Element i of a row reading byte i // 2 (an fp4 payload decoded element by element): Inductor fills a vector
    from sixteen scalar loads (an array, then a vector load that waits on the stores); inside the context half as many
    bytes are loaded and each interleaved with itself. Run under ``ATEN_CPU_CAPABILITY=avx2`` too."""
    gen = torch.Generator().manual_seed(0)
    payload = torch.randint(0, 256, (64, 64), dtype=torch.uint8, generator=gen)
    scales = torch.rand(64, 4, generator=gen)
    expected = _nibbles(payload, scales)
    plain_out, plain = _generated(_nibbles, (payload, scales), _plain_options())
    with codegen.vector_bitcasts():
        out, code = _generated(_nibbles, (payload, scales), codegen.options())
    assert code.count("_mm_unpacklo_epi8(b, b)") == 1 and "_mm_unpacklo_epi8" not in plain
    halved = re.compile(r"div_floor_integer\(static_cast<int64_t>\((x\d) \+ \1_inner\), static_cast<int64_t>\(2L\)\)")
    assert halved.search(plain) and not halved.search(code)  # torch 2.14 without the fix: a lane at a time
    for got in (out, plain_out):
        assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))


_PARTIAL = {  # a loop beside float32 reading 8 bytes of uint8 (AVX2: 8 lanes), one beside bf16 reading 16 (16 lanes)
    "8": lambda codes, grad, scales: codes.to(torch.int32).float() * scales[:, None],
    "16": lambda codes, grad, scales: (codes.to(torch.int32).float() * grad.float()).amax(-1),
}


@pytest.mark.skipif(codegen.vec_isa().split()[0] != "avx2", reason="AVX2 only (run with ATEN_CPU_CAPABILITY=avx2)")
@pytest.mark.parametrize("lanes", list(_PARTIAL))
def test_partial_vector_loads_under_avx2_go_straight_into_the_register_with_the_same_values(lanes):
    """ATen's AVX2 ``loadu(ptr, count)`` of fewer bytes than the register copies them into an array and loads that (a
    store-forwarding stall on every load of fp8 codes, fp4 bytes and bf16 gradients: about half the AVX2 step's time);
    inside the context the bytes load straight into the register, the rest of it as ATen leaves it (ones for uint8).
    The step's 8-lane loads of bf16 (zeros above) are checked by tests/mvas/test_kernels.py's AVX2 test."""
    gen = torch.Generator().manual_seed(0)
    args = (torch.randint(0, 256, (64, 128), dtype=torch.uint8, generator=gen),
            torch.randn(64, 128, generator=gen).bfloat16(), torch.rand(64, generator=gen))
    expected = _PARTIAL[lanes](*args)
    plain_out, plain = _generated(_PARTIAL[lanes], args, _plain_options())
    with codegen.vector_bitcasts():
        out, code = _generated(_PARTIAL[lanes], args, codegen.options())
    partial = re.compile(rf"Vectorized<uint8_t>::loadu\(in_ptr\d \+ [^;]*, static_cast<int64_t>\({lanes}\)\)")
    fast = "_mm256_blend_epi32(_mm256_set1_epi8(1), _mm256_castsi128_si256(_mm_load"
    assert partial.search(plain) and fast not in plain  # torch 2.14 without the fix: ATen's partial load
    assert fast in code and not partial.search(code)
    assert torch.equal(out, expected) and torch.equal(plain_out, expected)


def _two_vectors(codes, grad):  # a loop beside bf16 (two float vectors): bytes to int32, int32 <-> float, a bit cast
    c = codes.to(torch.int32)
    f = c.float() * grad.float()
    t = (f * 7.0).to(torch.int32)  # truncation toward zero, negative values included
    bits = (((c & 0x7F) << 23) + (t & 0xFF)).view(torch.float32)
    return bits + f, t


@pytest.mark.skipif(codegen.vec_isa().split()[0] not in ("avx512", "avx2"), reason="AVX-512 and AVX2 only")
def test_conversions_into_two_vectors_are_vector_code_with_the_same_values():
    """Beside a 16-bit type a loop holds two float vectors (the AVX2 step's block maxima beside its bf16 gradient, a
    dequantisation into bf16 under AVX2), where ATen converts bytes to int32 and int32 <-> float32 for one vector only
    and Inductor's bit cast of two is a lane-by-lane copy: each went through memory. Run under
    ``ATEN_CPU_CAPABILITY=avx2`` too."""
    gen = torch.Generator().manual_seed(0)
    args = (torch.randint(0, 256, (64, 128), dtype=torch.uint8, generator=gen),
            (torch.randn(64, 128, generator=gen) * 4).bfloat16())
    expected = _two_vectors(*args)
    plain_out, plain = _generated(_two_vectors, args, _plain_options())
    with codegen.vector_bitcasts():
        out, code = _generated(_two_vectors, args, codegen.options())
    generic = ("at::vec::convert<int32_t,2,uint8_t,1>(", "at::vec::convert<float,2,int32_t,2>(",
               "at::vec::convert<int32_t,2,float,2>(", "tmpbuf_out")
    assert all(g in plain for g in generic)  # torch 2.14 without the fix: ATen's generic, scalar conversions
    assert not any(g in code for g in generic) and "_cvtepu8_epi32(" in code
    for got in (out, plain_out):
        assert all(torch.equal(g.view(torch.int32), e.view(torch.int32)) for g, e in zip(got, expected, strict=True))
