"""ESMFold's folding trunk as a trainable block stack: the AlphaFold2-style model of claim C12 (post section 6).

ESMFold (Lin et al. 2023) predicts structure with a folding trunk derived from AlphaFold2's Evoformer
(OpenFold's code): 48 blocks, each updating a sequence state (width 1024) with gated self-attention biased by
the pair state, and a pair state (width 128) with the outgoing and incoming **triangular multiplicative
updates**, the starting- and ending-node **triangular attentions** and a transition MLP. transformers ships it
as ``EsmFoldingTrunk`` (``transformers.models.esm.modeling_esmfold``), configured by ``TrunkConfig`` (its
defaults are the published trunk: 48 blocks, 1024 / 128, head width 32). It builds on its own, without the
ESM-2 language model; ``FoldingStack`` uses its classes unchanged:

- ``embedding``: an amino-acid embedding into the sequence state (ESMFold's ``embedding``; the language
  model's features, which ESMFold adds to it, are left out);
- ``pairwise_positional_embedding``: the trunk's relative-position embedding (``EsmFoldRelativePosition``),
  the pair state's input;
- ``blocks``: ``TrunkConfig.num_blocks`` x ``EsmFoldTriangularSelfAttentionBlock``, as in the trunk;
- ``distogram_head``: ESMFold's distogram head (a linear map of the symmetrised pair state to 64 distance
  bins), trained with cross-entropy against the binned CA-CA distances, AlphaFold2's distogram loss.

What is left out of ``EsmFoldingTrunk.forward``, and why: the structure module (2.0M of the trunk's 688.5M
parameters, per-residue activations of width 384, so small beside the pair state's ``L x L x 128``) and the
recycling loop (earlier recycles run without gradients, so they hold no activations for backward). Under
fake tensors the structure module alone costs several seconds per step, more than all 48 blocks, and the
memory claim is about the Evoformer-style stack.

Training settings: ``chunk_size=None`` (chunked attention is an inference memory trick; OpenFold trains
unchunked), no mask (crops are full length).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.esm.configuration_esm import TrunkConfig
from transformers.models.esm.modeling_esmfold import EsmFoldRelativePosition, EsmFoldTriangularSelfAttentionBlock
from transformers.utils import ModelOutput

#: ESMFold's distogram: 64 bins, edges from 2.3125 to 21.6875 Angstrom (AlphaFold2's)
DISTOGRAM_BINS = 64
DISTOGRAM_MIN, DISTOGRAM_MAX = 2.3125, 21.6875
#: amino-acid tokens: 20 residues + unknown (ESMFold's ``n_tokens_embed`` is 23 with padding and mask)
N_TOKENS = 23


@dataclass
class FoldingOutput(ModelOutput):
    """``logits``: distogram logits (batch, L, L, 64); ``loss`` when distance bins were given."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None


def trunk_config(**overrides) -> TrunkConfig:
    """``TrunkConfig`` with the published trunk's sizes and training settings, ``overrides`` applied."""
    return TrunkConfig(**{"chunk_size": None, **overrides})


def distance_bins(coords: torch.Tensor) -> torch.Tensor:
    """The distogram target: the bin (0..63) of every CA-CA distance of ``coords`` (batch, L, 3)."""
    d = torch.cdist(coords.float(), coords.float())  # (B, L, L)
    edges = torch.linspace(DISTOGRAM_MIN, DISTOGRAM_MAX, DISTOGRAM_BINS - 1, device=coords.device)
    return torch.bucketize(d, edges)


class FoldingStack(nn.Module):
    """The folding trunk's block stack with ESMFold's embedding and distogram head (module docstring).

    Args:
        config: a ``TrunkConfig`` (``trunk_config()`` for the published sizes).
    """

    def __init__(self, config: TrunkConfig | None = None) -> None:
        super().__init__()
        self.config = config if config is not None else trunk_config()
        c_s, c_z = self.config.sequence_state_dim, self.config.pairwise_state_dim
        self.embedding = nn.Embedding(N_TOKENS, c_s)
        self.pairwise_positional_embedding = EsmFoldRelativePosition(self.config)
        self.blocks = nn.ModuleList(EsmFoldTriangularSelfAttentionBlock(self.config)
                                    for _ in range(self.config.num_blocks))
        self.distogram_head = nn.Linear(c_z, DISTOGRAM_BINS)

    def forward(self, aatype: torch.Tensor, residue_index: torch.Tensor | None = None,
                labels: torch.Tensor | None = None) -> FoldingOutput:
        """``aatype`` (batch, L) residue tokens, ``residue_index`` (batch, L) positions (default 0..L-1),
        ``labels`` (batch, L, L) distance bins."""
        if aatype.dim() != 2:
            raise ValueError(f"aatype must be (batch, L); got {tuple(aatype.shape)}")
        if residue_index is None:
            residue_index = torch.arange(aatype.shape[1], device=aatype.device).expand_as(aatype)
        s = self.embedding(aatype)  # (B, L, c_s)
        z = self.pairwise_positional_embedding(residue_index)  # (B, L, L, c_z)
        for block in self.blocks:
            s, z = block(s, z, chunk_size=self.config.chunk_size)
        logits = self.distogram_head(z)
        logits = (logits + logits.transpose(1, 2)) / 2  # (B, L, L, 64), symmetric as in ESMFold
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.flatten(0, 2).float(), labels.flatten())
        return FoldingOutput(loss=loss, logits=logits)


__all__ = ["DISTOGRAM_BINS", "FoldingOutput", "FoldingStack", "N_TOKENS", "distance_bins", "trunk_config"]
