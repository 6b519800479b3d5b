"""macroarch.mvas.interop.dcp in one process: a stopped run resumed from a DCP checkpoint is the uninterrupted one
(weights, packed moments, step counters, the stochastic-rounding seed, the scheduled learning rate), a load that
fails part-way (a truncated data file) or reads unusable values (NaN/inf codes, NaN scales) leaves model and
optimizer bitwise as they were, and the optimizer extras beside DCP's files are read without running code."""

import copy
import glob
import os

import pytest
import torch
from torch import nn

from macroarch.mvas import MVASAdamW, MVASWeight, apply, plan_from_rules
from macroarch.mvas.interop import dcp as mvas_dcp

STOP, MORE = 3, 3


def _build(seed):
    """An fp8/fp4 model and MVASAdamW with stochastic rounding and fp8 moments; ``seed`` drives the init and the
    optimizer's seed (drawn from the global generator)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    apply(model, plan_from_rules(model, [("0.weight", "fp8"), ("2.weight", "fp4")], block_size=16, min_numel=0))
    opt = MVASAdamW(model.parameters(), lr=1e-2, min_state_numel=1024, state_block_size=64)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    return model, opt, sched


def _train(model, opt, sched, steps, seed=3):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(8, 32, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()


def _bits(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8).clone()


def everything(model, opt):
    """Every byte of the weights and the optimizer state, with their dtypes, and the optimizer's other state."""
    out = {}
    for name, p in model.named_parameters():
        if isinstance(p, MVASWeight):
            out[name] = (_bits(p.payload), _bits(p.scales))
        else:
            out[name] = (p.dtype, _bits(p))
    for i, p in enumerate(opt.param_groups[0]["params"]):
        for key, v in opt.state.get(p, {}).items():
            out[f"{i}.{key}"] = (v.dtype, _bits(v)) if torch.is_tensor(v) else v
    out["groups"] = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    out["seed"], out["skipped"] = opt.seed, opt.skipped_nonfinite
    return out


def assert_same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, tuple):
            assert all((torch.equal(u, v) if torch.is_tensor(u) else u == v) for u, v in zip(x, y, strict=True)), key
        else:
            assert x == y, key


def test_a_resumed_run_is_the_uninterrupted_one(tmp_path):
    model, opt, sched = _build(0)
    _train(model, opt, sched, STOP)
    mvas_dcp.save(tmp_path / "ckpt", model, opt)
    sched_state = copy.deepcopy(sched.state_dict())  # the scheduler is the caller's, as with torch's own loops
    _train(model, opt, sched, MORE, seed=4)

    model2, opt2, sched2 = _build(1)  # other weights and another seed: only the checkpoint can make it match
    assert opt2.seed != opt.seed
    mvas_dcp.load(tmp_path / "ckpt", model2, opt2)
    assert opt2.seed == opt.seed and opt2.param_groups[0]["lr"] == pytest.approx(1e-2 / (1 + STOP))
    assert {s["exp_avg"].dtype for s in opt2.state.values() if s["exp_avg"].numel() >= 1024} == \
        {torch.float8_e4m3fn}
    sched2.load_state_dict(sched_state)
    _train(model2, opt2, sched2, MORE, seed=4)
    assert_same(everything(model, opt), everything(model2, opt2))


def _data_file(path):
    (found,) = glob.glob(os.path.join(path, "*.distcp"))
    return found


@pytest.mark.parametrize("keep", [0.25, 0.5, 0.95])
def test_a_truncated_data_file_loads_nothing(tmp_path, keep):
    model, opt, sched = _build(0)
    _train(model, opt, sched, 2)
    mvas_dcp.save(tmp_path / "ckpt", model, opt)
    data = _data_file(tmp_path / "ckpt")
    with open(data, "r+b") as f:
        f.truncate(int(os.path.getsize(data) * keep))

    target, target_opt, _ = _build(1)
    _train(target, target_opt, _, 1, seed=9)
    before = everything(target, target_opt)
    with pytest.raises(RuntimeError, match="failed part-way .CheckpointException: .*Error.*nothing was loaded"):
        mvas_dcp.load(tmp_path / "ckpt", target, target_opt)
    assert_same(before, everything(target, target_opt))
    fresh, fresh_opt, _ = _build(1)  # an optimizer without state keeps none
    with pytest.raises(RuntimeError):
        mvas_dcp.load(tmp_path / "ckpt", fresh, fresh_opt)
    assert not fresh_opt.state


@pytest.mark.parametrize("fault", ["e4m3 NaN code", "NaN scale", "negative scale", "moment NaN code",
                                   "moment inf scale"])
def test_unusable_values_in_a_dcp_checkpoint_are_refused(tmp_path, fault):
    model, opt, sched = _build(0)
    _train(model, opt, sched, 2)
    weight, state = model[0].weight, opt.state[model[0].weight]
    with torch.no_grad():  # written straight into the storage, as a corrupt file reads back
        if fault == "e4m3 NaN code":
            weight.payload.view(torch.uint8)[7] = 0x7F
        elif fault == "NaN scale":
            weight.scales[2] = float("nan")
        elif fault == "negative scale":
            weight.scales[2] = -1.0
        elif fault == "moment NaN code":
            state["exp_avg"].view(torch.uint8)[7] = 0xFF
        else:
            state["exp_avg_sq_scales"][1] = float("inf")
    mvas_dcp.save(tmp_path / "ckpt", model, opt)

    target, target_opt, _ = _build(1)
    _train(target, target_opt, _, 1, seed=9)
    before = everything(target, target_opt)
    where = "weight '0.weight'" if "moment" not in fault else "optimizer state 0.weight.exp_avg"
    with pytest.raises(ValueError, match=f"unusable values \\(nothing was loaded\\):\\n  {where}"):
        mvas_dcp.load(tmp_path / "ckpt", target, target_opt)
    assert_same(before, everything(target, target_opt))


def test_missing_or_crafted_extras_are_refused_and_run_no_code(tmp_path):
    model, opt, sched = _build(0)
    _train(model, opt, sched, 1)
    mvas_dcp.save(tmp_path / "ckpt", model, opt)
    extras = tmp_path / "ckpt" / mvas_dcp.EXTRAS_NAME.format(rank=0)
    marker = tmp_path / "marker"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    torch.save({"world_size": 1, "extras": Payload()}, extras)  # what a crafted file would hold
    target, target_opt, _ = _build(1)
    before = everything(target, target_opt)
    refused = "(?s)the optimizer extras cannot be read.*GLOBAL io.open was not an allowed.*nothing was loaded"
    with pytest.raises(ValueError, match=refused):
        mvas_dcp.load(tmp_path / "ckpt", target, target_opt)
    assert not marker.exists()
    extras.unlink()
    with pytest.raises(ValueError, match="holds no optimizer extras.*optimizer=None"):
        mvas_dcp.load(tmp_path / "ckpt", target, target_opt)
    assert_same(before, everything(target, target_opt))
    assert not target_opt.state
    mvas_dcp.load(tmp_path / "ckpt", target)  # the weights alone
    assert torch.equal(_bits(target[0].weight.payload), _bits(model[0].weight.payload))
