"""DGR and CompensatedAdamW through their public API, each against torch.optim.AdamW."""

from __future__ import annotations

import copy
import io

import torch
from compat.tiny import batches, build

from macroarch.dgr import DGRWrapper
from macroarch.optim import CompensatedAdamW


def _adamw_reference(steps: int):
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for ids in batches(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return model


def test_dgr_sync_gives_adamw_weights():
    """Sync DGR steps each group during backward; the weights are AdamW's on the whole model."""
    ids = batches(1)[0]
    model = build()
    net = DGRWrapper(model, group_size=1, example_inputs={"input_ids": ids, "labels": ids})
    opt = net.optimizer(torch.optim.AdamW, lr=1e-3)
    assert len(net.grouping.groups) > 1
    for ids in batches(3):
        net(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    reference = _adamw_reference(3)
    for (name, a), (_, b) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(a, b, msg=name)


def test_compensated_adamw_with_every_option_off_is_adamw():
    model = build()
    opt = CompensatedAdamW(model.parameters(), lr=1e-3, master_weights=False, grad_scale=None)
    for ids in batches(3):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    reference = _adamw_reference(3)
    for (name, a), (_, b) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(a, b, msg=name)


def test_compensated_adamw_state_dict_round_trip_continues_identically():
    model = build(dtype=torch.bfloat16)
    opt = CompensatedAdamW(model.parameters(), lr=1e-3, master_weights=True)
    steps = batches(4)
    for ids in steps[:2]:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    twin = copy.deepcopy(model)
    twin.load_state_dict(saved["model"])
    twin_opt = CompensatedAdamW(twin.parameters(), lr=1e-3, master_weights=True)
    twin_opt.load_state_dict(saved["opt"])
    for net, o in ((model, opt), (twin, twin_opt)):
        for ids in steps[2:]:
            net(input_ids=ids, labels=ids).loss.backward()
            o.step()
            o.zero_grad()
    for (name, a), (_, b) in zip(model.named_parameters(), twin.named_parameters()):
        assert torch.equal(a, b), name
