"""timm habits with MVAS: a ViT with timm's gradient checkpointing switch, create_optimizer_v2 (the clear error),
and training with MVASAdamW as the dense model trains."""

import pytest
import timm
import torch
import torch.nn.functional as F
from timm.optim import create_optimizer_v2

from macroarch import mvas

RULES = [("*mlp*", "fp4"), ("*attn*", "fp8"), ("*", "bf16")]


def _vit(managed):
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, num_classes=4,
                              depth=3)
    if managed:
        mvas.apply(model, mvas.plan_from_rules(model, RULES, block_size=32, min_numel=1024))
    return model


def _data(n=32):
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 4, (n,), generator=g)
    patterns = torch.randn(4, 3, 32, 32, generator=g)
    return patterns[labels] + 0.5 * torch.randn(n, 3, 32, 32, generator=g), labels


def test_timm_gradient_checkpointing_gives_the_same_gradients():
    x, y = _data(4)
    grads = []
    for on in (False, True):
        model = _vit(managed=True)
        model.set_grad_checkpointing(on)
        F.cross_entropy(model(x), y).backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_create_optimizer_v2_gives_the_clear_error():
    model = _vit(managed=True)
    x, y = _data(2)
    F.cross_entropy(model(x), y).backward()
    opt = create_optimizer_v2(model, "adamw", lr=1e-3)
    with pytest.raises(TypeError, match="MVASAdamW"):
        opt.step()


def _train(managed, steps=12):
    model = _vit(managed)
    model.set_grad_checkpointing(True)
    x, y = _data()
    opt = (mvas.MVASAdamW(model.parameters(), lr=2e-3, seed=0) if managed
           else torch.optim.AdamW(model.parameters(), lr=2e-3))
    losses = []
    for step in range(steps):
        batch = slice(8 * (step % 4), 8 * (step % 4) + 8)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x[batch]), y[batch])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


def test_a_vit_with_checkpointing_and_autocast_trains_as_the_dense_one():
    dense, managed = _train(False), _train(True)
    drop = lambda losses: sum(losses[:4]) / 4 - sum(losses[-4:]) / 4  # noqa: E731
    assert drop(managed) > 0.7 * drop(dense) > 0
