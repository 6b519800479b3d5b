"""MasterWeightAdamW against torch.optim.AdamW run on an fp32 copy of the model."""

import io

import pytest
import torch

from macroarch.optim import MasterWeightAdamW


def _model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_master_copy_follows_fp32_adamw(dtype):
    model = _model(dtype)
    reference = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    opt = MasterWeightAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.1, foreach=False)
    x = torch.randn(32, 8)
    for _ in range(4):
        model(x.to(dtype)).square().mean().backward()
        for p, r in zip(model.parameters(), reference):
            r.grad = p.grad.float()  # the same (16-bit) gradients, upcast
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for p, r, master in zip(model.parameters(), reference, opt.master_weights()):
        assert master.dtype == torch.float32
        torch.testing.assert_close(master, r, rtol=0, atol=0)
        assert torch.equal(p, r.to(dtype))  # the 16-bit weight is the rounded master copy


def test_state_dict_round_trip_keeps_fp32_state_and_continues_identically():
    model, twin = _model(torch.bfloat16), _model(torch.bfloat16)
    opt = MasterWeightAdamW(model.parameters(), lr=1e-2)
    x = torch.randn(16, 8, dtype=torch.bfloat16)
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()

    twin.load_state_dict(model.state_dict())
    twin_opt = MasterWeightAdamW(twin.parameters(), lr=1e-2)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)  # a checkpoint: no tensor shared between the two optimizers
    buffer.seek(0)
    twin_opt.load_state_dict(torch.load(buffer))
    assert all(m.dtype == torch.float32 for m in twin_opt.master_weights())
    for a, b in zip(opt.master_weights(), twin_opt.master_weights()):
        assert torch.equal(a, b)

    for net, o in ((model, opt), (twin, twin_opt)):
        net(x).sum().backward()
        o.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def test_bad_hyperparameters_are_named():
    params = _model(torch.bfloat16).parameters()
    with pytest.raises(ValueError, match="lr"):
        MasterWeightAdamW(params, lr=-1.0)
    with pytest.raises(ValueError, match="betas"):
        MasterWeightAdamW(_model(torch.bfloat16).parameters(), betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="master_dtype"):
        MasterWeightAdamW(_model(torch.bfloat16).parameters(), master_dtype=torch.int32)
