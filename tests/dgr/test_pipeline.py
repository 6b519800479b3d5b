"""DGR update scheduling against ordinary training: sync AdamW, LR schedulers, state_dict round trips,
gradient accumulation, per-group clipping, interleaved delays written out by hand, failure safety."""

import collections
import copy
import gc

import pytest
import torch
from torch import nn

from macroarch.dgr import DGRWrapper, GradientCompensator, PipelineConfig

F64 = torch.float64


def _assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, msg=lambda m, name=name: f"{name}: {m}")


def _schedule(step):
    return 1.0 / (1.0 + step)


@pytest.mark.parametrize("name", ["llama", "vit"])
def test_sync_equals_plain_adamw_with_a_scheduler(zoo, name):
    model, loss_fn = zoo[name](F64)
    ref = copy.deepcopy(model)
    dgr = DGRWrapper(model, group_size=2, loss_fn=loss_fn)
    opt = dgr.optimizer(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, _schedule)
    for _ in range(4):
        before = [p.detach().clone() for p in model.parameters()]
        loss_fn(dgr).backward()
        # Every group stepped inside backward, and released its gradients.
        assert all(p.grad is None for p in model.parameters())
        assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
        opt.step()
        opt.zero_grad()
        sched.step()
        loss_fn(ref).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_sched.step()
    _assert_same_weights(model, ref)
    assert [g["lr"] for g in opt.param_groups] == [ref_opt.param_groups[0]["lr"]] * len(dgr.grouping)


@pytest.mark.parametrize("mode", ["sync", "interleaved"])
def test_state_dict_round_trip_continues_identically(zoo, mode):
    def make():
        model, loss_fn = zoo["sequential"](F64)
        extra = {}
        if mode == "interleaved":
            extra = dict(mode="interleaved", compensator=GradientCompensator(adaptive=True))
        dgr = DGRWrapper(model, group_size=2, loss_fn=loss_fn, **extra)
        opt = dgr.optimizer(torch.optim.AdamW, lr=1e-2)
        return dgr, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5), loss_fn

    def train(dgr, opt, sched, loss_fn, steps):
        for _ in range(steps):
            loss_fn(dgr).backward()
            opt.step()
            opt.zero_grad()
            sched.step()

    first = make()
    train(*first, 3)
    saved = copy.deepcopy([first[0].state_dict(), first[1].state_dict(), first[2].state_dict()])
    if mode == "interleaved":
        assert any(saved[1]["dgr"]["pending"]) and saved[1]["dgr"]["compensator"]["meansquare"]
    train(*first, 3)

    second = make()
    for obj, state in zip(second[:3], saved):
        obj.load_state_dict(state)
    train(*second, 3)
    for p, q in zip(first[0].parameters(), second[0].parameters()):
        assert torch.equal(p, q)
    assert str(first[1].state_dict()) == str(second[1].state_dict())


def test_gradient_accumulation_equals_plain_accumulation(zoo):
    model, _ = zoo["llama"](F64)
    ref = copy.deepcopy(model)
    batches = [torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(i)) for i in range(6)]
    dgr = DGRWrapper(model, group_size=2, accumulation_steps=3, example_inputs={"input_ids": batches[0]})
    opt = dgr.optimizer(torch.optim.AdamW, lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for i, ids in enumerate(batches):
        (dgr(input_ids=ids, labels=ids).loss / 3).backward()  # the loop does not know about accumulation
        opt.step()
        opt.zero_grad()
        (ref(input_ids=ids, labels=ids).loss / 3).backward()
        if i % 3 == 2:
            ref_opt.step()
            ref_opt.zero_grad()
        if i == 2:
            assert all(p.grad is None for p in model.parameters())  # the third backward updated and released
    _assert_same_weights(model, ref)


def test_a_backward_past_the_accumulation_boundary_without_step_raises(zoo):
    model, loss_fn = zoo["sequential"]()
    dgr = DGRWrapper(model, group_size=2, accumulation_steps=2, loss_fn=loss_fn)
    dgr.optimizer(torch.optim.SGD, lr=0.1)
    loss_fn(dgr).backward()
    loss_fn(dgr).backward()
    with pytest.raises(RuntimeError, match=r"backward pass 3 since the last update with accumulation_steps=2"):
        loss_fn(dgr).backward()


def test_per_group_clipping_equals_clip_grad_norm_by_hand(zoo):
    model, loss_fn = zoo["llama"](F64)
    ref = copy.deepcopy(model)
    max_norm = 0.05
    dgr = DGRWrapper(model, group_size=2, max_grad_norm=max_norm, loss_fn=loss_fn)
    opt = dgr.optimizer(torch.optim.SGD, lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    named = dict(ref.named_parameters())
    for _ in range(3):
        loss_fn(dgr).backward()
        opt.step()
        opt.zero_grad()
        loss_fn(ref).backward()
        norms = [torch.nn.utils.clip_grad_norm_([named[n] for n in g.names], max_norm) for g in dgr.grouping]
        assert any(n > max_norm for n in norms)  # clipping did something
        ref_opt.step()
        ref_opt.zero_grad()
    _assert_same_weights(model, ref)
    assert [g["max_grad_norm"] for g in opt.param_groups] == [max_norm] * len(dgr.grouping)


def test_interleaved_applies_each_group_late_and_compensated_as_written_by_hand():
    torch.manual_seed(0)
    net = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(5, 5), nn.Tanh())]).to(F64)
    ref = copy.deepcopy(net)
    xs = [torch.randn(6, 5, dtype=F64) for _ in range(7)]
    lam, lr = 0.5, 0.1
    dgr = DGRWrapper(net, group_size=1, mode="interleaved", compensator=GradientCompensator(lam), example_inputs=xs[0])
    opt = dgr.optimizer(torch.optim.SGD, lr=lr)
    for x in xs:
        dgr(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    delay = {n: g.index for g in dgr.grouping for n in g.names}  # default: the group's index in backward order
    assert sorted(set(delay.values())) == [0, 1, 2, 3]
    queues = collections.defaultdict(collections.deque)
    for x in xs:
        ref.zero_grad()
        ref(x).square().mean().backward()
        with torch.no_grad():
            for name, p in ref.named_parameters():
                queues[name].append((p.grad.clone(), p.detach().clone()))
                if len(queues[name]) > delay[name]:
                    g, w_then = queues[name].popleft()
                    p -= lr * (g + lam * g * g * (p - w_then))
    _assert_same_weights(net, ref)


class _Cuttable(nn.Module):
    """Four blocks; ``cut=True`` detaches after block 1, so blocks 0 and 1 get no gradient on that step."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(5, 5) for _ in range(4))

    def forward(self, x, cut=False):
        for i, block in enumerate(self.blocks):
            x = torch.tanh(block(x))
            if cut and i == 1:
                x = x.detach()
        return x


def test_interleaved_delays_count_steps_for_groups_with_gradients_on_some_steps_only():
    torch.manual_seed(0)
    net = _Cuttable().to(F64)
    ref = copy.deepcopy(net)
    xs = [torch.randn(6, 5, dtype=F64) for _ in range(9)]
    cuts = [step % 3 != 0 for step in range(len(xs))]  # blocks 0 and 1 learn on every third step only
    lr, delays = 0.1, [0, 1, 2, 3]
    dgr = DGRWrapper(net, group_size=1, mode="interleaved", delays=delays, example_inputs=xs[0])
    assert all(any(p is b.weight for p in g.params) for g, b in zip(dgr.grouping, reversed(net.blocks)))
    opt = dgr.optimizer(torch.optim.SGD, lr=lr)
    for x, cut in zip(xs, cuts):
        dgr(x, cut=cut).square().mean().backward()
        opt.step()
        opt.zero_grad()

    # By hand: the gradient of step t is applied at step t + delay, and a step without one applies nothing.
    delay = {id(p): d for g, d in zip(dgr.grouping, delays) for p in g.params}
    refs = {id(p): q for p, q in zip(net.parameters(), ref.parameters())}
    queues = collections.defaultdict(collections.deque)
    applied = collections.Counter()
    for x, cut in zip(xs, cuts):
        ref.zero_grad()
        ref(x, cut=cut).square().mean().backward()
        with torch.no_grad():
            for key, p in refs.items():
                queues[key].append(None if p.grad is None else p.grad.clone())
                if len(queues[key]) > delay[key]:
                    g = queues[key].popleft()
                    if g is not None:
                        p -= lr * g
                        applied[key] += 1
    _assert_same_weights(net, ref)
    first = net.blocks[0].weight  # delay 3, gradients at steps 0, 3, 6: those of 0 and 3 are applied by step 8
    assert applied[id(first)] == 2 and not torch.equal(first, _Cuttable().to(F64).blocks[0].weight)


def test_interleaved_with_zero_delays_is_sync(zoo):
    runs = []
    for kwargs in (dict(mode="sync"), dict(mode="interleaved", delays=0, compensator=GradientCompensator(1.0))):
        model, loss_fn = zoo["sequential"](F64)
        dgr = DGRWrapper(model, group_size=2, loss_fn=loss_fn, **kwargs)
        opt = dgr.optimizer(torch.optim.AdamW, lr=1e-2)
        for _ in range(3):
            loss_fn(dgr).backward()
            opt.step()
            opt.zero_grad()
        runs.append(model)
    _assert_same_weights(*runs)


class _HalfStepSGD(torch.optim.SGD):
    """SGD that, once armed, updates its group's parameters (and momentum) and then raises."""

    target: torch.Tensor | None = None
    armed = False

    def step(self, closure=None):
        loss = super().step(closure)
        if self.armed and any(p is self.target for p in self.param_groups[0]["params"]):
            raise FloatingPointError("non-finite update")
        return loss


@pytest.mark.parametrize("atomic", [True, False])
def test_a_failing_group_step_is_rolled_back_and_named(zoo, atomic):
    model, loss_fn = zoo["sequential"](F64)
    target = model[4].weight

    def half_step_sgd(groups, **kwargs):
        opt = _HalfStepSGD(groups, **kwargs)
        opt.target = target
        return opt

    dgr = DGRWrapper(model, group_size=2, loss_fn=loss_fn, atomic_steps=atomic)
    opt = dgr.optimizer(half_step_sgd, lr=0.1, momentum=0.9)
    loss_fn(dgr).backward()  # a normal step: momentum buffers exist
    opt.step()
    opt.zero_grad()
    failing = next(g for g in dgr.grouping if any(p is target for p in g.params))
    params = [p.detach().clone() for p in model.parameters()]
    momentum = [opt.state[p]["momentum_buffer"].clone() for p in failing.params]
    for inner in opt._inner:
        inner.armed = True
    expected = rf"DGR group {failing.index} \(blocks: 4 .. 6\): _HalfStepSGD.step\(\) raised FloatingPointError"
    with pytest.raises(RuntimeError, match=expected) as info:
        loss_fn(dgr).backward()
    assert isinstance(info.value.__cause__, FloatingPointError)
    changed = {i for i, (a, p) in enumerate(zip(params, model.parameters())) if not torch.equal(a, p)}
    in_failing = {i for i, p in enumerate(model.parameters()) if any(p is q for q in failing.params)}
    if atomic:
        assert "the whole step was rolled back" in str(info.value)
        assert not changed  # all or nothing: the groups updated before it in this step were rolled back too
        for p, m in zip(failing.params, momentum):
            assert torch.equal(opt.state[p]["momentum_buffer"], m)
            assert p.grad is not None  # the gradient is kept
    else:
        assert "may be partly updated" in str(info.value) and changed & in_failing


def test_optimizer_factories_that_fail_or_return_junk_are_named(zoo):
    model, loss_fn = zoo["sequential"]()
    dgr = DGRWrapper(model, group_size=2, loss_fn=loss_fn)

    def broken_factory(groups, **kwargs):
        raise TypeError("unexpected keyword 'lrr'")

    with pytest.raises(ValueError, match=r"optimizer_cls broken_factory failed to build the optimizer of DGR group 0 "
                                         r"\(blocks: 8 .. 10\): TypeError: unexpected keyword 'lrr'"):
        dgr.optimizer(broken_factory)
    with pytest.raises(ValueError, match="must return a torch.optim.Optimizer with one param group, got list"):
        dgr.optimizer(lambda groups, **kwargs: [])
    with pytest.raises(ValueError, match="optimizer_cls=3 must be an optimizer class or factory"):
        dgr.optimizer(3)


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(mode="async"), r"mode='async' is not a DGR mode"),
    (dict(delays=[1, 2]), r"delays=\[1, 2\] only applies to mode='interleaved'"),
    (dict(mode="interleaved", delays=-1), r"delays=-1 must be an int >= 0"),
    (dict(accumulation_steps=0), r"accumulation_steps=0 must be a positive int"),
    (dict(max_grad_norm=-1.0), r"max_grad_norm=-1.0 must be a positive number"),
    (dict(clip_mode="global"), r"clip_mode='global' is not supported; use one of \('per_group',\)"),
])
def test_bad_pipeline_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PipelineConfig(**kwargs)


def test_wrong_number_of_per_group_settings(zoo):
    model, loss_fn = zoo["sequential"]()
    dgr = DGRWrapper(model, group_size=2, loss_fn=loss_fn, mode="interleaved", delays=[0, 1])
    with pytest.raises(ValueError, match="delays has 2 entries but the grouping has 3 groups"):
        dgr.optimizer(torch.optim.SGD, lr=0.1)


def test_suspended_backward_and_discarded_optimizers_update_nothing(zoo):
    model, loss_fn = zoo["sequential"]()
    dgr = DGRWrapper(model, group_size=2, loss_fn=loss_fn)
    opt = dgr.optimizer(torch.optim.SGD, lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with opt.suspended():
        loss_fn(dgr).backward()
    assert all(torch.equal(a, p) and p.grad is not None for a, p in zip(before, model.parameters()))
    opt.step()  # no hooked backward ran: step() updates every group, as a plain optimizer would
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    opt.zero_grad()

    after = [p.detach().clone() for p in model.parameters()]
    dgr._optimizer = None
    del opt
    gc.collect()
    loss_fn(dgr).backward()  # the hooks died with the optimizer
    assert all(torch.equal(a, p) and p.grad is not None for a, p in zip(after, model.parameters()))
