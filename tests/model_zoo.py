"""The tests' shared models and batches.

- ``ZOO[name]() -> (model, loss_fn)``: tiny models of every family the techniques must handle, each with a loss
  (``loss_fn(model)`` is a scalar); shared by the DGR and MVAS tests.
- :func:`tiny_gpt` and :func:`alphabet_batches`: a 2-layer GPT-2-style decoder and ``(ids, labels)`` batches
  of a 64-token alphabet (the loss falls within a few steps), for the training-harness tests.
- :func:`tiny_llama` (optionally MVAS-managed by :data:`MVAS_RULES`) and :func:`even_ids`: the integration tests'
  2-layer Llama and its token batches.
- :func:`in_bf16`: a model built with bf16 as torch's default dtype (the planner tests' real-tensor arbiters).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

GPT_SIZES = dict(n_layers=2, d_model=32, n_heads=2, n_kv_heads=2, d_ff=64, dropout=0.0, max_seq_len=16)
""":func:`tiny_gpt`'s shape: 16 tokens a row, as :func:`alphabet_batches` makes them."""

MVAS_RULES = [("*mlp*", "fp4"), ("*", "fp8")]
"""The integration tests' MVAS plan: feed-forward weights in fp4, the rest in fp8."""


def in_bf16(make):
    """``make()`` in training mode, built while torch's default dtype is bf16 (restored after, also on error)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return make().train()
    finally:
        torch.set_default_dtype(previous)


def tiny_gpt(dtype=torch.float32, **sizes):
    """A GPT-2-style decoder of ``GPT_SIZES`` (``sizes`` override them), seeded 0, built in ``dtype``."""
    from macroarch.models import get_model_spec

    torch.manual_seed(0)
    return get_model_spec("gpt3_tiny").scaled(**{**GPT_SIZES, **sizes}).build(dtype=dtype)


def alphabet_batches(n, rows=8, seed=0):
    """``n`` batches ``(ids, labels)`` of ``rows`` x 16 tokens drawn from 64 (labels = ids, a copy): a small
    alphabet, so that a language model's loss falls quickly."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 64, (rows, 16), generator=g)
        out.append((ids, ids.clone()))
    return out


def tiny_llama(managed=False):
    """The 2-layer ``llama_65b_tiny``, seeded 0; ``managed``: stored by MVAS under :data:`MVAS_RULES` (blocks of
    32, tensors from 1024 elements)."""
    from macroarch import mvas
    from macroarch.models import get_model_spec

    torch.manual_seed(0)
    model = get_model_spec("llama_65b_tiny").scaled(n_layers=2).build()
    if managed:
        mvas.apply(model, mvas.plan_from_rules(model, MVAS_RULES, block_size=32, min_numel=1024))
    return model


def even_ids(rows, length=16, seed=0):
    """``rows`` x ``length`` token ids, the even numbers below 32 (a pattern a tiny model learns in a few steps)."""
    return torch.randint(0, 16, (rows, length), generator=torch.Generator().manual_seed(seed)) * 2


class TokenWindows(torch.utils.data.Dataset):
    """``n`` windows of :func:`even_ids` as dicts (``input_ids``, ``labels``): the columns HF Trainer reads."""

    def __init__(self, n=32, length=16):
        self.ids = even_ids(n, length)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


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

