"""measure.machine: native bf16 needs the CPU's bf16 instructions, not only oneDNN's yes."""

import pytest
import torch

from macroarch.measure import machine


@pytest.mark.parametrize(("onednn", "avx512_bf16", "amx", "native"), [
    (True, True, False, True), (True, False, True, True), (True, False, False, False),  # AVX-512 alone: emulated
    (False, True, True, False),  # oneDNN cannot (ONEDNN_MAX_CPU_ISA=AVX2, say)
])
def test_bf16_is_native_only_with_avx512_bf16_or_amx_and_onednn(monkeypatch, onednn, avx512_bf16, amx, native):
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: onednn, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert machine.native_bf16_cpu() is native
    assert machine.auto_compute_dtype() == ("bfloat16" if native else "float32")


def test_without_the_cpu_probes_onednns_answer_stands(monkeypatch):
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True, raising=False)
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported")
    assert machine.native_bf16_cpu() is True
