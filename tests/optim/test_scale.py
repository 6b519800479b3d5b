"""NormGradScaler: the post's 2^5 / max_grad_norm over a window, with overflow back-off."""

import math

import pytest
import torch

from macroarch.optim import NormGradScaler, NormScaleConfig, norm_rule_scale


def test_scale_is_two_to_the_five_over_the_window_maximum():
    scaler = NormGradScaler(window=3)
    assert scaler.get_scale() == 32.0  # no norm seen yet: a norm of 1 assumed
    for norm in (1.0, 4.0, 2.0):
        scaler.update(norm)
    assert scaler.max_grad_norm == 4.0 and scaler.get_scale() == 2**5 / 4.0
    scaler.update(0.5)  # 1.0 leaves; 4.0 is still in the window
    assert scaler.get_scale() == 8.0
    scaler.update(0.5)
    scaler.update(0.5)  # 4.0 and 2.0 have left
    assert scaler.get_scale() == 64.0
    assert norm_rule_scale(4.0) == 8.0


def test_scaled_loss_carries_the_scale_into_the_gradient():
    scaler = NormGradScaler(init_scale=8.0)
    w = torch.tensor([3.0], requires_grad=True)
    scaler.scale((w * w).sum()).backward()
    assert w.grad.item() == 8.0 * 6.0 and scaler.applied_scale == 8.0


def test_overflow_halves_the_scale_until_it_leaves_the_window():
    scaler = NormGradScaler(window=4)
    scaler.update(2.0)
    scaler.scale(torch.tensor(1.0))
    applied = scaler.applied_scale
    assert applied == 16.0
    scaler.update(math.inf)
    assert scaler.overflows == 1 and scaler.get_scale() == applied * 0.5
    for _ in range(3):
        scaler.update(2.0)
    assert scaler.get_scale() == 8.0  # the overflow's entry is still in the window (4 entries)
    scaler.update(2.0)
    assert scaler.get_scale() == 16.0


def test_applied_scale_is_frozen_between_scale_calls():
    # Several optimizers (DGR groups) divide the same backward's gradients by one number.
    scaler = NormGradScaler()
    scaler.scale(torch.tensor(1.0))
    scaler.update(math.nan)
    scaler.update(100.0)
    assert scaler.applied_scale == 32.0 and scaler.get_scale() < 32.0


def test_scale_needs_a_scaled_loss_first():
    with pytest.raises(RuntimeError, match="scale"):
        NormGradScaler().applied_scale  # noqa: B018


def test_state_dict_round_trip():
    scaler = NormGradScaler(window=5, backoff=0.25)
    for norm in (1.0, 3.0, math.inf):
        scaler.scale(torch.tensor(1.0))
        scaler.update(norm)
    twin = NormGradScaler()
    twin.load_state_dict(scaler.state_dict())
    assert twin.get_scale() == scaler.get_scale() and twin.config == scaler.config and twin.overflows == 1


@pytest.mark.parametrize("kwargs, name", [
    ({"target": 0.0}, "target"), ({"window": 0}, "window"), ({"backoff": 1.0}, "backoff"),
    ({"init_scale": -1.0}, "init_scale"), ({"max_scale": math.inf}, "max_scale"),
])
def test_bad_settings_are_named(kwargs, name):
    with pytest.raises(ValueError, match=name):
        NormScaleConfig(**kwargs)
    with pytest.raises(ValueError, match="max_grad_norm"):
        norm_rule_scale(0.0)
