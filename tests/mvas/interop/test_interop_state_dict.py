"""What the store and the loaders share (``macroarch.mvas.interop.state_dict``): the flat packed form, a model's
registered parameters put back as the very objects, and snapshots of what a load writes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from macroarch.mvas import FORMATS, apply, pack, plan_from_rules
from macroarch.mvas import store as store_module
from macroarch.mvas.interop import state_dict


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("block", [32, None])
def test_the_format_and_block_are_read_back_from_a_flat_payload(fmt, block):
    packed = pack(torch.randn(4, 64), fmt, block)
    expected_block = block if FORMATS[fmt].block_scaled else None
    assert state_dict.format_of(packed.payload, packed.scales, 256) == (fmt, expected_block)


def test_a_payload_of_no_format_is_refused():
    with pytest.raises(ValueError, match="matches no MVAS format"):
        state_dict.format_of(torch.zeros(4, dtype=torch.int64), None, 4)


def test_packed_keys_are_told_from_the_others():
    assert state_dict.is_packed_buffer("w" + state_dict.PAYLOAD_SUFFIX)
    assert state_dict.is_packed_buffer("w" + state_dict.SCALES_SUFFIX)
    assert not state_dict.is_packed_buffer("w")


def test_registered_parameters_come_back_as_the_very_objects_tied_ones_under_each_owner():
    embed, head = nn.Embedding(64, 32), nn.Linear(32, 64, bias=False)
    head.weight = embed.weight  # tied: one object under two modules
    model = nn.Sequential(embed, nn.Linear(32, 32), head)
    before = state_dict.registered_parameters(model)
    assert sum(p is embed.weight for _, _, p in before) == 2
    weights = [model[0].weight, model[1].weight]
    apply(model, plan_from_rules(model, [("*", "fp8")], min_numel=0))  # the weights replaced by packed ones
    assert model[0].weight is not weights[0] and model[1].weight is not weights[1]
    assert model[2].weight is model[0].weight  # still tied
    state_dict.restore_parameters(before)
    assert [(m, n, p) for m, n, p in state_dict.registered_parameters(model)] == before
    assert model[2].weight is model[0].weight


def test_a_snapshot_puts_each_tensor_back_once():
    t = torch.arange(4.0)
    snapshot = state_dict.TensorSnapshot([t, t, "not a tensor"])
    t.add_(1)
    snapshot.restore()
    assert len(snapshot.saved) == 1 and torch.equal(t, torch.arange(4.0))


def test_the_store_still_exports_what_moved_below_it():
    for name in ("PAYLOAD_SUFFIX", "SCALES_SUFFIX", "TensorSnapshot", "format_of", "is_packed_buffer",
                 "registered_parameters", "restore_parameters"):
        assert getattr(store_module, name) is getattr(state_dict, name)
