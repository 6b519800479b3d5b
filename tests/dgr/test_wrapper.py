"""DGRWrapper: transparent state dicts, grouping on the first forward, one optimizer at a time, bad input."""

import pytest
import torch
from torch import nn

from macroarch.dgr import DGRWrapper, GradientCompensator


def test_state_dict_is_the_wrapped_modules_also_when_nested(zoo):
    model, loss_fn = zoo["llama"]()
    dgr = DGRWrapper(model, group_size=2)
    ours, theirs = dgr.state_dict(), model.state_dict()
    assert list(ours) == list(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert set(ours._metadata) == set(theirs._metadata)

    fresh = DGRWrapper(zoo["llama"]()[0], group_size=2)
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)
    result = fresh.load_state_dict(theirs)
    assert result.missing_keys == result.unexpected_keys == []
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))

    outer = nn.ModuleDict({"lm": dgr})
    assert list(outer.state_dict()) == [f"lm.{k}" for k in theirs]
    outer.load_state_dict(outer.state_dict())
    partial = dict(theirs)
    partial.pop("lm_head.weight")
    result = dgr.load_state_dict(partial, strict=False)
    assert result.missing_keys == ["lm_head.weight"] and result.unexpected_keys == []
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "lm_head.weight"'):
        DGRWrapper(model).load_state_dict(partial)


def test_groups_come_from_the_first_forward_and_its_backward_already_updates(zoo):
    model, loss_fn = zoo["vit"]()
    dgr = DGRWrapper(model, group_size=2)
    with pytest.raises(ValueError, match="the groups come from a forward pass and none has run yet"):
        dgr.optimizer(torch.optim.SGD, lr=0.1)
    with torch.no_grad():
        loss_fn(dgr)
    assert dgr.grouping is None  # a forward without a graph cannot be walked
    loss = loss_fn(dgr)
    assert dgr.grouping is not None and "blocks" in dgr.describe()
    opt = dgr.optimizer(torch.optim.SGD, lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    loss.backward()
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    opt.step()
    opt.zero_grad()


def test_a_second_optimizer_replaces_the_first(zoo):
    model, loss_fn = zoo["sequential"]()
    dgr = DGRWrapper(model, group_size=2, loss_fn=loss_fn)
    first = dgr.optimizer(torch.optim.SGD, lr=0.1)
    second = dgr.optimizer(torch.optim.SGD, lr=0.0)
    before = [p.detach().clone() for p in model.parameters()]
    loss_fn(dgr).backward()
    second.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # lr 0: only `second` ran
    assert first._handles == []


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(group_size=0), "group_size=0 must be a positive int"),
    (dict(mode="pipelined"), "mode='pipelined' is not a DGR mode; use one of"),
    (dict(compensator=GradientCompensator()), "compensator=.* only applies to mode='interleaved'"),
    (dict(mode="interleaved", compensator="dc-asgd"), "compensator='dc-asgd' must be a GradientCompensator"),
])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DGRWrapper(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), **kwargs)


def test_modules_without_trainable_parameters_are_refused():
    with pytest.raises(ValueError, match="module: Sequential has no trainable parameters"):
        DGRWrapper(nn.Sequential(nn.ReLU()))
    with pytest.raises(ValueError, match="module: Linear has no trainable parameters"):
        DGRWrapper(nn.Linear(2, 2).requires_grad_(False))
    with pytest.raises(ValueError, match="must be an nn.Module"):
        DGRWrapper(lambda x: x)
