"""Depth extrapolation phase by phase: models whose peak falls in another phase of the step at full depth than at the
shallow depths measured, checked against a step of the whole model (fake tensors and real ones).

The reference is always a step of the full-depth model, built independently of the extrapolation; what the tests
assert is derived from it and from the shallow measurements, never typed in.
"""

from __future__ import annotations

import torch
from torch import nn

from macroarch.measure.fit import TrainingStep, extrapolate_peak, fake_module, measure_training
from macroarch.measure.memory import StepMemory
from macroarch.planner import plan
from macroarch.planner.models import custom

SHALLOW = (2, 3, 4)


class _Stack(nn.Module):
    """Bias-free linear blocks between an input layer and a wide head: per block, the gradient (width^2 values)
    outweighs the saved input (batch x width), while the head's logits dominate a shallow model."""

    def __init__(self, depth: int, width: int, vocab: int) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width, bias=False)
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(depth))
        self.out = nn.Linear(width, vocab, bias=False)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return nn.functional.cross_entropy(self.out(h).float(), labels)


def _loss(runner, batch):
    return runner(batch["x"], batch["labels"])


def _sgd_step(depth: int, *, fake: bool, width: int = 512, vocab: int = 1536, batch: int = 256) -> TrainingStep:
    def build():
        torch.manual_seed(0)
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device("meta" if fake else "cpu"):
                model = _Stack(depth, width, vocab)
            if fake:
                model = fake_module(model)
        finally:
            torch.set_default_dtype(torch.float32)
        data = {"x": torch.randn(batch, 16, dtype=torch.bfloat16), "labels": torch.randint(0, vocab, (batch,))}
        return model, model, torch.optim.SGD(model.parameters(), lr=0.1, foreach=False), data

    return measure_training(build, _loss, fake=fake)


def test_peak_moves_from_backward_start_to_its_end():
    """Shallow, backward's peak is at its start (the logits' gradients beside every activation); at 16 blocks it is at
    its end (every block's gradient). One extrapolation of the step, or of backward as one phase, misses it."""
    shallow = {d: _sgd_step(d, fake=True) for d in SHALLOW}
    full = _sgd_step(16, fake=True)
    real = _sgd_step(16, fake=False)
    assert {r.peak_phase for r in shallow.values()} == {"backward"}
    assert full.peak_phase == "backward_tail" and real.peak_bytes == full.peak_bytes

    got = extrapolate_peak(shallow, 16)
    assert got.peak_phase == full.peak_phase
    assert (got.peak_bytes, got.by_category) == (full.peak_bytes, full.by_category)

    whole = extrapolate_peak({d: StepMemory(r.peak_bytes, r.by_category, {}, 0.0) for d, r in shallow.items()}, 16)
    assert whole.peak_bytes < full.peak_bytes  # the defect: the shallow phase extended
    merged = {d: TrainingStep(r.peak_bytes, r.by_category, {}, 0.0,
                              {k: v for k, v in r.phases.items() if k != "backward_tail"}) for d, r in shallow.items()}
    assert extrapolate_peak(merged, 16).peak_bytes < full.peak_bytes  # backward as one phase: its start extended


def test_one_block_depths_take_backward_as_one_phase():
    reports = {d: _sgd_step(d, fake=True, width=64, vocab=64, batch=8) for d in (1, 2, 3)}
    full = _sgd_step(7, fake=True, width=64, vocab=64, batch=8)
    got = extrapolate_peak(reports, 7)
    assert "backward_tail" not in got.phases
    assert got.peak_bytes == full.peak_bytes


# ------------------------------------------------------------------------------------------------ the planner
WIDTH, VOCAB, BATCH, LAYERS = 512, 512, 384, 16


def _stack_model():
    return custom("stack", lambda layers, seq, frames: _Stack(layers or LAYERS, WIDTH, VOCAB),
                  lambda b, s, f: {"x": torch.randn(b, 16), "labels": torch.randint(0, VOCAB, (b,))}, _loss,
                  layers=LAYERS, default_seq=1)


def test_planner_peak_changes_phase_with_depth():
    """fp16 weights and torch's AdamW (the post's recipe): backward holds the shallow peaks, the update the full
    model's. The planner's extrapolated peak is the full model's, measured on real tensors by a step built here."""
    from macroarch.planner.core import _setup
    from macroarch.planner.run import fake_step

    p = plan(_stack_model(), BATCH, dtype="post")
    c = p.combination("plain")
    setup, _ = _setup(None, "post", None, 1)
    shallow = {fake_step(_stack_model(), frozenset(), setup, BATCH, 1, d).peak_phase for d in SHALLOW}

    def build():
        torch.manual_seed(0)
        torch.set_default_dtype(torch.float16)
        try:
            model = _Stack(LAYERS, WIDTH, VOCAB)
        finally:
            torch.set_default_dtype(torch.float32)
        data = {"x": torch.randn(BATCH, 16, dtype=torch.float16), "labels": torch.randint(0, VOCAB, (BATCH,))}
        return model, model, torch.optim.AdamW(model.parameters(), foreach=False), data

    real = measure_training(build, _loss, fake=False)
    assert "extrapolated in depth" in c.how
    assert c.bytes.phase == real.peak_phase and c.bytes.phase not in shallow
    assert c.bytes.peak == real.peak_bytes
    assert c.bytes.at_peak == real.by_category
