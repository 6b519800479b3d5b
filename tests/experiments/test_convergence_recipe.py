"""Notebook 08's harness (C10): the recipe runs on a toy model, the spike guard's count on a scripted loss stream,
and the statistics on synthetic sweeps whose answer is known."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from model_zoo import alphabet_batches, tiny_gpt
from torch import nn

from macroarch.experiments import convergence_recipe as cr
from macroarch.experiments.loop import evaluate_lm
from macroarch.optim import MasterWeightAdamW, warmup_cosine


class Scripted(nn.Module):
    """A 'language model' whose training loss is the next value of a script (and whose logits are uniform)."""

    def __init__(self, losses):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(()))
        self.script = iter(losses)

    def forward(self, input_ids, labels=None):
        if labels is None:
            return SimpleNamespace(logits=torch.zeros(*input_ids.shape, 64) + self.w)
        return SimpleNamespace(loss=self.w * 0 + next(self.script))


def _expected_triggers(losses, threshold, window):
    """The guard's documented rule, written out: a finite loss more than `threshold` over the mean of the last
    `window` finite losses, once `window` losses have been seen, or a non-finite loss."""
    seen, count = [], 0
    for x in losses:
        if not math.isfinite(x):
            count += 1
            continue
        if len(seen) >= window and x > (1 + threshold) * np.mean(seen[-window:]):
            count += 1
        seen.append(x)
    return count


def test_spike_triggers_count_a_scripted_stream_exactly():
    # 20 calm steps, a 30% spike, a 10% bump (below 15% of a mean the spike raised), a 25% spike, then NaN.
    stream = [1.0] * 20 + [1.3] + [1.0] * 10 + [1.1] + [1.0] * 5 + [1.25] + [float("nan")] + [1.0] * 3
    assert _expected_triggers(stream, 0.15, 20) == 3
    r = cr.recipe_run(Scripted(stream), alphabet_batches(len(stream), rows=1), alphabet_batches(1, rows=1),
                      stack="plain", base_lr=1e-3, lr_multiplier=1.0, warmup_steps=0, warmup_extension=0.0,
                      spike_threshold=0.15)
    assert r.metrics["spike_triggers"] == 3  # at observations 20, 37 and the NaN at 38
    assert r.diverged_at == 38 and len(r.losses) == 38 and math.isnan(r.eval_loss)
    # A higher threshold: the 25% spike no longer counts.
    r = cr.recipe_run(Scripted(stream), alphabet_batches(len(stream), rows=1), alphabet_batches(1, rows=1),
                      stack="plain", base_lr=1e-3, lr_multiplier=1.0, warmup_steps=0, warmup_extension=0.0,
                      spike_threshold=0.28)
    assert r.metrics["spike_triggers"] == _expected_triggers(stream, 0.28, 20) == 2
    # The plain stack's guard is detached: it reports the factor it would set, the LR applied is the schedule's.
    schedule = warmup_cosine(0, len(stream), 0.1)
    assert r.metrics["min_lr_factor"] < 1.0
    assert r.series["lr"] == pytest.approx([1e-3 * schedule(t) for t in range(38)])


def test_recipe_macro_stack_tracks_plain_adamw_and_its_guard_lowers_the_lr():
    # DGR-sync is plain training reordered, and AdamW ignores a constant gradient scale (up to eps): the same run.
    train, held_out = alphabet_batches(8), alphabet_batches(1, seed=1)
    kwargs = dict(base_lr=1e-2, lr_multiplier=1.2, warmup_steps=2, warmup_extension=0.3)
    plain = cr.recipe_run(tiny_gpt(), train, held_out, stack="plain", **kwargs)
    macro = cr.recipe_run(tiny_gpt(), train, held_out, stack="macro", **kwargs)
    assert macro.losses == pytest.approx(plain.losses, rel=1e-3)
    assert plain.series["lr"][2] == pytest.approx(1.2e-2)  # warmup of ceil(2 * 1.3) = 3 steps ends at index 2
    # A batch of tokens the model has never been trained to predict, after four it has: its loss rises over the
    # last one, so the attached guard (window 1: any rise triggers) fires there and halves the LR it applies,
    # against the schedule's LR that the plain stack's detached guard leaves alone.
    unseen = [(ids + 192, labels + 192) for ids, labels in alphabet_batches(1, seed=2)]  # tokens 192-255, never targets
    spiky = train[:4] + unseen + train[4:]
    jumpy = cr.recipe_run(tiny_gpt(), spiky, held_out, stack="macro", spike_threshold=1e-9, guard_window=1, **kwargs)
    schedule = cr.recipe_run(tiny_gpt(), spiky, held_out, stack="plain", **kwargs).series["lr"]
    assert jumpy.metrics["spike_triggers"] >= 1
    assert jumpy.metrics["min_lr_factor"] <= 0.5
    assert min(a / b for a, b in zip(jumpy.series["lr"][4:], schedule[4:])) <= 0.5 + 1e-6


def test_unknown_stack_is_rejected():
    with pytest.raises(ValueError, match="stack"):
        cr.recipe_run(tiny_gpt(), alphabet_batches(1), alphabet_batches(1), stack="deepspeed", base_lr=1e-3,
                      lr_multiplier=1.0, warmup_steps=0, warmup_extension=0.0)


def test_bf16_compute_gives_plain_adamw_an_fp32_master():
    setup = cr.plain_stack(tiny_gpt(torch.bfloat16), alphabet_batches(1)[0], 1e-3)
    assert isinstance(setup.optimizer, MasterWeightAdamW)
    assert type(cr.plain_stack(tiny_gpt(), alphabet_batches(1)[0], 1e-3).optimizer) is torch.optim.AdamW


def test_mvas_stack_is_composed_packs_the_weights_and_learns():
    from macroarch.dgr import DGRWrapper

    model = tiny_gpt(d_model=64, d_ff=128)  # 64 x 64 and larger: MVAS manages them
    train, held_out = alphabet_batches(12), alphabet_batches(1, seed=1)
    before = evaluate_lm(model, held_out).loss
    setup = cr.mvas_stack(model, train[0], 1e-2)
    assert isinstance(setup.module, DGRWrapper) and setup.guard is None
    # A quarter of the packable bytes; the small tensors (norms, biases) stay: most of the model shrinks 4x.
    assert setup.store.plan.reduction() == pytest.approx(0.75, abs=0.05)
    model = tiny_gpt(d_model=64, d_ff=128)
    result = cr.recipe_run(model, train, held_out, stack="mvas", base_lr=1e-2, lr_multiplier=1.0, warmup_steps=2,
                           warmup_extension=0.0)
    assert result.eval_loss < before


def test_fitted_optimum_finds_a_parabola_vertex_and_falls_back_to_argmin():
    grid = [0.5, 0.75, 1.0, 1.2, 1.5, 2.0]
    losses = [(math.log(m) - math.log(1.3)) ** 2 for m in grid]  # minimum at 1.3, between grid points
    assert cr.fitted_optimum(grid, losses) == pytest.approx(1.3)
    assert cr.fitted_optimum(grid, [-v for v in losses]) in (0.5, 2.0)  # concave: the grid's argmin
    assert cr.fitted_optimum(grid, [5 - m for m in grid]) == 2.0  # monotone: clipped to the grid
    assert cr.fitted_optimum([1.0, 1.5], [2.0, 1.0]) == 1.5


def test_optimum_ratio_interval_is_paired_and_brackets_a_known_shift():
    grid = [0.5, 0.75, 1.0, 1.5, 2.0]
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(5, len(grid), generator=g) * 0.01
    curve = lambda center: torch.tensor([(math.log(m) - math.log(center)) ** 2 for m in grid])  # noqa: E731
    a = (curve(0.8) + noise).tolist()
    assert cr.optimum_ratio_interval(grid, a, a, samples=50) == (1.0, 1.0)  # paired: identical runs
    lo, hi = cr.optimum_ratio_interval(grid, a, (curve(1.2) + noise).tolist(), samples=200)
    assert lo <= 1.5 <= hi and lo > 1.0
    with pytest.raises(ValueError, match="losses_a"):
        cr.optimum_ratio_interval(grid, a, [row[:3] for row in a])


def _synthetic_sweep(centers, seeds=3, diverge=()):
    """A sweep whose held-out loss is an exact parabola in log LR, centred per (stack, warmup), plus a per-seed
    offset (which cancels in every paired difference and in the medians' argmin)."""
    mults, warms = [0.5, 1.0, 1.2, 1.35, 1.5, 2.0], [1.0, 1.3]
    settings = cr.RecipeSettings(seeds=seeds, n_layers=2, width=32, n_heads=2, seq_len=16, batch_size=8, steps=10,
                                 base_lr=1e-2, warmup_steps=1, lr_multipliers=tuple(mults), eval_batches=1,
                                 device="cpu", threads=1, warmup_factors=tuple(warms), stacks=("plain", "macro"))
    sw = cr.Sweep(settings, list(range(seeds)), 1000, initial_loss=9.0)
    for (stack, warm), c in centers.items():
        for m in mults:
            for s in range(seeds):
                loss = 3.0 + (math.log(m) - math.log(c)) ** 2 + 0.01 * s
                triggers = 2 if stack == "macro" and s == 0 else 0
                diverged = 0 if (stack, m, warm, s) in diverge else None
                sw.results[stack, m, warm, s] = cr.RunResult([loss], math.nan if diverged == 0 else loss, diverged,
                                                             0.0, {"spike_triggers": triggers, "min_lr_factor": 1.0})
    return sw


def test_analyse_recovers_known_optima_and_gains():
    centers = {("plain", 1.0): 1.0, ("plain", 1.3): 1.0, ("macro", 1.0): 1.1, ("macro", 1.3): 1.3}
    a = cr.analyse(_synthetic_sweep(centers))
    assert a.optimum["plain", 1.0] == pytest.approx(1.0) and a.optimum["macro", 1.3] == pytest.approx(1.3)
    assert a.best_lr_multiplier == pytest.approx(1.3) and a.metrics["best_lr_multiplier"] == pytest.approx(1.3)
    assert a.same_warmup_shift == pytest.approx(1.1)
    assert a.interval == pytest.approx((1.3, 1.3))  # the seeds differ by a constant: every bootstrap agrees
    assert a.warmup_gain["plain"] == pytest.approx(0.0, abs=1e-12)
    # macro: the usual warmup at 1x against the recipe (+30% warmup, 1.35x), same seed
    expected = (math.log(1.0) - math.log(1.1)) ** 2 - (math.log(1.35) - math.log(1.3)) ** 2
    assert a.recipe_gain == pytest.approx(expected)
    assert a.metrics["macro_spike_triggers"] == 2 * 6 * 2 and a.metrics["macro_runs_with_triggers"] == 12
    assert a.metrics["plain_spike_triggers"] == 0 and a.edges == []
    assert a.noise == pytest.approx(np.std([0, 0.01, 0.02], ddof=1) / math.sqrt(3))


def test_a_diverged_run_is_charged_the_untrained_loss():
    centers = {("plain", 1.0): 1.0, ("plain", 1.3): 1.0, ("macro", 1.0): 1.0, ("macro", 1.3): 1.0}
    sw = _synthetic_sweep(centers, diverge={("macro", 2.0, 1.3, 1)})
    assert sw.losses("macro", 1.3, 2.0)[1] == 9.0
    assert sw.losses("macro", 1.3, 2.0)[0] == pytest.approx(3.0 + math.log(2.0) ** 2)


def test_sweep_rows_hold_every_run_once():
    centers = {("plain", 1.0): 1.0, ("plain", 1.3): 1.0, ("macro", 1.0): 1.0, ("macro", 1.3): 1.0}
    sw = _synthetic_sweep(centers, diverge={("macro", 2.0, 1.3, 1)})
    rows = sw.rows()
    assert len(rows) == len(sw.results)
    keys = {(r["stack"], r["lr_multiplier"], r["warmup_factor"], r["seed"]) for r in rows}
    assert keys == set(sw.results)
    diverged = [r for r in rows if r["diverged_at"] is not None]
    assert [(r["stack"], r["lr_multiplier"], r["warmup_factor"], r["seed"]) for r in diverged] == [
        ("macro", 2.0, 1.3, 1)]
    assert all(r["spike_triggers"] == (2 if r["stack"] == "macro" and r["seed"] == 0 else 0) for r in rows)


def test_settings_name_the_field_that_is_wrong():
    good = dict(seeds=1, n_layers=2, width=32, n_heads=2, seq_len=16, batch_size=8, steps=10, base_lr=1e-2,
                warmup_steps=1, lr_multipliers=[1.0], eval_batches=1, device="cpu", threads=1)
    assert cr.RecipeSettings.from_params(dict(good, profile="ci")).lr_multipliers == (1.0,)
    with pytest.raises(ValueError, match="stacks"):
        cr.RecipeSettings.from_params(dict(good, stacks=["plain", "deepspeed"]))
    with pytest.raises(ValueError, match="'base_lrs'"):
        cr.RecipeSettings.from_params(dict(good, base_lrs=[1e-2]))  # a key no setting has
    with pytest.raises(ValueError, match="'steps'"):
        cr.RecipeSettings.from_params({k: v for k, v in good.items() if k != "steps"})
