"""optim.functional: the one AdamW step against torch.optim.AdamW (bitwise), the one argument check, and the
optimizers' DTensor-local updates (an FSDP2 parameter updates its shard)."""

import copy

import pytest
import torch
import torch.distributed as dist

from macroarch.mvas import MVASAdamW
from macroarch.optim import CompensatedAdamW, MasterWeightAdamW, adamw_step_, check_hyperparameters


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_step_is_torch_adamw_bitwise(dtype, weight_decay):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(257, generator=g).to(dtype)  # an odd length: the vectorised loops' tails too
    ref = torch.nn.Parameter(w.clone())
    ref_opt = torch.optim.AdamW([ref], lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=weight_decay)
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    for step in range(1, 30):
        grad = torch.randn(257, generator=g).to(dtype)
        ref.grad = grad.clone()
        ref_opt.step()
        adamw_step_(w, grad, m, v, step=float(step), lr=3e-3, beta1=0.8, beta2=0.95, eps=1e-6,
                    weight_decay=weight_decay)
    state = ref_opt.state[ref]
    assert torch.equal(w, ref.detach()) and torch.equal(m, state["exp_avg"]) and torch.equal(v, state["exp_avg_sq"])


@pytest.mark.parametrize(("args", "match"), [
    ((-1.0, (0.9, 0.99), 1e-8, 0.0), "lr=-1.0"), ((1e-3, (0.9, 1.0), 1e-8, 0.0), r"betas\[1\]"),
    ((1e-3, (0.9,), 1e-8, 0.0), "betas"), ((1e-3, (0.9, 0.99), float("nan"), 0.0), "eps"),
    ((1e-3, (0.9, 0.99), 1e-8, -0.1), "weight_decay"),
])
def test_one_argument_check_names_the_bad_value(args, match):
    with pytest.raises(ValueError, match=match):
        check_hyperparameters(*args)
    with pytest.raises(ValueError, match=r"param_groups\[2\]\['"):
        check_hyperparameters(*args, where="param_groups[2]")


def test_master_weight_adamw_is_compensated_adamw_with_master_weights():
    opt = MasterWeightAdamW([torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))])
    assert isinstance(opt, CompensatedAdamW) and opt.master_rule is True
    assert opt.master_weights()[0].dtype == torch.float32  # created up front, before any step
    for cls in (CompensatedAdamW, MasterWeightAdamW, MVASAdamW):  # the same check, the same message
        with pytest.raises(ValueError, match=r"betas\[1\]=1.0 must lie in \[0, 1\)"):
            cls([torch.nn.Parameter(torch.ones(4))], betas=(0.9, 1.0))


@pytest.fixture
def one_rank_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


@pytest.mark.parametrize("build", [
    lambda ps: CompensatedAdamW(ps, lr=1e-2, accumulation_steps=2),
    lambda ps: MVASAdamW(ps, lr=1e-2, state_format="fp8_e4m3", min_state_numel=0, compile=False),
], ids=["compensated", "mvas"])
def test_dtensor_parameters_update_their_local_shard_with_local_state(one_rank_mesh, build):
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    torch.manual_seed(0)
    plain = [torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(32))]
    sharded = [torch.nn.Parameter(distribute_tensor(p.detach().clone(), one_rank_mesh, [Shard(0)])) for p in plain]
    opt, ref_opt = build(sharded), build(copy.deepcopy(plain))
    ref_params = ref_opt.param_groups[0]["params"]
    for _ in range(4):
        grads = [torch.randn(p.shape) for p in plain]
        for p, r, grad in zip(sharded, ref_params, grads):
            p.grad = distribute_tensor(grad, one_rank_mesh, [Shard(0)])
            r.grad = grad.clone()
        opt.step()
        ref_opt.step()
    for p, r in zip(sharded, ref_params):
        assert isinstance(p, DTensor) and torch.equal(p.to_local(), r.detach())
        state = opt.state[p]
        assert not any(isinstance(v, DTensor) for v in state.values())  # state is local
        assert torch.equal(state["exp_avg"], ref_opt.state[r]["exp_avg"])
