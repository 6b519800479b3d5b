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


# ------------------------------------------------------------------------------------------- refused packed loads
def _sha256(t):
    """The sha256 of a tensor's bytes, computed here (the reference ``save_packed``'s checksums must equal)."""
    import hashlib

    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _write(path, tensors, compute='{}', checksums=True):
    """A packed file written by hand: ``tensors`` with ``save_packed``'s metadata (checksums of these tensors)."""
    import json

    import safetensors.torch

    metadata = {"format": "pt", "mvas_compute_dtypes": compute}
    if checksums:
        metadata["mvas_checksums"] = json.dumps({k: _sha256(v) for k, v in tensors.items()})
    safetensors.torch.save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata=metadata)
    return path


def _registered(net):
    return [(m, name, p, p.detach().contiguous().reshape(-1).view(torch.uint8).clone())
            for m in net.modules() for name, p in m.named_parameters(recurse=False, remove_duplicate=False)]


def _unchanged(net, before):
    now = [(m, n, p) for m in net.modules() for n, p in m.named_parameters(recurse=False, remove_duplicate=False)]
    assert len(now) == len(before)
    for (m, name, p), (m0, name0, p0, bits) in zip(now, before, strict=True):
        assert m is m0 and name == name0 and p is p0 and type(p) is type(p0), name
        assert torch.equal(p.detach().contiguous().reshape(-1).view(torch.uint8), bits), name


def test_save_packed_writes_each_tensors_sha256(tmp_path):
    import json

    from safetensors import safe_open

    net, fresh, loss_fn, _ = _llama()
    path = save_packed(net, tmp_path)
    with safe_open(path, framework="pt") as f:
        checksums = json.loads(f.metadata()["mvas_checksums"])
        assert checksums == {k: _sha256(f.get_tensor(k)) for k in f.keys()}
    assert checksums.keys() == packed_state_dict(net).keys()


@pytest.mark.parametrize("fault", ["unexpected key", "missing key", "shape"])
def test_a_refused_load_packed_leaves_a_dense_model_as_it_was(tmp_path, fault):
    net, fresh, loss_fn, _ = _llama()
    tensors = packed_state_dict(net)
    if fault == "unexpected key":
        tensors["lm_head.extra"] = torch.zeros(3)
    elif fault == "missing key":
        del tensors[next(k for k in tensors if k.endswith("norm.weight"))]
    else:
        key = next(k for k in tensors if k.endswith("norm.weight"))
        tensors[key] = torch.ones(tensors[key].numel() + 1, dtype=tensors[key].dtype)
    path = _write(tmp_path / "bad.safetensors", tensors, '{"x": "float32"}')
    dense = copy.deepcopy(fresh)
    before = _registered(dense)
    with pytest.raises((ValueError, RuntimeError)):
        load_packed(dense, path)
    _unchanged(dense, before)  # the same Parameter objects, not re-quantised
    assert not dense._load_state_dict_pre_hooks  # no store left behind
    assert load_packed(dense, save_packed(net, tmp_path)) is not None  # and the good file loads after


def test_a_refused_load_packed_leaves_a_managed_model_as_it_was(tmp_path):
    net, fresh, loss_fn, _ = _llama()
    other = copy.deepcopy(fresh)
    apply(other, plan_from_rules(other, RULES, block_size=16, min_numel=256))
    tensors = packed_state_dict(net)
    tensors["lm_head.extra"] = torch.zeros(3)
    before = _registered(other)
    with pytest.raises(ValueError, match=r"unexpected: \['lm_head.extra'\].*Nothing was loaded"):
        load_packed(other, _write(tmp_path / "bad.safetensors", tensors))
    _unchanged(other, before)


def _flip(path, key, count=64):
    """Flip ``count`` bytes in the middle of tensor ``key``'s data, found from the safetensors header."""
    import json

    raw = bytearray(path.read_bytes())
    header = int.from_bytes(raw[:8], "little")
    begin, end = json.loads(raw[8:8 + header])[key]["data_offsets"]
    start = 8 + header + begin + (end - begin - count) // 2
    assert end - begin >= count
    raw[start:start + count] = bytes(b ^ 0xA5 for b in raw[start:start + count])
    path.write_bytes(bytes(raw))


def test_flipped_bytes_are_refused_naming_the_tensor(tmp_path):
    net, fresh, loss_fn, _ = _llama()
    path = save_packed(net, tmp_path)
    key = next(k for k in packed_state_dict(net) if "mlp" in k and k.endswith("__mvas_payload"))  # fp4: any byte
    _flip(tmp_path / "mvas_model.safetensors", key)
    for target in (copy.deepcopy(fresh), net):
        before = _registered(target)
        with pytest.raises(ValueError, match=f"{key}: its bytes do not match its sha256.*Nothing was loaded"):
            load_packed(target, path)
        _unchanged(target, before)


def test_a_file_without_checksums_is_refused_unless_asked(tmp_path):
    net, fresh, loss_fn, _ = _llama()
    path = _write(tmp_path / "old.safetensors", packed_state_dict(net), '{"x": "float32"}', checksums=False)
    with pytest.raises(ValueError, match="carries no checksums.*verify=False"):
        load_packed(copy.deepcopy(fresh), path)
    restored = copy.deepcopy(fresh)
    load_packed(restored, path, verify=False)
    assert torch.equal(loss_fn(restored), loss_fn(net))


def _two_formats():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32))
    dense = copy.deepcopy(net)
    apply(net, plan_from_rules(net, [("0.weight", "fp8_e4m3"), ("1.weight", "fp8_e5m2")], block_size=16,
                               min_numel=0))
    return net, dense


@pytest.mark.parametrize(("key", "code"), [("0.weight", 0x7F), ("0.weight", 0xFF), ("1.weight", 0x7C),
                                           ("1.weight", 0xFC), ("1.weight", 0x7E)])
def test_payload_codes_that_decode_to_nan_or_inf_are_refused_on_every_load(tmp_path, key, code):
    net, dense = _two_formats()
    tensors = packed_state_dict(net)
    tensors[key + "__mvas_payload"] = tensors[key + "__mvas_payload"].clone()
    tensors[key + "__mvas_payload"].view(torch.uint8)[5] = code
    bad = f"{key}: 1 of the 2048 payload codes .*decode to NaN or infinity.*Nothing was loaded"
    path = _write(tmp_path / "nan.safetensors", tensors, '{"0.weight": "float32", "1.weight": "float32"}')
    for target in (copy.deepcopy(dense), _two_formats()[0]):  # into a dense model, into a managed one
        before = _registered(target)
        with pytest.raises(ValueError, match=bad):
            load_packed(target, path)
        _unchanged(target, before)
    managed = _two_formats()[0]
    before = _registered(managed)
    with pytest.raises(ValueError, match=bad):  # the flat form through load_state_dict
        managed.load_state_dict(tensors)
    weight = copy.deepcopy(net.state_dict()[key])
    weight.payload.view(torch.uint8)[5] = code
    with pytest.raises(ValueError, match=f"corrupt: {key}: 1 of the 2048 payload codes"):  # an MVASWeight itself
        managed.load_state_dict({**net.state_dict(), key: weight})
    _unchanged(managed, before)
    import io

    buffer = io.BytesIO()
    torch.save(weight, buffer)
    buffer.seek(0)
    with pytest.raises(ValueError, match="decode to NaN or infinity"):  # and torch.load
        torch.load(buffer, weights_only=True)
