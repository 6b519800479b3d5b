"""The C8/C10 training runs on a toy model: they run, and their controls hold."""

import math

import pytest
import torch

from macroarch.models import get_model_spec
from macroarch.experiments import optim as experiments

SPEC = get_model_spec("gpt3_tiny").scaled(n_layers=2, d_model=32, n_heads=2, n_kv_heads=2, d_ff=64, dropout=0.0,
                                          max_seq_len=16)


def _batches(n, rows=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 64, (rows, 16), generator=g)  # a small alphabet: the loss falls quickly
        out.append((ids, ids.clone()))
    return out


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return SPEC.build(dtype=dtype)


def test_accumulation_counts_see_the_same_tokens_per_update():
    # In fp32 the mean of k micro-batch gradients is the full-batch gradient up to rounding: the trajectories agree.
    train, held_out = _batches(6), _batches(2, seed=1)
    a = experiments.accumulation_run(_model(), train, held_out, lr=1e-2, accumulation_steps=1, master_weights=False)
    b = experiments.accumulation_run(_model(), train, held_out, lr=1e-2, accumulation_steps=4, master_weights=False)
    assert a.losses == pytest.approx(b.losses, rel=1e-4) and a.eval_loss == pytest.approx(b.eval_loss, rel=1e-4)
    assert a.losses[-1] < a.losses[0] and not a.diverged


def test_accumulation_run_counts_lost_updates_in_bf16():
    train, held_out = _batches(4), _batches(1, seed=1)
    off = experiments.accumulation_run(_model(torch.bfloat16), train, held_out, lr=1e-3, accumulation_steps=2,
                                       master_weights=False)
    on = experiments.accumulation_run(_model(torch.bfloat16), train, held_out, lr=1e-3, accumulation_steps=2,
                                      master_weights=True)
    assert off.metrics["lost_update_fraction"] > 0.01  # LayerNorm gains at 1.0 cannot move by 1e-3 in bf16
    assert on.metrics["lost_update_fraction"] < 1e-3 and on.metrics["master_copies"] > 0
    assert off.metrics["master_copies"] == 0


@pytest.mark.parametrize("method", experiments.SCALING_METHODS)
def test_loss_scaling_runs_probe_underflow(method):
    result = experiments.loss_scaling_run(_model(), _batches(3), _batches(1, seed=1), method=method, lr=1e-3,
                                          probe_every=2)
    assert result.metrics["probes"] == 2 and 0.0 <= result.metrics["underflow_fraction"] <= 1.0
    assert math.isfinite(result.eval_loss) and len(result.series["scale"]) == 3
    assert result.series["scale"][0] == {"none": 1.0, "gradscaler": 65536.0, "norm_rule": 32.0}[method]


def test_recipe_macro_stack_tracks_plain_adamw():
    # DGR-sync is plain training reordered, and AdamW ignores a constant gradient scale (up to eps): the same run.
    train, held_out = _batches(8), _batches(1, seed=1)
    kwargs = dict(base_lr=1e-2, lr_multiplier=1.2, warmup_steps=2, warmup_extension=0.3)
    plain = experiments.recipe_run(_model(), train, held_out, stack="plain", **kwargs)
    macro = experiments.recipe_run(_model(), train, held_out, stack="macro", **kwargs)
    assert macro.losses == pytest.approx(plain.losses, rel=1e-3)
    assert plain.series["lr"][2] == pytest.approx(1.2e-2)  # warmup of ceil(2 * 1.3) = 3 steps ends at index 2
    assert macro.metrics["spike_triggers"] >= 0 and plain.metrics["min_lr_factor"] <= 1.0


def test_unknown_names_are_rejected():
    with pytest.raises(ValueError, match="method"):
        experiments.loss_scaling_run(_model(), _batches(1), _batches(1), method="fp8", lr=1e-3)
    with pytest.raises(ValueError, match="stack"):
        experiments.recipe_run(_model(), _batches(1), _batches(1), stack="deepspeed", base_lr=1e-3, lr_multiplier=1.0,
                               warmup_steps=0, warmup_extension=0.0)
    with pytest.raises(ValueError, match="accumulation_steps"):
        experiments.accumulation_run(_model(), _batches(1, rows=6), _batches(1), lr=1e-3, accumulation_steps=4,
                                     master_weights=False)


def test_fitted_optimum_finds_a_parabola_vertex_and_falls_back_to_argmin():
    grid = [0.5, 0.75, 1.0, 1.2, 1.5, 2.0]
    losses = [(math.log(m) - math.log(1.3)) ** 2 for m in grid]  # minimum at 1.3, between grid points
    assert experiments.fitted_optimum(grid, losses) == pytest.approx(1.3)
    assert experiments.fitted_optimum(grid, [-v for v in losses]) in (0.5, 2.0)  # concave: the grid's argmin
    assert experiments.fitted_optimum(grid, [5 - m for m in grid]) == 2.0  # monotone: clipped to the grid
    assert experiments.fitted_optimum([1.0, 1.5], [2.0, 1.0]) == 1.5


def test_optimum_ratio_interval_is_paired_and_brackets_a_known_shift():
    grid = [0.5, 0.75, 1.0, 1.5, 2.0]
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(5, len(grid), generator=g) * 0.01
    curve = lambda center: torch.tensor([(math.log(m) - math.log(center)) ** 2 for m in grid])  # noqa: E731
    a = (curve(0.8) + noise).tolist()
    assert experiments.optimum_ratio_interval(grid, a, a, samples=50) == (1.0, 1.0)  # paired: identical runs
    lo, hi = experiments.optimum_ratio_interval(grid, a, (curve(1.2) + noise).tolist(), samples=200)
    assert lo <= 1.5 <= hi and lo > 1.0
    with pytest.raises(ValueError, match="losses_a"):
        experiments.optimum_ratio_interval(grid, a, [row[:3] for row in a])


def test_recipe_mvas_stack_packs_the_weights_and_learns():
    from macroarch.mvas import MVASWeight

    spec = get_model_spec("gpt3_tiny").scaled(n_layers=2, d_model=64, n_heads=2, n_kv_heads=2, d_ff=128,
                                              dropout=0.0, max_seq_len=16)  # 64 x 64 and larger: MVAS manages them
    torch.manual_seed(0)
    model = spec.build()
    train, held_out = _batches(12), _batches(1, seed=1)
    before = experiments.evaluate(model, held_out)
    result = experiments.recipe_run(model, train, held_out, stack="mvas", base_lr=1e-2, lr_multiplier=1.0,
                                    warmup_steps=2, warmup_extension=0.0)
    packed = [n for n, p in model.named_parameters() if isinstance(p, MVASWeight)]
    assert packed, "the mvas stack should pack the larger weights"
    assert result.eval_loss < before
