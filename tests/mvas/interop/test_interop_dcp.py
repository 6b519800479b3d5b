"""macroarch.mvas.interop.dcp: packed weights and quantised moments through torch.distributed.checkpoint, saved on 2
gloo
ranks (FSDP2, launched as torchrun launches), loaded on 1 (this process) and saved back, loaded on 2: bit for bit."""

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from macroarch.comm import launch
from macroarch.mvas import MVASAdamW, MVASWeight, apply, plan_from_rules
from macroarch.mvas.interop import dcp as mvas_dcp

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.distributed
BLOCK = 16


def build(seed=0, fmt="fp8", block=BLOCK):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    apply(model, plan_from_rules(model, [("*.weight", fmt)], block_size=block, min_numel=0))
    return model


def optimizer(params, **kwargs):
    return MVASAdamW(params, **{"lr": 1e-2, "rounding": "nearest", "min_state_numel": 0, "seed": 0, **kwargs})


def snapshot(model, opt):
    """Every byte of the weights (payload, scales, dense) and the optimizer state this process holds, and the
    optimizer's non-tensor state (its scheduled learning rate, stochastic-rounding seed and skip count)."""
    out = {"extras": (opt.param_groups[0]["lr"], opt.seed, opt.skipped_nonfinite)}
    for name, p in model.named_parameters():
        local = getattr(p, "_local_tensor", p)
        if isinstance(local, MVASWeight):
            out[name] = local.payload.view(torch.uint8).tolist() + local.scales.view(torch.uint8).tolist()
        else:
            out[name] = local.detach().reshape(-1).view(torch.uint8).tolist()
        state = opt.state[opt.param_groups[0]["params"][[n for n, _ in model.named_parameters()].index(name)]]
        for key, v in state.items():
            if torch.is_tensor(v):
                out[f"{name}.{key}"] = v.detach().reshape(-1).contiguous().view(torch.uint8).tolist()
    return out


def _sharded(seed):
    import torch.distributed as dist

    from macroarch.mvas.interop import fsdp as mvas_fsdp

    model = build(seed)
    mvas_fsdp.fully_shard(model[0])
    mvas_fsdp.fully_shard(model[2])
    mvas_fsdp.fully_shard(model)
    return model, optimizer(list(model.parameters())), dist.get_rank()  # MVASAdamW steps DTensors' local shards


def rank_save(path, path_ws):
    """Train 2 steps on 2 ranks, save; also save moments of a layout another world size cannot take."""
    model, opt, rank = _sharded(0)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    opt.param_groups[0]["lr"], opt.seed, opt.skipped_nonfinite = 4e-3, 11, 3  # as a schedule and a run leave them
    mvas_dcp.save(path, model, opt)
    # shards of 1024 elements: below min_state_numel=2048 each rank keeps dense moments; one rank packs them
    wide = optimizer(list(model.parameters()), min_state_numel=2048)
    mvas_dcp.ensure_state(wide)
    mvas_dcp.save(path_ws, model, wide)
    return snapshot(model, opt)


def rank_load(path):
    model, opt, rank = _sharded(1)  # other initial weights: everything must come from the checkpoint
    mvas_dcp.load(path, model, opt)
    return snapshot(model, opt)


def run(target, **kwargs):
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    outcomes = launch(f"test_interop_dcp:{target}", 2, kwargs=kwargs, timeout=120, pg_timeout=60, env=env)
    return [o.result for o in outcomes]


def test_two_ranks_to_one_and_back_is_bit_exact_and_other_layouts_are_refused(tmp_path):
    a, ws, b = tmp_path / "two", tmp_path / "ws", tmp_path / "one"
    saved = run("rank_save", path=str(a), path_ws=str(ws))

    # 2 -> 1: this process, no process group, a plain (unsharded) model and optimizer
    model = build(seed=2)
    opt = optimizer(list(model.parameters()))
    mvas_dcp.load(a, model, opt)
    one = snapshot(model, opt)
    # DCP holds tensors only: the optimizer's other state is carried beside it
    assert one["extras"] == tuple(saved[0]["extras"]) == tuple(saved[1]["extras"]) == (4e-3, 11, 3)
    for key, value in one.items():
        if key == "extras":
            continue
        if key.endswith(".step"):
            assert value == saved[0][key] == saved[1][key]
        else:  # rank 0's shard, then rank 1's: the whole tensor's bytes (flat payloads and scales each)
            assert value == _concat(key, saved, model), key
    mvas_dcp.save(b, model, opt)

    # 1 -> 2: every shard's bytes as they were saved
    loaded = run("rank_load", path=str(b))
    assert loaded == saved

    # another plan: block size, format, a dense model
    for other, match in [(build(fmt="fp8", block=32), "fp8_e4m3 in blocks of 16, this model fp8_e4m3 in blocks of 32"),
                         (build(fmt="fp8_e5m2"), "fp8_e4m3 in blocks of 16, this model fp8_e5m2"),
                         (nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)), "the weight is packed")]:
        before = [p.payload.clone() if isinstance(p, MVASWeight) else p.detach().clone() for p in other.parameters()]
        with pytest.raises(ValueError, match=match):
            mvas_dcp.load(a, other)
        after = [p.detach() if not isinstance(p, MVASWeight) else p.payload for p in other.parameters()]
        assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))  # nothing loaded
    # moments of 2 ranks' shards (dense below min_state_numel) do not fit one rank's packed moments
    model = build()
    refused = "optimizer state .optim.0.weight.exp_avg.: saved as torch.float32.*this world size cuts them differently"
    with pytest.raises(ValueError, match=refused):
        mvas_dcp.load(ws, model, optimizer(list(model.parameters()), min_state_numel=2048))
    mvas_dcp.load(ws, model)  # its weights alone load


def _concat(key, saved, model):
    """The whole tensor's bytes from the two ranks' shards (payload and scales are concatenated separately)."""
    name = key if key in dict(model.named_parameters()) else None
    if name is not None and isinstance(dict(model.named_parameters())[name], MVASWeight):
        w = dict(model.named_parameters())[name]
        n0, n1 = w.payload.numel() // 2, w.scales.numel() * 4 // 2
        r0, r1 = saved[0][key], saved[1][key]
        return r0[:n0] + r1[:n0] + r0[n0:n0 + n1] + r1[n0:n0 + n1]
    return saved[0][key] + saved[1][key]
