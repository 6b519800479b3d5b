"""The figure layout checker against figures built to have each defect (and one built to have none)."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from macroarch.repro.figures import MIN_PRINTED_PT, TEXT_WIDTH_IN, figure_problems  # noqa: E402


@pytest.fixture(autouse=True)
def _close():
    yield
    plt.close("all")


def _labelled(ax):
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats)")


def test_a_clean_figure_has_no_problems():
    fig, axes = plt.subplots(1, 2, figsize=(7, 3), layout="constrained")
    x = np.arange(10)
    axes[0].plot(x, x ** 2, label="squares")
    axes[0].legend(loc="upper left")
    for ax in axes:
        _labelled(ax)
    axes[1].bar([2, 5], [10, 40], label="bars")
    axes[1].text(2, 5, "10", ha="center")  # a value inside its bar is a label
    assert figure_problems(fig) == []


def test_a_wide_figure_prints_too_small():
    fig, ax = plt.subplots(figsize=(25, 5))
    ax.plot([0, 1], [0, 1])
    _labelled(ax)
    (p,) = figure_problems(fig)
    printed = 10 * TEXT_WIDTH_IN / fig.get_tightbbox().width  # default 10 pt tick labels, scaled to the page
    assert printed < MIN_PRINTED_PT and f"{round(printed, 1)} pt" in p and "wide" in p


def test_overlapping_tick_labels():
    fig, ax = plt.subplots(figsize=(5, 3.5), layout="constrained")
    ax.bar(np.arange(9) * 8 + 1, 1)
    ax.set_xticks([8, 16, 24, 25, 32])  # the C9 defect: "24" and "25" print as "2425"
    _labelled(ax)
    assert figure_problems(fig) == ["panel 1: x tick labels '24' and '25' overlap"]


def test_unlabelled_axes():
    fig, ax = plt.subplots(figsize=(5, 3.5), layout="constrained")
    ax.plot([0, 1], [0, 1])
    ax.set_ylabel("ratio (x)")
    assert figure_problems(fig) == ["panel 1: the x axis has tick labels but no label (name the quantity and "
                                    "its unit)"]
    fig, ax = plt.subplots(figsize=(5, 3.5), layout="constrained")
    ax.plot([0, 1], [0, 1])
    ax.set_yticks([])  # no ticks, nothing to label
    ax.set_xlabel("step")
    assert figure_problems(fig) == []


def test_a_legend_over_the_data():
    fig, ax = plt.subplots(figsize=(5, 3.5), layout="constrained")
    ax.plot(np.arange(10), np.arange(10), label="rising")
    ax.legend(loc="center")
    _labelled(ax)
    assert figure_problems(fig) == ["panel 1: the legend covers a line (rising)"]


def test_titles_that_run_into_each_other():
    fig, axes = plt.subplots(1, 2, figsize=(6, 3))
    for ax in axes:
        ax.set_title("a panel title long enough to reach its neighbour")
        _labelled(ax)
    problems = figure_problems(fig)
    assert any("title center and panel 2" in p and p.endswith("overlap") for p in problems), problems


def test_a_line_through_an_annotation():
    fig, ax = plt.subplots(figsize=(5, 3.5), layout="constrained")
    ax.bar([0, 1], [3, 4])
    ax.axhline(2.0, color="k", label="mean (graded)")  # the C15 defect: the mean line strikes the labels
    ax.text(0, 2.0, "3.2% (batch 1485)", ha="center", va="center")
    _labelled(ax)
    assert figure_problems(fig) == ["panel 1: text '3.2% (batch 1485)' is drawn over a line (mean (graded))"]
