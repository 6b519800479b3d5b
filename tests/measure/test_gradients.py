"""Gradient-flow analysis against closed forms, explicit products, brute-force covariances and real models."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from macroarch.measure.gradients import (
    GradientNormRecorder,
    controlled_stack,
    end_to_end_singular_values,
    fit_growth_rate,
    layer_jacobian_singular_values,
    layer_norm_spread,
    minibatch_gradient_variance,
)
from macroarch.models import find_repeated_layers

DEPTH, WIDTH, BATCH = 64, 16, 5


# ------------------------------------------------------------------------------- recorder, closed form
@pytest.mark.parametrize("sigma", [0.9, 1.0, 1.1])
def test_linear_stack_norms_match_closed_form(sigma):
    stack = controlled_stack(DEPTH, WIDTH, sigma, generator=0, dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float64)
    v = torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float64)
    with GradientNormRecorder(stack) as rec:
        (stack(x) * v).sum().backward()  # the gradient at the stack's output is v

    assert rec.names == [str(i) for i in range(DEPTH)]
    after = torch.arange(DEPTH - 1, -1, -1, dtype=torch.float64)  # layers between each output and the loss
    # Each W = sigma * Q: backprop through k layers multiplies the norm by sigma**k exactly.
    expected = sigma**after * v.norm()
    torch.testing.assert_close(rec.output_grad_norms, expected[None], rtol=1e-12, atol=0)
    # dL/dW_i = G_i^T X_i with G_i = V (sigma Q)^(D-1-i) and X_i = X (sigma Q)^i: norm sigma**(D-1) ||V^T X||.
    param_expected = torch.full((1, DEPTH), sigma ** (DEPTH - 1) * (v.T @ x).norm().item(), dtype=torch.float64)
    torch.testing.assert_close(rec.param_grad_norms, param_expected, rtol=1e-12, atol=0)

    fit = fit_growth_rate(after, rec.output_grad_norms[0])
    assert fit.n == DEPTH
    assert fit.rate == pytest.approx(math.log(sigma), abs=1e-12)
    assert fit.rate_stderr < 1e-12
    assert fit.intercept == pytest.approx(math.log(v.norm().item()), abs=1e-10)


def test_recorder_one_record_per_backward_and_hooks_removed():
    stack = controlled_stack(4, 3, 1.0, kind="mlp", generator=0)
    x = torch.randn(2, 3)
    with GradientNormRecorder(stack) as rec:
        for _ in range(3):
            stack(x).square().sum().backward()
        stack(x).sum().backward()  # a different loss: a different record
    assert rec.names == ["0", "2", "4", "6"]  # the Linears; the Tanhs in between hold no parameters
    assert rec.output_grad_norms.shape == rec.param_grad_norms.shape == (4, 4)
    torch.testing.assert_close(rec.output_grad_norms[0], rec.output_grad_norms[2])
    assert not torch.allclose(rec.output_grad_norms[0], rec.output_grad_norms[3])
    assert all(not m._forward_hooks for m in stack.modules())
    assert all(not p._backward_hooks for p in stack.parameters())
    stack(x).sum().backward()
    assert rec.output_grad_norms.shape[0] == 4
    with pytest.raises(RuntimeError, match="entered twice"), rec, rec:
        pass


class _TupleBlock(nn.Module):
    """Returns (hidden, aux) as pre-5 transformers layers did; aux must not count."""

    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, h):
        out = self.linear(h)
        return out, 100 * out


class _TupleNet(nn.Module):
    def __init__(self, width=4, depth=3):
        super().__init__()
        self.blocks = nn.ModuleList(_TupleBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, h):
        for block in self.blocks:
            h, _ = block(h)
        return self.head(h)


def test_tuple_outputs_measured_on_first_tensor():
    torch.manual_seed(0)
    net, x = _TupleNet().double(), torch.randn(2, 4, dtype=torch.float64)
    with GradientNormRecorder(net) as rec:
        net(x).sum().backward()
    assert rec.names == ["blocks.0", "blocks.1", "blocks.2"]
    # Independent reference: the same gradients via autograd.grad on the hidden states.
    hs, h = [], x
    for block in net.blocks:
        h, _ = block(h)
        hs.append(h)
    grads = torch.autograd.grad(net.head(h).sum(), hs)
    torch.testing.assert_close(rec.output_grad_norms[0], torch.stack([g.norm() for g in grads]))
    param_norms = [torch.cat([p.grad.flatten() for p in b.parameters()]).norm() for b in net.blocks]
    torch.testing.assert_close(rec.param_grad_norms[0], torch.stack(param_norms))


def test_explicit_layers_in_given_order():
    stack = controlled_stack(3, 4, 1.0, generator=0, dtype=torch.float64)
    with GradientNormRecorder(stack, layers=["2", "0"]) as rec:
        stack(torch.randn(1, 4, dtype=torch.float64)).sum().backward()
    assert rec.names == ["2", "0"] and rec.output_grad_norms.shape == (1, 2)
    # Orthogonal layers preserve the norm: the output's gradient (all ones) has norm 2.
    torch.testing.assert_close(rec.output_grad_norms[0], torch.full((2,), 2.0, dtype=torch.float64))


# ------------------------------------------------------------------------------------ real model zoo
def _assert_one_norm_per_block(model, loss, prefix, depth):
    with GradientNormRecorder(model) as rec:
        loss().backward()
    assert rec.names == [f"{prefix}.{i}" for i in range(depth)]
    for norms in (rec.output_grad_norms, rec.param_grad_norms):
        assert norms.shape == (1, depth)
        assert torch.isfinite(norms).all() and (norms > 0).all()


def test_recorder_on_bert():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=3, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16)
    torch.manual_seed(0)
    model = transformers.BertModel(config)
    ids = torch.randint(0, 50, (2, 8))
    _assert_one_norm_per_block(model, lambda: model(input_ids=ids).last_hidden_state.square().mean(),
                               "encoder.layer", 3)


def test_recorder_on_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 50, (2, 8))
    _assert_one_norm_per_block(model, lambda: model(input_ids=ids, labels=ids).loss, "model.layers", 3)


def test_recorder_on_timm_vit():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8,
                              num_classes=10, depth=3)
    images, labels = torch.randn(2, 3, 32, 32), torch.tensor([1, 7])
    _assert_one_norm_per_block(model, lambda: nn.functional.cross_entropy(model(images), labels), "blocks", 3)


# ------------------------------------------------------------------------------------------ Jacobians
def test_layer_jacobian_singular_values_are_sigma():
    layer = controlled_stack(1, 8, 1.3, generator=0, dtype=torch.float64)[0]
    s = layer_jacobian_singular_values(layer, torch.randn(3, 8, dtype=torch.float64))
    torch.testing.assert_close(s, torch.full((3, 8), 1.3, dtype=torch.float64))


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_end_to_end_jacobian_matches_explicit_product(kind):
    depth, width = 6, 5
    stack = controlled_stack(depth, width, 1.2, kind=kind, generator=3, dtype=torch.float64)
    x = torch.randn(4, width, dtype=torch.float64)
    weights = [m.weight.detach() for m in stack if isinstance(m, nn.Linear)]
    expected = []
    for xb in x:
        # Chain rule by hand: J = W_D diag(tanh'(z_{D-1})) W_{D-1} ... diag(tanh'(z_1)) W_1.
        jac, h = torch.eye(width, dtype=torch.float64), xb
        for i, w in enumerate(weights):
            if kind == "mlp" and i > 0:
                jac = torch.diag(1 - torch.tanh(h) ** 2) @ jac
                h = torch.tanh(h)
            jac, h = w @ jac, w @ h
        expected.append(torch.linalg.svdvals(jac))
    got = end_to_end_singular_values(stack, x)
    torch.testing.assert_close(got, torch.stack(expected))
    torch.testing.assert_close(end_to_end_singular_values(list(stack), x), got)
    if kind == "linear":
        torch.testing.assert_close(got, torch.full_like(got, 1.2**depth))


# ----------------------------------------------------------------------------------------- growth fit
def test_fit_growth_rate_noisy_stderr_is_calibrated():
    n, true_rate, noise = 40, -0.07, 0.2
    d = torch.arange(n, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    z = []
    for _ in range(300):
        log_norms = 1.5 + true_rate * d + noise * torch.randn(n, generator=g, dtype=torch.float64)
        fit = fit_growth_rate(d, log_norms.exp())
        z.append((fit.rate - true_rate) / fit.rate_stderr)
        # The estimate of the standard error tracks the true one, noise / sqrt(sum (d - mean d)^2).
        assert 0.6 < fit.rate_stderr / (noise / (d - d.mean()).square().sum().sqrt()) < 1.4
    z = torch.tensor(z)
    # |t| <= 2 holds ~95% of the time for 38 degrees of freedom; 300 draws put it within a few points.
    assert 0.90 < (z.abs() <= 2).double().mean() < 0.99
    assert abs(z.mean()) < 0.25


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_fit_growth_rate_rejects_bad_norms(bad):
    with pytest.raises(ValueError, match=r"norms\[2\]"):
        fit_growth_rate([0, 1, 2, 3], [1.0, 2.0, bad, 4.0])


def test_fit_growth_rate_rejects_bad_shapes():
    with pytest.raises(ValueError, match="differ in length"):
        fit_growth_rate([0, 1, 2], [1.0, 2.0])
    with pytest.raises(ValueError, match="at least 3"):
        fit_growth_rate([0, 1], [1.0, 2.0])
    with pytest.raises(ValueError, match="depths are all equal"):
        fit_growth_rate([1, 1, 1], [1.0, 2.0, 3.0])


# -------------------------------------------------------------------------------------------- variance
def _variance_setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 2)).double()
    batches = [(torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)) for _ in range(7)]

    def loss_fn(m, batch):
        return nn.functional.mse_loss(m(batch[0]), batch[1])

    return model, batches, loss_fn


def test_minibatch_gradient_variance_matches_brute_force():
    model, batches, loss_fn = _variance_setup()
    state = {k: v.clone() for k, v in model.state_dict().items()}  # weights and BatchNorm statistics
    sentinel = [torch.full_like(p, 7.0) for p in model.parameters()]
    for p, s in zip(model.parameters(), sentinel):
        p.grad = s.clone()
    groups = {"first": model[0].parameters(), "last": model[3].parameters()}

    result = minibatch_gradient_variance(model, loss_fn, batches, groups=groups)

    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    for p, s in zip(model.parameters(), sentinel):
        assert torch.equal(p.grad, s)

    rows = []
    for batch in batches:
        model.zero_grad(set_to_none=True)
        loss_fn(model, batch).backward()
        rows.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    grads = torch.stack(rows)  # (K, P)
    cov = torch.cov(grads.T)  # (P, P), divides by K - 1
    assert result.num_batches == len(batches) and result.num_params == grads.shape[1]
    assert result.trace == pytest.approx(cov.trace().item(), rel=1e-10)
    assert result.mean_grad_sq_norm == pytest.approx(grads.mean(0).square().sum().item(), rel=1e-10)
    n_first = sum(p.numel() for p in model[0].parameters())
    n_last = sum(p.numel() for p in model[3].parameters())
    diag = cov.diagonal()
    assert result.group_traces["first"] == pytest.approx(diag[:n_first].sum().item(), rel=1e-10)
    assert result.group_traces["last"] == pytest.approx(diag[-n_last:].sum().item(), rel=1e-10)


def test_minibatch_gradient_variance_bad_input():
    model, batches, loss_fn = _variance_setup()
    with pytest.raises(ValueError, match="batches: need at least 2"):
        minibatch_gradient_variance(model, loss_fn, batches[:1])
    with pytest.raises(ValueError, match="batches: need at least 2"):
        minibatch_gradient_variance(model, loss_fn, iter([]))
    with pytest.raises(ValueError, match="loss_fn must return a scalar"):
        minibatch_gradient_variance(model, lambda m, b: m(b[0]), batches)
    with pytest.raises(ValueError, match="groups"):
        minibatch_gradient_variance(model, loss_fn, batches, params=model[0].parameters(),
                                    groups={"last": model[3].parameters()})


def test_layer_norm_spread_matches_numpy():
    norms = np.array([0.5, 1.0, 2.0, 8.0])
    spread = layer_norm_spread(torch.tensor(norms))
    assert spread.n == 4
    assert spread.std == pytest.approx(np.std(norms))
    assert spread.cv == pytest.approx(np.std(norms) / np.mean(norms))
    assert spread.log_std == pytest.approx(np.std(np.log(norms)))
    with pytest.raises(ValueError, match=r"per_layer_norms\[1\]"):
        layer_norm_spread([1.0, 0.0, 2.0])
    with pytest.raises(ValueError, match="at least 2"):
        layer_norm_spread([1.0])


# ------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"depth": 0}, "depth=0 must be >= 1"),
    ({"width": 0}, "width=0 must be >= 1"),
    ({"sigma": 0.0}, "sigma=0.0 must be positive"),
    ({"sigma": -1.0}, "sigma=-1.0 must be positive"),
    ({"sigma": math.nan}, "sigma=nan must be positive"),
    ({"kind": "conv"}, "kind='conv'"),
    ({"kind": "mlp", "activation": "swish"}, "activation='swish'"),
])
def test_controlled_stack_rejects(kwargs, message):
    args = {"depth": 2, "width": 3, "sigma": 1.0, **kwargs}
    with pytest.raises(ValueError, match=message):
        controlled_stack(**args)


def test_controlled_stack_seeded_and_bias_free():
    a, b = controlled_stack(3, 4, 0.5, generator=7), controlled_stack(3, 4, 0.5, generator=7)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert all(m.bias is None for m in a)


def test_recorder_needs_layers_when_none_repeat():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Conv1d(1, 1, 1))
    assert find_repeated_layers(model) == []
    with pytest.raises(ValueError, match="layers: Sequential has no nn.ModuleList"):
        GradientNormRecorder(model)
    with pytest.raises(ValueError, match="no submodule 'head'"):
        GradientNormRecorder(model, layers=["head"])
    with pytest.raises(ValueError, match="layers must be a list"):
        GradientNormRecorder(model, layers="0")
    with pytest.raises(ValueError, match="layers is empty"):
        GradientNormRecorder(model, layers=[])
