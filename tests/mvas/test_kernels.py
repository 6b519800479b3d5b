"""mvas.kernels: the counter-based noise, and the compiled kernels against the eager path (the reference).

The compiled tests are marked slow: each storage combination is one C++ compilation (10-60 s on a loaded core).
They compile three kernels in all (one AdamW step, two dequantisations)."""

import copy

import pytest
import torch
from torch import nn

from macroarch.mvas import kernels, plan_from_rules
from macroarch.mvas.formats import FORMATS, pack
from macroarch.mvas.optim import MVASAdamW, _min_subnormal
from macroarch.mvas.store import apply
from macroarch.optim.functional import adamw_scalars

SPEC = kernels.StepSpec("fp8_e4m3", 32, True, False, "fp8_e4m3", 128, _min_subnormal("fp8_e4m3"))


def test_counter_noise_is_uniform_reproducible_and_the_same_in_any_chunking():
    n, bits = 1 << 16, 20
    key = kernels.stream_key(1, 2, 3)
    full = kernels.counter_noise(torch.tensor([key, 0]), n, bits)
    assert full.dtype == torch.int32 and int(full.min()) >= 0 and int(full.max()) < 1 << bits
    assert torch.equal(full, kernels.counter_noise(torch.tensor([key, 0]), n, bits))
    assert torch.equal(kernels.counter_noise(torch.tensor([key, 4096]), 8192, bits), full[4096:4096 + 8192])
    counts = torch.bincount((full >> (bits - 4)).long(), minlength=16).double()  # 16 bins of the top bits
    chi2 = float(((counts - n / 16) ** 2 / (n / 16)).sum())
    assert chi2 < 40.0  # 15 degrees of freedom: p < 1e-3 for a uniform draw
    low = torch.bincount((full & 15).long(), minlength=16).double()  # the low bits, which carry the rounding
    assert float(((low - n / 16) ** 2 / (n / 16)).sum()) < 40.0
    other = kernels.counter_noise(torch.tensor([kernels.stream_key(1, 2, 4), 0]), n, bits)
    assert float((other == full).double().mean()) < 0.01  # another step: another stream


def test_the_environment_variable_selects_the_eager_path(monkeypatch):
    monkeypatch.setenv(kernels.ENV, "0")
    assert not kernels.compile_enabled() and kernels.compile_enabled(True)
    monkeypatch.setenv(kernels.ENV, "1")
    assert kernels.compile_enabled() and not kernels.compile_enabled(False)
    kernels.reset_compile_stats()
    p = pack(torch.randn(256), "fp8", 32)
    out = kernels.dequantize(p.payload, p.scales, p.format, 32, 256, torch.float32, compile=False)
    assert torch.equal(out, p.dequantize_range(0, 256)) and kernels.compile_stats()["eager_calls"] == 1


def _storage(n, seed):
    g = torch.Generator().manual_seed(seed)
    w = pack(torch.randn(n, generator=g), "fp8_e4m3", 32)
    m = pack(torch.randn(n, generator=g) * 1e-2, "fp8_e4m3", 128)
    v = pack(torch.rand(n, generator=g) * 1e-3, "fp8_e4m3", 128)
    return [[t.payload.clone(), t.scales.clone()] for t in (w, m, v)], torch.randn(n, generator=g)


def _codes_close(a, b, scales, fmt):
    """Payloads equal but for rare codes one grid step apart (an ulp of the fp32 update crossing a rounding
    boundary): at most 1 in 500 codes differ, each by at most one spacing of the format at its value."""
    differ = a.view(torch.uint8) != b.view(torch.uint8)
    assert float(differ.double().mean()) <= 2e-3
    da, db = a.float(), b.float()
    spacing = da.abs().clamp(min=2.0 ** -6) * 2.0 ** -FORMATS[fmt].mantissa_bits
    assert bool(((da - db).abs() <= spacing * 1.0001).all())


@pytest.mark.slow
def test_compiled_step_equals_eager_up_to_stated_ulps_with_one_kernel_for_all_sizes_and_steps():
    kernels.reset_compile_stats()
    for step, n in ((1, 4096), (7, 3 * 8192)):  # two sizes, two steps (new scalars): one compilation
        (w, m, v), grad = _storage(n, step)
        twin = copy.deepcopy((w, m, v))
        scalars = adamw_scalars(float(step), 1e-3, 0.9, 0.999, 1e-8, 0.1)
        counter = torch.tensor([kernels.stream_key(0, 0, step), 0])
        kernels.adamw_step(grad, tuple(w), None, tuple(m), tuple(v), counter, scalars, SPEC, compile=True)
        kernels.adamw_step(grad, tuple(twin[0]), None, tuple(twin[1]), tuple(twin[2]), counter, scalars, SPEC,
                           compile=False)
        for (payload, scales), (payload_e, scales_e) in zip((w, m, v), twin):
            _codes_close(payload, payload_e, scales, "fp8_e4m3")
            torch.testing.assert_close(scales, scales_e, rtol=4 * 2.0 ** -23, atol=0)  # a few ulps
    stats = kernels.compile_stats()
    assert stats["compiles"] == 1 and stats["compiled_calls"] == 2 and stats["compile_seconds"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("fmt, dtype", [("fp8_e4m3", torch.float32), ("fp4_e2m1", torch.bfloat16)])
def test_compiled_dequantize_is_bitwise_eager(fmt, dtype):
    kernels.reset_compile_stats()
    for n in (512, 4096 + 1024):  # two sizes, one kernel
        p = pack(torch.randn(n), fmt, 32)
        fused = kernels.dequantize(p.payload, p.scales, fmt, 32, n, dtype, compile=True)
        eager = kernels.dequantize(p.payload, p.scales, fmt, 32, n, dtype, compile=False)
        assert fused.dtype == dtype and torch.equal(fused, eager)
    assert kernels.compile_stats()["compiles"] == 1


@pytest.mark.slow
def test_mvas_adamw_and_weights_compiled_track_the_eager_run(monkeypatch):
    """A packed linear layer trained three steps with everything compiled (forward and backward dequantisation,
    the step) against the same run eager: the kernel of the step test is reused (no new compilation for it)."""
    def run(compile):
        monkeypatch.setenv(kernels.ENV, "1" if compile else "0")
        torch.manual_seed(0)
        net = nn.Linear(256, 64, bias=False)
        apply(net, plan_from_rules(net, [("*", "fp8_e4m3")], block_size=32, min_numel=0))
        opt = MVASAdamW(net.parameters(), lr=1e-2, seed=3, min_state_numel=0)
        x = torch.randn(8, 256)
        for _ in range(3):
            net(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return net.weight.dequantize(torch.float32), opt

    kernels.reset_compile_stats()
    weight_c, opt_c = run(True)
    assert kernels.compile_stats()["compiled_calls"] >= 2 * 3  # each step: the forward and the update
    weight_e, _ = run(False)
    diff = (weight_c - weight_e).abs()
    # block scales a few ulps apart move whole blocks by ~1e-7 relative; codes one grid step apart stay rare
    assert float((diff > 1e-5 * weight_e.abs()).double().mean()) <= 2e-3
    assert float(diff.max()) <= float(weight_e.abs().max()) * 2.0 ** -3
