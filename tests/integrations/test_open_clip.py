"""open_clip with MVAS: its own gradient checkpointing switch and contrastive loss (ClipLoss), trained with
MVASAdamW as the dense model trains."""

import open_clip
import torch
from open_clip.loss import ClipLoss

from macroarch import mvas

VISION = dict(layers=2, width=32, patch_size=8, image_size=32, head_width=16)
TEXT = dict(context_length=12, vocab_size=64, width=32, heads=2, layers=2)


def _clip(managed):
    torch.manual_seed(0)
    model = open_clip.model.CLIP(32, VISION, TEXT)
    model.set_grad_checkpointing(True)
    if managed:
        rules = [("visual.*", "fp8"), ("transformer.*", "fp4"), ("*", "bf16")]
        mvas.apply(model, mvas.plan_from_rules(model, rules, block_size=32, min_numel=1024))
    return model


def _pairs(n=16):
    """Image-caption pairs that match: caption tokens and image pattern come from the same class."""
    g = torch.Generator().manual_seed(0)
    classes = torch.arange(n) % 8
    patterns, words = torch.randn(8, 3, 32, 32, generator=g), torch.randint(1, 64, (8, 12), generator=g)
    return patterns[classes] + 0.3 * torch.randn(n, 3, 32, 32, generator=g), words[classes]


def _train(managed, steps=10):
    model = _clip(managed)
    images, texts = _pairs()
    loss_fn = ClipLoss()
    opt = (mvas.MVASAdamW(model.parameters(), lr=3e-3, seed=0) if managed
           else torch.optim.AdamW(model.parameters(), lr=3e-3))
    losses = []
    for _ in range(steps):
        image_features, text_features, scale = model(images, texts)[:3]
        loss = loss_fn(image_features, text_features, scale)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses, model


def test_open_clip_with_checkpointing_trains_its_contrastive_loss_as_the_dense_model():
    (dense, _), (managed, model) = _train(False), _train(True)
    assert sum(isinstance(p, mvas.MVASWeight) for p in model.parameters()) >= 4
    drop = lambda losses: sum(losses[:3]) / 3 - sum(losses[-3:]) / 3  # noqa: E731
    assert drop(managed) > 0.7 * drop(dense) > 0


def test_checkpointing_changes_no_gradient():
    images, texts = _pairs(4)
    grads = []
    for on in (False, True):
        model = _clip(managed=True)
        model.set_grad_checkpointing(on)
        ClipLoss()(*model(images, texts)[:3]).backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
