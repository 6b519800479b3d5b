"""MVASSchedule: re-plans under the byte budget from the importance, logs each move, keeps training going."""

import pytest
import torch
from model_zoo import ZOO

from macroarch.dgr import DGRWrapper
from macroarch.mvas import MVASAdamW, MVASSchedule, apply, plan_from_rules


class _Recorder:
    def __init__(self):
        self.logged = []

    def log(self, step, **metrics):
        self.logged.append((step, metrics))


def _setup():
    net, loss_fn = ZOO["llama"]()
    store = apply(net, plan_from_rules(net, [("*", "fp8")], block_size=16, min_numel=256))
    return net, loss_fn, store


def test_the_most_important_tensor_moves_up_and_the_budget_holds():
    net, loss_fn, store = _setup()
    star = next(n for n in store.entries if "layers.1.mlp.down_proj" in n)
    estimator = lambda: {n: torch.full(store.entries[n].param.shape, 1e6 if n == star else 1e-6)  # noqa: E731
                         for n in store.entries}
    run = _Recorder()
    schedule = MVASSchedule(store, every=2, warmup=1, estimator=estimator, block_size=16, run=run)
    budget = store.packed_bytes()
    assert schedule.step()  # step 1 = warmup: re-planned
    assert store.packed(star).format == "fp16"
    assert store.packed_bytes() <= budget
    assert {c.name for c in schedule.history} >= {star}
    assert all(c.step == 1 for c in schedule.history)
    assert run.logged[0][0] == 1 and run.logged[0][1]["mvas_replan_changes"] == len(schedule.history)
    assert schedule.step() == []  # step 2: not due
    loss_fn(net).backward()


def test_the_fisher_default_sees_gradients_also_under_dgr():
    net, loss_fn, store = _setup()
    schedule = MVASSchedule(store, every=3, warmup=2, block_size=16)  # before the DGR optimizer: hooks first
    wrapper = DGRWrapper(net, group_size=2, loss_fn=loss_fn)
    opt = wrapper.optimizer(MVASAdamW, lr=1e-3)
    budget = store.packed_bytes()
    replans = []
    for _ in range(5):
        loss_fn(net).backward()
        opt.step()
        opt.zero_grad()
        replans.append(schedule.step())
    assert set(schedule.importance()) == set(store.entries)
    assert all(torch.isfinite(d).all() and d.sum() > 0 for d in schedule.importance().values())
    assert store.packed_bytes() <= budget
    assert schedule.steps == 5
    schedule.close()


def test_before_any_gradient_it_says_what_is_missing():
    net, loss_fn, store = _setup()
    schedule = MVASSchedule(store, every=1, warmup=1)
    with pytest.raises(ValueError, match="no importance yet.*raise warmup"):
        schedule.step()


@pytest.mark.parametrize(("kwargs", "match"), [(dict(every=0), "every"), (dict(warmup=-1), "warmup"),
                                               (dict(formats=("fp5",)), "fp5"), (dict(formats=()), "formats")])
def test_bad_arguments_are_named(kwargs, match):
    net, loss_fn, store = _setup()
    with pytest.raises(ValueError, match=match):
        MVASSchedule(store, **kwargs)


def test_a_budget_below_the_smallest_formats_is_refused_with_the_minimum():
    net, loss_fn, store = _setup()
    loss_fn(net).backward()
    schedule = MVASSchedule(store, every=1, warmup=1, target_bytes=10, estimator=lambda: {
        n: torch.ones(e.param.shape) for n, e in store.entries.items()})
    with pytest.raises(ValueError, match="below the minimum achievable"):
        schedule.step()


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2", "fp4_e2m1"])
def test_expected_rounding_error_uses_the_formats_true_spacing(fmt):
    from macroarch.mvas.codecs.formats import get_format
    from macroarch.mvas.plan.schedule import expected_rounding_error

    f = get_format(fmt)
    if fmt == "fp4_e2m1":
        grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    else:  # every finite non-negative value of torch's own float8 dtype
        grid = torch.arange(128, dtype=torch.uint8).view(f.storage_dtype).float()
        grid = grid[torch.isfinite(grid)].unique()
    x = torch.rand(4, 32, generator=torch.Generator().manual_seed(0)) * 0.9 * f.max_normal
    x[:, 0] = f.max_normal  # block absmax = max_normal: scale 1, values compared on the grid itself
    hi = grid[torch.searchsorted(grid, x.reshape(-1), right=True).clamp(max=len(grid) - 1)]
    lo = grid[torch.searchsorted(grid, x.reshape(-1), right=True) - 1]
    spacing = torch.where(hi > lo, hi - lo, grid[-1] - grid[-2]).view(x.shape)
    assert torch.allclose(expected_rounding_error(x, fmt, 32), spacing.square() / 12, rtol=1e-6)
