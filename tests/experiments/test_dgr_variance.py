"""Notebook 04's harness on a toy decoder: the training loop, the measurements and the figure's notes."""

import copy
import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure

from macroarch.experiments import dgr_variance as dv
from macroarch.measure.gradients import minibatch_gradient_variance
from macroarch.measure.workload import lm_loss


@pytest.fixture(scope="module", autouse=True)
def _one_thread_for_the_module():
    """The module's fixtures train before the per-test one-thread fixture runs: the references in the tests
    (one thread) must see the same kernels' summation order to compare bitwise."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def setup():
    g = torch.Generator().manual_seed(0)
    text = SimpleNamespace(train=torch.randint(0, 256, (4000,), generator=g),
                           val=torch.randint(0, 256, (2000,), generator=g))
    return dv.setup(text, n_layers=4, width=16, n_heads=2, seq_len=16, batch_size=2, steps=4, variance_batches=3,
                    seed=0)


@pytest.fixture(scope="module")
def comparison(setup):
    return dv.train_variants(setup, group_size=2, lr=1e-2, measure_every=2)


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
    assert len({(m.trace, m.layer_log_std) for m in first.values()}) == 1
    assert comparison.runs["plain"].groups is None and comparison.runs["DGR sync"].groups >= 4 // 2  # 4 blocks / 2


def test_metrics_follow_the_definitions(comparison):
    m = comparison.metrics()
    plain = np.array([h.trace for h in comparison.runs["plain"].history[1:]])
    graded = np.array([h.trace for h in comparison.runs[dv.GRADED].history[1:]])
    assert m["variance_reduction_factor"] == pytest.approx(np.mean(plain / graded), rel=1e-12)
    assert m["sync_weights_identical"] == 1 and m["DGR_sync_trace_factor"] == 1.0
    assert m["plain_final_loss"] == np.mean(comparison.runs["plain"].losses[-5:])
    rows = comparison.series()
    assert (0, {"plain_loss": comparison.runs["plain"].losses[0]}) in rows
    assert sum("DGR_sync_variance_trace" in values for _, values in rows) == 3


def test_the_figure_says_which_runs_coincide(comparison):
    assert comparison.coincides_with("plain") is None
    assert comparison.coincides_with("DGR sync") == ("plain", 0.0)
    near = dataclasses.replace(comparison.runs["DGR sync"], losses=[x * 1.001 for x in comparison.runs["plain"].losses])
    far = dataclasses.replace(comparison.runs["DGR sync"], losses=[x * 2 for x in comparison.runs["plain"].losses])
    assert dv.Comparison({"plain": comparison.runs["plain"], "x": near}).coincides_with("x")[1] == pytest.approx(
        0.001 / 1.001)
    assert dv.Comparison({"plain": comparison.runs["plain"], "x": far}).coincides_with("x") is None
    fig = dv.plot_variance(comparison)
    labels = [t.get_text() for t in fig.axes[1].get_legend().get_texts()]
    assert "DGR sync (identical to plain: drawn on top of it)" in labels
    assert isinstance(fig, Figure)


def test_gradient_memory_plain_holds_every_gradient_dgr_one_group(setup, memory):
    m = memory.metrics()
    assert m["plain_peak_grad_bytes"] == 4 * setup.n_params  # fp32 gradients of every parameter at once
    assert m["dgr_sync_peak_grad_bytes"] < m["plain_peak_grad_bytes"]
    assert memory.grad_ratio > 1 and "x less" in memory.text()


def test_c6_texts(setup, comparison, memory):
    texts = dv.c6_texts(setup, comparison, memory, comparison.metrics() | memory.metrics(), group_size=2, steps=4)
    assert "4-layer GPT-2-style decoder, width 16" in texts["scale"] and "2x16 bytes" in texts["scale"]
    assert f"{comparison.metrics()['variance_reduction_factor']:.3f}x" in texts["measured_text"]
