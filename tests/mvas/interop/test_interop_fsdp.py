"""macroarch.mvas.interop.fsdp: MVAS weights sharded and all-gathered packed by FSDP2, on 2 gloo ranks launched as
torchrun
launches them (one launch for every distributed check); the storage operations and the refusals in-process."""

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from macroarch.comm import launch
from macroarch.mvas import MVASAdamW, MVASWeight, apply, plan_from_rules
from macroarch.mvas.interop import fsdp as mvas_fsdp

HERE = Path(__file__).resolve().parent
STEPS, BATCH = 4, 8
LOSS_TOLERANCE = 1e-5  # relative: the gradient is an average of two half-batch gradients instead of one sum


def build(fmt="fp8", block=16, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    apply(model, plan_from_rules(model, [("*.weight", fmt)], block_size=block, min_numel=0))
    return model


def optimizer(params):
    # round to nearest (stochastic draws would differ between a shard and the whole tensor); moments in fp8 blocks
    # of 128, which cut each rank's shard (1024 elements) at the same places as the whole tensor
    return MVASAdamW(params, lr=1e-2, rounding="nearest", min_state_numel=0, state_block_size=128, seed=0)


def rank_checks(fmt):
    """Single-process MVAS on the full batch (computed here on every rank), FSDP2 + MVAS on each rank's half."""
    import torch.distributed as dist

    from macroarch.measure.fsdp_bytes import measure_fsdp

    rank, world = dist.get_rank(), dist.get_world_size()
    batches = [torch.randn(BATCH, 32, generator=torch.Generator().manual_seed(100 + s)) for s in range(STEPS)]
    reference = build(fmt)
    opt = optimizer(list(reference.parameters()))
    reference_losses = []
    for x in batches:
        loss = reference(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        reference_losses.append(loss.item())

    model = build(fmt)
    for module in (model[0], model[2], model):
        mvas_fsdp.fully_shard(module)
    opt = optimizer(list(model.parameters()))  # MVASAdamW steps each DTensor's local shard
    losses = []
    for x in batches:
        loss = model(x.chunk(world)[rank]).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    weights = {}
    for (name, p), r in zip(model.named_parameters(), reference.parameters(), strict=True):
        local = p._local_tensor
        full = r.dequantize() if isinstance(r, MVASWeight) else r.detach()
        weights[name] = {"type": type(local).__name__, "shard_shape": list(local.shape),
                         "max_diff": (p.full_tensor() - full).abs().max().item()}
        if isinstance(local, MVASWeight):  # the shard's codes against the reference's rows of this rank
            rows = r.payload.view(r.shape[0], -1).chunk(world)[rank].reshape(-1)
            weights[name]["codes_differing"] = int((local.payload.view(torch.uint8) != rows.view(torch.uint8)).sum())
            weights[name]["moment_bytes"] = sum(v.numel() * v.element_size() for k, v in opt.state[p].items()
                                                if k.startswith("exp_avg"))
    # FSDP2's mixed precision: gathered packed, the unsharded weight computes in bf16
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mixed = build(fmt)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for module in (mixed[0], mixed[2], mixed):
        mvas_fsdp.fully_shard(module, mp_policy=policy)
    seen = []
    mixed[0].register_forward_pre_hook(lambda module, args: seen.append(repr(module.weight)))
    out = mixed(batches[0])
    expected = build(fmt).to(torch.bfloat16)(batches[0].to(torch.bfloat16))
    return {"losses": losses, "reference_losses": reference_losses, "weights": weights,
            "mixed": {"unsharded": seen, "dtype": str(out.dtype), "max_diff": (out - expected).abs().max().item()},
            "bytes": measure_fsdp(d_model=64, n_layers=2, tokens=8, steps=2, weight_format=fmt, block_size=32)}


@pytest.fixture(scope="module")
def two_ranks():
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    outcomes = launch("test_interop_fsdp:rank_checks", 2, kwargs={"fmt": "fp8"}, timeout=150, pg_timeout=60, env=env)
    return [o.result for o in outcomes]


@pytest.mark.distributed
def test_fsdp2_with_packed_weights_trains_as_one_process_does(two_ranks):
    for r in two_ranks:
        losses, reference = torch.tensor(r["losses"]), torch.tensor(r["reference_losses"])
        assert reference[-1] < reference[0]  # it trains
        assert torch.allclose(losses, reference, rtol=LOSS_TOLERANCE, atol=0), (losses, reference)
        for name, w in r["weights"].items():
            if name.endswith("weight"):
                # each rank holds a packed shard: half the rows, its codes those of the single-process weight
                assert w["type"] == "MVASWeight" and w["shard_shape"][0] * 2 in (64, 32)
                assert w["codes_differing"] <= 2, (name, w)  # a rounding tie flipped by summation order, at most
                assert w["moment_bytes"] == 2 * (1024 + 1024 // 128 * 4)  # fp8 moments of the shard, and scales
            assert w["max_diff"] <= 0.1, (name, w)


@pytest.mark.distributed
def test_mixed_precision_gathers_packed_and_computes_in_bf16(two_ranks):
    for mixed in (r["mixed"] for r in two_ranks):
        weight = "MVASWeight(fp8_e4m3, block 16, shape (64, 32), dtype torch.bfloat16, device cpu, requires_grad)"
        assert mixed["unsharded"] == [weight]  # the whole weight, still packed, during the forward
        assert mixed["dtype"] == "torch.bfloat16" and mixed["max_diff"] == 0.0


@pytest.mark.distributed
def test_the_all_gather_carries_the_packed_bytes(two_ranks):
    for b in (r["bytes"] for r in two_ranks):
        mvas, bf16 = b["mvas"], b["bf16"]
        # measured at the collective: every parameter gathered twice a step (forward, then backward after the
        # reshard), each time the rank's shard storage as held
        assert mvas["all_gather_bytes_per_step"] == 2 * mvas["weights"]
        assert bf16["all_gather_bytes_per_step"] == 2 * bf16["weights"]
        weights = b["mvas"]["parameters"] - 2 * (256 + 64)  # two layers of (64 -> 256 -> 64); biases stay bf16
        assert mvas["weights"] == (weights * (1 + 4 / 32) + 2 * 2 * (256 + 64)) / 2  # fp8 + fp32 scales per 32
        assert mvas["all_gather_bytes_per_step"] < 0.6 * bf16["all_gather_bytes_per_step"]
        assert mvas["grads"] == bf16["grads"]  # dense bf16 gradients either way
        assert mvas["optimizer"] < 0.6 * bf16["optimizer"]


def test_dim0_shards_at_whole_blocks_are_packed_storage_and_others_are_refused():
    w = MVASWeight.from_dense(torch.randn(8, 16), "fp4", 32)
    before = w.dequantize()
    top, bottom = torch.chunk(w, 2)  # 64 elements each: two blocks, 32 bytes
    assert not top.is_view and top.payload.data_ptr() == w.payload.data_ptr()
    assert bottom.payload.data_ptr() == w.payload.data_ptr() + 32 and torch.equal(bottom.scales, w.scales[2:])
    assert torch.equal(bottom.dequantize(), w.dequantize()[4:])
    assert w[1:3].is_view  # 32 elements from element 16: not whole blocks, a read-only view
    with mvas_fsdp.sharding():
        assert w.is_contiguous()
        padded = w.new_zeros((4, 16))
        assert type(padded) is MVASWeight and padded.format == "fp4_e2m1" and padded.payload.numel() == 32
        padded.narrow(0, 0, 4).copy_(bottom)  # what FSDP2 does with a rank's shard: the bytes, not a re-pack
    assert not w.is_contiguous() and type(w.new_zeros((4, 16))) is torch.Tensor  # outside FSDP2: unchanged
    assert torch.equal(padded.payload, bottom.payload) and torch.equal(padded.scales, bottom.scales)
    bottom.copy_(torch.zeros(4, 16))  # a shard written in place writes the weight's storage
    assert torch.equal(w.dequantize()[4:], torch.zeros(4, 16))
    assert torch.equal(w.dequantize()[:4], before[:4])

    net = nn.Sequential(nn.Linear(16, 6), nn.Linear(6, 3), nn.Linear(16, 2))
    apply(net, plan_from_rules(net, [("0.weight", "fp8"), ("1.weight", "fp8"), ("2.weight", "fp4")], block_size=32,
                               min_numel=0))
    with pytest.raises(ValueError) as error:
        mvas_fsdp.check_shardable(net, 2)
    message = str(error.value)
    assert "'0.weight'" in message and "shard of 48 elements must be whole blocks of 32" in message
    assert "'1.weight'" in message and "dim 0 must divide evenly over the 2 ranks" in message
    assert "'2.weight'" in message and "whole blocks of 32 and whole bytes" in message
    mvas_fsdp.check_shardable(net, 1)
    whole = nn.Linear(16, 4)
    apply(whole, plan_from_rules(whole, [("weight", "fp8")], block_size=None, min_numel=0))
    with pytest.raises(ValueError, match="whole blocks of 64"):  # one scale for the tensor cannot be cut
        mvas_fsdp.check_shardable(whole, 2)
