"""macroarch.mvas.interop.dcp in one process: a stopped run resumed from a DCP checkpoint is the uninterrupted one
(weights, packed moments, step counters, the stochastic-rounding seed, the scheduled learning rate); a checkpoint
that is truncated, has flipped bytes or NaN scales written into its data file, a chunk without its sha256, or
unusable values saved in it (NaN/inf codes, NaN scales) is refused before anything is written, and a load that
fails part-way after its checks (the file changed meanwhile, an interrupt) is put back: either way model and
optimizer are bitwise as they were. The extras beside DCP's files are read without running code."""

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


def _saved(tmp_path):
    model, opt, sched = _build(0)
    _train(model, opt, sched, 2)
    mvas_dcp.save(tmp_path / "ckpt", model, opt)
    return model, opt


def _refused(path, match):
    """A load into a trained model and optimizer, and into fresh ones, is refused with ``match`` and changes
    nothing (an optimizer without state keeps none)."""
    target, target_opt, _ = _build(1)
    _train(target, target_opt, _, 1, seed=9)
    before = everything(target, target_opt)
    with pytest.raises(ValueError, match=match):
        mvas_dcp.load(path, target, target_opt)
    assert_same(before, everything(target, target_opt))
    fresh, fresh_opt, _ = _build(1)
    with pytest.raises(ValueError, match=match):
        mvas_dcp.load(path, fresh, fresh_opt)
    assert not fresh_opt.state


@pytest.mark.parametrize("keep", [0.25, 0.5, 0.95])
def test_a_truncated_data_file_is_refused_before_anything_is_written(tmp_path, keep):
    _saved(tmp_path)
    data = _data_file(tmp_path / "ckpt")
    with open(data, "r+b") as f:
        f.truncate(int(os.path.getsize(data) * keep))
    _refused(tmp_path / "ckpt", "(?s)is refused, nothing was loaded:.*: unreadable .CheckpointException")


def _file_offset(path, t):
    """Where tensor ``t``'s bytes sit in the DCP data file (DCP writes each chunk's storage as it is)."""
    raw = open(_data_file(path), "rb").read()
    wanted = _bits(t).numpy().tobytes()
    at = raw.find(wanted)
    assert at >= 0 and raw.find(wanted, at + 1) < 0, "the tensor's bytes are not found once in the data file"
    return at


def _patch(path, at, new):
    with open(_data_file(path), "r+b") as f:
        f.seek(at)
        f.write(new)


@pytest.mark.parametrize("where", ["payload", "scales", "moment", "moment scales", "bias"])
def test_flipped_bytes_in_the_data_file_are_refused(tmp_path, where):
    model, opt = _saved(tmp_path)
    state = opt.state[model[0].weight]
    t = {"payload": model[0].weight.payload, "scales": model[0].weight.scales, "moment": state["exp_avg"],
         "moment scales": state["exp_avg_sq_scales"], "bias": model[2].bias}[where]
    at = _file_offset(tmp_path / "ckpt", t)
    old = _bits(t).numpy().tobytes()
    n = min(64, len(old))
    # the lowest bit of each byte: fp8 codes stay finite codes (0x7E <-> 0x7F is avoided), scales stay finite
    flipped = bytes(b ^ 0x01 if (b & 0x7F) not in (0x7E, 0x7F) else b for b in old[:n])
    assert flipped != old[:n]
    _patch(tmp_path / "ckpt", at, flipped)
    name = {"payload": "weight '0.weight' \\(payload\\)", "scales": "weight '0.weight' \\(scales\\)",
            "moment": "optimizer state 0.weight.exp_avg", "moment scales": "optimizer state 0.weight.exp_avg_sq_scales",
            "bias": "tensor '2.bias'"}[where]
    _refused(tmp_path / "ckpt", f"(?s)refused, nothing was loaded:\n  {name}, chunk at \\[0\\]: sha256 .* is not the "
                                ".* recorded at save")


def test_nan_scales_written_into_the_data_file_are_refused(tmp_path):
    model, _ = _saved(tmp_path)
    scales = model[2].weight.scales
    at = _file_offset(tmp_path / "ckpt", scales)
    _patch(tmp_path / "ckpt", at, torch.full((4,), float("nan")).numpy().tobytes())
    _refused(tmp_path / "ckpt", "weight '2.weight' \\(scales\\), chunk at \\[0\\]: sha256")


def test_a_chunk_without_its_sha256_is_refused(tmp_path):
    _saved(tmp_path)
    extras = tmp_path / "ckpt" / mvas_dcp.EXTRAS_NAME.format(rank=0)
    saved = torch.load(extras, weights_only=True)
    del saved["sha256"]["0.weight__mvas_scales"]
    torch.save(saved, extras)
    _refused(tmp_path / "ckpt", "weight '0.weight' \\(scales\\), chunk at \\[0\\]: no sha256 was recorded")


@pytest.mark.parametrize("interrupt", [OSError("disk went away"), KeyboardInterrupt()], ids=["error", "interrupt"])
def test_a_load_that_fails_part_way_after_its_checks_is_put_back(tmp_path, monkeypatch, interrupt):
    """The checks passed, then DCP's in-place load writes every tensor and fails (files changed meanwhile, Ctrl-C)."""
    _saved(tmp_path)
    real = mvas_dcp.dist_cp.load

    def writes_then_fails(state, **kwargs):
        real(state, **kwargs)
        if len(state) > 1:  # the in-place load of everything, not a check's read of one tensor
            raise interrupt

    monkeypatch.setattr(mvas_dcp.dist_cp, "load", writes_then_fails)
    target, target_opt, _ = _build(1)
    _train(target, target_opt, _, 1, seed=9)
    before = everything(target, target_opt)
    expected = KeyboardInterrupt if isinstance(interrupt, KeyboardInterrupt) else RuntimeError
    with pytest.raises(expected, match=None if expected is KeyboardInterrupt else
                       "failed part-way .OSError: disk went away.* put back as they were: nothing was loaded"):
        mvas_dcp.load(tmp_path / "ckpt", target, target_opt)
    assert_same(before, everything(target, target_opt))


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
    where = "weight '0.weight' \\(payload\\)" if "code" in fault else "weight '0.weight' \\(scales\\)"
    if "moment" in fault:
        where = "optimizer state 0.weight.exp_avg" + ("" if "code" in fault else "_sq_scales")
    with pytest.raises(ValueError, match=f"refused, nothing was loaded:\\n  {where}: 1 values are NaN, infinite or "
                                         "negative"):
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
    refused = "(?s)mvas_extras.rank0.pt cannot be read.*GLOBAL io.open was not an allowed.*nothing was loaded"
    with pytest.raises(ValueError, match=refused):
        mvas_dcp.load(tmp_path / "ckpt", target, target_opt)
    assert not marker.exists()
    extras.unlink()
    for opt_or_none in (target_opt, None):  # without the digests not even the weights alone can be verified
        with pytest.raises(ValueError, match="has no mvas_extras.rank0.pt .the sha256 of each tensor.*cannot be "
                                             "verified; nothing was loaded"):
            mvas_dcp.load(tmp_path / "ckpt", target, opt_or_none)
    assert_same(before, everything(target, target_opt))
    assert not target_opt.state


def test_a_checkpoint_saved_without_an_optimizer_loads_the_weights_alone(tmp_path):
    model, opt, sched = _build(0)
    _train(model, opt, sched, 1)
    mvas_dcp.save(tmp_path / "ckpt", model)
    target, target_opt, _ = _build(1)
    with pytest.raises(ValueError, match="saved without an optimizer.*optimizer=None"):
        mvas_dcp.load(tmp_path / "ckpt", target, target_opt)
    assert not target_opt.state
    mvas_dcp.load(tmp_path / "ckpt", target)
    assert torch.equal(_bits(target[0].weight.payload), _bits(model[0].weight.payload))
