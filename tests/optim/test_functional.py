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


def _packed_linear():
    from macroarch.mvas import apply, plan_from_rules

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    apply(model, plan_from_rules(model, [("weight", "fp8")], block_size=32, min_numel=0))
    return model


@pytest.mark.parametrize("case", ["compensated", "compensated_master", "mvas", "mvas_master"])
def test_init_state_creates_the_zero_state_the_first_step_would(case):
    from macroarch.mvas import MVASWeight

    if case.startswith("compensated"):
        def build():
            torch.manual_seed(0)
            model = torch.nn.Linear(64, 32).to(torch.bfloat16 if case.endswith("master") else torch.float32)
            return model, CompensatedAdamW(model.parameters(), lr=1e-2, master_weights=case.endswith("master"))
    else:
        def build():
            model = _packed_linear()
            return model, MVASAdamW(model.parameters(), lr=1e-2, min_state_numel=0, state_block_size=128, seed=0,
                                    master_weights=case.endswith("master"), compile=False)

    def stored(model):
        return [p.payload.clone() if isinstance(p, MVASWeight) else p.detach().clone() for p in model.parameters()]

    eager, eager_opt = build()
    lazy, lazy_opt = build()
    weights = stored(eager)
    eager_opt.init_state()
    assert [torch.equal(a, b) for a, b in zip(stored(eager), weights)] == [True, True]  # no step taken
    for p in eager.parameters():
        state = eager_opt.state[p]
        assert float(state["step"]) == 0.0
        assert not state["exp_avg"].view(torch.uint8).any() and not state["exp_avg_sq"].view(torch.uint8).any()
        assert ("master" in state) == (case.endswith("master") and (case == "compensated_master" or p.dim() == 2))
    assert eager_opt.state[eager.weight]["exp_avg"].dtype == (torch.float8_e4m3fn if case.startswith("mvas") else
                                                             torch.float32)
    for step in range(2):  # then it steps as the optimizer that created its state lazily, bit for bit
        for m in (eager, lazy):
            m(torch.randn(4, 64, generator=torch.Generator().manual_seed(step)).to(m.bias.dtype)).square().sum() \
                .backward()
        eager_opt.step()
        lazy_opt.step()
        if step == 0:
            assert set(eager_opt.state[eager.weight]) == set(lazy_opt.state[lazy.weight])
            eager_opt.init_state()  # existing state is kept
    assert all(torch.equal(a, b) for a, b in zip(stored(eager), stored(lazy)))
    for p, q in zip(eager.parameters(), lazy.parameters()):
        for key, value in eager_opt.state[p].items():
            other = lazy_opt.state[q][key]
            assert torch.equal(value, other) if torch.is_tensor(value) else value == other, key
    with pytest.raises(ValueError, match=r"shape \(3,\) is not a parameter of this optimizer"):
        eager_opt.init_state([torch.nn.Parameter(torch.ones(3))])


def test_agree_without_dtensors_communicates_nothing_and_sums_norms_as_one_process():
    from macroarch.optim import global_grad_norm
    from macroarch.optim.functional import agree, all_finite

    grads = [torch.randn(5, 3), torch.randn(7)]
    params = [torch.nn.Parameter(torch.zeros(5, 3)), torch.nn.Parameter(torch.zeros(7))]
    result = agree([True, False], params, zip(grads, params))
    assert result.flags == (True, False) and result.norm == global_grad_norm(grads)
    assert all_finite(grads, over=params) and not all_finite([grads[0], torch.tensor(float("nan"))], over=params)


def test_agree_over_a_mesh_counts_replicated_gradients_once_and_refuses_partial_sums(one_rank_mesh):
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from macroarch.optim.functional import agree, all_finite, device_meshes

    g = torch.randn(8, 4)
    sharded = torch.nn.Parameter(distribute_tensor(torch.zeros(8, 4), one_rank_mesh, [Shard(0)]))
    replicated = torch.nn.Parameter(distribute_tensor(torch.zeros(8, 4), one_rank_mesh, [Replicate()]))
    plain = torch.nn.Parameter(torch.zeros(8, 4))
    assert len(device_meshes([sharded, replicated, plain, None])) == 1
    result = agree([False, True], [sharded, replicated, plain],
                   [(distribute_tensor(g, one_rank_mesh, [Shard(0)]), sharded), (g, replicated), (g, plain)])
    assert result.flags == (False, True)
    assert result.norm == pytest.approx(3 ** 0.5 * torch.linalg.vector_norm(g).item(), rel=1e-6)
    sharded.grad = distribute_tensor(g.clone(), one_rank_mesh, [Shard(0)])
    sharded.grad.to_local()[0, 0] = float("inf")
    assert not all_finite([sharded.grad]) and all_finite([g], over=[sharded])
    partial = DTensor.from_local(torch.zeros(8, 4), one_rank_mesh, [Partial()])  # a gradient not yet reduced
    with pytest.raises(ValueError, match="partial sum on mesh dim 0"):
        agree([], [partial], [(g, partial)])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_locally_finite_finds_any_inf_or_nan_and_no_overflow_of_finite_16_bit_values(dtype):
    from macroarch.optim.functional import locally_finite

    # fp16: a sum that overflows fp16 (not float32); bf16 and float32: large, with a sum within float32's range
    big = torch.full((1000,), 60000.0 if dtype == torch.float16 else 1e34, dtype=dtype)
    assert locally_finite([big, torch.ones(3, dtype=dtype)]) and locally_finite([])
    for bad in (float("inf"), float("-inf"), float("nan")):
        for where in (0, 517, 999):
            t = torch.randn(1000).to(dtype)
            t[where] = bad
            assert not locally_finite([torch.ones(3, dtype=dtype), t]), (bad, where)
    # infinities of both signs in different tensors: their sums cancel to NaN, still not finite
    plus, minus = torch.zeros(8, dtype=dtype), torch.zeros(8, dtype=dtype)
    plus[3], minus[5] = float("inf"), float("-inf")
    assert not locally_finite([plus, minus]) and not locally_finite([minus, torch.ones(2, dtype=dtype), plus])


def test_finite_checked_answers_for_exactly_the_tensors_it_was_given_and_only_inside():
    from macroarch.optim.functional import all_finite, finite_checked, locally_finite

    bad = torch.tensor([1.0, float("inf")])  # an inf the caller claims to have checked: the context is a promise
    other = torch.tensor([float("nan")])
    with finite_checked([bad, None]):
        assert locally_finite([bad]) and all_finite([bad, None])
        assert not locally_finite([bad, other])  # a tensor it was not given: summed as always
        assert not locally_finite([bad.clone()])  # the same values, another tensor
        with finite_checked([]):
            assert not locally_finite([bad])  # the innermost context counts
        assert locally_finite([bad])
    assert not locally_finite([bad])
    with pytest.raises(RuntimeError, match="inside"), finite_checked([bad]):
        raise RuntimeError("inside")
    assert not locally_finite([bad])
