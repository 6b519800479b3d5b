"""MVASWeight, the managed parameter: every read is the dequantised weight (inside or outside the owning module,
through views, under autocast and activation checkpointing), writes other than copy_ are refused with a
TypeError naming MVASAdamW, and its packed form survives copies, casts and pickling exactly."""

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from model_zoo import ZOO
from torch import nn
from torch.utils.checkpoint import checkpoint

from macroarch.mvas import MVASWeight, apply, pack, plan_from_rules
from macroarch.optim import CompensatedAdamW, MasterWeightAdamW


class TiedLM(nn.Module):
    """An LM whose head reads the embedding outside the embedding's forward: F.linear(h, self.emb.weight)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))

    def forward(self, ids):
        h = self.emb(ids)
        return F.linear(h + self.mlp(h), self.emb.weight)


def _pair(net, rules, **kwargs):
    """``net`` under MVAS and a dense copy holding the dequantised weights."""
    dense = copy.deepcopy(net)
    store = apply(net, plan_from_rules(net, rules, block_size=16, min_numel=0), **kwargs)
    with torch.no_grad():
        for name, p in dense.named_parameters():
            if name in store:
                p.copy_(store.dense(name, p.dtype))
    return store, dense


def _same_grads(a, b, rtol=0.0, atol=0.0):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=rtol, atol=atol), name


def test_a_tied_head_read_outside_the_module_is_the_weight():
    torch.manual_seed(0)
    net = TiedLM()
    store, dense = _pair(net, [("emb.*", "fp8"), ("mlp.*", "fp4")])
    ids = torch.randint(0, 64, (3, 5))
    out, ref = net(ids), dense(ids)
    assert torch.isfinite(out).all() and torch.equal(out, ref)
    out.square().mean().backward()
    ref.square().mean().backward()
    _same_grads(net, dense)
    assert isinstance(net.emb.weight, MVASWeight) and net.emb.weight.grad.shape == (64, 32)


def test_views_of_a_weight_read_the_viewed_values_and_pass_gradients():
    torch.manual_seed(0)
    w0 = torch.randn(8, 12)
    w = nn.Parameter(MVASWeight.from_dense(w0, "fp8_e4m3", 16))
    d = nn.Parameter(w.dequantize().clone())
    for f in (lambda t: t.t(), lambda t: t[2:5, ::3], lambda t: t.view(-1)[7:20], lambda t: t.transpose(0, 1)[3],
              lambda t: torch.chunk(t, 3, dim=1)[1], lambda t: t.unsqueeze(0).expand(2, 8, 12), lambda t: t[-1]):
        view, ref = f(w), f(d)
        assert isinstance(view, MVASWeight) and view.is_view
        assert torch.equal(view * 1.0, ref)
        (view * torch.arange(ref.numel()).view(ref.shape)).sum().backward()
        (ref * torch.arange(ref.numel()).view(ref.shape)).sum().backward()
        assert torch.equal(w.grad, d.grad)
        w.grad = d.grad = None


def test_autocast_and_activation_checkpointing_compute_with_the_dequantised_weights():
    torch.manual_seed(0)
    net, loss_fn = ZOO["vit"]()
    store, dense = _pair(net, [("*mlp*", "fp4"), ("*attn*", "fp8"), ("*", "bf16")], compute_dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, ref = loss_fn(net), loss_fn(dense)
    assert torch.equal(loss, ref)
    loss.backward()
    ref.backward()
    _same_grads(net, dense)

    block = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16))
    apply(block, plan_from_rules(block, [("*", "fp8")], block_size=16, min_numel=0))
    x = torch.randn(4, 16, requires_grad=True)
    block(x).square().sum().backward()
    plain = [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]
    for reentrant in (False, True):
        block.zero_grad()
        x.grad = None
        checkpoint(block, x, use_reentrant=reentrant).square().sum().backward()
        assert all(torch.equal(a, b) for a, b in zip(plain, [p.grad for p in block.parameters()] + [x.grad]))


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, foreach=False),
    lambda ps: torch.optim.AdamW(ps, foreach=True),
    lambda ps: torch.optim.AdamW(ps, fused=True),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    lambda ps: CompensatedAdamW(ps),
    lambda ps: MasterWeightAdamW(ps),
], ids=["adamw", "adamw-foreach", "adamw-fused", "sgd", "compensated", "master"])
def test_optimizers_that_cannot_write_packed_storage_raise_a_type_error_and_touch_nothing(make):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16))  # biases stay ordinary parameters
    apply(net, plan_from_rules(net, [("*.weight", "fp8")], block_size=16, min_numel=0))
    net(torch.randn(2, 16)).sum().backward()
    before = [p.payload.clone() if isinstance(p, MVASWeight) else p.detach().clone() for p in net.parameters()]
    opt = make(list(net.parameters()))
    with pytest.raises(TypeError, match="cannot update an MVAS-managed weight.*MVASAdamW"):
        opt.step()
    after = [p.payload if isinstance(p, MVASWeight) else p.detach() for p in net.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_in_place_writes_other_than_copy_are_refused():
    w = nn.Parameter(MVASWeight.from_dense(torch.randn(4, 16), "fp4", 16))
    with torch.no_grad():
        assert torch.equal(torch.zeros(4, 16).add_(w), w.dequantize())  # reading a weight in place elsewhere is fine
    with pytest.raises(TypeError, match="MVASAdamW"):
        w.data.mul_(0.5)
    with torch.no_grad(), pytest.raises(TypeError, match="MVASAdamW"):
        w.add_(1.0)
    with torch.no_grad(), pytest.raises(TypeError, match="read-only"):
        w.t().copy_(torch.zeros(16, 4))
    value = torch.randn(4, 16)
    with torch.no_grad():
        w.copy_(value)
    assert torch.equal(w.dequantize(), pack(value, "fp4", 16).dequantize())


def test_copies_casts_and_pickles_keep_the_packed_form():
    w = nn.Parameter(MVASWeight.from_dense(torch.randn(8, 16), "fp8_e5m2", 32))
    twin = copy.deepcopy(w)
    assert isinstance(twin, nn.Parameter) and isinstance(twin, MVASWeight)
    assert torch.equal(twin.payload.view(torch.uint8), w.payload.view(torch.uint8))
    assert twin.payload.data_ptr() != w.payload.data_ptr()
    cast = w.detach().to(torch.bfloat16)  # what autocast makes: another compute dtype on the same storage
    assert isinstance(cast, MVASWeight) and cast.payload is w.payload and cast.dtype == torch.bfloat16
    assert torch.equal(cast * 1, w.dequantize(torch.bfloat16))
    buffer = io.BytesIO()
    torch.save({"w": w.detach()}, buffer)
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)["w"]
    assert isinstance(loaded, MVASWeight) and loaded.format == "fp8_e5m2" and loaded.block_size == 32
    assert torch.equal(loaded.payload.view(torch.uint8), w.payload.view(torch.uint8))
    assert torch.equal(loaded.scales, w.scales)


def test_a_pickle_saved_without_the_dtype_attribute_still_loads():
    """Weights pickled before ``MVASWeight`` kept its compute dtype as an attribute load with it set."""
    w = MVASWeight.from_dense(torch.randn(8, 32), "fp8", 32, dtype=torch.bfloat16)
    expected = w.dequantize()
    del w._dtype  # what such a pickle holds
    buffer = io.BytesIO()
    torch.save(w, buffer)
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    assert loaded._dtype == torch.bfloat16 == loaded.dtype
    assert torch.equal(loaded.dequantize(), expected)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_a_pickle_with_corrupt_scales_is_refused_on_load(bad):
    w = MVASWeight.from_dense(torch.randn(4, 32), "fp8", 32)
    w.scales[1] = bad
    buffer = io.BytesIO()
    torch.save(w, buffer)
    with pytest.raises(ValueError, match="NaN, infinite or negative"):
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)


def test_raw_readers_are_told_to_ask_for_contiguous_which_is_the_dense_weight():
    w = MVASWeight.from_dense(torch.randn(4, 32), "fp4", 32)
    assert not w.is_contiguous()
    dense = w.contiguous()
    assert type(dense) is torch.Tensor and dense.is_contiguous() and torch.equal(dense, w.dequantize())
    assert w.data_ptr() == w.untyped_storage().data_ptr() == w.payload.data_ptr()  # identity: the packed storage


def test_moving_the_model_to_another_dtype_changes_the_compute_dtype_only():
    net = nn.Linear(32, 8)
    store = apply(net, plan_from_rules(net, [("weight", "fp8")], block_size=32, min_numel=0))
    payload = store.packed("weight").payload.clone()
    net.to(torch.bfloat16)
    assert isinstance(net.weight, MVASWeight) and net.weight.dtype == torch.bfloat16
    assert store.parameter("weight") is net.weight and torch.equal(net.weight.payload.view(torch.uint8),
                                                                   payload.view(torch.uint8))
    assert net(torch.randn(2, 32, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_a_direct_payload_write_marked_as_such_stops_a_stale_backward():
    w = nn.Parameter(MVASWeight.from_dense(torch.randn(8, 16), "fp8", 16))
    loss = F.linear(torch.randn(2, 16, requires_grad=True), w).square().sum()  # saves w.t() for backward
    with torch.no_grad():
        w.payload.copy_(torch.zeros_like(w.payload))  # what a fused optimizer kernel would do
    w.mark_written()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_an_unaware_optimizer_is_refused_on_a_dtensor_of_a_managed_weight():
    """FSDP2's parameters are DTensors whose local shard is the ``MVASWeight``: torch's AdamW is refused with the
    error that names MVASAdamW and the shard's format (it failed with an AttributeError on the DTensor instead)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        weight = MVASWeight.from_packed(pack(torch.randn(64, 64), "fp8_e4m3", 32), torch.float32)
        p = nn.Parameter(DTensor.from_local(weight, mesh, [Replicate()], run_check=False))
        p.grad = DTensor.from_local(torch.zeros(64, 64), mesh, [Replicate()], run_check=False)
        with pytest.raises(TypeError, match=r"AdamW cannot update an MVAS-managed weight: it is stored packed "
                                            r"\(fp8_e4m3, \(64, 64\)\).*MVASAdamW"):
            torch.optim.AdamW([p]).step()
    finally:
        dist.destroy_process_group()
