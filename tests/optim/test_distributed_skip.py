"""Atomic steps across ranks: under FSDP2 an inf in one rank's gradient shard skips the step on every rank
(``macroarch.optim.functional.agree``), for ``CompensatedAdamW`` (with and without the norm loss scale, whose norm
is the whole gradient's) and ``MVASAdamW`` on packed weights (``macroarch.mvas.interop.fsdp.fully_shard``).

2 gloo ranks in one launch (``macroarch.comm.launch``); the functions without ``test_`` run on the ranks and
return what they saw, the tests assert on it here. Without the agreement, rank 0 (finite shard) would step and
rank 1 skip: the checks "unchanged on both" and "the same step count on both" fail.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from macroarch.comm import launch

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.distributed


# ------------------------------------------------------------------------------------------ on the ranks
def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every byte a step could change on this rank: local weight shards (packed payload and scales for managed
    weights) and every state tensor (step counters included)."""
    out = []
    for p in model.parameters():
        shard = p.to_local()
        out += [shard.payload.clone(), shard.scales.clone()] if hasattr(shard, "payload") else [shard.clone()]
        out += [v.clone() for _, v in sorted(opt.state[p].items()) if torch.is_tensor(v)]
    return out


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x.view(torch.uint8) if x.dim() else x, y.view(
        torch.uint8) if y.dim() else y) for x, y in zip(a, b))


def _scenario(model: nn.Module, opt, x: torch.Tensor, poison: str, scaled: bool = False) -> dict:
    """One finite step (so that moments exist), then a step poisoned on rank 1 only (``"grad"``: an inf in its
    gradient shard; ``"loss"``: its closure returns NaN), then a finite step."""
    import torch.distributed as dist

    rank = dist.get_rank()

    def backward():
        loss = model(x).square().mean()
        (opt.scale_loss(loss) if scaled else loss).backward()
        return loss

    def counters():
        return [float(opt.state[p]["step"]) for p in model.parameters()]

    backward()
    opt.step()
    opt.zero_grad()
    before = _snapshot(model, opt)
    backward()
    closure = None
    if poison == "grad" and rank == 1:
        next(iter(model.parameters())).grad.to_local().view(-1)[0] = float("inf")
    elif poison == "loss":
        closure = (lambda: torch.tensor(float("nan"))) if rank == 1 else (lambda: torch.tensor(1.0))
    opt.step(closure)
    opt.zero_grad()
    after_skip = _snapshot(model, opt)
    result = {"unchanged": _same(before, after_skip), "skipped": bool(opt.step_was_skipped),
              "skipped_nonfinite": int(opt.skipped_nonfinite), "steps_after_skip": counters()}
    if scaled:
        result["overflows"] = opt.grad_scaler.overflows
        # a finite step: the scaler records the whole gradient's norm (from the full tensors, on every rank)
        backward()
        grads_norm = torch.linalg.vector_norm(torch.cat([p.grad.full_tensor().reshape(-1)
                                                         for p in model.parameters()])).item()
        grads_norm /= opt.grad_scaler.applied_scale
        opt.step()
        result["recorded_norm"], result["full_norm"] = opt.grad_scaler._norms[-1], grads_norm
    else:
        backward()
        opt.step()
    opt.zero_grad()
    result["changed_after"] = not _same(after_skip, _snapshot(model, opt))
    result["steps_after"] = counters()
    result["skipped_after"] = bool(opt.step_was_skipped)
    return result


def _dense_model() -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    for module in (model[0], model[2], model):
        fully_shard(module)
    return model


def _packed_model() -> nn.Module:
    from macroarch.mvas import apply, plan_from_rules
    from macroarch.mvas.interop import fsdp as mvas_fsdp

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    apply(model, plan_from_rules(model, [("*.weight", "fp8")], block_size=16, min_numel=0))
    for module in (model[0], model[2], model):
        mvas_fsdp.fully_shard(module)
    return model


def rank_checks() -> dict:
    import torch.distributed as dist

    from macroarch.mvas import MVASAdamW
    from macroarch.optim import CompensatedAdamW

    rank = dist.get_rank()
    x16 = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    x32 = torch.randn(4, 32, generator=torch.Generator().manual_seed(rank))
    out = {}
    model = _dense_model()
    out["compensated"] = _scenario(model, CompensatedAdamW(model.parameters(), lr=1e-2), x16, "grad")
    model = _dense_model()
    out["compensated_loss"] = _scenario(model, CompensatedAdamW(model.parameters(), lr=1e-2), x16, "loss")
    model = _dense_model()
    opt = CompensatedAdamW(model.parameters(), lr=1e-2, grad_scale="norm", accumulation_steps=1)
    out["compensated_norm"] = _scenario(model, opt, x16, "grad", scaled=True)

    def mvas(model):
        return MVASAdamW(model.parameters(), lr=1e-2, rounding="nearest", min_state_numel=0, state_block_size=128,
                         seed=0, compile=False)

    model = _packed_model()
    out["mvas"] = _scenario(model, mvas(model), x32, "grad")
    model = _packed_model()
    out["mvas_loss"] = _scenario(model, mvas(model), x32, "loss")
    return out


# ----------------------------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def ranks():
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    return [o.result for o in launch("test_distributed_skip:rank_checks", 2, timeout=120, pg_timeout=60, env=env)]


@pytest.mark.parametrize("case", ["compensated", "compensated_loss", "compensated_norm", "mvas", "mvas_loss"])
def test_a_nonfinite_value_on_one_rank_skips_the_step_on_both(ranks, case):
    for rank, r in enumerate(ranks):
        c = r[case]
        # weights (packed bytes for MVAS), moments and step counters bitwise unchanged, on the finite rank too
        assert c["unchanged"] and c["skipped"] and c["skipped_nonfinite"] == 1, (rank, c)
        assert set(c["steps_after_skip"]) == {1.0}, (rank, c)
        # and the next, finite step proceeds on both
        assert c["changed_after"] and not c["skipped_after"] and set(c["steps_after"]) == {2.0}, (rank, c)


def test_the_loss_scale_uses_the_whole_gradients_norm_on_every_rank(ranks):
    first, second = (r["compensated_norm"] for r in ranks)
    for c in (first, second):
        assert c["overflows"] == 1  # the skip backed the scale off on both ranks
        assert c["recorded_norm"] == pytest.approx(c["full_norm"], rel=1e-5)
    assert first["recorded_norm"] == second["recorded_norm"]  # the same number, so the same scale, on both
