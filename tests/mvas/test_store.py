"""The MVAS store: packed parameters dequantised on use, checked against the dense model on the dequantised
weights, against MemTracker's bytes, and across state_dict round trips."""

import copy
import io
import warnings
import weakref

import pytest
import torch
from model_zoo import ZOO

from macroarch.measure.memory import measure_step
from macroarch.mvas import plan_from_rules, storage_bytes
from macroarch.mvas.optim import MVASAdamW
from macroarch.mvas.packed.weight import MVASWeight
from macroarch.mvas.store import apply

RULES = [("*mlp*", "fp4"), ("*fc*", "fp4"), ("*self_attn*", "fp8"), ("*attn*", "fp8_e5m2"), ("*embed*", "fp16"),
         ("*", "bf16")]


def _managed(name):
    net, loss_fn = ZOO[name]()
    plan = plan_from_rules(net, RULES, block_size=16, min_numel=256)
    return net, loss_fn, plan


@pytest.mark.parametrize("name", ["llama", "gpt2_tied", "vit", "clip"])
def test_forward_and_gradients_equal_the_dense_model_on_the_dequantised_weights(name):
    net, loss_fn, plan = _managed(name)
    reference = copy.deepcopy(net)
    store = apply(net, plan)
    assert len(store.entries) >= 4, "the rules should manage several tensors"
    with torch.no_grad():
        for n, p in reference.named_parameters():
            if n in store:
                p.copy_(store.dense(n))
    loss, ref_loss = loss_fn(net), loss_fn(reference)
    loss.backward()
    ref_loss.backward()
    assert torch.allclose(loss, ref_loss, rtol=1e-6, atol=1e-6)
    grads = dict(net.named_parameters())
    for n, p in reference.named_parameters():
        assert torch.allclose(grads[n].grad, p.grad, rtol=1e-5, atol=1e-6), n


def test_the_dense_weight_lives_only_while_an_op_reads_it(monkeypatch):
    net, loss_fn, plan = _managed("llama")
    apply(net, plan)
    made = []
    original = MVASWeight.dequantize

    def tracking_dequantize(weight, dtype=None):
        w = original(weight, dtype)
        made.append(weakref.ref(w._base if w._base is not None else w))
        return w

    monkeypatch.setattr(MVASWeight, "dequantize", tracking_dequantize)
    loss = loss_fn(net)
    assert made and all(r() is None for r in made), "dense weights outlived the ops that read them"
    n_forward = len(made)
    loss.backward()
    assert len(made) > n_forward, "backward did not re-materialise the weights it needs"
    assert all(r() is None for r in made)


def test_memory_tracker_sees_the_planned_bytes_and_at_most_one_dense_weight_more():
    net, loss_fn, plan = _managed("llama")
    dense = copy.deepcopy(net)

    def step_of(model, opt):
        def step():
            loss_fn(model).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        step()  # optimizer state in place, as in every later step
        return step

    opt_dense = torch.optim.AdamW(dense.parameters())
    store = apply(net, plan)
    opt = MVASAdamW(net.parameters(), state_format="fp8_e4m3", state_block_size=64, min_state_numel=256, seed=0)
    base = measure_step(step_of(dense, opt_dense), dense, opt_dense)
    mem = measure_step(step_of(net, opt), net, opt)
    unmanaged = sum(p.numel() * p.element_size() for p in net.parameters() if not isinstance(p, MVASWeight))
    assert mem.by_category["parameters"] == plan.bytes() == store.packed_bytes() + unmanaged  # packed, exactly
    assert base.by_category["parameters"] == plan.dense_bytes()
    expected_state = 0
    for p in net.parameters():
        if p.numel() >= 256 and p.numel() % 64 == 0:
            expected_state += 2 * storage_bytes(p.numel(), "fp8_e4m3", 64)
        else:
            expected_state += 2 * 4 * p.numel()
    assert mem.max_by_category["optimizer_state"] == expected_state
    # one weight is dense while an op reads it (plus its dequantisation temporary): the only extra bytes, and
    # MemTracker sees them (it lets the weight's dispatch run under it)
    largest = max(t.numel * 4 for t in plan.tensors if t.name in store.entries)
    assert 0 < mem.max_by_category["activations"] - base.max_by_category["activations"] <= 2 * largest


def test_state_dict_round_trips_the_packed_form_exactly():
    net, loss_fn, plan = _managed("gpt2_tied")
    fresh = copy.deepcopy(net)
    store = apply(net, plan)
    opt = MVASAdamW(net.parameters(), lr=1e-2, seed=1)
    for _ in range(3):
        loss_fn(net).backward()
        opt.step()
        opt.zero_grad()
    buffer = io.BytesIO()
    torch.save(net.state_dict(), buffer)
    saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    assert all(isinstance(saved[k], MVASWeight) for k in store.entries), "the packed form is what is saved"
    store2 = apply(fresh, plan)
    result = fresh.load_state_dict(saved)
    assert not result.missing_keys and not result.unexpected_keys
    for name in store.entries:
        a, b = store.packed(name), store2.packed(name)
        assert a.payload.dtype == b.payload.dtype and torch.equal(a.payload.view(torch.uint8),
                                                                  b.payload.view(torch.uint8))
    assert torch.equal(loss_fn(net), loss_fn(fresh))


def test_a_checkpoint_of_another_plan_is_refused_and_nothing_is_loaded():
    net, loss_fn, plan = _managed("llama")
    other_net = copy.deepcopy(net)
    store = apply(net, plan)
    other_plan = plan_from_rules(other_net, [("*mlp*", "fp8"), ("*", "bf16")], block_size=16, min_numel=256)
    other = apply(other_net, other_plan)
    before = {n: store.dense(n) for n in store.entries}
    with torch.no_grad():
        for p in other_net.parameters():
            if not isinstance(p, MVASWeight):
                p.add_(1.0)
    with pytest.raises(ValueError, match="another MVAS plan.*q_proj.weight: checkpoint bf16, model fp8_e4m3.*Nothing"
                                         ".*store.replan"):
        net.load_state_dict(other_net.state_dict())
    assert all(torch.equal(before[n], store.dense(n)) for n in store.entries)
    loss_fn(net).backward()  # still usable
    # adopting the checkpoint's plan first makes it load
    store.replan(store.plan_from_state_dict(other_net.state_dict()))
    net.load_state_dict(other_net.state_dict())
    assert all(torch.equal(other.dense(n), store.dense(n)) for n in store.entries)


def test_a_dense_checkpoint_is_packed_on_load():
    net, loss_fn, plan = _managed("llama")
    dense_sd = copy.deepcopy(net.state_dict())
    reference = copy.deepcopy(net)
    store = apply(net, plan)
    with torch.no_grad():  # move every managed weight away from the checkpoint
        for name in store.entries:
            store.write(name, store.dense(name) * 0.5, rounding="nearest")
    net.load_state_dict(dense_sd)
    probe = apply(reference, plan)
    for name in store.entries:
        assert torch.equal(store.dense(name), probe.dense(name))


def test_replan_moves_tensors_between_tiers_and_reports_each_change():
    net, loss_fn, plan = _managed("llama")
    store = apply(net, plan)
    before = store.packed_bytes()
    with pytest.raises(ValueError, match="no entry for managed tensor"):
        store.replan(plan_from_rules({"x": torch.zeros(8)}, []))
    new_rules = [("*mlp*", "fp8"), ("*self_attn*", "fp8"), ("*embed*", "fp16"), ("*", "bf16")]
    new_plan = plan_from_rules(dict(store.weights()), new_rules, block_size=16, min_numel=256)
    values = {n: store.dense(n) for n in store.entries}
    changes = store.replan(new_plan)
    assert {n for n, _, _ in changes} == {n for n in store.entries if "mlp" in n}
    assert all(old == "fp4_e2m1" and new == "fp8_e4m3" for _, old, new in changes)
    assert store.packed_bytes() > before
    for n in store.entries:  # fp4 values are exactly representable in fp8 at the same block scale or finer
        assert torch.allclose(store.dense(n), values[n], rtol=0.07, atol=0)
    loss_fn(net).backward()


def test_an_update_between_forward_and_backward_is_caught():
    net, loss_fn, plan = _managed("llama")
    store = apply(net, plan)
    loss = loss_fn(net)
    name = next(n for n in store.entries if "q_proj" in n)  # a linear weight, saved for backward
    store.write(name, store.dense(name))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_bad_plans_are_refused_and_leave_the_model_as_it_was():
    net, loss_fn, plan = _managed("llama")
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    other = plan_from_rules({"not.a.parameter": torch.zeros(4096)}, [("*", "fp8")])
    with pytest.raises(ValueError, match="does not have.*not.a.parameter"):
        apply(net, other)
    with pytest.raises(TypeError, match="PrecisionPlan"):
        apply(net, {"x": "fp8"})
    with pytest.raises(ValueError, match="compute_dtype"):
        apply(net, plan, compute_dtype=torch.int8)
    assert all(torch.equal(p, before[n]) for n, p in net.named_parameters())
    apply(net, plan)
    with pytest.raises(ValueError, match="already managed"):
        apply(net, plan)


def test_remove_gives_back_dense_parameters():
    net, loss_fn, plan = _managed("vit")
    store = apply(net, plan)
    values = {n: store.dense(n) for n in store.entries}
    store.remove()
    params = dict(net.named_parameters())
    assert all(torch.equal(params[n], values[n]) for n in values)
    assert not any(isinstance(v, MVASWeight) for v in net.state_dict().values())
    loss_fn(net).backward()


def test_eval_without_grad_matches():
    net, loss_fn, plan = _managed("llama")
    apply(net, plan)
    with torch.no_grad():
        a = loss_fn(net)
    b = loss_fn(net)
    assert torch.equal(a, b.detach())


def test_fake_tensor_full_width_layer():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from macroarch.models import get_model_spec

    with FakeTensorMode():
        net = get_model_spec("llama_65b").scaled(n_layers=1).build()
        plan = plan_from_rules(net, [("*layers*", "fp4"), ("*", "bf16")], block_size=32)
        store = apply(net, plan, compute_dtype=torch.bfloat16)
        opt = MVASAdamW(net.parameters(), seed=0)
        ids = torch.randint(0, 32000, (1, 16))
        net(input_ids=ids, labels=ids).loss.backward()
        with warnings.catch_warnings():  # a fake tensor has no data pointer to key a plan on: none is read
            warnings.filterwarnings("error", message=".*data pointer.*")
            opt.step()
            opt.step()
    assert store.packed_bytes() == sum(plan[n].nbytes for n in store.entries)


def _registered(net):
    """Every registration (module, name) with its parameter object and its bytes."""
    return [(m, name, p, p.detach().contiguous().view(-1).view(torch.uint8).clone())
            for m in net.modules() for name, p in m.named_parameters(recurse=False, remove_duplicate=False)]


def _unchanged(net, before):
    now = [(m, name, p) for m in net.modules() for name, p in m.named_parameters(recurse=False, remove_duplicate=False)]
    assert len(now) == len(before)
    for (m, name, p), (m0, name0, p0, bits) in zip(now, before, strict=True):
        assert m is m0 and name == name0 and p is p0, f"{name}: another parameter object"
        assert type(p) is torch.nn.Parameter and torch.equal(p.detach().view(-1).view(torch.uint8), bits), name


@pytest.mark.parametrize("fail", ["second_weight", "load_hook"])
def test_apply_that_fails_part_way_puts_the_models_own_parameters_back(fail, monkeypatch):
    net, loss_fn, plan = _managed("gpt2_tied")  # tied embedding and head: one object under two names
    before = _registered(net)
    if fail == "second_weight":
        calls, original = [], MVASWeight.from_packed.__func__

        def failing(cls, *args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("injected")
            return original(cls, *args, **kwargs)

        monkeypatch.setattr(MVASWeight, "from_packed", classmethod(failing))
        error = RuntimeError
    else:
        def failing(*args, **kwargs):
            raise KeyboardInterrupt  # a BaseException: undone as well, and passed on as it is

        monkeypatch.setattr(net, "register_load_state_dict_pre_hook", failing)
        error = KeyboardInterrupt
    with pytest.raises(error):
        apply(net, plan)
    _unchanged(net, before)
    monkeypatch.undo()
    store = apply(net, plan)  # and it can be applied again: nothing of the failed attempt is left
    assert store.entries and len(net._load_state_dict_pre_hooks) == 1
