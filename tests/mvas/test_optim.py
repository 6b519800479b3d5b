"""MVASAdamW against torch.optim.AdamW, and what its low-precision storage does and does not change."""

import copy

import pytest
import torch
from model_zoo import ZOO
from torch import nn

from macroarch.dgr import DGRWrapper
from macroarch.mvas import plan_from_rules, quantize_dequantize
from macroarch.mvas.optim import MVASAdamW
from macroarch.mvas.packed.weight import MVASWeight
from macroarch.mvas.store import apply

KW = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)


def _grads(params, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=g) for p in params] for _ in range(steps)]


def _run(opt, params, grads):
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g.clone()
        opt.step()


def test_with_dense_state_and_no_managed_parameters_it_is_adamw_bitwise():
    net = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 8))
    ref = copy.deepcopy(net)
    grads = _grads(list(net.parameters()), 50)
    opt = MVASAdamW(net.parameters(), state_format="fp32", compile=False, **KW)  # the eager kernel: the one AdamW
    _run(opt, list(net.parameters()), grads)
    ref_opt = torch.optim.AdamW(ref.parameters(), **KW)
    _run(ref_opt, list(ref.parameters()), grads)
    for a, b in zip(net.parameters(), ref.parameters()):
        assert torch.equal(a, b)
        assert torch.equal(opt.state[a]["exp_avg_sq"], ref_opt.state[b]["exp_avg_sq"])


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3", "fp4_e2m1"])
def test_the_master_copy_follows_adamw_and_the_weights_are_its_rounding(fmt):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 128, bias=False))
    ref = copy.deepcopy(net)
    store = apply(net, plan_from_rules(net, [("*", fmt)], block_size=32, min_numel=0))
    with torch.no_grad():  # the master starts from the stored (rounded) weights
        ref[0].weight.copy_(store.dense("0.weight"))
    params = list(net.parameters())
    grads = _grads(params, 30)
    opt = MVASAdamW(params, state_format="fp32", master_weights=True, **KW)
    _run(opt, params, grads)
    _run(torch.optim.AdamW(ref.parameters(), **KW), list(ref.parameters()), grads)
    master = opt.state[params[0]]["master"]
    assert torch.allclose(master, ref[0].weight, rtol=1e-5, atol=1e-6)
    assert torch.equal(store.dense("0.weight"), quantize_dequantize(master, fmt, 32))


def test_round_to_nearest_loses_small_updates_and_stochastic_rounding_keeps_them_on_average():
    torch.manual_seed(0)
    w0 = (torch.rand(64, 256) + 1.0).bfloat16().float()  # in [1, 2): bf16's spacing is 2^-7
    grad = torch.ones_like(w0)  # Adam's first step moves every weight by -lr
    lr = 1e-3  # below half the spacing: round-to-nearest gives the same weight back
    moved = {}
    for rounding in ("nearest", "stochastic"):
        net = nn.Linear(256, 64, bias=False)
        with torch.no_grad():
            net.weight.copy_(w0)
        store = apply(net, plan_from_rules(net, [("*", "bf16")], min_numel=0))
        opt = MVASAdamW(net.parameters(), lr=lr, weight_decay=0.0, state_format="fp32", rounding=rounding, seed=0)
        net.weight.grad = grad
        opt.step()
        moved[rounding] = (store.dense("weight") - w0).double()
    assert torch.count_nonzero(moved["nearest"]) == 0  # every update lost
    assert abs(moved["stochastic"].mean().item() + lr) < 0.1 * lr  # unbiased: E[w1 - w0] = -lr


def test_packed_moments_stay_close_to_adamws_and_cost_what_they_should():
    torch.manual_seed(0)
    net = nn.Linear(256, 128)
    ref, w0 = copy.deepcopy(net), net.weight.detach().clone()
    params = list(net.parameters())
    grads = _grads(params, 20)
    opt = MVASAdamW(params, state_format="fp8_e4m3", state_block_size=128, **KW)
    _run(opt, params, grads)
    _run(torch.optim.AdamW(ref.parameters(), **KW), list(ref.parameters()), grads)
    state = opt.state[net.weight]
    assert state["exp_avg"].dtype == torch.float8_e4m3fn and state["exp_avg_scales"].numel() == 256
    assert state["exp_avg_sq"].dtype == torch.float8_e4m3fn
    assert opt.state[net.bias]["exp_avg"].dtype == torch.float32  # 128 elements: below min_state_numel
    assert opt.state_bytes() == 2 * (128 * 256 * 1 + 256 * 4) + 2 * 128 * 4
    # fp8 e4m3 keeps 3 mantissa bits (relative error up to 1/16 per element): the displacement over 20 steps
    # stays within 10% of AdamW's, in the same direction
    moved, ref_moved = (net.weight - w0).detach().flatten(), (ref.weight - w0).detach().flatten()
    assert (moved - ref_moved).norm() < 0.1 * ref_moved.norm()
    assert torch.nn.functional.cosine_similarity(moved, ref_moved, dim=0) > 0.99


def test_zero_moments_underflowing_read_back_as_their_blocks_floor():
    net = nn.Linear(128, 64, bias=False)
    opt = MVASAdamW(net.parameters(), state_format="fp8_e4m3", state_block_size=128, **KW)
    grad = torch.zeros(64, 128)
    grad[:, 0] = 1e3  # one huge gradient per block makes the others underflow
    grad[:, 1:] = 1e-6
    net.weight.grad = grad
    opt.step()
    w_before = net.weight.detach().clone()
    net.weight.grad = grad
    opt.step()
    assert torch.isfinite(net.weight).all()
    assert (net.weight - w_before).abs().max() <= 1.01 * KW["lr"] * (1 + KW["weight_decay"])  # no m / eps blow-up


def test_resuming_from_state_dicts_continues_bit_for_bit():
    def build():
        net, loss_fn = ZOO["llama"]()
        store = apply(net, plan_from_rules(net, [("*mlp*", "fp4"), ("*", "fp8")], block_size=16, min_numel=256))
        return net, loss_fn, store, MVASAdamW(net.parameters(), lr=3e-3, seed=5, state_block_size=64,
                                              min_state_numel=256)

    net, loss_fn, store, opt = build()
    for _ in range(2):
        loss_fn(net).backward()
        opt.step()
        opt.zero_grad()
    saved_model, saved_opt = copy.deepcopy(net.state_dict()), copy.deepcopy(opt.state_dict())
    for _ in range(3):
        loss_fn(net).backward()
        opt.step()
        opt.zero_grad()
    net2, loss_fn2, store2, opt2 = build()
    net2.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    assert opt2.state[next(p for p in net2.parameters() if isinstance(p, MVASWeight))]["exp_avg"].dtype \
        == torch.float8_e4m3fn
    for _ in range(3):
        loss_fn2(net2).backward()
        opt2.step()
        opt2.zero_grad()
    for name in store.entries:
        assert torch.equal(store.packed(name).payload.view(torch.uint8), store2.packed(name).payload.view(torch.uint8))


def test_dgr_sync_with_mvas_is_the_same_training():
    def build():
        net, loss_fn = ZOO["llama"]()
        apply(net, plan_from_rules(net, [("*mlp*", "fp4"), ("*", "fp8")], block_size=16, min_numel=256))
        return net, loss_fn

    net, loss_fn = build()
    opt = MVASAdamW(net.parameters(), lr=3e-3, rounding="nearest", state_format="fp32")
    dgr_net, dgr_loss = build()
    wrapper = DGRWrapper(dgr_net, group_size=1, loss_fn=dgr_loss)
    dgr_opt = wrapper.optimizer(MVASAdamW, lr=3e-3, rounding="nearest", state_format="fp32")
    assert len(wrapper.grouping.groups) > 2
    for _ in range(3):
        loss_fn(net).backward()
        opt.step()
        opt.zero_grad()
        dgr_loss(dgr_net).backward()  # groups step during backward
        dgr_opt.step()
        dgr_opt.zero_grad()
    managed = 0
    for (n, a), b in zip(net.named_parameters(), dgr_net.parameters()):
        if isinstance(a, MVASWeight):
            managed += 1
            assert torch.equal(a.payload.view(torch.uint8), b.payload.view(torch.uint8)), n
            assert torch.equal(a.scales, b.scales), n
        else:
            assert torch.equal(a, b), n
    assert managed > 2


@pytest.mark.parametrize("inner", ["mvas", "compensated"])
def test_under_dgr_the_group_optimizer_does_not_sum_the_gradients_dgr_just_checked(inner, monkeypatch):
    """DGR checks each group's gradients (one sum each) before it steps the group's optimizer, which checked them
    again (optim.functional.finite_checked); a non-finite gradient still skips the whole step."""
    from macroarch.optim import CompensatedAdamW

    net, loss_fn = ZOO["llama"]()
    if inner == "mvas":
        apply(net, plan_from_rules(net, [("*", "fp8")], block_size=16, min_numel=256))
    wrapper = DGRWrapper(net, group_size=1, loss_fn=loss_fn)
    opt = wrapper.optimizer(MVASAdamW if inner == "mvas" else CompensatedAdamW, lr=1e-3)
    n_grads = sum(p.requires_grad for p in net.parameters())
    loss = loss_fn(wrapper)
    summed, original, params = [], torch.Tensor.sum, list(net.parameters())

    def counting(t, *args, **kwargs):  # sums of gradients (not the sum of those sums that decides)
        if any(t is p.grad for p in params):
            summed.append(t.shape)
        return original(t, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "sum", counting)
    loss.backward()  # the groups step in here (backward runs hooks in its own thread: no dispatch mode sees them)
    monkeypatch.undo()
    assert len(summed) == n_grads  # was twice as many
    opt.step()
    opt.zero_grad()
    before = [p.detach().clone() for p in net.parameters()]
    victim = next(p for p in net.parameters() if not isinstance(p, MVASWeight))
    victim.register_hook(lambda g: torch.full_like(g, float("inf")))
    loss_fn(wrapper).backward()
    assert opt.skipped_nonfinite == 1
    for p, b in zip(net.parameters(), before):
        same = torch.equal(p.payload.view(torch.uint8), b.payload.view(torch.uint8)) if isinstance(p, MVASWeight) \
            else torch.equal(p, b)
        assert same


def test_lr_schedulers_drive_it():
    net = nn.Linear(8, 8)
    opt = MVASAdamW(net.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.0)
    assert opt.param_groups[0]["lr"] == 0.0
    before = net.weight.detach().clone()
    net.weight.grad = torch.ones(8, 8)
    opt.step()
    sched.step()
    assert torch.equal(net.weight, before * (1 - 0.0))


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(lr=-1.0), "lr=-1.0"),
    (dict(betas=(0.9, 1.0)), "betas"),
    (dict(eps=-1.0), "eps"),
    (dict(weight_decay=-0.1), "weight_decay"),
    (dict(state_format="fp6"), "fp6"),
    (dict(state_block_size=0), "state_block_size"),
    (dict(rounding="up"), "rounding"),
])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MVASAdamW(nn.Linear(2, 2).parameters(), **kwargs)


def test_large_tensors_are_updated_in_chunks_with_the_same_result(monkeypatch):
    from macroarch.mvas import optim as mvas_optim

    def run():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(64, 96, bias=False), nn.Linear(96, 64, bias=False))
        store = apply(net, plan_from_rules(net, [("0.*", "fp4"), ("1.*", "bf16")], block_size=32, min_numel=0))
        params = list(net.parameters())
        opt = MVASAdamW(params, rounding="nearest", state_block_size=32, min_state_numel=0, **KW)
        _run(opt, params, _grads(params, 5))
        return store, opt, params

    store, opt, params = run()
    monkeypatch.setattr(mvas_optim, "STEP_CHUNK_NUMEL", 64)  # 96 chunks per tensor
    assert opt._chunk(params[0], opt.state[params[0]]) == 64
    chunked_store, chunked_opt, chunked = run()
    for name in store.entries:
        assert torch.equal(store.dense(name), chunked_store.dense(name))
    for a, b in zip(params, chunked):
        for key in ("exp_avg", "exp_avg_sq", "exp_avg_scales"):
            assert torch.equal(opt.state[a][key].view(torch.uint8), chunked_opt.state[b][key].view(torch.uint8))


@pytest.mark.parametrize("dgr", [False, True])
def test_zero_grad_clears_managed_gradients_without_their_torch_function(dgr, torch_function_calls):
    """``zero_grad`` reads and clears ``.grad`` of every parameter: for a managed weight that needs no
    ``__torch_function__`` (~1.6 us of Python per read or write), and the gradients are gone all the same."""
    net, loss_fn = ZOO["llama"]()
    apply(net, plan_from_rules(net, [("*", "fp8")], block_size=16, min_numel=256))
    if dgr:
        wrapper = DGRWrapper(net, group_size=1, loss_fn=loss_fn)
        opt = wrapper.optimizer(MVASAdamW, lr=1e-3)
    else:
        opt = MVASAdamW(net.parameters(), lr=1e-3)
    managed = [p for p in net.parameters() if isinstance(p, MVASWeight)]
    assert managed
    for p in net.parameters():
        with torch._C.DisableTorchFunctionSubclass():
            p.grad = torch.ones(p.shape, dtype=p.dtype)
    torch_function_calls.clear()
    opt.zero_grad()
    seen = list(torch_function_calls)
    assert seen == []
    assert all(p.grad is None for p in net.parameters())


# ------------------------------------------------------------------------------------------- refused loads
def _bits(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8).clone()


def _trained(width, steps=1, **kwargs):
    """A managed fp8 model of one ``width`` x 64 layer and its MVASAdamW (fp8 moments) after ``steps`` steps."""
    torch.manual_seed(width)
    net = nn.Sequential(nn.Linear(64, width, bias=False))
    apply(net, plan_from_rules(net, [("*", "fp8")], block_size=32, min_numel=0))
    opt = MVASAdamW(net.parameters(), lr=1e-2, seed=1, min_state_numel=1024, **kwargs)
    for _ in range(steps):
        net(torch.randn(4, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return net, opt


def _everything(net, opt):
    """Every byte of the weights and of the optimizer state, and its counters."""
    w = net[0].weight
    state = {k: _bits(v) if torch.is_tensor(v) else v for k, v in opt.state[w].items()}
    return _bits(w.payload), _bits(w.scales), state, opt.seed, opt.skipped_nonfinite


def _same(a, b):
    assert a[3:] == b[3:]
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    _same_state(a[2], b[2])


def _same_state(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert (torch.equal(a[key], b[key]) if torch.is_tensor(a[key]) else a[key] == b[key]), key


def test_another_models_state_is_refused_before_anything_changes():
    wide, wide_opt = _trained(128)  # exp_avg (8192,) fp8 codes for a 4096-element weight
    narrow, opt = _trained(64, steps=2)
    before = _everything(narrow, opt)
    with pytest.raises(ValueError, match=r"parameter 0: exp_avg \(8192,\) for 8192 elements, the parameter "
                                         r"\(64, 64\) has 4096.*nothing was loaded"):
        opt.load_state_dict(wide_opt.state_dict())
    _same(before, _everything(narrow, opt))
    narrow(torch.randn(4, 64)).square().mean().backward()
    opt.step()  # and it still steps, from its own state
    assert float(opt.state[narrow[0].weight]["step"]) == 3


def test_dense_moments_of_another_shape_and_another_state_format_are_refused():
    wide, wide_opt = _trained(128, state_format="fp32")
    narrow, opt = _trained(64, state_format="fp32")
    with pytest.raises(ValueError, match=r"parameter 0: exp_avg \(128, 64\), the parameter \(64, 64\)"):
        opt.load_state_dict(wide_opt.state_dict())
    narrow_e5, opt_e5 = _trained(64, state_format="fp8_e5m2")
    before = _everything(narrow, opt)
    with pytest.raises(ValueError, match="exp_avg is stored as torch.float8_e5m2, this optimizer's state_format "
                                         "fp32"):
        opt.load_state_dict(opt_e5.state_dict())
    _same(before, _everything(narrow, opt))


@pytest.mark.parametrize(("fmt", "code"), [("fp8_e4m3", 0x7F), ("fp8_e4m3", 0xFF), ("fp8_e5m2", 0x7C),
                                           ("fp8_e5m2", 0xFE)])
def test_moments_with_nan_or_inf_codes_or_bad_scales_are_refused(fmt, code):
    net, opt = _trained(64, state_format=fmt)
    saved = copy.deepcopy(opt.state_dict())
    saved["state"][0]["exp_avg"].view(torch.uint8)[17] = code
    other, other_opt = _trained(64, steps=2, state_format=fmt)
    before = _everything(other, other_opt)
    with pytest.raises(ValueError, match="parameter 0: 1 codes of exp_avg decode to NaN or infinity"):
        other_opt.load_state_dict(saved)
    saved = copy.deepcopy(opt.state_dict())
    saved["state"][0]["exp_avg_sq_scales"][3] = float("nan")
    with pytest.raises(ValueError, match="1 of exp_avg_sq_scales are NaN, infinite or negative"):
        other_opt.load_state_dict(saved)
    _same(before, _everything(other, other_opt))
    other_opt.load_state_dict(opt.state_dict())  # the good one loads, exactly
    _same_state(_everything(net, opt)[2], _everything(other, other_opt)[2])
    assert other_opt.seed == opt.seed


def test_importing_mvas_does_not_import_dynamo():
    """``torch.compiler.disable`` on ``step`` imports dynamo (most of torch.compile): it is applied on the first call,
    so ``import macroarch.mvas`` costs no compiler, with MACROARCH_COMPILE=0 or not."""
    import subprocess
    import sys

    code = "import sys, macroarch.mvas; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_a_users_torch_compile_runs_the_step_as_it_is():
    """A training step compiled by the user (dynamo traces it; the eager backend) calls MVASAdamW's step untraced, the
    first call included: the same weights as the step uncompiled."""
    x = torch.randn(8, 64)

    def train(compiled: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4))
        apply(net, plan_from_rules(net, [("*", "fp8")], min_numel=1024))
        opt = MVASAdamW(net.parameters(), lr=1e-2, seed=1, compile=False)

        def step() -> torch.Tensor:
            loss = net(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        run = torch.compile(step, backend="eager") if compiled else step
        for _ in range(3):
            run()
        return [p.detach().float().clone() for p in net.parameters()]

    for a, b in zip(train(False), train(True)):
        assert torch.equal(a, b)
