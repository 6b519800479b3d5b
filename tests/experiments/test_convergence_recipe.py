"""Notebook 08's harness (C10): the recipe runs on a toy model, the spike guard's count on a scripted loss stream,
the paired seeds of a real sweep, and the statistics and the grid's growth on synthetic sweeps whose answer is
known."""

import dataclasses
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from model_zoo import alphabet_batches, tiny_gpt
from torch import nn

from macroarch.experiments import convergence_recipe as cr
from macroarch.experiments.loop import evaluate_lm
from macroarch.measure.stats import MIN_BOOTSTRAP_N
from macroarch.optim import MasterWeightAdamW, warmup_cosine
from macroarch.repro.claims import INCONCLUSIVE, REPRODUCED, get_claim, regrade_leaving_out
from macroarch.repro.figures import figure_problems


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



def _parabola(grid, center):
    return [(math.log(m) - math.log(center)) ** 2 for m in grid]


def test_curve_optimum_finds_the_vertex_between_grid_points():
    grid = [0.5, 0.75, 1.0, 1.2, 1.5, 2.0]
    # An exact parabola in log LR: the 3-point parabola around the lowest point is the curve itself.
    assert cr.curve_optimum(grid, _parabola(grid, 1.3)) == (pytest.approx(1.3), 3)  # nearest: 1.2
    assert cr.curve_optimum(grid, [v + 7.0 for v in _parabola(grid, 0.9)]) == (pytest.approx(0.9), 2)
    # Two equal lowest points: no tie to pick, the parabola's vertex lies midway between them in log LR.
    assert cr.curve_optimum([0.5, 1.0, 2.0, 4.0], [2.0, 1.0, 1.0, 2.0]) == (pytest.approx(math.sqrt(2)), 1)
    assert cr.curve_optimum([0.5, 1.0, 2.0], [1.0, 1.0, 1.0]) == (0.5, 0)  # flat: the first point, at the edge
    with pytest.raises(ValueError, match="increase"):
        cr.curve_optimum([1.0, 0.5, 2.0], [1.0, 2.0, 3.0])


def test_an_optimum_at_the_grid_edge_is_found_by_index():
    # issue 42: plain's optimum sat at the grid's lower edge, but an equality test against the grid's values said
    # no. The lowest point's index decides: a curve still falling at either end is at the edge.
    grid = [0.5, 1.0, 1.35, 2.0]
    optimum, i = cr.curve_optimum(grid, [1.0, 1.1, 1.2, 1.3])
    assert (optimum, i) == (0.5, 0) and cr.at_edge(i, len(grid))
    optimum, i = cr.curve_optimum(grid, [1.3, 1.2, 1.1, 1.0])
    assert (optimum, i) == (2.0, 3) and cr.at_edge(i, len(grid))
    assert not cr.at_edge(1, len(grid)) and not cr.at_edge(2, len(grid))


def _columns(tables):
    return tuple(tuple(t[:, j]) for t in tables for j in range(t.shape[1]))


def test_shift_estimate_is_paired_and_brackets_a_known_shift():
    grid = [0.5, 0.7, 1.0, 1.35, 1.8, 2.5]
    rng = np.random.default_rng(0)
    seeds = 8
    offsets = rng.normal(0, 0.3, (seeds, 1))  # per-seed level: shared by both stacks, cancels in the pairing
    noise = lambda: rng.normal(0, 0.005, (seeds, len(grid)))  # noqa: E731
    a = np.array(_parabola(grid, 0.9)) + offsets + noise()
    b = np.array(_parabola(grid, 0.9 * 1.35)) + offsets + noise()
    same = cr.shift_estimate(*_columns([a, a]), multipliers=grid)
    assert same.value == 1.0 and (same.low, same.high) == (1.0, 1.0) and same.n == seeds
    e = cr.shift_estimate(*_columns([a, b]), multipliers=grid)
    # The point value is the ratio of the two seed-mean curves' optima, computed here by hand.
    by_hand = cr.curve_optimum(grid, b.mean(axis=0))[0] / cr.curve_optimum(grid, a.mean(axis=0))[0]
    assert e.value == pytest.approx(by_hand) and e.n == seeds and e.confidence == 0.9 and e.log_scale
    assert e.low <= 1.35 <= e.high and e.low > 1.1 and "bootstrap" in e.method
    assert get_claim("C10").grade({"best_lr_multiplier": e, "optimum_at_grid_edge": 0}, scale="t").grade == REPRODUCED
    few = cr.shift_estimate(*_columns([a[:MIN_BOOTSTRAP_N - 1], b[:MIN_BOOTSTRAP_N - 1]]), multipliers=grid)
    assert not few.has_interval  # too few seeds for a bootstrap: the grade cannot rest on it
    assert get_claim("C10").grade({"best_lr_multiplier": few, "optimum_at_grid_edge": 0}, scale="t").grade == \
        INCONCLUSIVE
    with pytest.raises(ValueError, match="columns"):
        cr.shift_estimate(*_columns([a]), multipliers=grid)


MULTS, WARMS = (0.5, 0.7, 1.0, 1.35, 1.8, 2.5), (1.0, 1.3)


def _settings(seeds, **kw):
    return cr.RecipeSettings(**{**dict(seeds=seeds, n_layers=2, width=32, n_heads=2, seq_len=16, batch_size=8,
                                       steps=10, base_lr=1e-2, warmup_steps=1, lr_multipliers=MULTS, eval_batches=1,
                                       device="cpu", threads=1, warmup_factors=WARMS, stacks=("plain", "macro")),
                                **kw})


def _fake_result(loss, stack, seed, diverged=False):
    return cr.RunResult([loss], math.nan if diverged else loss, 0 if diverged else None, 0.0,
                        {"spike_triggers": 2 if stack == "macro" and seed == 0 else 0, "min_lr_factor": 1.0})


def _synthetic_sweep(centers, seeds=8, diverge=(), usual_offset=0.0, mults=MULTS, **settings):
    """A sweep whose held-out loss is an exact parabola in log LR, centred per stack, plus a per-seed offset (which
    cancels in every paired difference and in the seed-mean curve's argmin); the usual warmup's runs are
    ``usual_offset`` worse."""
    settings = _settings(seeds, lr_multipliers=mults, **settings)
    sw = cr.Sweep(settings, list(range(seeds)), 1000, initial_loss=9.0, multipliers=list(mults))
    for stack, c in centers.items():
        for s in range(seeds):
            for m in mults:
                loss = 3.0 + (math.log(m) - math.log(c)) ** 2 + 0.01 * s
                sw.results[stack, m, 1.3, s] = _fake_result(loss, stack, s, (stack, m, 1.3, s) in diverge)
            for m in settings.warmup_multipliers:
                loss = 3.0 + (math.log(m) - math.log(c)) ** 2 + 0.01 * s + usual_offset
                sw.results[stack, m, 1.0, s] = _fake_result(loss, stack, s)
    return sw


def test_analyse_recovers_known_optima_at_the_same_warmup_and_the_paired_gains():
    a = cr.analyse(_synthetic_sweep({"plain": 1.0, "macro": 1.3}, usual_offset=0.02))
    assert a.optimum["plain"] == pytest.approx(1.0) and a.optimum["macro"] == pytest.approx(1.3)
    e = a.estimates["best_lr_multiplier"]
    assert e.value == pytest.approx(1.3) and (e.low, e.high) == (pytest.approx(1.3), pytest.approx(1.3))
    assert e.n == 8 and a.seed_shifts == pytest.approx([1.3] * 8)
    # The +30% warmup's gain: usual - longer, per seed, at 1x: the 0.02 offset exactly, with a zero-width interval.
    g = a.estimates["macro_warmup_extension_gain"]
    assert g.value == pytest.approx(0.02) and g.n == 8 and g.high - g.low < 1e-9
    # The recipe point is the setting's 1.35 (no nearest-to-1.35 search): macro at 1x usual warmup - at 1.35x longer.
    expected = 0.02 + math.log(1.3) ** 2 - (math.log(1.35) - math.log(1.3)) ** 2
    assert a.estimates["recipe_loss_gain"].value == pytest.approx(expected)
    assert a.metrics["macro_spike_triggers"] == 2 * (6 + 1) and a.metrics["macro_runs_with_triggers"] == 7
    assert a.metrics["plain_spike_triggers"] == 0 and a.edges == [] and a.metrics["optimum_at_grid_edge"] == 0


def test_analyse_counts_a_graded_optimum_at_the_edge_and_the_grade_is_inconclusive():
    sw = _synthetic_sweep({"plain": 0.4, "macro": 1.3})  # plain still falling at the grid's 0.5
    a = cr.analyse(sw)
    assert a.edges == ["plain"] and a.metrics["optimum_at_grid_edge"] == 1 and a.optimum["plain"] == 0.5
    verdict = get_claim("C10").grade({**a.metrics, **a.estimates}, scale="t")
    assert verdict.grade == INCONCLUSIVE and "edge" in verdict.note


@pytest.mark.parametrize("centers, sides", [({"plain": 0.3, "macro": 1.3}, {"plain": -1}),
                                            ({"plain": 1.0, "macro": 4.0}, {"macro": 1}),
                                            ({"plain": 0.3, "macro": 4.0}, {"plain": -1, "macro": 1})])
def test_a_vertex_outside_the_grid_is_reported_at_the_edge_found_by_index(centers, sides):
    # issue 42: plain's optimum sat at the grid's lower edge, but the check compared the optimum with the grid's
    # values and said 0. Here the true vertex lies past the first (0.3 < 0.5) or last (4.0 > 2.5) grid point: a
    # parabola through the three points nearest the edge would put its vertex off the grid, and the optimum must be
    # that edge's grid point, flagged by its index, on the side it falls.
    sw = _synthetic_sweep(centers)
    a = cr.analyse(sw)
    assert cr.edge_sides(sw) == sides
    assert sorted(a.edges) == sorted(sides) and a.metrics["optimum_at_grid_edge"] == len(sides)
    for stack, side in sides.items():
        edge = slice(0, 3) if side < 0 else slice(-3, None)  # a parabola through the three points at that edge
        fit = np.polyfit(np.log(MULTS[edge]), np.asarray(a.means[stack])[edge], 2)
        vertex = math.exp(-fit[1] / (2 * fit[0]))
        assert vertex == pytest.approx(centers[stack]) and (vertex < MULTS[0] if side < 0 else vertex > MULTS[-1])
        assert a.optimum[stack] == (MULTS[0] if side < 0 else MULTS[-1])
        assert cr.mean_curve_optimum(MULTS, sw.table(stack))[1] == (0 if side < 0 else len(MULTS) - 1)
    assert get_claim("C10").grade({**a.metrics, **a.estimates}, scale="t").grade == INCONCLUSIVE


def test_an_optimum_strictly_inside_the_grid_is_not_flagged_even_next_to_an_edge():
    # plain's vertex 0.6 lies between the first two grid points (its lowest point is 0.7, index 1), macro's 2.0
    # between the last two (lowest point 1.8, index 4): both bracketed, neither at the edge.
    sw = _synthetic_sweep({"plain": 0.6, "macro": 2.0})
    a = cr.analyse(sw)
    assert a.optimum["plain"] == pytest.approx(0.6) and a.optimum["macro"] == pytest.approx(2.0)
    assert [cr.mean_curve_optimum(MULTS, sw.table(s))[1] for s in ("plain", "macro")] == [1, 4]
    assert a.edges == [] and cr.edge_sides(sw) == {} and a.metrics["optimum_at_grid_edge"] == 0
    assert a.estimates["best_lr_multiplier"].value == pytest.approx(2.0 / 0.6)


def test_the_recipe_point_is_the_settings_multiplier_never_a_nearest_pick():
    # issue 42: the recipe point was min(mults, key=lambda x: abs(x - 1.35)), and with 1.2 and 1.5 in the grid a
    # floating-point tie picked 1.5. The settings now refuse a grid without the recipe multiplier, and the gain is
    # taken at exactly that grid point.
    assert abs(1.5 - 1.35) < abs(1.2 - 1.35)  # the tie the old search broke by rounding
    with pytest.raises(ValueError, match="lr_multipliers.*recipe_multiplier 1.35"):
        _settings(2, lr_multipliers=(0.5, 1.0, 1.2, 1.5, 2.0))  # 1.2 and 1.5, no 1.35
    grid = (0.5, 1.0, 1.2, 1.5, 2.0)
    for recipe in (1.2, 1.5):
        sw = _synthetic_sweep({"plain": 1.0, "macro": 1.3}, mults=grid, recipe_multiplier=recipe)
        at = {m: 3.0 + (math.log(m) - math.log(1.3)) ** 2 for m in grid}
        usual = at[1.0]  # macro at 1x with the usual warmup (usual_offset 0)
        assert cr.analyse(sw).estimates["recipe_loss_gain"].value == pytest.approx(usual - at[recipe])
    assert at[1.2] != at[1.5]  # the two candidates give different gains: picking the wrong one would show


def test_the_grid_grows_past_an_edge_until_it_brackets_the_optimum(monkeypatch):
    centers = {"plain": 0.3, "macro": 0.45}

    def fake_run(model, batches, eval_set, *, stack, lr_multiplier, **_):
        return _fake_result(3.0 + (math.log(lr_multiplier) - math.log(centers[stack])) ** 2, stack, 1)

    monkeypatch.setattr(cr, "recipe_run", fake_run)
    settings = _settings(2, lr_multipliers=(0.5, 1.0, 1.35, 2.0), max_grid_points=7)
    sw = cr.sweep(settings)
    # 0.5 is the lowest point, so 0.25 (0.5 * 0.5 / 1.0) runs; 0.25 is lowest again (0.3 is nearer it in log LR),
    # so 0.125 runs; now 0.25 has a neighbour on each side: the optimum is bracketed and the grid stops.
    assert sw.extensions == [0.25, 0.125] and sw.multipliers == [0.125, 0.25, 0.5, 1.0, 1.35, 2.0]
    assert {k[1] for k in sw.results if k[2] == 1.3} == set(sw.multipliers)
    a = cr.analyse(sw)
    assert a.edges == [] and a.optimum["plain"] == pytest.approx(0.3) and a.optimum["macro"] == pytest.approx(0.45)
    capped = cr.sweep(dataclasses.replace(settings, max_grid_points=5))
    assert capped.extensions == [0.25] and cr.analyse(capped).metrics["optimum_at_grid_edge"] == 1


def test_a_real_sweep_pairs_its_seeds():
    # Every stack, multiplier and warmup of one seed starts from the same weights and first batch: the first
    # training loss (before any update) is the same across them; another seed's differs.
    settings = _settings(2, steps=2, lr_multipliers=(0.5, 1.0, 1.35), max_grid_points=3, recipe_multiplier=1.35)
    sw = cr.sweep(settings)
    assert len(sw.results) == 2 * 3 * 2 + 2 * 1 * 2
    first = {s: {r.losses[0] for k, r in sw.results.items() if k[3] == s} for s in sw.seeds}
    assert all(len(v) == 1 for v in first.values()) and first[0] != first[1]
    torch.manual_seed(123)
    a, b = cr._build(settings, 0), cr._build(settings, 0)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


def test_leaving_a_seed_out_regrades_from_the_raw_columns():
    sw = _synthetic_sweep({"plain": 1.0, "macro": 1.3}, seeds=7)
    rep = cr.repeated(sw)
    assert rep["best_lr_multiplier"].n == 7 and rep["best_lr_multiplier"].estimate().value == pytest.approx(1.3)
    stability = regrade_leaving_out("C10", rep, fixed={"optimum_at_grid_edge": 0})
    assert stability.grade == REPRODUCED and stability.stable


def test_a_diverged_run_is_charged_the_untrained_loss():
    sw = _synthetic_sweep({"plain": 1.0, "macro": 1.0}, diverge={("macro", 2.5, 1.3, 1)})
    assert sw.losses("macro", 1.3, 2.5)[1] == 9.0 and sw.diverged("macro", 1.3, 2.5) == 1
    assert sw.losses("macro", 1.3, 2.5)[0] == pytest.approx(3.0 + math.log(2.5) ** 2)


def test_sweep_rows_hold_every_run_once():
    sw = _synthetic_sweep({"plain": 1.0, "macro": 1.0}, diverge={("macro", 2.5, 1.3, 1)})
    rows = sw.rows()
    assert len(rows) == len(sw.results)
    keys = {(r["stack"], r["lr_multiplier"], r["warmup_factor"], r["seed"]) for r in rows}
    assert keys == set(sw.results)
    diverged = [r for r in rows if r["diverged_at"] is not None]
    assert [(r["stack"], r["lr_multiplier"], r["warmup_factor"], r["seed"]) for r in diverged] == [
        ("macro", 2.5, 1.3, 1)]


def test_plot_and_texts_render(tmp_path):
    sw = _synthetic_sweep({"plain": 1.0, "macro": 1.3}, diverge={("macro", 2.5, 1.3, 1)})
    for k in list(sw.results):
        sw.results[k].series["lr"] = [1e-3, 5e-4]
    a = cr.analyse(sw)
    target = get_claim("C10").target_for("best_lr_multiplier")
    fig = cr.plot(sw, a, target)
    fig.savefig(tmp_path / "c10.png")
    # issue 44: a 21-inch row of four panels printed its text at 2 pt in the report
    assert figure_problems(fig) == [] and fig.get_size_inches()[0] <= 8
    panels, twin = fig.axes[:4], fig.axes[4]  # the spike-guard panel's loss axis shares its x axis
    assert all(ax.get_xlabel() and ax.get_ylabel() for ax in panels) and twin.get_ylabel()
    renderer = fig.canvas.get_renderer()
    for ax in panels:  # each legend below its panel, clear of the x label and the tick labels
        legend, label = ax.get_legend(), ax.xaxis.label.get_window_extent(renderer)
        ticks = [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_text()]
        assert legend is not None and legend.get_window_extent(renderer).y1 <= min([label.y0, *(t.y0 for t in ticks)])
    shift = panels[1]  # the graded shift's axis holds the post's band (the registry's), the estimate and its interval
    e = a.estimates["best_lr_multiplier"]
    low, high = shift.get_ylim()
    assert low <= target.lo and high >= target.hi and low <= e.low <= e.high <= high
    band = next(r for r in shift.patches if "post" in r.get_label())
    assert (band.get_y(), band.get_y() + band.get_height()) == (pytest.approx(target.lo), pytest.approx(target.hi))
    texts = cr.verdict_texts(sw, a)
    assert e.describe(3) in texts["measured_text"] and "paired seeds" in texts["scale"]
    assert "best_lr_multiplier" in cr.text(sw, a)


def test_the_harness_does_not_import_the_reproduction_layer():
    # issue 41: the figure drew its target from macroarch.repro.claims; the notebook passes it now.
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(cr))
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m and m.startswith("macroarch.repro")]


def test_settings_name_the_field_that_is_wrong():
    good = dict(seeds=1, n_layers=2, width=32, n_heads=2, seq_len=16, batch_size=8, steps=10, base_lr=1e-2,
                warmup_steps=1, lr_multipliers=[0.5, 1.0, 1.35], eval_batches=1, device="cpu", threads=1)
    assert cr.RecipeSettings.from_params(dict(good, profile="ci")).lr_multipliers == (0.5, 1.0, 1.35)
    with pytest.raises(ValueError, match="stacks"):
        cr.RecipeSettings.from_params(dict(good, stacks=["plain", "deepspeed"]))
    with pytest.raises(ValueError, match="stacks"):
        cr.RecipeSettings.from_params(dict(good, stacks=["plain", "mvas"]))  # the graded pair needs macro
    with pytest.raises(ValueError, match="lr_multipliers"):
        cr.RecipeSettings.from_params(dict(good, lr_multipliers=[0.5, 1.0, 1.5]))  # no 1.35: no recipe point
    with pytest.raises(ValueError, match="lr_multipliers"):
        cr.RecipeSettings.from_params(dict(good, lr_multipliers=[1.0, 0.5, 1.35]))  # not increasing
    with pytest.raises(ValueError, match="max_grid_points"):
        cr.RecipeSettings.from_params(dict(good, max_grid_points=2))  # fewer than the starting grid
    with pytest.raises(ValueError, match="warmup_multipliers"):
        cr.RecipeSettings.from_params(dict(good, warmup_multipliers=[0.7]))
    with pytest.raises(ValueError, match="'base_lrs'"):
        cr.RecipeSettings.from_params(dict(good, base_lrs=[1e-2]))  # a key no setting has
    with pytest.raises(ValueError, match="'steps'"):
        cr.RecipeSettings.from_params({k: v for k, v in good.items() if k != "steps"})
