"""Notebook 04's harness on a toy decoder: the training loop, the measurements, the graded factor over seeds and the
figure."""

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from matplotlib.container import ErrorbarContainer

from macroarch.experiments import dgr_variance as dv
from macroarch.measure.gradients import minibatch_gradient_variance
from macroarch.measure.workload import lm_loss
from macroarch.repro.claims import get_claim, regrade_leaving_out
from macroarch.repro.figures import figure_problems

SETTINGS = dv.DGRVarianceSettings(n_layers=4, width=16, seq_len=16, batch_size=2, steps=4, group_size=2,
                                  measure_every=2, variance_batches=3, threads=1, seeds=3, n_heads=2, lr=1e-2)


@pytest.fixture(scope="module", autouse=True)
def _one_thread_for_the_module():
    """The module's fixtures train before the per-test one-thread fixture runs: the references in the tests
    (one thread) must see the same kernels' summation order to compare bitwise."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def text():
    g = torch.Generator().manual_seed(0)
    return SimpleNamespace(train=torch.randint(0, 256, (4000,), generator=g),
                           val=torch.randint(0, 256, (2000,), generator=g))


@pytest.fixture(scope="module")
def seeds(text):
    return dv.train_seeds(text, SETTINGS)


@pytest.fixture(scope="module")
def setup(seeds):
    return seeds.setups[0]


@pytest.fixture(scope="module")
def comparison(seeds):
    return seeds.first


@pytest.fixture(scope="module")
def memory(setup):
    return dv.gradient_memory(setup, group_size=2, lr=1e-2)


def test_variant_keys_are_metric_names():
    assert [dv.variant_key(v) for v in dv.VARIANTS] == ["plain", "DGR_sync", "DGR_interleaved_DC_ASGD",
                                                        "DGR_interleaved_no_compensation"]


def test_plain_run_is_adamw_written_out_and_measured_where_asked(setup, comparison):
    reference = copy.deepcopy(setup.initial)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    losses = []
    for ids, labels in setup.train:
        loss = reference(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    run = comparison.runs["plain"]
    assert run.losses == losses
    assert [h.step for h in run.history] == [0, 2, 4]
    final = minibatch_gradient_variance(reference, lm_loss, setup.held_out)
    # the same weights (checked bitwise below); the trace is a difference of sums, so its last digits follow the
    # kernels' summation order (thread count, oneDNN algorithm)
    assert run.history[-1].trace == pytest.approx(final.trace, rel=1e-6)
    assert all(torch.equal(p, q) for p, q in zip(run.model.parameters(), reference.parameters()))


def test_measurement_at_step_zero_is_the_same_for_every_variant(comparison):
    first = {v: r.history[0] for v, r in comparison.runs.items()}
    assert set(first) == set(dv.TRAINED) and "DGR sync" not in first  # sync is plain's computation, not trained
    assert len({(m.trace, m.layer_log_std) for m in first.values()}) == 1
    assert comparison.runs["plain"].groups is None and comparison.runs[dv.GRADED].groups >= 4 // 2  # 4 blocks / 2


def test_seeds_pair_plain_and_dgr_and_differ_from_each_other(text, seeds):
    assert seeds.seeds == (0, 1, 2)
    assert [set(c.runs) for c in seeds.comparisons] == [set(dv.TRAINED), {"plain", dv.GRADED}, {"plain", dv.GRADED}]
    for c in seeds.comparisons:  # paired: the same initial weights, batches and held-out set within a seed
        assert c.runs["plain"].history[0] == c.runs[dv.GRADED].history[0]
        assert c.runs["plain"].losses[0] == c.runs[dv.GRADED].losses[0]
    assert seeds.comparisons[1].runs["plain"].losses[0] != seeds.comparisons[2].runs["plain"].losses[0]
    again = dv.setup(text, SETTINGS, 2)
    assert all(torch.equal(a, b) for a, b in zip(again.initial.parameters(), seeds.setups[2].initial.parameters()))
    assert not torch.equal(seeds.setups[1].held_out[0][0], seeds.setups[2].held_out[0][0])


def _per_seed(seeds, column: str) -> list[float]:
    """Plain / DGR + DC-ASGD of ``column`` at each measurement after step 0, averaged, per seed: written out."""
    out = []
    for c in seeds.comparisons:
        plain = np.array([getattr(h, column) for h in c.runs["plain"].history[1:]])
        graded = np.array([getattr(h, column) for h in c.runs[dv.GRADED].history[1:]])
        out.append(float(np.mean(plain / graded)))
    return out


def test_graded_factor_is_a_geometric_mean_over_seeds_with_a_t_interval_on_logs(seeds):
    per_seed = _per_seed(seeds, "trace")
    assert seeds.factors == pytest.approx(per_seed, rel=1e-12)
    e = seeds.estimates()["variance_reduction_factor"]
    logs = np.log(per_seed)
    half = 2.919986 * np.std(logs, ddof=1) / np.sqrt(3)  # Student's t, 2 dof: the 90% two-sided interval
    assert e.n == 3 and e.log_scale and e.value == pytest.approx(np.exp(logs.mean()))
    assert (e.low, e.high) == pytest.approx((np.exp(logs.mean() - half), np.exp(logs.mean() + half)), rel=1e-5)
    assert 0 < e.low < e.value < e.high  # a ratio of variances: its interval never reaches below zero
    m = seeds.metrics()
    assert "variance_reduction_factor" not in m and "DGR_sync_trace_factor" not in m  # no identity as a measurement
    assert m["seeds"] == 3 and [r["seed"] for r in seeds.rows()] == [0, 1, 2]
    assert regrade_leaving_out("C6", seeds.repeated()).grade == \
        get_claim("C6").grade(seeds.estimates(), scale="toy").grade
    rows = seeds.first.series()
    assert (0, {"plain_loss": seeds.first.runs["plain"].losses[0]}) in rows
    assert sum("DGR_interleaved_DC_ASGD_variance_trace" in values for _, values in rows) == 3


def test_the_spread_across_layers_is_reported_with_its_interval_not_graded(seeds):
    """The claim defines gradient variance across mini-batches and across layers: the second is reported too."""
    per_seed = _per_seed(seeds, "layer_log_std")
    e = seeds.estimates()["layer_spread_factor"]
    assert seeds.layer_factors == pytest.approx(per_seed, rel=1e-12)
    assert e.n == 3 and e.has_interval and e.value == pytest.approx(np.exp(np.mean(np.log(per_seed))))
    assert "layer_spread_factor" not in {t.metric for t in get_claim("C6").targets}  # not graded
    assert "layer_spread_factor" not in seeds.metrics()  # an estimate, not a bare mean
    assert "spread across layers (not graded)" in seeds.table()


def test_the_figure_shows_both_factors_with_intervals_and_keeps_legends_off_the_axes(seeds):
    fig = dv.plot_variance(seeds, get_claim("C6"))
    assert figure_problems(fig) == []
    assert all(ax.get_legend() is None for ax in fig.axes)  # figure legends, beside or above the axes
    graded = next(ax for ax in fig.axes if ax.get_title().startswith("graded"))
    bars = [c for c in graded.containers if isinstance(c, ErrorbarContainer)]
    e = seeds.estimates()
    assert [b.lines[0].get_ydata()[0] for b in bars] == pytest.approx(
        [e["variance_reduction_factor"].value, e["layer_spread_factor"].value])
    labels = [t.get_text() for legend in fig.legends for t in legend.get_texts()]
    assert any("n=3" in t for t in labels)
    # the variance panel shows every seed's measurements, not the first seed's few points alone
    trace = next(ax for ax in fig.axes if ax.get_title().startswith("variance across mini-batches"))
    assert len(trace.get_lines()) == len(dv.TRAINED) + 2 * (len(seeds.seeds) - 1)


def test_gradient_memory_plain_holds_every_gradient_dgr_one_group(setup, memory):
    m = memory.metrics()
    assert m["plain_peak_grad_bytes"] == 4 * setup.n_params  # fp32 gradients of every parameter at once
    assert m["dgr_sync_peak_grad_bytes"] < m["plain_peak_grad_bytes"]
    assert memory.grad_ratio > 1 and "x less" in memory.text()
    assert memory.sync_identical and m["sync_weights_identical"] == 1  # the identity, checked


def test_c6_texts(seeds, memory):
    texts = dv.c6_texts(seeds, memory, SETTINGS)
    assert "4-layer GPT-2-style decoder, width 16" in texts["scale"] and "2x16 bytes" in texts["scale"]
    assert "3 seeds" in texts["scale"]
    for e in seeds.estimates().values():  # both numbers with interval, n, method and kind
        assert e.describe(3) in texts["measured_text"]
    assert "sync" not in texts["measured_text"] and "1 by construction" in texts["note"]
