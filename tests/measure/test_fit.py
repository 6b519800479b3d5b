"""macroarch.measure.fit: the search against brute force, the fake-tensor answer against a real-tensor step at
the boundary, depth extrapolation against a full-depth measurement."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from macroarch.measure.fit import (
    MeasureCache,
    extrapolate_peak,
    fake_module,
    largest_fitting,
    measure_training,
)
from macroarch.measure.memory import StepMemory
from macroarch.optim import MasterWeightAdamW


def _report(peak: int) -> StepMemory:
    return StepMemory(peak_bytes=peak, by_category={"activations": peak}, max_by_category={"activations": peak},
                      seconds=0.0)


PEAKS = {
    "affine": lambda n: 1000 + 37 * n,
    "cubic": lambda n: 500 + 3 * n + n**3 // 50,
    "steps": lambda n: 100 * (n // 7) + 5,  # flat stretches: the largest size of a plateau must be found
}


@pytest.mark.parametrize("shape", PEAKS)
@pytest.mark.parametrize("multiple", [1, 8])
@pytest.mark.parametrize("budget", [2_000, 9_999, 123_456])
def test_search_finds_the_brute_force_boundary(shape, multiple, budget):
    f = PEAKS[shape]
    calls = []

    def measure(n):
        calls.append(n)
        return _report(f(n))

    if f(multiple) > budget:
        with pytest.raises(ValueError, match="below the peak of one step"):
            largest_fitting(measure, budget, multiple=multiple)
        return
    fit = largest_fitting(measure, budget, multiple=multiple)
    expected = max(n for n in range(multiple, 100_000, multiple) if f(n) <= budget)
    assert fit.size == expected and fit.peak_bytes == f(expected)
    assert fit.next_size == expected + multiple and fit.next_peak_bytes == f(expected + multiple) > budget
    assert all(n % multiple == 0 for n in calls) and len(calls) == len(set(calls)) == fit.measurements
    # far fewer measurements than a scan; within about twice bisection's count from a bracket of at most 8x
    assert fit.measurements <= 4 * (expected // multiple).bit_length() + 6


def test_affine_peak_needs_few_measurements():
    fit = largest_fitting(lambda n: _report(10_000 + 1_000 * n), 1_000_000)
    assert fit.size == 990 and fit.measurements <= 6


def test_cap_and_bad_input():
    fit = largest_fitting(lambda n: _report(n), 10**9, max_size=64)
    assert fit.size == 64 and fit.capped
    with pytest.raises(ValueError, match="0.002 GB is below the peak of one step at the smallest size "
                                         r"\(4 frames\): 0.004 GB"):
        largest_fitting(lambda n: _report(n * 1_000_000), 2e6, multiple=4, unit="frame")
    for kwargs in ({"multiple": 0}, {"start": 3, "multiple": 2}, {"max_size": 0}):
        with pytest.raises(ValueError):
            largest_fitting(lambda n: _report(n), 100, **kwargs)
    with pytest.raises(ValueError, match="budget_bytes"):
        largest_fitting(lambda n: _report(n), 0)


def test_cache_measures_each_size_once():
    calls = []
    cache = MeasureCache(lambda n: calls.append(n) or _report(50 * n))
    a = largest_fitting(cache, 5_000)
    b = largest_fitting(cache, 6_000)
    assert (a.size, b.size) == (100, 120)
    assert len(calls) == len(set(calls)) == len(cache.reports)
    assert cache.peaks() == {n: 50 * n for n in sorted(calls)}


class _MLP(nn.Module):
    def __init__(self, width: int = 64, depth: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth))
        self.out = nn.Linear(width, 10)

    def forward(self, x, labels):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return nn.functional.cross_entropy(self.out(h).float(), labels)


def _build(batch: int, *, fake: bool, depth: int = 3):
    def build():
        torch.manual_seed(0)
        torch.set_default_dtype(torch.bfloat16)  # built in bf16: .to() of a fake parameter cannot swap it
        try:
            if fake:
                with torch.device("meta"):
                    model = fake_module(_MLP(depth=depth))
            else:
                model = _MLP(depth=depth)
        finally:
            torch.set_default_dtype(torch.float32)
        x = torch.randn(batch, 16, dtype=torch.bfloat16)
        y = torch.randint(0, 10, (batch,))
        return model, model, MasterWeightAdamW(model.parameters()), {"x": x, "labels": y}
    return build


def _loss(runner, batch):
    return runner(batch["x"], batch["labels"])


def test_fake_fit_holds_for_a_real_step_at_the_boundary():
    fake = MeasureCache(lambda n: measure_training(_build(n, fake=True), _loss))
    # a budget between the fake peaks of two batch sizes, so the boundary is known without the search
    budget = (fake(20).peak_bytes + fake(21).peak_bytes) // 2
    fit = largest_fitting(fake, budget)
    assert fit.size == 20
    real_fit = measure_training(_build(fit.size, fake=False), _loss, fake=False)
    real_next = measure_training(_build(fit.size + 1, fake=False), _loss, fake=False)
    assert real_fit.peak_bytes <= budget < real_next.peak_bytes
    assert real_fit.peak_bytes == fit.peak_bytes  # CPU kernels: fake and real tensors hold the same bytes
    assert fit.report.by_category["master_weights"] > 0 and fit.report.by_category["activations"] > 0


def test_depth_extrapolation_matches_full_depth():
    reports = {d: measure_training(_build(8, fake=True, depth=d), _loss) for d in (1, 2, 3)}
    full = measure_training(_build(8, fake=True, depth=7), _loss)
    got = extrapolate_peak(reports, 7)
    assert got.peak_bytes == full.peak_bytes
    assert got.by_category == full.by_category and got.max_by_category == {}
    bent = dict(reports)
    bent[3] = _report(reports[3].peak_bytes + 4096)
    bent[1], bent[2] = _report(reports[1].peak_bytes), _report(reports[2].peak_bytes)
    with pytest.raises(ValueError, match="not affine in depth"):
        extrapolate_peak(bent, 7)
    with pytest.raises(ValueError, match="two or more depths"):
        extrapolate_peak({1: reports[1]}, 7)


def test_fake_module_keeps_ties_and_shapes():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    with FakeTensorMode():
        model = fake_module(model)
    assert isinstance(model[0].weight, FakeTensor) and model[0].weight.device.type == "cpu"
    assert model[1].weight is model[0].weight and model[0].weight.shape == (10, 4)
