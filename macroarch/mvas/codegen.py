"""How Inductor generates the C++ of the MVAS kernels: the options they compile with, and fixes to its vector code.

``macroarch.mvas.compiled`` compiles every kernel through ``options()`` and generates its code inside
``vector_bitcasts()``; nothing here touches any other ``torch.compile`` in the process (one compiling in another
thread at that very moment would see the vector casts too, which give the same bits).

**The vector ISA in the cache key** (``options``): ``cpp.simdlen`` is pinned to the width Inductor picks in this
process, so that Inductor's FX graph cache, whose key holds no CPU ISA, keeps one entry per vector width
(``compiled``'s module docstring tells what goes wrong without it).

**Threads** (``options``): ``cpp.dynamic_threads``, so that the loops ask OpenMP for the thread count of each call.
Otherwise Inductor writes the thread count of the compiling process into the code, and dynamo's guards do not see
it: a kernel compiled under one thread ran on one thread after ``torch.set_num_threads(2)`` (measured:
``MVASAdamW`` at 16M elements, 119.6 ms on one thread, 114.9 on two; now 101 and 47).

**Vector bit casts** (``vector_bitcasts``). ``Tensor.view(dtype)`` between float32 and int32, which the kernels do in
every stochastic rounding, block scale and code computation, has no vector form in Inductor's C++ code generation
(torch 2.14: ``CppVecOverrides`` has no ``to_dtype_bitcast``, so ``_scalarize`` makes it a lambda that stores the
vector into an array, casts it lane by lane into a second array and loads that). gcc copies the array with 256-bit
moves, and the 512-bit load after them waits for both stores to retire: a store-forwarding stall on every cast
(``perf annotate`` of the fp4 dequantisation: most of its cycles on the instructions after such loads). Inside this
context a cast between 32-bit types of one vector each is ``at::vec::cast``, ATen's reinterpretation of the vector
(one register move on AVX-512 and AVX2), and of two vectors (a loop beside a 16-bit type) that of each. The values are
the same bits either way (the first-call check in ``compiled`` still compares each kernel with its eager source).
Measured on one core (AVX-512), 2^20 elements, ns per element: the fp8 step 5.6 -> 4.6, the step with fp4 weights
8.3 -> 6.3. On AVX-512 a cast between 1-byte types of one vector each (uint8 codes stored into an fp8 payload: the
stochastically rounded fp8 weight, ``codecs._fp8_by_arithmetic``) is likewise the same register taken as the other type
(``Vectorized<T>(__m512i(x))``), where Inductor copied it a lane at a time through memory.

**Narrowing to bytes** (same context). ATen's AVX-512 vector library converts int32 and int16 vectors to int8 in one
instruction (``vpmovdb``, ``vpmovwb``) but has no such conversion to uint8, so Inductor's ``at::vec::convert<uint8_t>``
of an int32 vector (every fp4 code, and the packing of two codes into a byte) is ATen's generic one: a store, sixteen
scalar conversions (``vpextrd``/``vpinsrb`` in ``perf annotate``) and a partial load. Inside this context it is the int8
conversion, reinterpreted as uint8: the same bytes (both truncate to the low 8 bits). AVX2 has no such conversion
either: there the low bytes are packed with AVX2's unsigned saturating packs, of values masked to 0..255 (so exact).

**Loops over int16** (same context). Inductor vectorises a loop only when every dtype in it is in its
``VECTORIZABLE_DTYPES``, which lacks int16 (ATen's vector library has ``Vectorized<int16_t>`` with the bitwise ops
and shifts the kernels use). The fp4 packing reads two codes as one int16 (``codecs._pack_nibbles``), so it ran a
lane at a time, about 8% of the step with fp4 weights in ``perf``; inside this context int16 is vectorisable too.
Only as a source: Inductor's vector ``to_dtype`` has no int16 target (it raises while generating the code, and
``compiled`` then runs the eager path), so no kernel converts to int16; views and bitwise ops are what they use.

**fp8 to float** (same context, AVX-512). ATen converts one vector of fp8 codes into one of float32
(``VecConvert<float, 1, Float8_*, 1>``) but has no conversion into two, which Inductor asks for wherever a loop also
holds a 16-bit type (a dequantisation into bf16: 32 lanes): the generic one, a store and 32 scalar conversions. Inside
this context that is ATen's conversion twice, on each half of the codes (e5m2), or, for e4m3, this module's own,
in both widths: ATen's e4m3 conversion renormalises subnormals with a branch and about 25 instructions per 16 lanes,
where the code's sign, exponent and mantissa bits placed into an fp16 (bias 15 for 7: a factor 2^-8; e4m3's
subnormals are fp16 subnormals, which ``vcvtph2ps`` converts exactly) and scaled by 2^8 (exact: every value is a
normal float32) take about a dozen for 32 lanes, and 0x7F/0xFF become the NaN of torch's cast (0x7FF00000 with the
code's sign; ATen's vector conversion gives 0x7FC00000). Every code gives the bits of torch's cast (tested). Measured on
one core, in one session: an fp8 e4m3 weight of 672 x 256 read into bf16, 50-51 -> 30 us (e5m2: 137 -> 25);
``MVASAdamW`` with fp8 weights and moments on 8 tensors of 2^21 elements, 75-81 -> 71-73 ms a step.

**Element indices** (same context). Inductor writes a vector of consecutive integer indices (the noise hash's
element index in every stochastic rounding) as ``Vectorized<int32_t>::arange(first, stride)``, which ATen builds from
one scalar per lane: sixteen ``lea`` and as many inserts per vector in ``perf annotate`` of the fp8 step. Inside this
context it is the first index broadcast plus ``arange(0, stride)``, a constant: the same values (both wrap alike), two
instructions. Measured on one core, ``MVASAdamW`` with fp8 weights on 2^20 elements: 0.78-0.81 -> 0.86-0.89 of
foreach AdamW's speed.

**Max and min with a constant** (same context). ATen's vector ``maximum``/``minimum`` are IEEE's: NaN from either
side, four instructions (the max, an unordered compare, the mask made a vector, an or). Every encoding clamps to the
format's range, two of them per element. Where one side is a constant that is finite and nonzero (its value range, which
Inductor knows for the scalar, is kept on the vector it is broadcast to), only the other side can be NaN, and ATen's
``clamp_min``/``clamp_max`` put the constant first, so the instruction returns the other side's value on NaN: one
instruction, eager's bits, NaN's payload too (ATen's own gives all ones). A zero constant is left alone (-0.0 and
+0.0 compare equal, and the instruction would pick the other side's zero). Measured on one core, ``MVASAdamW`` with fp8
weights on 2^20 elements, four alternating runs of each: 0.89-1.02 (mean 0.96) -> 0.97-0.99 (0.98) of foreach AdamW's
speed.

**Bytes read twice** (same context). Where element ``i`` of a loop reads byte ``i // 2`` (an fp4 weight decoded
element by element into float32: ``codecs._decode_e2m1_elements``), Inductor fills each vector from one scalar load
per lane into an array, then loads the array (a store-forwarding stall). Inside this context the vector's half as many
bytes are loaded at once and interleaved with themselves (``_mm_unpacklo_epi8``): the same bytes. With it, decoding
fp4 element by element beats decoding by pairs (172K elements into float32, one AVX-512 core: 104-116 -> 76-79 us;
under AVX2 332-373 -> 122-125), and the step with fp4 weights decodes them in its main loop (``kernels``' docstring).

**AVX2 partial loads** (same context). Under AVX2 a loop of 8 float lanes reads 8 bytes of fp8 codes or fp4 bytes and 16
of a bf16 gradient, less than the 32-byte register; ATen's ``loadu(ptr, count)`` copies them into an array and loads
the array, a store-forwarding stall on every such load (``perf``: the hottest instructions of the AVX2 step). Inside
this context they load straight into the register, the rest of it as ATen leaves it (ones for uint8, zeros for bf16
and fp16). ``MVASAdamW`` under ``ATEN_CPU_CAPABILITY=avx2`` (AVX-512 machine, 1M-4M elements, two alternated runs of
each): fp8 weights 0.23-0.28 -> 0.51-0.61 of foreach AdamW's speed, fp4 0.27-0.33 -> 0.46-0.57.

**Conversions into two vectors** (same context). Beside a 16-bit type a loop holds two float vectors (AVX2's step
beside its bf16 gradient, a read into bf16 under AVX2). ATen converts uint8 -> int32 and int32 <-> float32 for one
vector only; for two, a store, a conversion per lane and a load (``perf``: the hottest instructions of the AVX2 fp8
read into bf16). Here bytes become int32 by ``vpmovzxbd`` of each half, int32 <-> float32 is ATen's one-vector
conversion of each (the same bits). One core, ``ATEN_CPU_CAPABILITY=avx2``: an fp8 672x256 read into bf16 330-390 ->
116-124 us; ``MVASAdamW`` at 1M-4M, fp8 weights 0.40-0.54 -> 0.52-0.60 of foreach AdamW, fp4 0.37-0.51 -> 0.48-0.58.

The fix changes generated code that Inductor's cache key does not see, so the kernels compile with a graph pass that
does nothing and whose ``uuid`` names the fix (``post_grad_custom_post_pass``: Inductor's documented way to put a
custom pass into the key): a cache entry written without the fix is never read back with it, nor the reverse.
Under another torch's code generation nothing is patched and the key has no pass.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from typing import Any

__all__ = ["options", "vec_isa", "vector_bitcasts"]

_FIX = ("macroarch.mvas.codegen: vector bit casts between 32-bit types (at::vec::cast), 2; "
        "int32/int16 to uint8 through int8 on AVX-512, by saturating packs on AVX2, 1; int16 loops vectorised, 1; "
        "fp8 e4m3 to float through fp16 on AVX-512, 2; fp8 e5m2 to two float vectors, 2; "
        "bit casts between 1-byte types on AVX-512, 1; integer arange as a broadcast plus constant lanes, 1; "
        "float max/min with a constant as one instruction, 1; bytes read twice for elements 2i and 2i + 1, 1; "
        "AVX2 partial loads straight into the register, 1; conversions into two vectors, 1")


def vec_isa() -> str:
    """The CPU vector ISA Inductor compiles the kernels for in this process (``pick_vec_isa``, which honours
    ``ATEN_CPU_CAPABILITY``)."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return str(pick_vec_isa()) or "none"


def options() -> dict[str, Any]:
    """Inductor options for the kernels: ``cpp.simdlen`` pinned to the vector width Inductor picks in this process
    (the user's own ``cpp.simdlen`` if set; module docstring), and the cache key of ``vector_bitcasts``."""
    from torch._inductor import config as inductor_config
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    if inductor_config.cpp.simdlen is not None:
        chosen: dict[str, Any] = {"cpp.simdlen": inductor_config.cpp.simdlen}
    else:
        isa = pick_vec_isa()
        chosen = {"cpp.simdlen": isa.bit_width() if isa else 1}  # 1: no vectorisation (no vector ISA here)
    chosen["cpp.dynamic_threads"] = True  # the thread count of each call, not of the compiling one (docstring)
    patch = _bitcast_patch()
    if patch is not None:
        chosen["post_grad_custom_post_pass"] = patch[1]
    return chosen


# AVX-512: fp8 e4m3fn codes (the low 16 or 32 bytes of a vector, int16 lanes ``h``) as float32 (module docstring, "fp8
# to float"): ``f16`` their fp16 patterns, ``nan`` the NaN codes, ``part`` one vector of floats from 16 of them
_E4M3_HALF = ("const __m512i f16 = _mm512_and_si512(_mm512_srai_epi16(_mm512_slli_epi16(h, 8), 1), "
              "_mm512_set1_epi16(-16385)); "  # sign to bit 15, exponent and mantissa to bits 7..13
              "const __mmask32 nan = _mm512_cmpeq_epi16_mask(_mm512_or_si512(h, _mm512_set1_epi16(0x80)), "
              "_mm512_set1_epi16(0xFF)); "
              "auto part = [&](__m256i half, __mmask16 is_nan) {{ "
              "__m512 f = _mm512_mul_ps(_mm512_cvtph_ps(half), _mm512_set1_ps(256.0f)); "
              "if (C10_UNLIKELY(is_nan)) f = _mm512_mask_mov_ps(f, is_nan, _mm512_castsi512_ps(_mm512_or_si512("
              "_mm512_set1_epi32(0x7FF00000), "
              "_mm512_and_si512(_mm512_castps_si512(f), _mm512_set1_epi32(INT32_MIN))))); "
              "return f; }}; ")
_E4M3_CODES = "const __m512i h = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(__m512i({0}))); " + _E4M3_HALF
# AVX-512: fp8 codes as float32, by (fp8 dtype's name, float vectors): e4m3 by _E4M3_HALF in both widths, e5m2's 32
# lanes by ATen's conversion of 16 twice (ATen's own conversion of 16 e5m2 lanes, through fp16, stays)
_FP8_TO_FLOAT = {
    ("float8_e4m3fn", 1): "[&]() {{ " + _E4M3_CODES
    + "return at::vec::Vectorized<float>(part(_mm512_castsi512_si256(f16), __mmask16(nan))); }}()",
    ("float8_e4m3fn", 2): "[&]() {{ " + _E4M3_CODES
    + "at::vec::VectorizedN<float, 2> r; r[0] = part(_mm512_castsi512_si256(f16), __mmask16(nan)); "
      "r[1] = part(_mm512_extracti64x4_epi64(f16, 1), __mmask16(nan >> 16)); return r; }}()",
    ("float8_e5m2", 2): "[&]() {{ const __m512i v = __m512i({0}); at::vec::VectorizedN<float, 2> r; "
                        "r[0] = at::vec::convert<float>(at::vec::Vectorized<at::Float8_e5m2>(v)); "
                        "r[1] = at::vec::convert<float>(at::vec::Vectorized<at::Float8_e5m2>("
                        "_mm512_castsi128_si512(_mm512_extracti32x4_epi32(v, 1)))); return r; }}()",
}

# AVX2: the low byte of each lane, packed into the low lanes of a uint8 vector (the rest zero), with unsigned saturating
# packs of values masked to 0..255 (so exact): 8 int32 lanes (two packs) or 16 int16 lanes (one)
_AVX2_BYTES = {
    "int32": "[&]() {{ __m256i t = _mm256_and_si256(__m256i({0}), _mm256_set1_epi32(255)); "
             "__m128i w = _mm_packus_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1)); "
             "return at::vec::Vectorized<uint8_t>(_mm256_inserti128_si256(_mm256_setzero_si256(), "
             "_mm_packus_epi16(w, _mm_setzero_si128()), 0)); }}()",
    "int16": "[&]() {{ __m256i t = _mm256_and_si256(__m256i({0}), _mm256_set1_epi16(255)); "
             "return at::vec::Vectorized<uint8_t>(_mm256_inserti128_si256(_mm256_setzero_si256(), "
             "_mm_packus_epi16(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1)), 0)); }}()",
}

# conversions into two vectors (a loop beside a 16-bit type: 32 lanes on AVX-512, 16 on AVX2), where ATen has them
# for one vector only and its generic one stores the source, converts lane by lane and loads the result (a
# store-forwarding stall): int32 <-> float32 as ATen's one-vector conversion of each half (any ISA: the same
# truncation and rounding), by (source, target) dtype; uint8 codes into int32 from their low 32 (16) bytes, by ISA
_TO_PAIR = {(s, d): f"at::vec::VectorizedN<{c}, 2>(at::vec::convert<{c}>({{0}}[0]), at::vec::convert<{c}>({{0}}[1]))"
            for s, d, c in (("torch.int32", "torch.float32", "float"), ("torch.float32", "torch.int32", "int32_t"))}
_BYTES_TO_INT32_PAIR = {
    "avx512": "[&]() {{ const __m512i v = __m512i({0}); return at::vec::VectorizedN<int32_t, 2>("
              "at::vec::Vectorized<int32_t>(_mm512_cvtepu8_epi32(_mm512_castsi512_si128(v))), "
              "at::vec::Vectorized<int32_t>(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(v, 1)))); }}()",
    "avx2": "[&]() {{ const __m128i b = _mm256_castsi256_si128(__m256i({0})); "
            "return at::vec::VectorizedN<int32_t, 2>(at::vec::Vectorized<int32_t>(_mm256_cvtepu8_epi32(b)), "
            "at::vec::Vectorized<int32_t>(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)))); }}()",
}

# each byte twice, from half as many (``_halved`` indices), by vector width and lanes: the low 8 (4) bytes loaded and
# interleaved with themselves (b0 b0 b1 b1 ...), where Inductor loads the 16 (8) lanes one scalar at a time
_BYTES_TWICE = {
    512: {16: "at::vec::Vectorized<uint8_t>([&]() {{ const __m128i b = _mm_loadl_epi64("
              "reinterpret_cast<const __m128i*>({0})); return _mm512_castsi128_si512(_mm_unpacklo_epi8(b, b)); }}())"},
    256: {8: "at::vec::Vectorized<uint8_t>([&]() {{ int32_t w; std::memcpy(&w, {0}, 4); const __m128i b = "
             "_mm_cvtsi32_si128(w); return _mm256_castsi128_si256(_mm_unpacklo_epi8(b, b)); }}())"},
}

# AVX2: a contiguous vector of fewer bytes than the register (8 or 16 bytes of uint8, 16 of bf16/fp16), by (dtype,
# bytes): the register ATen's partial ``loadu(ptr, count)`` gives (the rest ones for uint8, zeros for 16-bit floats),
# loaded straight, where ATen copies the bytes into an array and loads that (a store-forwarding stall per load)
_LOW = "_mm256_castsi128_si256({}(reinterpret_cast<const __m128i*>({{0}})))"
_AVX2_PART = {
    ("torch.uint8", 8): "at::vec::Vectorized<uint8_t>(_mm256_blend_epi32(_mm256_set1_epi8(1), "
                        + _LOW.format("_mm_loadl_epi64") + ", 0x03))",
    ("torch.uint8", 16): "at::vec::Vectorized<uint8_t>(_mm256_blend_epi32(_mm256_set1_epi8(1), "
                         + _LOW.format("_mm_loadu_si128") + ", 0x0F))",
    ("torch.bfloat16", 16): "at::vec::Vectorized<at::BFloat16>(_mm256_inserti128_si256(_mm256_setzero_si256(), "
                            "_mm_loadu_si128(reinterpret_cast<const __m128i*>({0})), 0))",
    ("torch.float16", 16): "at::vec::Vectorized<at::Half>(_mm256_inserti128_si256(_mm256_setzero_si256(), "
                           "_mm_loadu_si128(reinterpret_cast<const __m128i*>({0})), 0))",
}


def _halved(index: Any, var: Any) -> bool:
    """Whether ``index`` is ``base + var // 2`` with ``base`` free of ``var``: element ``var`` reads byte ``var // 2``
    (an fp4 payload's byte for each of its two elements; ``var`` starts each vector at an even value)."""
    import sympy
    from torch.utils._sympy.functions import FloorDiv

    terms = [t for t in sympy.Add.make_args(index) if var in t.free_symbols]
    return len(terms) == 1 and terms[0] == FloorDiv(var, 2)


def _nonzero_constant(var: Any) -> bool:
    """Whether an Inductor C++ variable is known to hold one finite, nonzero float32 value (its value range is that
    value: a constant, or its broadcast inside ``vector_bitcasts``)."""
    import torch

    bounds = getattr(var, "bounds", None)
    lower, upper = getattr(bounds, "lower", None), getattr(bounds, "upper", None)
    try:
        return (getattr(var, "dtype", None) == torch.float32 and lower is not None and bool(lower == upper)
                and math.isfinite(float(lower)) and float(lower) != 0.0)
    except (TypeError, ValueError):  # a symbolic bound
        return False


@contextlib.contextmanager
def vector_bitcasts() -> Iterator[None]:
    """Generate the kernels' C++ with vector bit casts and byte narrowing (module docstring); a no-op where the patch
    does not apply. The code generation of a compile runs in the calling thread, inside this context."""
    patch = _bitcast_patch()
    if patch is None:
        yield
        return
    replaced, _ = patch
    for owner, name, _original, vectorised in replaced:
        setattr(owner, name, vectorised)
    try:
        yield
    finally:
        for owner, name, original, _vectorised in replaced:
            setattr(owner, name, original)


@functools.cache
def _bitcast_patch() -> tuple[tuple[tuple[type, str, Any, Any], ...], Any] | None:
    """((owner, attribute, original, replacement) for ``CppVecOverrides.to_dtype_bitcast``, ``.maximum`` and
    ``.minimum``, ``CppVecKernel.get_to_dtype_expr``, ``.arange`` and ``.broadcast`` and the list of dtypes Inductor
    vectorises, the cache-key pass), or None where Inductor's C++ code generation does not have the shape this fix was
    written for."""
    try:
        from torch._inductor.codegen import cpp
        from torch._inductor.custom_graph_pass import CustomGraphPass
    except ImportError:
        return None
    overrides = getattr(cpp, "CppVecOverrides", None)
    original = vars(overrides).get("to_dtype_bitcast") if overrides is not None else None
    kernel_type = getattr(cpp, "CppVecKernel", None)
    to_dtype_expr = vars(kernel_type).get("get_to_dtype_expr") if kernel_type is not None else None
    vectorizable = getattr(cpp, "VECTORIZABLE_DTYPES", None)
    original_arange = vars(kernel_type).get("arange") if kernel_type is not None else None
    original_broadcast = vars(kernel_type).get("broadcast") if kernel_type is not None else None
    maximum, minimum = (vars(overrides).get(name) if overrides is not None else None for name in ("maximum", "minimum"))
    original_load = vars(kernel_type).get("load") if kernel_type is not None else None
    if not isinstance(original, staticmethod) or not callable(to_dtype_expr) or not callable(original_arange) or \
            not callable(original_broadcast) or not isinstance(maximum, staticmethod) or \
            not isinstance(minimum, staticmethod) or not callable(original_load) or \
            not hasattr(kernel_type, "_get_num_vectors") or not hasattr(cpp, "DTYPE_TO_CPP") or \
            not isinstance(vectorizable, list):
        return None
    import torch

    scalarised = original.__func__
    _BYTE_TYPES = {torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2}

    def width(kernel: Any) -> int:  # the vector width in bits (0: unknown)
        return getattr(kernel.vec_isa, "bit_width", lambda: 0)()

    def to_dtype_bitcast(x: Any, dtype: Any, src_dtype: Any) -> Any:
        kernel = cpp.V.kernel
        if (isinstance(kernel, kernel_type) and dtype in cpp.DTYPE_TO_CPP and dtype.itemsize == src_dtype.itemsize == 4
                and kernel._get_num_vectors(src_dtype) == kernel._get_num_vectors(dtype) == 2):
            cast = f"at::vec::cast<{cpp.DTYPE_TO_CPP[dtype]}>"
            return f"at::vec::VectorizedN<{cpp.DTYPE_TO_CPP[dtype]}, 2>({cast}({x}[0]), {cast}({x}[1]))"
        if (isinstance(kernel, kernel_type) and dtype in cpp.DTYPE_TO_CPP
                and kernel._get_num_vectors(src_dtype) == 1 and kernel._get_num_vectors(dtype) == 1):
            if dtype.itemsize == src_dtype.itemsize == 4:
                return f"at::vec::cast<{cpp.DTYPE_TO_CPP[dtype]}>({x})"
            if {dtype, src_dtype} <= _BYTE_TYPES and dtype != src_dtype and width(kernel) == 512:
                return f"at::vec::Vectorized<{cpp.DTYPE_TO_CPP[dtype]}>(__m512i({x}))"
        return scalarised(x, dtype, src_dtype)

    def get_to_dtype_expr(self: Any, src: Any, dtype: Any, src_dtype: Any, rounding: bool = False) -> str:
        bits = width(self)
        if self._get_num_vectors(dtype) == 2 and getattr(src, "is_vec", False) and not rounding:
            if self._get_num_vectors(src_dtype) == 2 and (str(src_dtype), str(dtype)) in _TO_PAIR:
                return _TO_PAIR[(str(src_dtype), str(dtype))].format(src)
            isa = (str(self.vec_isa).split() or [""])[0]  # "avx512 avx512_vnni amx_tile" on AMX
            if src_dtype == torch.uint8 and dtype == torch.int32 and isa in _BYTES_TO_INT32_PAIR \
                    and self._get_num_vectors(src_dtype) == 1:
                return _BYTES_TO_INT32_PAIR[isa].format(src)
        fp8 = (str(src_dtype).removeprefix("torch."), self._get_num_vectors(dtype))
        if (dtype == torch.float32 and fp8 in _FP8_TO_FLOAT and bits == 512 and getattr(src, "is_vec", False)
                and self._get_num_vectors(src_dtype) == 1):
            return _FP8_TO_FLOAT[fp8].format(src)
        if (dtype == torch.uint8 and src_dtype in (torch.int32, torch.int16) and not rounding
                and getattr(src, "is_vec", False)
                and self._get_num_vectors(src_dtype) == 1 and self._get_num_vectors(dtype) == 1):
            if bits == 512:
                return f"at::vec::cast<uint8_t>(at::vec::convert<int8_t>({src}))"
            if bits == 256 and str(self.vec_isa) == "avx2":
                return _AVX2_BYTES[str(src_dtype).removeprefix("torch.")].format(src)
        return to_dtype_expr(self, src, dtype, src_dtype, rounding)

    def load(self: Any, name: str, index: Any) -> Any:
        dtype = cpp.V.graph.get_dtype(name)
        if not self.tail_size and self._load_mask is None and self._get_num_vectors(dtype) == 1:
            renamed, var = self.rename_indexing(index), self.itervars[self.tiling_idx]
            line = None
            if dtype == torch.uint8 and self.tiling_factor in _BYTES_TWICE.get(width(self), {}) \
                    and _halved(renamed, var):
                line = _BYTES_TWICE[width(self)][self.tiling_factor]
            elif str(self.vec_isa) == "avx2" and (str(dtype), self.tiling_factor * dtype.itemsize) in _AVX2_PART \
                    and self._try_get_const_stride(renamed, var) == 1:
                line = _AVX2_PART[(str(dtype), self.tiling_factor * dtype.itemsize)]
            if line is not None:
                csevar = self.cse.generate(
                    self.loads, line.format(f"{self.args.input(name)} + {cpp.cexpr_index(renamed)}"), dtype=dtype)
                csevar.update_on_args("load", (self, name, renamed), {})
                csevar.is_vec = True
                return csevar
        return original_load(self, name, index)

    def arange(self: Any, index: Any, stride: Any) -> Any:
        if getattr(index, "is_vec", True) or index.dtype not in (torch.int32, torch.int64):
            return original_arange(self, index, stride)
        vec = self._get_vec_type(index.dtype)
        csevar = self.cse.generate(self.compute, f"({vec}({index}) + {vec}::arange(0, {stride}))")
        csevar.dtype, csevar.is_vec = index.dtype, True
        return csevar

    def broadcast(self: Any, scalar: Any) -> Any:
        vector = original_broadcast(self, scalar)
        if _nonzero_constant(scalar) and self._get_num_vectors(torch.float32) == 1:
            vector.bounds = scalar.bounds  # the one value in every lane: what maximum/minimum below look for
        return vector

    def bound(clamp: str, ieee: Any) -> Any:
        def op(a: Any, b: Any) -> Any:
            if getattr(a, "dtype", None) == getattr(b, "dtype", None) == torch.float32:
                if _nonzero_constant(b) and not _nonzero_constant(a):
                    return f"at::vec::{clamp}({a}, {b})"
                if _nonzero_constant(a) and not _nonzero_constant(b):
                    return f"at::vec::{clamp}({b}, {a})"
            return ieee.__func__(a, b)

        op.__name__ = ieee.__func__.__name__
        return staticmethod(op)

    to_dtype_bitcast.__name__ = "to_dtype_bitcast"
    get_to_dtype_expr.__name__ = "get_to_dtype_expr"

    class _Key(CustomGraphPass):
        """A graph pass that changes nothing: its ``uuid`` puts the fix into Inductor's cache key."""

        def __call__(self, graph: Any) -> None:
            return None

        def uuid(self) -> str:
            return _FIX

    replaced = ((overrides, "to_dtype_bitcast", original, staticmethod(to_dtype_bitcast)),
                (kernel_type, "get_to_dtype_expr", to_dtype_expr, get_to_dtype_expr),
                (cpp, "VECTORIZABLE_DTYPES", vectorizable, [*vectorizable, torch.int16]),
                (kernel_type, "arange", original_arange, arange),
                (kernel_type, "load", original_load, load),
                (kernel_type, "broadcast", original_broadcast, broadcast),
                (overrides, "maximum", maximum, bound("clamp_min", maximum)),
                (overrides, "minimum", minimum, bound("clamp_max", minimum)))
    return replaced, _Key()
