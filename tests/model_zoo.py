"""Tiny models of every family the techniques must handle, each with a loss: ``ZOO[name]() -> (model, loss_fn)``,
where ``loss_fn(model)`` is a scalar. Shared by the DGR and MVAS tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _sequential(dtype=torch.float32):
    torch.manual_seed(0)
    net = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(8, 8), nn.Tanh())]).to(dtype)
    x = torch.randn(3, 8, dtype=dtype)
    return net, lambda m: m(x).square().mean()


def _llama(dtype=torch.float32):
    from macroarch.models import get_model_spec

    torch.manual_seed(0)
    net = get_model_spec("llama_65b_tiny").scaled(n_layers=4).build(dtype=dtype)
    ids = torch.randint(0, 256, (2, 12))
    return net, lambda m: m(input_ids=ids, labels=ids).loss


def _gpt2_tied(dtype=torch.float32):
    from macroarch.models import get_model_spec

    torch.manual_seed(0)
    net = get_model_spec("gpt3_tiny").scaled(n_layers=3, dropout=0.0).build(dtype=dtype)
    ids = torch.randint(0, 256, (2, 12))
    return net, lambda m: m(input_ids=ids, labels=ids).loss


def _bert(dtype=torch.float32):
    from macroarch.models import bert_small_config, build_bert_mlm

    net = build_bert_mlm(bert_small_config(260, hidden=32, layers=4, heads=2, dropout=0.0), seed=0).to(dtype)
    ids = torch.randint(0, 260, (2, 12), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, 1::2] = -100
    return net, lambda m: m(input_ids=ids, labels=labels).loss


def _vit(dtype=torch.float32):
    import timm

    torch.manual_seed(0)
    net = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, num_classes=10,
                            depth=4).to(dtype)
    x, y = torch.randn(2, 3, 32, 32, dtype=dtype), torch.tensor([3, 7])
    return net, lambda m: F.cross_entropy(m(x), y)


def _clip(dtype=torch.float32):
    import open_clip

    torch.manual_seed(0)
    vision = dict(layers=3, width=32, patch_size=8, image_size=32, head_width=16)
    text = dict(context_length=12, vocab_size=100, width=32, heads=2, layers=2)
    net = open_clip.model.CLIP(32, vision, text).to(dtype)
    images, texts = torch.randn(3, 3, 32, 32, dtype=dtype), torch.randint(0, 100, (3, 12))

    def loss(m):  # the symmetric contrastive loss of CLIP
        image_features, text_features, scale = m(images, texts)[:3]
        logits = scale * image_features @ text_features.T
        target = torch.arange(len(logits))
        return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2

    return net, loss


ZOO = {"sequential": _sequential, "llama": _llama, "gpt2_tied": _gpt2_tied, "bert": _bert, "vit": _vit, "clip": _clip}

