"""The hand-fused CPU step (``macroarch.mvas.native``): bit for bit Inductor's kernel of the same step (the
independent reference: the code ``torch.compile`` generates from ``kernels._adamw_step``), checked against eager on
its first call like every compiled kernel, and what ``MVASAdamW`` runs for fp8 and fp4 weights."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from macroarch.mvas import MVASWeight, compiled, kernels, native
from macroarch.mvas.formats import pack
from macroarch.mvas.optim import MVASAdamW, _min_subnormal
from macroarch.optim.functional import adamw_scalars

FLOOR = _min_subnormal("fp8_e4m3")
SPEC = kernels.StepSpec("fp8_e4m3", 32, True, False, "fp8_e4m3", 128, FLOOR)
SMALL_BLOCKS = kernels.StepSpec("fp8_e4m3", 16, True, False, "fp8_e4m3", 64, FLOOR)
FP4 = kernels.StepSpec("fp4_e2m1", 32, True, False, "fp8_e4m3", 128, FLOOR)

pytestmark = pytest.mark.skipif(native._vector_width() is None, reason="no AVX-512 or AVX2 here")


def _state(n, spec, seed, step):
    """Packed weight and moments of ``n`` elements with the awkward cases: a block of zero moments (scale 0), a
    block of zero gradients, sqrt(v) codes that underflowed to 0 (the floor), a weight block at the format's top."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, generator=g) * 0.02
    w[: spec.weight_block] *= 1e4  # a block of large weights
    m = torch.randn(n, generator=g) * 1e-4
    v = torch.rand(n, generator=g) * 1e-6
    m[: spec.state_block] = 0
    v[spec.state_block: spec.state_block + 7] = 1e-30
    if step == 1:  # the first step: zero moments
        m.zero_(), v.zero_()
    packed = [pack(w, spec.weight_format, spec.weight_block), pack(m, "fp8_e4m3", spec.state_block),
              pack(v.sqrt(), "fp8_e4m3", spec.state_block)]
    grad = torch.randn(n, generator=g) * 1e-3
    grad[2 * spec.state_block: 3 * spec.state_block] = 0
    return [[p.payload.clone(), p.scales.clone()] for p in packed], grad


def _args(state, grad, spec, step):
    rows = kernels._step_rows(spec, grad.numel())
    pair = lambda p: tuple(kernels._as_bytes(t).view(rows, -1) for t in p)  # noqa: E731
    counter = torch.tensor([kernels.stream_key(0, 0, step), 4096])
    scalars = kernels._scalars_tensor(tuple(adamw_scalars(float(step), 1e-3, 0.9, 0.999, 1e-8, 0.1)))
    return (grad.view(rows, -1), pair(state[0]), None, pair(state[1]), pair(state[2]), counter, scalars, spec)


def _bytes(state):
    return [t.view(torch.uint8) if t.dtype != torch.float32 else t.view(torch.int32) for pair in state for t in pair]


@pytest.mark.slow
@pytest.mark.parametrize("spec, grad_dtype", [(SPEC, torch.bfloat16), (SPEC, torch.float32),
                                              (SMALL_BLOCKS, torch.float32), (FP4, torch.bfloat16)])
def test_the_fused_step_is_bitwise_inductors_kernel_of_the_same_step(spec, grad_dtype):
    """Every code and scale it writes equals what Inductor's compiled kernel writes, on the first step (zero moments)
    and a later one, one thread and two (the rows split across threads)."""
    assert native.covers(spec, grad_dtype, torch.device("cpu"))
    for step, n in ((1, 4 * spec.state_block), (7, 40 * spec.state_block)):
        state, grad = _state(n, spec, seed=step, step=step)
        grad = grad.to(grad_dtype)
        reference = copy.deepcopy(state)
        compiled._compiled("adamw_step", _args(reference, grad, spec, step))
        threads = torch.get_num_threads()
        for count in (1, 2):
            fused = copy.deepcopy(state)
            torch.set_num_threads(count)
            try:
                native.NativeStep(spec, grad_dtype)(_args(fused, grad, spec, step))
            finally:
                torch.set_num_threads(threads)
            for a, b in zip(_bytes(fused), _bytes(reference)):
                assert torch.equal(a, b), (step, count, int((a != b).sum()))
        assert not all(torch.equal(a, b) for a, b in zip(_bytes(state), _bytes(reference)))  # it did write


def test_it_covers_only_the_storage_it_was_written_for(monkeypatch):
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    assert native.covers(SPEC, bf16, cpu) and native.covers(FP4, bf16, cpu)
    other = [SPEC.__class__(*fields) for fields in (
        ("fp8_e5m2", 32, True, False, "fp8_e4m3", 128, FLOOR),  # e5m2 weights
        ("fp8_e4m3", 32, True, False, "fp8_e5m2", 128, FLOOR),  # e5m2 moments
        ("fp8_e4m3", 32, False, False, "fp8_e4m3", 128, FLOOR),  # rounded to nearest
        ("fp8_e4m3", 32, True, True, "fp8_e4m3", 128, FLOOR),  # a master copy
        ("fp8_e4m3", 32, True, False, "fp32", None, FLOOR),  # dense moments
        ("fp8_e4m3", 128, True, False, "fp8_e4m3", 32, FLOOR),  # weight blocks larger than the moments'
        ("fp8_e4m3", 4, True, False, "fp8_e4m3", 128, FLOOR))]  # blocks shorter than a vector
    assert not any(native.covers(spec, bf16, cpu) for spec in other)
    assert not native.covers(SPEC, torch.float16, cpu)
    assert not native.covers(SPEC, bf16, torch.device("meta"))
    monkeypatch.setenv(native.ENV, "0")
    assert not native.covers(SPEC, bf16, cpu)


def test_building_it_counts_as_compiling_once_per_storage(monkeypatch):
    """``compile_stats`` counts a build (or a load from Inductor's disk cache) once per storage and process."""
    monkeypatch.setattr(native, "_BUILT", set())
    first, again = native.NativeStep(SPEC, torch.bfloat16), native.NativeStep(SPEC, torch.bfloat16)
    assert first.compile_seconds > 0 and again.compile_seconds == 0 and first.call is again.call


def _step_warns_and_equals_eager(step, warning):
    """One step of SPEC's storage through ``kernels.adamw_step`` (compiled allowed): it warns ``warning`` and leaves
    the eager step's bytes, compared with the same step run eagerly on a copy. Returns a call that steps it again."""
    state, grad = _state(8 * 128, SPEC, seed=step, step=step)
    twin = copy.deepcopy(state)
    counter = torch.tensor([kernels.stream_key(0, 0, step), 0])
    scalars = adamw_scalars(float(step), 1e-3, 0.9, 0.999, 1e-8, 0.1)

    def run(stored, **kwargs):
        kernels.adamw_step(grad, tuple(stored[0]), None, tuple(stored[1]), tuple(stored[2]), counter, scalars, SPEC,
                           **kwargs)

    with pytest.warns(RuntimeWarning, match=warning):
        run(state)
    run(twin, compile=False)
    assert all(torch.equal(a, b) for a, b in zip(_bytes(state), _bytes(twin)))
    return lambda: run(state)


def test_a_fused_kernel_that_differs_from_eager_warns_once_and_the_eager_result_is_used(monkeypatch):
    """The guard of every compiled kernel holds for it: a kernel that writes wrong codes (a stand-in here) is caught on
    its first call, named as the native kernel, and the step then runs eagerly; nothing it wrote reaches the user."""
    real = native.NativeStep.__call__

    def corrupting(self, args):
        real(self, args)
        args[1][0].view(torch.uint8)[:, :5] ^= 0x10  # five codes of every weight row

    monkeypatch.setenv(kernels.ENV, "1")  # the tests run eagerly by default (conftest)
    monkeypatch.setattr(compiled, "_VERIFIED", {})
    monkeypatch.setattr(native.NativeStep, "__call__", corrupting)
    kernels.reset_compile_stats()
    step_again = _step_warns_and_equals_eager(3, r"native adamw_step kernel for StepSpec.*differs")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: eager from now on, silently
        step_again()
    stats = kernels.compile_stats()
    assert stats["mismatches"] == 1 and stats["checks"] == 1


def test_a_fused_kernel_that_cannot_build_warns_and_runs_eagerly(monkeypatch):
    def no_compiler(*args):
        raise RuntimeError("No working C++ compiler found (a stand-in)")

    monkeypatch.setenv(kernels.ENV, "1")
    for name, value in (("_VERIFIED", {}), ("_FAILED", {})):
        monkeypatch.setattr(compiled, name, value)
    monkeypatch.setattr(native, "_module", no_compiler)
    _step_warns_and_equals_eager(4, r"adamw_step kernel could not be compiled \(RuntimeError: No working C")


def _train(steps, monkeypatch, native_on, fmt):
    """MVASAdamW (``fmt`` weights, fp8 moments, bf16 gradients) on three tensors for ``steps`` steps: its weights'
    bytes, its state dict, and the kinds of the kernels that ran."""
    monkeypatch.setenv(native.ENV, "1" if native_on else "0")
    monkeypatch.setenv(kernels.ENV, "1")
    monkeypatch.setattr(compiled, "_VERIFIED", {})
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(MVASWeight.from_packed(pack(torch.randn(rows, 256, generator=g) * 0.02, fmt, 32),
                                                     torch.bfloat16)) for rows in (4, 24, 9)]
    opt = MVASAdamW(params, lr=1e-3, weight_decay=0.1, seed=0, state_format="fp8_e4m3", state_block_size=128)
    for _ in range(steps):
        for p in params:
            p.grad = (torch.randn(p.shape, generator=g) * 1e-3).bfloat16()
        opt.step()
    kinds = {type(v).__name__ for k, v in compiled._VERIFIED.items() if k[0] == "adamw_step"}
    return [p.payload.view(torch.uint8).clone() for p in params], opt.state_dict(), kinds


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp4_e2m1"])
def test_mvas_adamw_trains_to_the_same_bits_with_the_fused_step_as_with_inductors(monkeypatch, fmt):
    """Five steps of MVASAdamW (fp8 moments), through its prepared calls: the same weights and state as with
    Inductor's kernel, and the fused kernel is what ran."""
    fused, fused_state, fused_kinds = _train(5, monkeypatch, True, fmt)
    inductor, inductor_state, inductor_kinds = _train(5, monkeypatch, False, fmt)
    # (the smallest tensor keeps float32 moments, MVASAdamW's rule for small tensors: Inductor's kernel for both)
    assert "NativeStep" in fused_kinds and inductor_kinds and "NativeStep" not in inductor_kinds
    assert all(torch.equal(a, b) for a, b in zip(fused, inductor))
    for a, b in zip(fused_state["state"].values(), inductor_state["state"].values()):
        for key in a:
            x, y = a[key], b[key]
            if isinstance(x, torch.Tensor):
                assert x.dtype == y.dtype and torch.equal(x.reshape(-1).view(torch.uint8),
                                                          y.reshape(-1).view(torch.uint8)), key


@pytest.mark.slow
def test_under_avx2_too_when_this_cpu_has_avx512(tmp_path):
    """The AVX2 build (F16C reads, 8 lanes), run on a CPU with AVX-512 by emulating AVX2 (``ATEN_CPU_CAPABILITY``, and
    Haswell's instruction set for the C++, a fresh Inductor cache): this file's bitwise and training tests in a
    subprocess. On an AVX2 CPU they ran above."""
    if native._vector_width() != 16:
        pytest.skip("this CPU's own build is the AVX2 one: the tests above ran it")
    # -march=haswell: with -march=native (Inductor's default) the "AVX2" code may use AVX-512VL's 32 registers
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "TORCHINDUCTOR_CPP_MARCH": "haswell",
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                           "-k", "bitwise or same_bits", "-o", "addopts="], env=env, capture_output=True, text=True,
                          timeout=900, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "6 passed" in done.stdout, done.stdout[-2000:]
