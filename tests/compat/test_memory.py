"""A fake-tensor memory count through macroarch.measure's public functions, against a count by hand."""

from __future__ import annotations

import torch
from compat.tiny import build

from macroarch.measure.memory import measure_training_step


def test_fake_step_counts_the_training_state():
    report = measure_training_step(build, batch_size=2, seq_len=16, precision="fp32", fake=True, device="cpu")
    numel = sum(p.numel() for p in build().parameters())
    assert report.fake
    assert report.max_by_category["parameters"] == 4 * numel
    assert report.max_by_category["gradients"] == 4 * numel
    assert report.max_by_category["optimizer_state"] == 2 * 4 * numel  # Adam's m and v, fp32
    assert report.end_of_forward["activations"] > 0
    assert report.peak_bytes == sum(report.by_category.values())


def test_fake_and_real_tensors_count_the_same():
    fake = measure_training_step(build, batch_size=2, seq_len=16, precision="fp32", fake=True, device="cpu")
    real = measure_training_step(build, batch_size=2, seq_len=16, precision="fp32", fake=False, device="cpu")
    assert fake.max_by_category == real.max_by_category
    assert fake.end_of_forward == real.end_of_forward
    assert torch.get_default_dtype() == torch.float32
