"""CompensatedAdamW against torch.optim.AdamW (the reference), option by option."""

import io
import math

import pytest
import torch

from macroarch.dgr import DGRWrapper, GradientCompensator, dc_asgd_compensate
from macroarch.optim import CompensatedAdamW, LossSpikeGuard, NormGradScaler, recipe_scheduler


def _model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16),
                               torch.nn.Linear(16, 4)).to(dtype)


def _twin(model):
    twin = _model(next(model.parameters()).dtype, seed=1)
    twin.load_state_dict(model.state_dict())
    return twin


def _loss(model, seed):
    g = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    x = torch.randn(16, 8, generator=g).to(dtype)
    y = torch.randn(16, 4, generator=g).to(dtype)
    return (model(x) - y).float().square().mean()


def _state(opt, model):
    return {(i, k): v.clone() for i, p in enumerate(model.parameters()) for k, v in opt.state[p].items()}


def _params_equal(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


# ------------------------------------------------------------------------------------------ options off = AdamW
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_options_off_is_torch_adamw_bitwise_over_many_steps(dtype):
    model = _model(dtype)
    ref = _twin(model)
    groups = lambda m: [{"params": list(m[0].parameters()), "lr": 3e-3},  # noqa: E731
                        {"params": list(m[2].parameters()) + list(m[3].parameters()), "weight_decay": 0.0}]
    opt = CompensatedAdamW(groups(model), lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(groups(ref), lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    for step in range(60):
        for net, o in ((model, opt), (ref, ref_opt)):
            _loss(net, step).backward()
            o.step()
            o.zero_grad()
    assert _params_equal(model, ref)
    assert opt.stats["updates"] == 60 and all(opt.master_weight(p) is None for p in model.parameters())
    for p, q in zip(model.parameters(), ref.parameters()):  # the moments too, in the parameter's dtype
        assert opt.state[p]["exp_avg"].dtype == dtype
        assert torch.equal(opt.state[p]["exp_avg_sq"], ref_opt.state[q]["exp_avg_sq"])


def test_works_with_torch_lr_schedulers_like_adamw():
    model = _model()
    ref = _twin(model)
    opt = CompensatedAdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    lrs = torch.optim.lr_scheduler
    scheds = [lrs.SequentialLR(o, [lrs.LinearLR(o, 0.1, total_iters=5), lrs.CosineAnnealingLR(o, 20)], milestones=[5])
              for o in (opt, ref_opt)]
    for step in range(25):
        for net, o, s in ((model, opt, scheds[0]), (ref, ref_opt, scheds[1])):
            _loss(net, step).backward()
            o.step()
            o.zero_grad()
            s.step()
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    assert _params_equal(model, ref)


# ------------------------------------------------------------------------------------------- master weights
@pytest.mark.parametrize("accumulation_steps, expected", [(1, False), (2, False), (3, False), (4, True), (8, True)])
def test_auto_master_copy_from_four_accumulation_steps(accumulation_steps, expected):
    model = _model(torch.bfloat16)
    opt = CompensatedAdamW(model.parameters(), accumulation_steps=accumulation_steps)
    for micro in range(accumulation_steps):
        _loss(model, micro).backward()
        opt.step()
        opt.zero_grad()
    assert opt.stats["updates"] == 1
    assert all((opt.master_weight(p) is not None) == expected for p in model.parameters())
    if expected:
        assert all(opt.master_weight(p).dtype == torch.float32 for p in model.parameters())
        assert all(opt.state[p]["exp_avg"].dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("master_weights, dtype, expected", [
    (True, torch.bfloat16, True), (True, torch.float16, True), (False, torch.bfloat16, False),
    (True, torch.float32, False), ("auto", torch.float32, False),
])
def test_forced_master_copy_only_for_16_bit_parameters(master_weights, dtype, expected):
    opt = CompensatedAdamW(_model(dtype).parameters(), master_weights=master_weights, accumulation_steps=8)
    assert all(opt.uses_master(p) == expected for g in opt.param_groups for p in g["params"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_master_copy_follows_fp32_adamw_on_the_same_gradients(dtype):
    model = _model(dtype)
    reference = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    opt = CompensatedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, master_weights=True)
    ref_opt = torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.1)
    for step in range(20):
        _loss(model, step).backward()
        for p, r in zip(model.parameters(), reference):
            r.grad = p.grad.float()  # the same 16-bit gradients, upcast
        opt.step()
        ref_opt.step()
        opt.zero_grad()
    for p, r in zip(model.parameters(), reference):
        assert torch.equal(opt.master_weight(p), r)
        assert torch.equal(p, r.to(dtype))  # the 16-bit weight is the rounded master


def test_small_updates_are_lost_without_master_and_kept_with_it():
    # bf16 has 8 significant bits: at 1.0 the spacing is 2**-7, so an update below 2**-8 rounds away. Adam's
    # first steps move each weight by about lr, here 1e-3 < 2**-8.
    lr, steps = 1e-3, 12
    results = {}
    for master in (False, True):
        w = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
        opt = CompensatedAdamW([w], lr=lr, weight_decay=0.0, master_weights=master, count_lost_updates=True)
        for _ in range(steps):
            w.grad = torch.full_like(w, 0.5)
            opt.step()
        results[master] = (w, opt)
    w_off, opt_off = results[False]
    assert torch.equal(w_off.detach(), torch.ones_like(w_off)) and opt_off.lost_update_fraction == 1.0
    w_on, opt_on = results[True]
    assert opt_on.lost_update_fraction == 0.0
    assert torch.allclose(opt_on.master_weight(w_on), torch.full((64,), 1 - steps * lr), atol=1e-5)
    assert torch.equal(w_on.detach(), torch.full_like(w_on, 1 - steps * lr))  # 0.988 in bf16: it moved
    assert opt_on.stats["stalled_elements"] > 0  # the bf16 weight waited for the master to cross a spacing


# -------------------------------------------------------------------------------------------- accumulation
@pytest.mark.parametrize("dtype, master", [(torch.float32, False), (torch.bfloat16, True), (torch.bfloat16, False)])
def test_accumulation_is_adamw_on_the_mean_micro_gradient(dtype, master):
    k = 4
    model = _model(dtype)
    wide = torch.float32 if master else dtype
    reference = [p.detach().to(wide).clone().requires_grad_() for p in model.parameters()]
    opt = CompensatedAdamW(model.parameters(), lr=1e-2, accumulation_steps=k, master_weights=master)
    ref_opt = torch.optim.AdamW(reference, lr=1e-2)
    for update in range(5):
        sums = [None] * len(reference)
        for micro in range(k):
            _loss(model, 10 * update + micro).backward()
            for i, p in enumerate(model.parameters()):  # the sum in the accumulation dtype, in arrival order
                g = p.grad.to(wide)
                sums[i] = g.clone() if sums[i] is None else sums[i].add_(g)
            opt.step()
            assert opt.updated == (micro == k - 1)
            opt.zero_grad()
        for r, s in zip(reference, sums):
            r.grad = (s.float() / k).to(wide)
        ref_opt.step()
    for p, r in zip(model.parameters(), reference):
        assert torch.equal(opt.master_weight(p) if master else p, r)


# ----------------------------------------------------------------------------------- non-finite gradients
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("which", [0, 3, 5])
@pytest.mark.parametrize("dtype, accumulation_steps", [(torch.float32, 1), (torch.bfloat16, 4)])
def test_non_finite_gradient_skips_update_and_lowers_scale(bad, which, dtype, accumulation_steps):
    model = _model(dtype)
    opt = CompensatedAdamW(model.parameters(), lr=1e-2, grad_scale="norm", accumulation_steps=accumulation_steps)
    for step in range(3 * accumulation_steps):  # some state first
        opt.scale_loss(_loss(model, step)).backward()
        opt.step()
        opt.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    state_before = _state(opt, model)
    scale_before = opt.grad_scaler.get_scale()
    for micro in range(accumulation_steps):
        opt.scale_loss(_loss(model, 100 + micro)).backward()
        if micro == accumulation_steps // 2:
            list(model.parameters())[which].grad.view(-1)[1] = bad
        opt.step()
        opt.zero_grad()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    state_after = _state(opt, model)
    assert state_after.keys() == state_before.keys()  # no accumulation buffer left behind
    assert all(torch.equal(state_after[k], v) for k, v in state_before.items())
    assert opt.grad_scaler.get_scale() < scale_before
    assert opt.stats["skipped_nonfinite"] == 1 and opt.grad_scaler.overflows == 1
    for micro in range(accumulation_steps):  # and training goes on
        opt.scale_loss(_loss(model, 200 + micro)).backward()
        opt.step()
        opt.zero_grad()
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_norm_scale_is_divided_out_of_the_update():
    model = _model()
    ref = _twin(model)
    opt = CompensatedAdamW(model.parameters(), lr=1e-2, grad_scale="norm")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(10):
        scale = opt.grad_scaler.get_scale()
        opt.scale_loss(_loss(model, step)).backward()
        _loss(ref, step).backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad * scale)  # the loss was scaled
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)  # unscaled: AdamW up to rounding


def test_scale_loss_is_required_once_grad_scale_is_set():
    model = _model()
    opt = CompensatedAdamW(model.parameters(), grad_scale="norm")
    _loss(model, 0).backward()
    with pytest.raises(RuntimeError, match="scale_loss"):
        opt.step()


# ------------------------------------------------------------------------------------ delay compensation
def test_delay_compensation_applies_dc_asgd_to_stale_gradients():
    # A gradient applied one update late: g_t is computed at w_t and applied at w_{t+1}, corrected with
    # DC-ASGD g + lambda * g * g * (w_now - w_then) (the dgr module's formula is the reference).
    lam = 0.5
    model = _model()
    reference = _twin(model)
    opt = CompensatedAdamW(model.parameters(), lr=1e-2, delay_compensation=GradientCompensator(lam))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    pending = None  # (gradients, the reference's weights they were computed at)
    for step in range(8):
        opt.snapshot_weights()
        w_then = [r.detach().clone() for r in reference.parameters()]
        _loss(model, step).backward()
        fresh = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        if pending is not None:
            for p, r, g, then in zip(model.parameters(), reference.parameters(), *pending):
                p.grad = g
                r.grad = dc_asgd_compensate(g, r.detach(), then, lam)
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            assert _params_equal(model, reference)
        pending = (fresh, w_then)
    assert len(opt._snapshots) == 1  # the snapshot of the gradient still in flight


def test_snapshot_without_compensator_is_an_error():
    with pytest.raises(ValueError, match="delay_compensation"):
        CompensatedAdamW(_model().parameters()).snapshot_weights()


# ----------------------------------------------------------------------------------------- spike guard
def test_spike_guard_skip_leaves_weights_and_lowers_lr_with_schedulers():
    model = _model()
    guard = LossSpikeGuard(threshold=0.15, window=4, action="skip")
    opt = CompensatedAdamW(model.parameters(), lr=1e-2, spike_guard=guard)
    for loss in (1.0, 1.0, 1.0, 1.0):
        guard.observe(loss)
        _loss(model, 0).backward()
        opt.step()
        opt.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    assert guard.observe(1.5) is not None
    _loss(model, 1).backward()
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert opt.stats["skipped_spike"] == 1
    opt.zero_grad()
    guard.observe(1.0)
    _loss(model, 2).backward()
    opt.step()
    assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_spike_guard_lr_factor_multiplies_the_scheduled_lr():
    model, twin = _model(), _model()
    twin.load_state_dict(model.state_dict())
    guard = LossSpikeGuard(threshold=0.15, window=2, factor=0.5, recovery_steps=1000)
    opt = CompensatedAdamW(model.parameters(), lr=1e-2, spike_guard=guard)
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    sched, ref_sched = recipe_scheduler(opt, 2, 10), recipe_scheduler(ref, 2, 10)
    for loss in (1.0, 1.0, 2.0):  # the third triggers: factor 0.5
        guard.observe(loss)
    assert guard.lr_factor == 0.5
    _loss(model, 0).backward()
    _loss(twin, 0).backward()
    opt.step()
    for group in ref.param_groups:  # the reference steps at half the scheduled LR
        group["lr"] *= 0.5
    ref.step()
    assert _params_equal(model, twin)
    assert opt.param_groups[0]["lr"] == 2 * ref.param_groups[0]["lr"]  # the schedule itself is untouched
    sched.step()
    ref_sched.step()


def test_spike_guard_lower_scale_backs_off_the_shared_scaler_once():
    scaler = NormGradScaler()
    guard = LossSpikeGuard(threshold=0.15, window=2, action="lower_scale")
    CompensatedAdamW(_model().parameters(), grad_scale=scaler, spike_guard=guard)
    CompensatedAdamW(_model().parameters(), grad_scale=scaler, spike_guard=guard)
    before = scaler.get_scale()
    for loss in (1.0, 1.0, 3.0):
        guard.observe(loss)
    assert scaler.get_scale() == before * scaler.config.backoff


# ----------------------------------------------------------------------------------------- state_dict
def _run_all_options(model, opt, guard, steps, offset):
    for step in range(offset, offset + steps):
        loss = _loss(model, step)
        guard.observe(loss.item() * (1.5 if step % 7 == 3 else 1.0))  # some spikes
        if step % 2 == 0:  # one snapshot per update, taken before its first micro-batch
            opt.snapshot_weights()
        opt.scale_loss(loss).backward()
        opt.step()
        opt.zero_grad()


def _build_all_options(model):
    guard = LossSpikeGuard(threshold=0.1, window=3)
    opt = CompensatedAdamW(model.parameters(), lr=1e-2, master_weights=True, accumulation_steps=2,
                           grad_scale="norm", delay_compensation=GradientCompensator(adaptive=True),
                           spike_guard=guard, count_lost_updates=True)
    return opt, guard


def test_state_dict_round_trip_continues_the_same_trajectory():
    model = _model(torch.bfloat16)
    twin = _twin(model)
    opt, guard = _build_all_options(model)
    _run_all_options(model, opt, guard, steps=9, offset=0)  # odd: a checkpoint in mid-accumulation
    assert opt._micro == 1 and guard.triggers

    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer)
    twin.load_state_dict(checkpoint["model"])
    twin_opt, twin_guard = _build_all_options(twin)
    twin_opt.load_state_dict(checkpoint["opt"])
    for p in twin.parameters():
        assert twin_opt.master_weight(p).dtype == torch.float32
        assert twin_opt.state[p]["grad_accum"].dtype == torch.float32

    _run_all_options(model, opt, guard, steps=11, offset=9)
    _run_all_options(twin, twin_opt, twin_guard, steps=11, offset=9)
    assert _params_equal(model, twin)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(opt.master_weight(p), twin_opt.master_weight(q))
    assert opt.stats == twin_opt.stats and guard.lr_factor == twin_guard.lr_factor
    assert opt.grad_scaler.get_scale() == twin_opt.grad_scaler.get_scale()


def test_load_refuses_a_state_dict_with_other_options():
    model = _model()
    opt = CompensatedAdamW(model.parameters(), grad_scale="norm")
    with pytest.raises(ValueError, match="grad_scaler"):
        CompensatedAdamW(_model().parameters()).load_state_dict(opt.state_dict())


# ---------------------------------------------------------------------------------------------------- DGR
def _gpt2():
    from macroarch.models import get_model_spec

    torch.manual_seed(0)
    net = get_model_spec("gpt3_tiny").scaled(n_layers=4, d_model=32, n_heads=2, n_kv_heads=2, d_ff=64,
                                             dropout=0.0).build()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    return net, {"input_ids": ids, "labels": ids}


def test_dgr_per_group_stepping_equals_adamw():
    net, batch = _gpt2()
    ref = _gpt2()[0]
    ref.load_state_dict(net.state_dict())
    wrapper = DGRWrapper(net, group_size=2, mode="sync", example_inputs=batch)
    opt = wrapper.optimizer(CompensatedAdamW, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    assert len(opt.param_groups) > 2
    for _ in range(4):
        wrapper(**batch).loss.backward()  # the groups step inside backward
        opt.step()
        opt.zero_grad()
        ref(**batch).loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert _params_equal(net, ref)


def test_dgr_with_shared_scale_and_guard_trains():
    import functools

    net, batch = _gpt2()
    wrapper = DGRWrapper(net, group_size=2, mode="sync", example_inputs=batch)
    scaler, guard = NormGradScaler(), LossSpikeGuard()
    opt = wrapper.optimizer(functools.partial(CompensatedAdamW, grad_scale=scaler, spike_guard=guard), lr=1e-2)
    losses = []
    for _ in range(6):
        loss = wrapper(**batch).loss
        guard.observe(loss)
        scaler.scale(loss).backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert scaler.observations == 6 * len(opt.param_groups)  # one norm per group update
    assert all(inner.stats["updates"] == 6 for inner in opt._inner)


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("kwargs, name", [
    ({"lr": -1e-3}, "lr"), ({"lr": math.nan}, "lr"), ({"betas": (0.9, 1.0)}, "betas"),
    ({"betas": (-0.1, 0.9)}, "betas"), ({"betas": (0.9,)}, "betas"), ({"eps": -1.0}, "eps"),
    ({"weight_decay": -0.1}, "weight_decay"), ({"accumulation_steps": 0}, "accumulation_steps"),
    ({"accumulation_steps": 2.0}, "accumulation_steps"), ({"master_weights": "yes"}, "master_weights"),
    ({"grad_scale": "max"}, "grad_scale"), ({"delay_compensation": 0.1}, "delay_compensation"),
    ({"spike_guard": 0.15}, "spike_guard"),
])
def test_bad_arguments_are_named(kwargs, name):
    with pytest.raises(ValueError, match=name):
        CompensatedAdamW(_model().parameters(), **kwargs)


def test_bad_param_group_lr_is_named():
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['lr'\]"):
        CompensatedAdamW([{"params": _model().parameters(), "lr": -1.0}])
