"""MVAS through its public API: a packed store trains with MVASAdamW, eager and compiled, and round-trips."""

from __future__ import annotations

import io

import pytest
import torch
from compat.tiny import batches, build

from macroarch import mvas

RULES = [("*mlp*", "fp4"), ("*", "fp8")]


def _packed(seed: int = 0):
    model = build(seed=seed)
    store = mvas.apply(model, mvas.plan_from_rules(model, RULES, min_numel=1024))
    return model, store


def _train(model, optimizer, steps: int) -> list[float]:
    losses = []
    for ids in batches(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_weights_are_stored_packed():
    """Each packed weight dequantises to the dense one within its format's rounding bound, derived here: fp4 e2m1
    with a block scale of blockmax / 6 errs by at most half its widest step (4 -> 6), blockmax / 6; fp8 e4m3 by
    2^-4 relative (3 mantissa bits) plus half its smallest subnormal, (blockmax / 448) * 2^-10."""
    model, _ = _packed()
    dense = build().state_dict()
    served = mvas.dense_state_dict(model)
    packed = [n for n, p in model.named_parameters() if isinstance(p, mvas.MVASWeight)]
    assert len(packed) == 2 + 2 * len(model.layers), packed  # embedding, head, two per block (not norms, biases)
    for name in packed:
        reference, got = dense[name], served[name].float()
        absmax = reference.abs().max()
        if ".mlp." in name:
            bound = torch.full_like(reference, float(absmax) / 6)
        else:
            bound = reference.abs() / 16 + float(absmax) / 448 / 1024
        assert ((got - reference).abs() <= bound * (1 + 1e-6)).all(), name
        assert not torch.equal(got, reference), f"{name} was not quantised"


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_mvas_adamw_trains_a_packed_model(compile):
    """Compiled: the step's kernels ran compiled on this torch (not eagerly after a failed compile), checked against
    the eager source without a mismatch; eager: none ran compiled."""
    model, _ = _packed()
    mvas.reset_compile_stats()
    losses = _train(model, mvas.MVASAdamW(model.parameters(), lr=3e-3, compile=compile), steps=20)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) / 3 < 0.9 * sum(losses[:3]) / 3, f"loss did not fall: {losses}"
    stats = mvas.compile_stats()
    if compile:
        assert stats["compile_failures"] == 0 and stats["mismatches"] == 0, stats
        assert stats["compiles"] >= 1 and stats["checks"] >= 1, stats
        # the step of every parameter, every step, ran compiled (the first call of each kernel too, then checked)
        assert stats["compiled_calls"] >= 20 * len(list(model.parameters())), stats
    else:
        assert stats["compiled_calls"] == 0 and stats["compiles"] == 0, stats


def test_packed_checkpoint_round_trip():
    model, _ = _packed()
    _train(model, mvas.MVASAdamW(model.parameters(), lr=3e-3), steps=2)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    restored, _ = _packed(seed=1)  # other weights, same plan
    restored.load_state_dict(torch.load(buffer))
    for (name, a), (_, b) in zip(model.named_parameters(), restored.named_parameters()):
        assert torch.equal(a.detach(), b.detach()), name
    ids = batches(1)[0]
    assert torch.equal(model(input_ids=ids).logits, restored(input_ids=ids).logits)
