"""The clipping probe, checked against closed forms and against plain training with clip_grad_norm_."""

import copy
import math

import numpy as np
import pytest
import torch
from torch import nn

from macroarch.measure.clipping import (
    ClippingProbe,
    clip_coefficient,
    measure_clipping,
    steps_to_target,
)
from macroarch.models.bert import bert_small_config, build_bert_mlm, mlm_loss


class Linear(nn.Module):
    """One weight vector; with ``loss = <a, w>`` the gradient is exactly ``a``."""

    def __init__(self, n, dtype=torch.float64):
        super().__init__()
        self.w = nn.Parameter(torch.randn(n, dtype=dtype, generator=torch.Generator().manual_seed(0)))


def linear_loss(model, a):
    return (a * model.w).sum()


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).double()


def mse_loss(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def mse_batches(n, seed=0):
    generator = torch.Generator().manual_seed(seed)
    # a varying input scale makes the gradient norm range over an order of magnitude
    return [(torch.randn(32, 8, generator=generator, dtype=torch.float64) * (0.3 + 2 * (i % 5) / 4),
             torch.randn(32, 1, generator=generator, dtype=torch.float64)) for i in range(n)]


def sgd(lr=0.1, momentum=0.0):
    return lambda model: torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)


@pytest.mark.parametrize("scale", [0.1, 1.0, 30.0])
def test_clip_coefficient_is_the_factor_clip_grad_norm_applies(scale):
    generator = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.zeros(shape)) for shape in ((5, 7), (7,), (3, 2, 4))]
    for p in params:
        p.grad = scale * torch.randn(p.shape, generator=generator)
    raw = [p.grad.clone() for p in params]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm=1.0)
    coefficient = clip_coefficient(norm, 1.0)
    for p, g in zip(params, raw):
        assert torch.equal(p.grad, g * coefficient)  # same ops as torch, so the same bits
    independent = math.sqrt(sum(float((g.double() ** 2).sum()) for g in raw))
    assert clip_coefficient(independent, 1.0) == pytest.approx(min(1.0, 1.0 / (independent + 1e-6)), rel=1e-12)
    assert float(coefficient) == pytest.approx(clip_coefficient(independent, 1.0), rel=1e-6)


@pytest.mark.parametrize("with_schedule", [False, True])
def test_plain_sgd_shortens_each_step_by_exactly_the_clip_coefficient(with_schedule):
    model, batches, max_norm, lr = mlp(), mse_batches(12), 0.5, 0.1
    probe = ClippingProbe(model, mse_loss, sgd(lr), max_norm)
    # the shadow must follow an LR schedule that only the real optimizer knows about
    schedule = torch.optim.lr_scheduler.LambdaLR(probe.optimizer, lambda t: 1 / (1 + t)) if with_schedule else None
    for t, batch in enumerate(batches):
        grads = torch.autograd.grad(mse_loss(model, batch), list(model.parameters()))
        norm = math.sqrt(sum(float((g**2).sum()) for g in grads))
        expected = min(1.0, max_norm / (norm + 1e-6))
        record = probe.step(batch)
        step_lr = lr / (1 + t) if with_schedule else lr
        assert record.grad_norm == pytest.approx(norm, rel=1e-12)
        assert record.unclipped_update_norm == pytest.approx(step_lr * norm, rel=1e-9)  # du = -lr g
        assert record.update_ratio == pytest.approx(expected, rel=1e-9)
        assert record.clip_coefficient == pytest.approx(expected, rel=1e-12)
        assert record.update_cosine == pytest.approx(1.0, abs=1e-9)
        if schedule is not None:
            schedule.step()
    summary = probe.trace().summary()
    assert 0 < summary["clip_fraction"] < 1  # the test covers clipped and unclipped steps
    assert summary["effective_lr_reduction"] == pytest.approx(1 - summary["mean_clip_coefficient"], rel=1e-9)


def test_momentum_sgd_ratio_is_the_momentum_average_of_coefficients():
    # parallel gradients g_t = a_t u: the buffers are b_t = beta b_{t-1} + a_t u and the same with c_t a_t
    n, beta, max_norm = 16, 0.9, 1.0
    u = torch.ones(n, dtype=torch.float64) / 4.0  # unit vector
    sizes = [0.5, 3.0, 0.8, 2.0, 0.2, 4.0, 1.5, 0.9]
    probe = ClippingProbe(Linear(n), linear_loss, sgd(0.05, beta), max_norm)
    raw = clipped = 0.0
    for a in sizes:
        c = min(1.0, max_norm / (a + 1e-6))
        raw, clipped = beta * raw + a, beta * clipped + c * a
        assert probe.step(a * u).update_ratio == pytest.approx(clipped / raw, rel=1e-9)


def test_huge_threshold_changes_nothing():
    model, batches = mlp(), mse_batches(8)
    trace = measure_clipping(model, mse_loss, batches, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
                             max_norm=1e30, steps=8)
    assert not trace.clipped.any()
    assert np.array_equal(trace.clipped_update_norm, trace.unclipped_update_norm)
    assert trace.summary()["effective_lr_reduction"] == 0.0
    assert trace.summary()["effective_lr_reduction_ratio_of_means"] == 0.0


def test_shadow_step_restores_weights_and_gradients_bit_for_bit():
    model = mlp()
    probe = ClippingProbe(model, mse_loss, lambda m: torch.optim.AdamW(m.parameters(), lr=0.1), 0.1)
    probe.step(mse_batches(1)[0])  # give both optimizers state
    mse_loss(model, mse_batches(2)[1]).backward()
    weights = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad.clone() for p in model.parameters()]
    deltas = probe._shadow_update()
    assert all(d.abs().sum() > 0 for d in deltas)
    for p, w, g in zip(model.parameters(), weights, grads):
        assert torch.equal(p, w) and torch.equal(p.grad, g)


def test_adamw_probe_trains_exactly_like_clip_grad_norm_and_adamw():
    """A small BERT with dropout: same weights, same losses, bit for bit; the shadow's state stays apart."""
    config = bert_small_config(260, hidden=32, layers=2, heads=2, max_len=32, pad_token_id=256)
    model = build_bert_mlm(config, seed=0)
    reference = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(6):
        ids = torch.randint(0, 256, (4, 32), generator=generator)
        masked = torch.rand(4, 32, generator=generator) < 0.15
        batches.append({"input_ids": ids.masked_fill(masked, 259), "labels": ids.masked_fill(~masked, -100)})
    make_adamw = lambda m: torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.01)  # noqa: E731
    max_norm = 0.5

    trace = measure_clipping(model, mlm_loss, batches, make_adamw, max_norm, steps=6, seed=3)

    optimizer = torch.optim.AdamW(reference.parameters(), lr=3e-3, weight_decay=0.01)
    losses = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        for batch in batches:
            optimizer.zero_grad()
            loss = mlm_loss(reference, batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
            optimizer.step()
            losses.append(loss.item())
    assert trace.clipped.any()
    assert np.array_equal(trace.loss, np.array(losses))
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)


def test_real_and_shadow_adam_states_are_separate():
    model = mlp()
    probe = ClippingProbe(model, mse_loss, lambda m: torch.optim.Adam(m.parameters(), lr=1e-2), 1e-3)
    for batch in mse_batches(3):
        probe.step(batch)
    p = next(model.parameters())
    real, shadow = probe.optimizer.state[p], probe.shadow_optimizer.state[p]
    assert real["exp_avg"] is not shadow["exp_avg"]
    assert float(real["step"]) == float(shadow["step"]) == 3
    # every step is clipped hard, so the real second moment is far below the raw one
    assert (real["exp_avg_sq"].sum() < 1e-3 * shadow["exp_avg_sq"].sum()).item()


@pytest.mark.parametrize("eps", [1e-8, 1e-3])
def test_adamw_ignores_a_constant_clip_coefficient_up_to_eps(eps):
    """Every gradient has norm K, so every step is clipped by the same c = max_norm / (K + 1e-6).

    With every element of g_t equal to +-s (s = K / sqrt(n)), Adam's bias-corrected second moment is s^2
    exactly, in both streams up to the factor c^2. Per element the clipped update is
    m_hat / (s + eps / c) against m_hat / (s + eps) unclipped, so every element, hence the norm, is shorter
    by the same factor and the reduction is 1 - (s + eps) / (s + eps / c) <= eps / (c s).
    """
    n, K, max_norm = 64, 8.0, 1.0
    s, c = K / math.sqrt(n), max_norm / (K + 1e-6)
    generator = torch.Generator().manual_seed(0)
    signs = [torch.randint(0, 2, (n,), generator=generator).double() * 2 - 1 for _ in range(20)]
    make_adamw = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, eps=eps, weight_decay=0.0)  # noqa: E731
    trace = measure_clipping(Linear(n), linear_loss, [s * a for a in signs], make_adamw, max_norm, steps=20)

    assert trace.clipped.all()
    np.testing.assert_allclose(trace.clip_coefficient, c, rtol=1e-12)
    expected = 1 - (s + eps) / (s + eps / c)
    assert 0 <= expected <= eps / (c * s)
    reduction = trace.summary()["effective_lr_reduction"]
    assert reduction == pytest.approx(expected, rel=1e-6, abs=1e-12)
    assert reduction <= eps / (c * s) + 1e-12


def test_steps_to_target_on_an_exponential_curve():
    t = np.arange(200)
    losses = 10 * np.exp(-t / 20)
    # one step: 10 exp(-t/20) <= 1 from t >= 20 ln 10 = 46.05
    assert steps_to_target(losses, 1.0, window=1) == math.ceil(20 * math.log(10))
    # window w ending at i: 10 exp(-i/20) * S / w with S = sum_{k<w} exp(k/20)
    w = 10
    S = sum(math.exp(k / 20) for k in range(w))
    assert steps_to_target(losses, 1.0, window=w) == math.ceil(20 * math.log(10 * S / w))
    assert steps_to_target(losses, 0.0, window=w) is None
    assert steps_to_target(losses[:5], 100.0, window=w) is None  # no full window yet


def test_steps_to_target_ignores_a_lone_dip_when_averaging():
    losses = np.full(50, 2.0)
    losses[10] = 0.0
    assert steps_to_target(losses, 1.0, window=1) == 10
    assert steps_to_target(losses, 1.0, window=5) is None


@pytest.mark.parametrize("max_norm", [0.0, -1.0])
def test_nonpositive_max_norm_is_rejected_by_name(max_norm):
    for call in (
        lambda: clip_coefficient(1.0, max_norm),
        lambda: ClippingProbe(mlp(), mse_loss, sgd(), max_norm),
        lambda: measure_clipping(mlp(), mse_loss, mse_batches(2), sgd(), max_norm, steps=2),
    ):
        with pytest.raises(ValueError, match="max_norm"):
            call()


def test_bad_steps_batches_window_and_optimizer_factory_are_rejected_by_name():
    with pytest.raises(ValueError, match="steps"):
        measure_clipping(mlp(), mse_loss, mse_batches(2), sgd(), 1.0, steps=0)
    with pytest.raises(ValueError, match="batches"):
        measure_clipping(mlp(), mse_loss, mse_batches(2), sgd(), 1.0, steps=3)
    with pytest.raises(ValueError, match="window"):
        steps_to_target([1.0, 0.5], 0.7, window=0)
    model = mlp()
    shared = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="make_optimizer"):
        ClippingProbe(model, mse_loss, lambda m: shared, 1.0)
