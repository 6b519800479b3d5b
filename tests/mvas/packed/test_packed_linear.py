"""``F.linear`` on a managed weight as one autograd node (``macroarch.mvas.packed.linear``), against the dispatch
path."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from macroarch.mvas.packed import weight as tensor
from macroarch.mvas.packed.weight import MVASWeight


def _run(fast, monkeypatch, x0, w0, b0, grad, create_graph=False):
    monkeypatch.setattr(tensor, "_LINEAR", F.linear if fast else None)  # None: every linear through dispatch
    x = x0.clone().requires_grad_()
    w = MVASWeight.from_dense(w0, "fp8_e4m3", 32).requires_grad_()
    b = None if b0 is None else b0.clone().requires_grad_()
    y = F.linear(x, w, b)
    grads = torch.autograd.grad(y, [t for t in (x, w, b) if t is not None], grad, create_graph=create_graph)
    return y, grads


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(64, 256), (4, 16, 256), (2, 2, 8, 256)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_fast_linear_is_bitwise_the_dispatch_path(dtype, shape, bias, monkeypatch):
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(shape, generator=g).to(dtype)
    w0 = (torch.randn(96, 256, generator=g) * 0.05).to(dtype)
    b0 = torch.randn(96, generator=g).to(dtype) if bias else None
    grad = torch.randn(*shape[:-1], 96, generator=g).to(dtype)
    y_fast, grads_fast = _run(True, monkeypatch, x0, w0, b0, grad)
    y_ref, grads_ref = _run(False, monkeypatch, x0, w0, b0, grad)
    assert type(y_fast.grad_fn).__name__ == "MVASLinearBackward"
    assert type(y_ref.grad_fn).__name__ != "MVASLinearBackward"
    assert torch.equal(y_fast, y_ref)
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(grads_fast, grads_ref, strict=True))


def test_a_fast_linear_runs_python_torch_function_only_for_the_call_itself(torch_function_calls):
    """Forward and backward of the fast path read the weight's dtype and storage from plain attributes: the one
    ``__torch_function__`` call is ``F.linear``'s own (each further one, a property read such as ``dtype``, costs
    ~3 us of Python per layer, 5-6 times that between a model's matmuls)."""
    seen = torch_function_calls
    x = torch.randn(4, 16, 256, dtype=torch.bfloat16, requires_grad=True)
    w = MVASWeight.from_dense(torch.randn(96, 256) * 0.05, "fp8_e4m3", 32, dtype=torch.bfloat16).requires_grad_()
    seen.clear()
    y = F.linear(x, w)
    y.backward(torch.randn_like(y))
    assert seen == [F.linear] and type(y.grad_fn).__name__ == "MVASLinearBackward"
    assert x.grad is not None and w.grad is not None


def test_double_backward_reaches_the_weight_as_through_dispatch(monkeypatch):
    g = torch.Generator().manual_seed(1)
    x0, w0, grad = torch.randn(16, 256, generator=g), torch.randn(96, 256, generator=g) * 0.05, torch.randn(16, 96)
    second = []
    for fast in (True, False):
        monkeypatch.setattr(tensor, "_LINEAR", F.linear if fast else None)
        x = x0.clone().requires_grad_()
        w = MVASWeight.from_dense(w0, "fp8_e4m3", 32).requires_grad_()
        (grad_x,) = torch.autograd.grad(F.linear(x, w), x, grad, create_graph=True)
        second.append(torch.autograd.grad(grad_x.square().sum(), w)[0])
    assert second[0].abs().sum() > 0 and torch.equal(second[0], second[1])


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_autocast_dispatch_modes_and_views_take_the_dispatch_path():
    w = MVASWeight.from_dense(torch.randn(32, 64), "fp8_e4m3", 32).requires_grad_()
    x = torch.randn(4, 64, requires_grad=True)
    assert type(F.linear(x, w).grad_fn).__name__ == "MVASLinearBackward"
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the cast happens in dispatch
        out = F.linear(x, w)
    assert out.dtype == torch.bfloat16 and type(out.grad_fn).__name__ != "MVASLinearBackward"
    with _Ops() as mode:  # a mode sees the op with the packed weight, as before
        out = F.linear(x, w)
    assert type(out.grad_fn).__name__ != "MVASLinearBackward" and mode.ops
    view = w.t().t()  # a view that replays view ops after dequantising: dispatch replays them
    assert view.is_view and type(F.linear(x, view).grad_fn).__name__ != "MVASLinearBackward"
    cast = w.to(torch.float64)  # a cast is no view (the dequantisation casts): fast, and in float64
    out = F.linear(x.double(), cast)
    assert out.dtype == torch.float64 and type(out.grad_fn).__name__ == "MVASLinearBackward"
    with torch.no_grad():  # nothing to record: no node at all
        assert F.linear(x, w).grad_fn is None


def test_a_weight_written_between_forward_and_backward_makes_backward_raise():
    w = MVASWeight.from_dense(torch.randn(32, 64), "fp8_e4m3", 32).requires_grad_()
    out = F.linear(torch.randn(4, 64, requires_grad=True), w)
    w.mark_written()  # what MVASAdamW does after writing the packed storage
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
