"""A causal LM small enough to train in milliseconds, built from torch alone (the compat venv has no transformers)."""

from __future__ import annotations

import torch
from torch import nn

VOCAB, WIDTH, LAYERS = 64, 64, 2


class Output(dict):
    """``logits`` and ``loss``, as keys (DGR walks dicts for the backward graph) and as attributes (as HF's outputs)."""

    __getattr__ = dict.__getitem__


class Block(nn.Module):
    def __init__(self, width: int, **factory) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width, **factory)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width, **factory), nn.GELU(),
                                 nn.Linear(2 * width, width, **factory))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class TinyLM(nn.Module):
    """Embedding, ``LAYERS`` residual MLP blocks in a ModuleList (DGR's repeated stack), a head; returns ``.loss``."""

    def __init__(self, vocab: int = VOCAB, width: int = WIDTH, layers: int = LAYERS, **factory) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width, **factory)
        self.layers = nn.ModuleList(Block(width, **factory) for _ in range(layers))
        self.head = nn.Linear(width, vocab, bias=False, **factory)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Output:
        x = self.embed(input_ids)  # (B, T, C)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)  # (B, T, V)
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return Output(logits=logits, loss=loss)


def build(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0) -> TinyLM:
    """The model with seeded weights, made in place (``.to()`` cannot swap fake tensors that MemTracker watches)."""
    torch.manual_seed(seed)
    return TinyLM(device=device, dtype=dtype)


def batches(n: int, batch: int = 4, seq: int = 16, seed: int = 1) -> list[torch.Tensor]:
    """``n`` batches of a repeating token pattern (learnable, so a loss must fall)."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, VOCAB, (n, batch, 1), generator=g)
    return list((starts + torch.arange(seq)) % VOCAB)
