"""ESMFold's folding trunk as macroarch.models.folding trains it: transformers' own blocks at the published
size, the distogram target and head."""

from __future__ import annotations

import numpy as np
import torch

from macroarch.models.folding import DISTOGRAM_BINS, FoldingStack, distance_bins, trunk_config


def test_blocks_are_the_published_trunks():
    from transformers.models.esm.configuration_esm import TrunkConfig
    from transformers.models.esm.modeling_esmfold import EsmFoldingTrunk

    with torch.device("meta"):
        ours = FoldingStack()
        trunk = EsmFoldingTrunk(TrunkConfig())  # built alone, no language model
    assert len(ours.blocks) == 48 and ours.config.chunk_size is None
    assert sum(p.numel() for p in ours.blocks.parameters()) == sum(p.numel() for p in trunk.blocks.parameters())
    assert [type(b) for b in ours.blocks] == [type(b) for b in trunk.blocks]


def test_distance_bins_match_a_direct_binning():
    coords = torch.randn(2, 12, 3) * 8
    edges = np.linspace(2.3125, 21.6875, 63)
    d = np.linalg.norm(coords.numpy()[:, :, None] - coords.numpy()[:, None], axis=-1)
    assert torch.equal(distance_bins(coords), torch.from_numpy(np.searchsorted(edges, d, side="left")))


def test_forward_is_symmetric_and_trains_every_block():
    torch.manual_seed(0)
    model = FoldingStack(trunk_config(num_blocks=2, sequence_state_dim=32, pairwise_state_dim=16,
                                      sequence_head_width=8, pairwise_head_width=8))
    aatype = torch.randint(0, 20, (2, 10))
    labels = distance_bins(torch.randn(2, 10, 3).cumsum(1) * 3)
    out = model(aatype, labels=labels)
    assert out.logits.shape == (2, 10, 10, DISTOGRAM_BINS)
    assert torch.allclose(out.logits, out.logits.transpose(1, 2))
    out.loss.backward()
    for i, block in enumerate(model.blocks):
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in block.parameters()), f"block {i}"
