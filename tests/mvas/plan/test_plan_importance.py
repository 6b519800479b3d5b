"""Importance estimators against dense references: torch.func's exact Hessian, enumerated probes, hand EMAs."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from macroarch.mvas.plan.importance import (
    FisherDiagonal,
    HutchinsonEstimator,
    block_importance,
    fisher_diagonal,
    hessian_diagonal_probe,
    hutchinson_diagonal,
    sensitivity,
    tensor_importance,
)


def _mlp():
    """A 212-parameter tanh MLP in float64 with a regression loss over fixed batches."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(32, 8, generator=g, dtype=torch.float64), torch.randn(32, 4, generator=g,
                                                                                  dtype=torch.float64))]
    return net, (lambda m, b: F.mse_loss(m(b[0]), b[1])), batches


def _exact_hessian(model, loss_fn, batch):
    """The dense Hessian over all parameters (flattened in named_parameters order) and the name layout."""
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    sizes = [p.numel() for _, p in model.named_parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def f(v):
        params = {n: t.view(s) for n, t, s in zip(names, v.split(sizes), shapes)}
        return loss_fn(lambda *a, **k: torch.func.functional_call(model, params, a, k), batch)

    return torch.func.hessian(f)(flat), names, sizes, shapes


class _Quadratic(nn.Module):
    """0.5 (w - w0)^T A (w - w0), w the concatenation of two parameter tensors."""

    def __init__(self, a, w0=None):
        super().__init__()
        self.a_ = nn.Parameter(torch.zeros(3, dtype=torch.float64))
        self.b_ = nn.Parameter(torch.zeros(2, dtype=torch.float64))
        self.register_buffer("A", a)
        self.register_buffer("w0", torch.zeros(5, dtype=torch.float64) if w0 is None else w0)
        if w0 is not None:
            with torch.no_grad():
                self.a_.copy_(w0[:3])
                self.b_.copy_(w0[3:])

    def forward(self):
        d = torch.cat([self.a_, self.b_]) - self.w0
        return 0.5 * d @ self.A @ d


def _quad_loss(m, _batch):
    return m()


def _random_symmetric(n, seed):
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(n, n, generator=g, dtype=torch.float64)
    return m + m.T


def _snapshot(model):
    return ({n: p.detach().clone() for n, p in model.named_parameters()},
            {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()})


def _assert_unchanged(model, snap):
    weights, grads = snap
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), weights[n]), n
        assert (p.grad is None) == (grads[n] is None), n
        if p.grad is not None:
            assert torch.equal(p.grad, grads[n]), n


def test_hutchinson_converges_to_exact_diagonal_like_one_over_sqrt_probes():
    net, loss_fn, batches = _mlp()
    hess, names, sizes, shapes = _exact_hessian(net, loss_fn, batches[0])
    exact = hess.diagonal()
    offdiag_sq = hess.square().sum() - exact.square().sum()  # sum_i Var[z_i (Hz)_i] = sum_{i != j} H_ij^2
    errors = {}
    for n in (10, 100, 1000):
        est = hutchinson_diagonal(net, loss_fn, batches, n, generator=torch.Generator().manual_seed(n))
        flat = torch.cat([est[k].reshape(-1) for k in names])
        errors[n] = float((flat - exact).norm() / exact.norm())
        predicted = math.sqrt(offdiag_sq / n) / float(exact.norm())  # RMS relative error
        # ~200 roughly independent squared errors: the realised norm sits close to its RMS value.
        assert 0.5 * predicted < errors[n] < 2.0 * predicted, (n, errors[n], predicted)
    assert errors[10] > errors[100] > errors[1000]


def test_probe_mean_over_all_sign_vectors_is_exact_diagonal():
    a = _random_symmetric(5, seed=0)
    model = _Quadratic(a)
    params = list(model.parameters())
    grads = torch.autograd.grad(model(), params, create_graph=True)
    total = torch.zeros(5, dtype=torch.float64)
    signs = list(itertools.product((-1.0, 1.0), repeat=5))
    for s in signs:
        z = torch.tensor(s, dtype=torch.float64)
        total += torch.cat(hessian_diagonal_probe(grads, params, [z[:3], z[3:]]))
    torch.testing.assert_close(total / len(signs), a.diagonal(), rtol=0, atol=1e-12)


def test_quadratic_estimate_within_variance_formula_and_exact_for_diagonal_a():
    a = _random_symmetric(5, seed=1)
    model = _Quadratic(a)
    n = 4000
    est = hutchinson_diagonal(model, _quad_loss, [None], n, generator=torch.Generator().manual_seed(0))
    flat = torch.cat([est["a_"], est["b_"]])
    std = ((a.square().sum(1) - a.diagonal().square()) / n).sqrt()
    assert ((flat - a.diagonal()).abs() < 4 * std).all()

    diag_a = torch.diag(torch.tensor([3.0, -1.0, 0.5, 2.0, 7.0], dtype=torch.float64))
    est = hutchinson_diagonal(_Quadratic(diag_a), _quad_loss, [None, None], 1)
    torch.testing.assert_close(torch.cat([est["a_"], est["b_"]]), diag_a.diagonal(), rtol=0, atol=1e-12)


def test_per_tensor_probing_drops_cross_tensor_variance():
    # A couples a_ with b_ only: the diagonal blocks are diagonal, so per-tensor probes are exact at once,
    # while whole-model probes pick up the cross terms.
    a = torch.diag(torch.tensor([3.0, 1.0, 0.5, 2.0, 7.0], dtype=torch.float64))
    a[:3, 3:] = torch.tensor([[1.0, -2.0], [0.5, 4.0], [-3.0, 1.5]], dtype=torch.float64)
    a[3:, :3] = a[:3, 3:].T
    model = _Quadratic(a)
    gen = torch.Generator().manual_seed(0)
    est = hutchinson_diagonal(model, _quad_loss, [None], 3, per_tensor=True, generator=gen)
    torch.testing.assert_close(torch.cat([est["a_"], est["b_"]]), a.diagonal(), rtol=0, atol=1e-12)
    est = hutchinson_diagonal(model, _quad_loss, [None], 3, generator=gen)
    assert not torch.allclose(torch.cat([est["a_"], est["b_"]]), a.diagonal())

    # On the MLP both modes are unbiased: per-tensor error within its own (smaller) variance formula.
    net, loss_fn, batches = _mlp()
    hess, names, sizes, _ = _exact_hessian(net, loss_fn, batches[0])
    block = torch.zeros_like(hess)
    for lo, size in zip(itertools.accumulate([0, *sizes[:-1]]), sizes):
        block[lo:lo + size, lo:lo + size] = hess[lo:lo + size, lo:lo + size]
    n = 200
    est = hutchinson_diagonal(net, loss_fn, batches, n, per_tensor=True, generator=torch.Generator().manual_seed(2))
    flat = torch.cat([est[k].reshape(-1) for k in names])
    rms = math.sqrt(float(block.square().sum() - hess.diagonal().square().sum()) / n)
    assert float((flat - hess.diagonal()).norm()) < 2 * rms


def test_estimator_mean_matches_function_and_ema_is_bias_corrected():
    net, loss_fn, _ = _mlp()
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 8, generator=g, dtype=torch.float64),
                torch.randn(8, 4, generator=g, dtype=torch.float64)) for _ in range(3)]
    ref = hutchinson_diagonal(net, loss_fn, batches, 4, generator=torch.Generator().manual_seed(7))
    est = HutchinsonEstimator(net, loss_fn, 4, generator=torch.Generator().manual_seed(7))
    for b in batches:
        est.update(b)
    assert est.steps == 3
    for k in ref:
        torch.testing.assert_close(est.diagonal()[k], ref[k])

    diag_a = torch.diag(torch.tensor([3.0, 1.0, 0.5, 2.0, 7.0], dtype=torch.float64))
    ema = HutchinsonEstimator(_Quadratic(diag_a), _quad_loss, 1, beta=0.9)
    out = ema.update(None)
    torch.testing.assert_close(out["a_"], diag_a.diagonal()[:3])  # no pull towards the zero start
    restored = HutchinsonEstimator(_Quadratic(diag_a), _quad_loss, 1, beta=0.5)
    restored.load_state_dict(ema.state_dict())
    torch.testing.assert_close(restored.diagonal()["b_"], diag_a.diagonal()[3:])


def test_fisher_diagonal_is_hand_computed_ema_of_squared_gradients():
    net, loss_fn, _ = _mlp()
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(4, 8, generator=g, dtype=torch.float64),
                torch.randn(4, 4, generator=g, dtype=torch.float64)) for _ in range(4)]
    beta = 0.8
    fisher = FisherDiagonal(beta)
    hand = {n: torch.zeros_like(p) for n, p in net.named_parameters()}
    for b in batches:
        net.zero_grad()
        loss_fn(net, b).backward()
        fisher.update(net)
        for n, p in net.named_parameters():
            hand[n] = beta * hand[n] + (1 - beta) * p.grad.square()
    for n, v in fisher.diagonal().items():
        torch.testing.assert_close(v, hand[n] / (1 - beta ** len(batches)))

    snap = _snapshot(net)
    mean = fisher_diagonal(net, loss_fn, batches)
    _assert_unchanged(net, snap)
    for n, p in net.named_parameters():
        squares = [torch.autograd.grad(loss_fn(net, b), p)[0].square() for b in batches]
        torch.testing.assert_close(mean[n], torch.stack(squares).mean(0))


def _grid(w, fmt):
    step = {"coarse": 0.5, "fine": 0.1}[fmt]
    return torch.round(w / step) * step


def test_sensitivity_equals_formula_and_orders_tensors():
    g = torch.Generator().manual_seed(0)
    w = {"x": torch.randn(3, 4, generator=g), "y": torch.randn(5, generator=g)}
    h = {"x": torch.rand(3, 4, generator=g), "y": torch.rand(5, generator=g)}
    out = sensitivity(h, w, _grid, ["coarse", "fine"])
    for name in w:
        for fmt in ("coarse", "fine"):
            wv, hv, qv = w[name].reshape(-1).tolist(), h[name].reshape(-1).tolist(), _grid(w[name], fmt).reshape(-1)
            expected = sum(hi * (qi - wi) ** 2 / 2 for hi, qi, wi in zip(hv, qv.tolist(), wv))
            assert out[name][fmt] == pytest.approx(expected, rel=1e-6)

    # Same weights: ten times the curvature is ten times as sensitive; weights on the grid cost nothing;
    # fp8 e5m2 (2 mantissa bits) hurts more than e4m3 (3 bits).
    base = torch.linspace(-2, 2, 64)
    w = {"flat": base, "steep": base.clone(), "on_grid": torch.round(base * 2) / 2}
    h = {"flat": torch.ones(64), "steep": 10 * torch.ones(64), "on_grid": 100 * torch.ones(64)}
    out = sensitivity(h, w, _grid, ["coarse"])
    assert out["steep"]["coarse"] == pytest.approx(10 * out["flat"]["coarse"])
    assert out["on_grid"]["coarse"] == 0.0
    fp8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
    out = sensitivity(h, w, lambda t, f: t.to(fp8[f]).to(t.dtype), ["e4m3", "e5m2"])
    assert out["flat"]["e5m2"] > out["flat"]["e4m3"] > 0


def test_hutchinson_sensitivity_predicts_loss_increase_at_a_minimum():
    diag_a = torch.diag(torch.tensor([3.0, 1.0, 0.5, 2.0, 7.0], dtype=torch.float64))
    w0 = torch.tensor([0.33, -1.27, 0.81, 2.04, -0.6], dtype=torch.float64)
    model = _Quadratic(diag_a, w0)
    h = hutchinson_diagonal(model, _quad_loss, [None], 2)
    weights = dict(model.named_parameters())
    predicted = sum(s["coarse"] for s in sensitivity(h, weights, _grid, ["coarse"]).values())
    with torch.no_grad():
        d = torch.cat([_grid(model.a_, "coarse"), _grid(model.b_, "coarse")]) - w0
        actual = float(0.5 * d @ diag_a @ d)
    assert predicted == pytest.approx(actual, rel=1e-12)
    assert torch.equal(torch.cat([model.a_, model.b_]).detach(), w0)


def test_summaries():
    d = {"t": torch.arange(10, dtype=torch.float32).view(2, 5)}
    assert tensor_importance(d) == {"t": 4.5}
    assert tensor_importance(d, "sum") == {"t": 45.0}
    torch.testing.assert_close(block_importance(d, 4)["t"], torch.tensor([1.5, 5.5, 8.5]))
    torch.testing.assert_close(block_importance(d, 10)["t"], torch.tensor([4.5]))


def test_weights_and_grads_unchanged_on_tiny_llama():
    from macroarch.models import get_model_spec

    torch.manual_seed(0)
    model = get_model_spec("llama_65b_tiny").build(attn_implementation="eager")
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))

    def loss_fn(m, batch):
        return m(input_ids=batch, labels=batch).loss

    loss_fn(model, ids).backward()  # a training step's gradients sit in .grad
    snap = _snapshot(model)
    est = hutchinson_diagonal(model, loss_fn, [ids], 2, generator=torch.Generator().manual_seed(0))
    _assert_unchanged(model, snap)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert est.keys() == trainable.keys()
    assert all(est[n].shape == p.shape and torch.isfinite(est[n]).all() for n, p in trainable.items())
    assert any(est[n].abs().sum() > 0 for n in est)

    # The final norm's diagonal against the exact one from unit-vector HVPs, within the variance formula.
    name = "model.norm.weight"
    p = trainable[name]
    (g,) = torch.autograd.grad(loss_fn(model, ids), p, create_graph=True)
    rows = torch.stack([torch.autograd.grad(g, p, grad_outputs=e, retain_graph=True)[0]
                        for e in torch.eye(p.numel())])  # H restricted to this tensor, (64, 64)
    exact = rows.diagonal()
    n = 64
    est = hutchinson_diagonal(model, loss_fn, [ids], n, params=[name], generator=torch.Generator().manual_seed(1))
    rms = math.sqrt(float(rows.square().sum() - exact.square().sum()) / n)
    assert float((est[name] - exact).norm()) < 2 * rms
    _assert_unchanged(model, snap)


class _FirstOrderOnlyGrad(torch.autograd.Function):
    """``2 x g``, the derivative of x^2, with no derivative of its own: a stand-in for an op like CPU SDPA."""

    @staticmethod
    def forward(ctx, x, grad):
        return 2 * x * grad

    @staticmethod
    def backward(ctx, _):
        raise RuntimeError("derivative for _FirstOrderOnlyGrad is not implemented")


class _SquareNoDoubleBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return _FirstOrderOnlyGrad.apply(x, grad)


class _SquareOnceDifferentiable(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


def test_clear_error_when_model_is_not_twice_differentiable():
    lin = nn.Linear(3, 1)
    x = torch.randn(4, 3)
    with pytest.raises(RuntimeError, match='attn_implementation="eager"'):
        hutchinson_diagonal(lin, lambda m, b: _SquareNoDoubleBackward.apply(m(b)).sum(), [x], 1)
    # once_differentiable does not raise for a Hessian with respect to parameters: autograd prunes the node
    # that would. When that leaves no gradient depending on the parameters, a warning says so.
    with pytest.warns(UserWarning, match="once_differentiable"):
        est = hutchinson_diagonal(lin, lambda m, b: _SquareOnceDifferentiable.apply(m(b)).sum(), [x], 1)
    assert all(v.abs().sum() == 0 for v in est.values())


def test_sdpa_llama_gives_the_eager_hint():
    from macroarch.models import get_model_spec

    model = get_model_spec("llama_65b_tiny").build(attn_implementation="sdpa")
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match='attn_implementation="eager"'):
        hutchinson_diagonal(model, lambda m, b: m(input_ids=b, labels=b).loss, [ids], 1)


def test_bad_inputs():
    net, loss_fn, batches = _mlp()
    with pytest.raises(ValueError, match="n_probes"):
        hutchinson_diagonal(net, loss_fn, batches, 0)
    with pytest.raises(ValueError, match="n_probes"):
        HutchinsonEstimator(net, loss_fn, n_probes=-1)
    with pytest.raises(ValueError, match="batches"):
        hutchinson_diagonal(net, loss_fn, [], 4)
    with pytest.raises(ValueError, match="batches"):
        fisher_diagonal(net, loss_fn, iter([]))
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="model"):
        hutchinson_diagonal(frozen, lambda m, b: m(b).sum(), [torch.ones(2)], 1)
    with pytest.raises(ValueError, match="params"):
        hutchinson_diagonal(net, loss_fn, batches, 1, params=["nope"])
    with pytest.raises(ValueError, match="beta"):
        FisherDiagonal(beta=1.0)
    with pytest.raises(ValueError, match="grad"):
        FisherDiagonal().update(net)
    with pytest.raises(ValueError, match="block_size"):
        block_importance({"t": torch.ones(3)}, 0)
    with pytest.raises(ValueError, match="reduction"):
        tensor_importance({"t": torch.ones(3)}, "max")
    with pytest.raises(ValueError, match="weights"):
        sensitivity({"t": torch.ones(3)}, {}, _grid, ["fine"])
    with pytest.raises(ValueError, match="shape"):
        sensitivity({"t": torch.ones(3)}, {"t": torch.ones(4)}, _grid, ["fine"])
    with pytest.raises(ValueError, match="formats"):
        sensitivity({"t": torch.ones(3)}, {"t": torch.ones(3)}, _grid, [])
