"""Checkpoints of MVAS models: dense for other tools (same outputs in a dense model), packed on request (exact),
and every load that would go wrong refused before anything is copied."""

import copy

import pytest
import torch
from model_zoo import ZOO
from torch import nn

from macroarch.mvas import (
    MVASWeight,
    apply,
    dense_state_dict,
    load_packed,
    packed_state_dict,
    plan_from_rules,
    save_packed,
)

RULES = [("*mlp*", "fp4"), ("*self_attn*", "fp8"), ("*embed*", "fp16"), ("*", "bf16")]


def _llama():
    net, loss_fn = ZOO["llama"]()
    fresh = copy.deepcopy(net)
    store = apply(net, plan_from_rules(net, RULES, block_size=16, min_numel=256))
    return net, fresh, loss_fn, store


def _payloads(net):
    return {n: (p.payload.view(torch.uint8), p.scales) for n, p in net.named_parameters() if isinstance(p, MVASWeight)}


def test_a_dense_model_loads_the_dense_or_the_packed_state_dict_and_computes_the_same():
    net, fresh, loss_fn, _ = _llama()
    expected = loss_fn(net)
    for state_dict in (dense_state_dict(net), net.state_dict()):
        dense = copy.deepcopy(fresh)
        assert not dense.load_state_dict(state_dict).missing_keys
        assert not any(isinstance(p, MVASWeight) for p in dense.parameters())
        assert torch.equal(loss_fn(dense), expected)


def test_safetensors_writes_dense_weights_or_refuses(tmp_path):
    import safetensors.torch

    net, fresh, loss_fn, _ = _llama()
    safetensors.torch.save_file(dense_state_dict(net), tmp_path / "dense.safetensors")
    dense = copy.deepcopy(fresh)
    safetensors.torch.load_model(dense, tmp_path / "dense.safetensors")
    assert torch.equal(loss_fn(dense), loss_fn(net))
    with pytest.raises(ValueError, match="non contiguous tensor"):  # raw bytes of a packed weight: refused
        safetensors.torch.save_file(net.state_dict(), tmp_path / "raw.safetensors")
    with pytest.raises(RuntimeError, match="covering the entire storage"):  # save_model too, loudly
        safetensors.torch.save_model(net, tmp_path / "raw.safetensors")


def test_the_packed_safetensors_form_round_trips_exactly(tmp_path):
    net, fresh, loss_fn, store = _llama()
    flat = packed_state_dict(net)
    assert all(type(v) is torch.Tensor for v in flat.values())
    path = save_packed(net, tmp_path)
    restored = copy.deepcopy(fresh)
    new_store = load_packed(restored, path)  # a dense model: put under the checkpoint's plan first
    assert {n: (e.plan.format, e.plan.block_size) for n, e in new_store.entries.items()} == \
        {n: (e.plan.format, e.plan.block_size) for n, e in store.entries.items()}
    for name, (payload, scales) in _payloads(net).items():
        other = _payloads(restored)[name]
        assert torch.equal(payload, other[0]) and (scales is None or torch.equal(scales, other[1]))
    assert torch.equal(loss_fn(restored), loss_fn(net))
    again = copy.deepcopy(fresh)  # into a model already under the same plan
    apply(again, plan_from_rules(again, RULES, block_size=16, min_numel=256))
    assert load_packed(again, path) is None and torch.equal(loss_fn(again), loss_fn(net))


def test_a_single_block_tensor_round_trips():
    def build():
        net = nn.Sequential(nn.Linear(16, 16, bias=False))
        apply(net, plan_from_rules(net, [("*", "fp8")], block_size=256, min_numel=0))
        return net

    net, other = build(), build()
    assert net[0].weight.scales.numel() == 1
    result = other.load_state_dict(net.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    other.load_state_dict(packed_state_dict(net))
    assert torch.equal(other[0].weight.payload.view(torch.uint8), net[0].weight.payload.view(torch.uint8))


def test_a_checkpoint_of_a_wider_model_is_refused_as_such_without_advice_to_repack():
    def build(width):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, 8))
        store = apply(net, plan_from_rules(net, [("*.weight", "fp8")], block_size=32, min_numel=0))
        return net, store

    net, store = build(64)
    wider, _ = build(128)
    before = _payloads(net)
    with pytest.raises(ValueError, match=r"another shape.*0.weight: checkpoint \(128, 32\), model \(64, 32\)") as info:
        net.load_state_dict(wider.state_dict())
    assert "replan" not in str(info.value)
    assert all(torch.equal(before[n][0], p[0]) for n, p in _payloads(net).items())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -2.0])
def test_corrupt_scales_in_a_packed_checkpoint_are_refused_and_nothing_loads(bad):
    net, fresh, loss_fn, store = _llama()
    other = copy.deepcopy(fresh)
    apply(other, plan_from_rules(other, RULES, block_size=16, min_numel=256))
    flat = packed_state_dict(net)
    key = next(k for k in flat if k.endswith("__mvas_scales"))
    flat[key] = flat[key].clone()
    flat[key][0] = bad
    before = _payloads(other)
    with pytest.raises(ValueError, match="NaN, infinite or negative.*Nothing was loaded"):
        other.load_state_dict(flat)
    assert all(torch.equal(before[n][0], p[0]) for n, p in _payloads(other).items())


def test_a_dense_checkpoint_with_nan_is_refused_and_nothing_loads():
    net, fresh, loss_fn, store = _llama()
    state = copy.deepcopy(fresh.state_dict())
    name = next(n for n in store.entries if "mlp" in n)
    state[name][0, 0] = float("nan")
    before = _payloads(net)
    with pytest.raises(ValueError, match=f"cannot be packed: {name}: the dense value has inf or NaN"):
        net.load_state_dict(state)
    assert all(torch.equal(before[n][0], p[0]) for n, p in _payloads(net).items())
