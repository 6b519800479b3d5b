"""The LR multiplier and warmup extension, alone and composed with torch schedulers."""

import math

import pytest
import torch

from macroarch.optim import extended_warmup, recipe_scheduler, scale_lr, scaled_lr, warmup_cosine


def _opt(lr=1e-3):
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=lr)


@pytest.mark.parametrize("warmup, extension, expected", [(10, 0.3, 13), (100, 0.3, 130), (7, 0.3, 10), (0, 0.3, 0),
                                                         (10, 0.0, 10)])
def test_extended_warmup_rounds_up(warmup, extension, expected):
    assert extended_warmup(warmup, extension) == expected


def test_scaled_lr_and_scale_lr():
    assert scaled_lr(1e-3, 1.35) == pytest.approx(1.35e-3)
    opt = scale_lr(_opt(), 1.5)
    assert opt.param_groups[0]["lr"] == pytest.approx(1.5e-3)


def test_scale_lr_composes_with_a_scheduler_built_after_it():
    opt = scale_lr(_opt(), 1.2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    assert sched.base_lrs == [pytest.approx(1.2e-3)]
    with pytest.raises(ValueError, match="before building the scheduler"):
        scale_lr(opt, 1.2)


def test_warmup_cosine_shape():
    f = warmup_cosine(4, 14, min_lr_ratio=0.1)
    assert [f(t) for t in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == 1.0
    assert f(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(14) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)


def test_recipe_scheduler_lengthens_warmup_and_scales_peak():
    opt = _opt()
    sched = recipe_scheduler(opt, warmup_steps=10, total_steps=100, lr_multiplier=1.5, warmup_extension=0.3)
    lrs = []
    for _ in range(20):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(1.5e-3 / 13)
    assert lrs[12] == pytest.approx(1.5e-3) and lrs[11] < lrs[12]  # peak at step 13 of warmup (index 12)
    assert max(lrs) == pytest.approx(1.5e-3)


@pytest.mark.parametrize("call, name", [
    (lambda: scaled_lr(-1.0, 1.2), "base_lr"), (lambda: scaled_lr(1e-3, 0.0), "multiplier"),
    (lambda: extended_warmup(-1, 0.3), "warmup_steps"), (lambda: extended_warmup(10, -1.0), "extension"),
    (lambda: warmup_cosine(20, 10), "warmup_steps"), (lambda: warmup_cosine(2, 10, 1.5), "min_lr_ratio"),
    (lambda: warmup_cosine(2, 0), "total_steps"),
])
def test_bad_arguments_are_named(call, name):
    with pytest.raises(ValueError, match=name):
        call()
