"""The model and batches the communication measurements train: a GPT-2-style decoder of chosen size.

Every rank builds the same initial weights (one seed) and draws its own batches (seed + rank), as data
parallelism does; all sizes come from the caller, so the ci and cpu profiles differ only in numbers.

The ranks (``comm_bench``, ``calibrate``) time forward, backward and the gradient synchronisation, with no optimizer
step so that every set-up sees the same weights: a benchmark of the synchronisation, not a training loop, so it
does not go through ``experiments.loop`` (a layer above this one).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Workload:
    """Sizes of the model and of one rank's micro-batch."""

    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    seq_len: int = 32
    batch_size: int = 2
    seed: int = 0

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len

    def spec(self):
        from macroarch.models import get_model_spec

        return get_model_spec("gpt3_tiny").scaled(n_layers=self.n_layers, d_model=self.d_model, n_heads=self.n_heads,
                                                  n_kv_heads=self.n_heads, d_ff=4 * self.d_model, dropout=0.0,
                                                  max_seq_len=max(self.seq_len, 8))

    def model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return self.spec().build()

    def mlp(self) -> nn.Module:
        """A plain MLP of the same width and depth: for runs where the model does not matter (failure demos),
        without the seconds that importing transformers costs every launched rank."""
        torch.manual_seed(self.seed)
        return nn.Sequential(*[nn.Sequential(nn.Linear(self.d_model, 4 * self.d_model), nn.GELU(),
                                             nn.Linear(4 * self.d_model, self.d_model)) for _ in range(self.n_layers)])

    def mlp_batches(self, rank: int, count: int) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1000 + rank + 1)
        return [torch.randn(self.tokens, self.d_model, generator=generator) for _ in range(count)]

    def batches(self, rank: int, count: int) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed * 1000 + rank + 1)
        vocab = self.spec().shape.vocab_size
        return [torch.randint(0, vocab, (self.batch_size, self.seq_len), generator=generator) for _ in range(count)]


def lm_loss(model: nn.Module, batch: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The model's own causal-LM loss (transformers shifts the labels). ``batch`` is ``(input_ids, labels)``, or a
    tensor of ids that are their own labels (the communication workloads' batches); it is moved to the device of
    the model's first parameter. The project's one definition: the training loop, the experiments and the
    measurements all call this one."""
    input_ids, labels = (batch, batch) if isinstance(batch, torch.Tensor) else batch
    device = next(model.parameters()).device
    return model(input_ids=input_ids.to(device), labels=labels.to(device)).loss


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def flat_grads(params: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in params])
