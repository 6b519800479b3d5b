"""The value checks of loaders: ``nonfinite_codes`` against torch's own float8 decoding of every byte,
``bad_scales``, and ``MVASWeight.from_packed`` / ``validate`` refusing what they find."""

import pytest
import torch

from macroarch.mvas import MVASWeight, pack
from macroarch.mvas.packed.packed_tensor import PackedTensor, bad_scales, nonfinite_codes


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_every_fp8_byte_is_judged_as_torch_decodes_it(dtype):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    decoded = codes.view(dtype).float()  # the reference: torch's own decoding
    for code, value in zip(codes.tolist(), decoded.tolist()):
        one = torch.tensor([code], dtype=torch.uint8).view(dtype)
        assert nonfinite_codes(one) == (0 if torch.isfinite(torch.tensor(value)) else 1), hex(code)
    assert nonfinite_codes(codes.view(dtype)) == int((~torch.isfinite(decoded)).sum())


def test_fp4_bytes_have_no_such_code_and_16_bit_payloads_count_nan_only():
    assert nonfinite_codes(torch.arange(256, dtype=torch.int32).to(torch.uint8)) == 0
    half = torch.tensor([1.0, float("nan"), float("inf"), -float("inf")], dtype=torch.float16)
    assert nonfinite_codes(half) == 1 and nonfinite_codes(half.to(torch.bfloat16)) == 1
    assert nonfinite_codes(torch.empty(0, dtype=torch.float8_e4m3fn)) == 0
    assert nonfinite_codes(torch.empty(8, dtype=torch.float8_e4m3fn, device="meta")) == 0


def test_bad_scales_are_counted():
    assert bad_scales(None) == 0
    assert bad_scales(torch.tensor([0.0, 1.0, float("nan"), float("inf"), -1.0, -0.0])) == 3


@pytest.mark.parametrize(("fmt", "code"), [("fp8_e4m3", 0x7F), ("fp8_e4m3", 0xFF), ("fp8_e5m2", 0x7C),
                                           ("fp8_e5m2", 0xFC), ("fp8_e5m2", 0x7D)])
def test_from_packed_and_validate_refuse_nan_and_inf_codes(fmt, code):
    packed = pack(torch.randn(8, 32), fmt, 32)
    weight = MVASWeight.from_packed(packed)
    weight.validate()
    payload = packed.payload.clone()
    payload.view(torch.uint8)[3] = code
    bad = PackedTensor(packed.format, packed.shape, packed.dtype, packed.block_size, payload, packed.scales)
    with pytest.raises(ValueError, match=f"1 of the 256 payload codes of a {fmt} weight of shape \\(8, 32\\) decode "
                                         "to NaN or infinity"):
        MVASWeight.from_packed(bad)
    weight.payload.view(torch.uint8)[3] = code  # written in place, as a loader filling storage would
    with pytest.raises(ValueError, match="decode to NaN or infinity"):
        weight.validate()


def test_validate_refuses_bad_scales():
    weight = MVASWeight.from_dense(torch.randn(4, 64), "fp8_e4m3", 32)
    weight.scales[1] = -2.0
    with pytest.raises(ValueError, match="1 of the 8 block scales .*NaN, infinite or negative"):
        weight.validate()
