"""DC-ASGD compensation: the formulas on hand-made numbers, state round trip, and its effect on a delayed run."""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from macroarch.dgr import (
    DC_ASGD_A_LAMBDA,
    DC_ASGD_C_LAMBDA,
    DGRWrapper,
    GradientCompensator,
    adaptive_lambda,
    dc_asgd_compensate,
    update_meansquare,
)

F64 = torch.float64
G = torch.tensor([1.0, -2.0, 0.5], dtype=F64)
W_NOW = torch.tensor([1.0, 1.0, 1.0], dtype=F64)
W_THEN = torch.tensor([0.0, 2.0, 1.0], dtype=F64)  # w_now - w_then = [1, -1, 0]


def test_constant_lambda_by_hand():
    # g + 0.5 * g^2 * dw = [1 + 0.5, -2 + 0.5 * 4 * -1, 0.5 + 0]
    expected = torch.tensor([1.5, -4.0, 0.5], dtype=F64)
    assert torch.equal(dc_asgd_compensate(G, W_NOW, W_THEN, 0.5), expected)
    comp = GradientCompensator(0.5)
    assert torch.equal(comp.compensate("w", G, W_NOW, W_THEN), expected)
    assert comp.meansquare == {}  # the constant variant keeps no state
    assert comp(["w", "b"], [G, None], [W_NOW, W_NOW], [W_THEN, W_THEN])[1] is None


def test_adaptive_lambda_by_hand():
    lambda0, m, eps = 2.0, 0.9, 1e-7
    comp = GradientCompensator(lambda0, adaptive=True, momentum=m, eps=eps)
    g2 = torch.tensor([0.5, 1.0, -1.0], dtype=F64)
    out1 = comp.compensate("w", G, W_NOW, W_THEN)
    out2 = comp.compensate("w", g2, W_NOW, W_THEN)
    dw = [1.0, -1.0, 0.0]
    for i in range(3):
        ms1 = (1 - m) * G[i].item() ** 2  # the mean square starts at zero
        ms2 = m * ms1 + (1 - m) * g2[i].item() ** 2
        g, h = G[i].item(), g2[i].item()
        assert out1[i].item() == pytest.approx(g + lambda0 / math.sqrt(ms1 + eps) * g * g * dw[i], rel=1e-12)
        assert out2[i].item() == pytest.approx(h + lambda0 / math.sqrt(ms2 + eps) * h * h * dw[i], rel=1e-12)
        assert comp.meansquare["w"][i].item() == pytest.approx(ms2, rel=1e-12)
    ms = update_meansquare(None, G, m)
    torch.testing.assert_close(adaptive_lambda(ms, lambda0, eps), lambda0 / torch.sqrt((1 - m) * G * G + eps))


def test_defaults_follow_the_paper_and_low_precision_keeps_its_dtype():
    assert GradientCompensator().lambda_ == DC_ASGD_C_LAMBDA == 0.04
    assert GradientCompensator(adaptive=True).lambda_ == DC_ASGD_A_LAMBDA == 2.0
    assert GradientCompensator(adaptive=True).momentum == 0.95
    out = GradientCompensator(0.5).compensate("w", G.bfloat16(), W_NOW.bfloat16(), W_THEN.bfloat16())
    assert out.dtype == torch.bfloat16 and out.tolist() == [1.5, -4.0, 0.5]


def test_state_dict_round_trip():
    a = GradientCompensator(adaptive=True, momentum=0.8)
    a.compensate("w", G, W_NOW, W_THEN)
    b = GradientCompensator()
    b.load_state_dict(a.state_dict())
    assert (b.lambda_, b.adaptive, b.momentum, b.eps) == (a.lambda_, a.adaptive, a.momentum, a.eps)
    assert torch.equal(a.compensate("w", -G, W_NOW, W_THEN), b.compensate("w", -G, W_NOW, W_THEN))
    with pytest.raises(ValueError, match=r"lacks \['meansquare'\]"):
        b.load_state_dict({k: v for k, v in a.state_dict().items() if k != "meansquare"})


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(lambda_=-0.1), "lambda_=-0.1 must be a finite number >= 0"),
    (dict(lambda_=float("nan")), "lambda_=nan"),
    (dict(momentum=1.0), r"momentum=1.0 must lie in \[0, 1\)"),
    (dict(eps=0.0), "eps=0.0 must be a finite number > 0"),
    (dict(adaptive="yes"), "adaptive='yes' must be True or False"),
])
def test_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GradientCompensator(**kwargs)
    with pytest.raises(ValueError, match="must have one shape"):
        GradientCompensator().compensate("w", G, W_NOW[:2], W_THEN)


def _delayed_run(delay, compensator, steps=150, lr=0.5):
    """Full-batch SGD on a small classifier MLP whose gradients arrive ``delay`` steps late (one group)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g, dtype=F64)
    y = (x @ torch.randn(8, 4, generator=g, dtype=F64)).argmax(-1)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)).to(F64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dgr = DGRWrapper(net, group_size=3, mode="interleaved", delays=delay, compensator=compensator,
                         example_inputs=x)
    assert len(dgr.grouping) == 1
    opt = dgr.optimizer(torch.optim.SGD, lr=lr)
    trajectory = []
    for _ in range(steps):
        F.cross_entropy(dgr(x), y).backward()
        opt.step()
        opt.zero_grad()
        trajectory.append(torch.cat([p.detach().flatten() for p in net.parameters()]))
    return torch.stack(trajectory)


@pytest.mark.parametrize("compensator", [GradientCompensator(1.0), GradientCompensator(adaptive=True)],
                         ids=["DC-ASGD-c", "DC-ASGD-a"])
def test_compensation_brings_a_delayed_run_closer_to_the_undelayed_one(compensator):
    delay = 8
    undelayed = _delayed_run(0, None)

    def distance(run):
        # The delayed run applies nothing for `delay` steps; after step t it has taken t - delay + 1 updates.
        return (run[delay:] - undelayed[:-delay]).norm(dim=1).mean().item()

    plain, compensated = distance(_delayed_run(delay, None)), distance(_delayed_run(delay, compensator))
    assert compensated < plain
