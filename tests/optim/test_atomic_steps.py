"""Every optimizer here takes a step atomically: an inf or NaN gradient anywhere, or a non-finite loss, leaves
weights (packed and unpacked), moments and step counters bitwise as they were, is counted in the optimizer's
state, and the run then continues exactly as if the bad step had not been tried."""

import copy
import math

import pytest
import torch
from model_zoo import ZOO

from macroarch.dgr import DGRWrapper
from macroarch.mvas import MVASAdamW, MVASWeight, apply, plan_from_rules
from macroarch.optim import CompensatedAdamW, LossSpikeGuard, MasterWeightAdamW


def _snapshot(model, opt):
    """Everything a step may change, as raw bytes: weights (packed payloads and scales), optimizer state."""
    weights = [(p.payload.view(torch.uint8).clone(), p.scales.clone()) if isinstance(p, MVASWeight)
               else p.detach().clone() for p in model.parameters()]
    state = [{k: v.clone() for k, v in s.items() if torch.is_tensor(v)} for s in opt.state.values()]
    return weights, state


def _bits(t):
    return t.reshape(-1).view(torch.uint8)  # NaN == NaN, -0.0 != 0.0: bitwise


def _equal(a, b):
    (wa, sa), (wb, sb) = a, b
    same_w = all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) if isinstance(x, tuple) else
                 torch.equal(_bits(x), _bits(y)) for x, y in zip(wa, wb))
    same_s = len(sa) == len(sb) and all(
        s.keys() == t.keys() and all(torch.equal(_bits(s[k]), _bits(t[k])) for k in s)
        for s, t in zip(sa, sb))
    return same_w and same_s


def _llama_mvas():
    net, loss_fn = ZOO["llama"]()
    apply(net, plan_from_rules(net, [("*mlp*", "fp4"), ("*", "fp8")], block_size=16, min_numel=256))
    return net, loss_fn


def _skipped(opt):
    if isinstance(opt, CompensatedAdamW):
        return opt.stats["skipped_nonfinite"]
    return opt.skipped_nonfinite


SETUPS = {
    "mvas": lambda: (*_llama_mvas(), lambda net: MVASAdamW(net.parameters(), lr=1e-2, seed=0, min_state_numel=256,
                                                           state_block_size=64)),
    "mvas-master": lambda: (*_llama_mvas(), lambda net: MVASAdamW(net.parameters(), lr=1e-2, master_weights=True)),
    "compensated": lambda: (*ZOO["llama"](), lambda net: CompensatedAdamW(net.parameters(), lr=1e-2)),
    "compensated-scaled": lambda: (*ZOO["llama"](torch.bfloat16), lambda net: CompensatedAdamW(
        net.parameters(), lr=1e-2, grad_scale="norm", master_weights=True)),
    "master": lambda: (*ZOO["llama"](torch.bfloat16), lambda net: MasterWeightAdamW(net.parameters(), lr=1e-2)),
}


def _step(net, loss_fn, opt, poison=None):
    loss = loss_fn(net)
    (opt.scale_loss(loss) if isinstance(opt, CompensatedAdamW) else loss).backward()
    if poison is not None:
        poison(net)
    opt.step()
    opt.zero_grad()


def _nan_in_managed(net):
    p = next(p for p in net.parameters() if isinstance(p, MVASWeight) or p.numel() > 4096)
    p.grad[0, 0] = math.nan


def _inf_in_small(net):
    p = next(p for p in net.parameters() if p.numel() < 256)  # a norm weight: never packed, fp32 moments
    p.grad[0] = math.inf


@pytest.mark.parametrize("poison", [_nan_in_managed, _inf_in_small], ids=["nan-large", "inf-small"])
@pytest.mark.parametrize("setup", list(SETUPS))
def test_a_non_finite_gradient_anywhere_skips_the_whole_step(setup, poison):
    runs = []
    for bad in (False, True):
        net, loss_fn, make = SETUPS[setup]()
        opt = make(net)
        _step(net, loss_fn, opt)  # state exists
        if bad:
            before = _snapshot(net, opt)
            _step(net, loss_fn, opt, poison)
            assert _equal(before, _snapshot(net, opt)), "the non-finite step changed something"
            assert _skipped(opt) == 1
            assert all(torch.isfinite(p.dequantize() if isinstance(p, MVASWeight) else p).all()
                       for p in net.parameters())
        _step(net, loss_fn, opt)
        runs.append(_snapshot(net, opt))
    assert _equal(*runs), "after a skipped step, training must continue as if it had not been tried"


@pytest.mark.parametrize("setup", ["mvas", "master", "compensated"])
def test_a_non_finite_closure_loss_skips_the_step(setup):
    net, loss_fn, make = SETUPS[setup]()
    opt = make(net)
    _step(net, loss_fn, opt)
    before = _snapshot(net, opt)

    def closure():
        loss = loss_fn(net)
        loss.backward()
        return loss * math.nan

    opt.step(closure)
    assert _equal(before, _snapshot(net, opt)) and _skipped(opt) == 1


def test_the_spike_guard_lowering_the_lr_never_applies_an_update_on_a_nan_loss():
    net, loss_fn = ZOO["llama"]()
    guard = LossSpikeGuard(action="lower_lr", min_history=1)
    opt = CompensatedAdamW(net.parameters(), lr=1e-2, spike_guard=guard)
    for _ in range(2):
        guard.observe(loss_fn(net).detach())
        _step(net, loss_fn, opt)
    before = _snapshot(net, opt)
    loss = loss_fn(net)
    guard.observe(loss * math.nan)  # the batch's loss is NaN (its gradients here are finite)
    loss.backward()
    opt.step()
    assert _equal(before, _snapshot(net, opt))
    assert opt.stats["skipped_nonfinite"] == 1 and guard.lr_factor < 1.0


def test_one_bad_micro_batch_skips_the_whole_accumulated_update():
    net, loss_fn = ZOO["llama"]()
    opt = CompensatedAdamW(net.parameters(), lr=1e-2, accumulation_steps=4)
    for _ in range(4):
        _step(net, loss_fn, opt)
    before = _snapshot(net, opt)
    for micro in range(4):
        _step(net, loss_fn, opt, _nan_in_managed if micro == 1 else None)
    after = _snapshot(net, opt)
    assert _equal((before[0], []), (after[0], [])) and opt.stats["skipped_nonfinite"] == 1
    assert all("grad_accum" not in s for s in opt.state.values())  # the window's gradients are dropped


@pytest.mark.parametrize("mode", ["sync", "interleaved"])
@pytest.mark.parametrize("inner", ["mvas", "adamw"])
def test_dgr_rolls_back_groups_already_updated_when_a_later_group_is_non_finite(mode, inner):
    def build():
        net, loss_fn = _llama_mvas() if inner == "mvas" else ZOO["llama"]()
        wrapper = DGRWrapper(net, group_size=1, loss_fn=loss_fn, mode=mode)
        cls, kwargs = (MVASAdamW, dict(seed=0)) if inner == "mvas" else (torch.optim.AdamW, {})
        return net, loss_fn, wrapper, wrapper.optimizer(cls, lr=1e-2, **kwargs)

    runs = []
    for bad in (False, True):
        net, loss_fn, wrapper, opt = build()
        first = wrapper.grouping.groups[-1].params[0]  # the last group in backward order: the input side
        for _ in range(3):
            _step(net, loss_fn, opt)
        if bad:
            before, queues = _snapshot(net, opt), copy.deepcopy(opt.state_dict()["dgr"]["pending"])
            handle = first.register_hook(lambda g: g * math.nan)  # NaN after the other groups have updated
            _step(net, loss_fn, opt)
            handle.remove()
            assert _equal(before, _snapshot(net, opt)), "groups updated before the NaN were not rolled back"
            assert opt.skipped_nonfinite == 1
            after = opt.state_dict()["dgr"]["pending"]
            assert [len(q) for q in after] == [len(q) for q in queues]
        _step(net, loss_fn, opt)
        runs.append(_snapshot(net, opt))
    if inner == "adamw":  # MVASAdamW's stochastic rounding drew numbers in the rolled-back updates
        assert _equal(*runs)


def test_dgr_skips_the_step_of_a_non_finite_observed_loss():
    net, loss_fn = ZOO["llama"]()
    wrapper = DGRWrapper(net, group_size=1, loss_fn=loss_fn)
    opt = wrapper.optimizer(torch.optim.AdamW, lr=1e-2)
    _step(net, loss_fn, opt)
    before = _snapshot(net, opt)
    loss = loss_fn(net)
    assert not opt.observe_loss(loss * math.inf)
    loss.backward()
    opt.step()
    opt.zero_grad()
    assert _equal(before, _snapshot(net, opt)) and opt.skipped_nonfinite == 1


def test_dgr_with_a_shared_loss_scale_backs_off_once_and_then_updates_again():
    from macroarch.optim import NormGradScaler

    net, loss_fn = ZOO["llama"]()
    wrapper = DGRWrapper(net, group_size=1, loss_fn=loss_fn)
    scaler = NormGradScaler()
    opt = wrapper.optimizer(CompensatedAdamW, lr=1e-2, grad_scale=scaler)

    def step():
        scaler.scale(loss_fn(net)).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(2):
        step()
    before, scale = _snapshot(net, opt), scaler.get_scale()
    handle = wrapper.grouping.groups[-1].params[0].register_hook(lambda g: g * math.inf)  # the input side
    step()
    handle.remove()
    assert _equal(before, _snapshot(net, opt)) and opt.skipped_nonfinite == 1
    assert scaler.overflows == 1 and scaler.get_scale() <= scale * scaler.config.backoff  # backed off once
    step()
    assert all(inner.updated for inner in opt._inner), "every group updates on the next finite step"
