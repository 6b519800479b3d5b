"""A DGR run stopped after step k and resumed from ``state_dict()`` is the uninterrupted run, bitwise: weights
(packed payloads and scales), per-group optimizer state in its stored dtype and bytes (MVASAdamW's fp8 moments,
CompensatedAdamW's fp32 masters of bf16 weights), step counters, the LR schedule, the stochastic-rounding seeds,
DGR's delay queues and compensator. The reference is the same run never stopped; the resumed optimizer is built
with other seeds, so only the checkpoint can make it match."""

import io

import pytest
import torch
from torch import nn

from macroarch import mvas
from macroarch.dgr import DGRWrapper, GradientCompensator
from macroarch.optim import CompensatedAdamW

STOP, MORE = 3, 3
VARIANTS = ["mvas-sync", "mvas-interleaved", "master-sync", "master-interleaved"]


def _batches():
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(8, 64, generator=g), torch.randn(8, 8, generator=g)) for _ in range(STOP + MORE)]


class Net(nn.Module):
    """Four repeated blocks (four DGR groups of one block) and a head (a group of its own)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4))
        self.head = nn.Linear(64, 8)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _build(variant, seed):
    """Model, DGR optimizer and LR schedule; ``seed`` drives the model init and every seed drawn at construction."""
    torch.manual_seed(seed)
    model = Net()
    if variant.startswith("mvas"):
        mvas.apply(model, mvas.plan_from_rules(model, [("*", "fp8")], block_size=32, min_numel=1024))
        cls, kwargs = mvas.MVASAdamW, dict(lr=1e-2)  # stochastic rounding, seeds drawn from the global generator
    else:
        model.to(torch.bfloat16)
        cls, kwargs = CompensatedAdamW, dict(lr=1e-2, master_weights=True)
    interleaved = variant.endswith("interleaved")
    dtype = next(model.parameters()).dtype
    x = _batches()[0][0].to(dtype)
    net = DGRWrapper(model, group_size=1, mode="interleaved" if interleaved else "sync",
                     compensator=GradientCompensator(adaptive=True) if interleaved else None, example_inputs=x)
    opt = net.optimizer(cls, **kwargs)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    return net, opt, sched


def _train(net, opt, sched, batches):
    for x, y in batches:
        dtype = next(net.parameters()).dtype
        nn.functional.mse_loss(net(x.to(dtype)).float(), y).backward()
        opt.step()
        opt.zero_grad()
        sched.step()


def _checkpoint(net, opt, sched):
    buffer = io.BytesIO()  # through bytes, as a file: nothing of the live run is shared with the resumed one
    torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _bits(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same_tensor(a, b, where):
    assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    assert torch.equal(_bits(a), _bits(b)), f"{where}: the bytes differ"


def assert_same_state(a, b, where="state"):
    """Nested state dicts equal, tensors by dtype, shape and bytes."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b), where
        assert_same_tensor(a, b, where)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys {sorted(a, key=str)} vs " \
            f"{sorted(b, key=str)}"
        for k in a:
            assert_same_state(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def assert_same_weights(a, b):
    """Packed weights by payload and scales (``mvas.packed_state_dict``), the rest as tensors."""
    pa, pb = mvas.packed_state_dict(a), mvas.packed_state_dict(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        assert_same_tensor(pa[k], pb[k], k)


@pytest.mark.parametrize("variant", VARIANTS)
def test_stopped_and_resumed_equals_the_uninterrupted_run(variant):
    batches = _batches()
    net, opt, sched = _build(variant, seed=0)
    _train(net, opt, sched, batches[:STOP])
    saved = _checkpoint(net, opt, sched)
    _train(net, opt, sched, batches[STOP:])

    net2, opt2, sched2 = _build(variant, seed=1)  # other weights and other seeds: only the checkpoint can match
    net2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    sched2.load_state_dict(saved["sched"])
    if variant.startswith("mvas"):  # the moments are back in their stored format, not cast to the weights' dtype
        stored = [s["exp_avg"].dtype for s in opt2.state.values() if s["exp_avg"].numel() >= 4096]
        assert stored and set(stored) == {torch.float8_e4m3fn}
    else:
        assert {s["master"].dtype for s in opt2.state.values()} == {torch.float32}
    _train(net2, opt2, sched2, batches[STOP:])

    assert_same_weights(net, net2)
    assert_same_state(opt.state_dict(), opt2.state_dict(), "optimizer")
    assert sched.state_dict() == sched2.state_dict()
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in opt2.param_groups]


def test_the_state_dict_has_torchs_layout_and_each_groups_own_extras():
    net, opt, sched = _build("mvas-sync", seed=0)
    _train(net, opt, sched, _batches()[:1])
    state_dict = opt.state_dict()
    n_params = sum(len(g["params"]) for g in opt.param_groups)
    assert [i for g in state_dict["param_groups"] for i in g["params"]] == list(range(n_params))
    assert sorted(state_dict["state"]) == list(range(n_params))
    inner = state_dict["dgr"]["inner"]
    assert len(inner) == len(opt.param_groups) == 5
    assert len({extra["mvas_seed"] for extra in inner}) == len(inner)  # one stochastic-rounding stream per group


def test_a_failed_load_changes_nothing():
    """Group 2's part of the checkpoint is refused by its optimizer after groups 0 and 1 were loaded: every group
    is as before, and the error names the group."""
    net, opt, sched = _build("master-sync", seed=0)
    _train(net, opt, sched, _batches()[:2])
    before = _checkpoint(net, opt, sched)["opt"]

    other, other_opt, other_sched = _build("master-sync", seed=1)
    _train(other, other_opt, other_sched, _batches()[:1])
    bad = _checkpoint(other, other_opt, other_sched)["opt"]
    bad["dgr"]["inner"][2]["compensated"]["grad_scaler"] = {"scale": 1.0}  # saved with a scaler this one lacks
    with pytest.raises(ValueError, match=r"DGR group 2 .*grad_scaler.*nothing was loaded"):
        opt.load_state_dict(bad)
    assert_same_state(before, opt.state_dict(), "optimizer")
    _train(net, opt, sched, _batches()[2:3])  # and it still trains
