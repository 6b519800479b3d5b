"""Functions the distributed tests run on every launched rank (``macroarch.comm.launch``); they return numbers
and the tests assert on them in the parent, so a failure shows what was measured."""

from __future__ import annotations

import copy
import os
import time

import torch
import torch.distributed as dist
from torch import nn

from macroarch.comm import GradientBucketer
from macroarch.measure.workload import Workload, flat_grads, lm_loss

TINY = Workload(d_model=32, n_layers=2, n_heads=2, seq_len=8, batch_size=2)


def _explicit_average(model: nn.Module, loss) -> torch.Tensor:
    """The reference: each gradient all-reduced on its own, divided by the world size."""
    reference = copy.deepcopy(model)
    loss(reference).backward()
    for p in reference.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    return flat_grads(list(reference.parameters()))


class _MixedDtypes(nn.Module):
    """fp32 and fp64 parameters: two flat buffers, buckets of both kinds."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(16, 64)
        self.b = nn.Linear(64, 4).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)).double()).float()


def all_checks(equality_kwargs: dict, dgr_kwargs: dict, window_kwargs: dict) -> dict:
    """One launch for the checks that share two ranks (each launch costs seconds of start-up)."""
    return {"equality": equality(**equality_kwargs), "dgr": dgr(**dgr_kwargs), "window": window(**window_kwargs)}


def equality(bucket_mbs: list[float]) -> dict:
    rank = dist.get_rank()
    model = TINY.model()
    ids = TINY.batches(rank, 1)[0]
    reference = _explicit_average(model, lambda m: lm_loss(m, ids))
    ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    lm_loss(ddp, ids).backward()
    ddp_grads = flat_grads(list(ddp.module.parameters()))
    out = environment() | {"ddp_vs_reference": (ddp_grads - reference).abs().max().item(),
                           "reference_norm": reference.norm().item(), "sizes": {}, "vs_ddp": {}, "vs_reference": {},
                           "collectives": {}, "straddling": {}}
    for mb in bucket_mbs:
        m = copy.deepcopy(model)
        bucketer = GradientBucketer(m, bucket_mb=mb, timeout=30)
        lm_loss(m, ids).backward()
        assert bucketer.wait() is True
        grads = flat_grads(list(m.parameters()))
        key = str(mb)
        out["sizes"][key] = bucketer.bucket_bytes
        out["vs_ddp"][key] = (grads - ddp_grads).abs().max().item()
        out["vs_reference"][key] = (grads - reference).abs().max().item()
        out["collectives"][key] = bucketer.collectives
        out["straddling"][key] = sum(len(pieces) > 1 for pieces in bucketer._pieces)
        out["grads_are_bucket_views"] = all(p.grad.data_ptr() == v.data_ptr() for p, v in zip(bucketer.params,
                                                                                             bucketer._views))

    # Mixed dtypes: one flat buffer per dtype.
    mixed = _MixedDtypes()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    reference = _explicit_average(mixed, lambda m: m(x).square().mean())
    bucketer = GradientBucketer(mixed, bucket_mb=0.001, timeout=30)
    mixed(x).square().mean().backward()
    bucketer.wait()
    out["mixed_vs_reference"] = (flat_grads(list(mixed.parameters())) - reference).abs().max().item()
    out["mixed_dtypes"] = sorted({str(b.dtype) for b in bucketer.buckets})

    # Accumulation: no_sync for the first micro-steps, as with DDP.
    batches = TINY.batches(rank, 3)
    m, d = copy.deepcopy(model), torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    bucketer = GradientBucketer(m, bucket_mb=0.01, timeout=30)
    for i, ids in enumerate(batches):
        last = i == len(batches) - 1
        with bucketer.no_sync() if not last else _nothing():
            lm_loss(m, ids).backward()
        with d.no_sync() if not last else _nothing():
            lm_loss(d, ids).backward()
        out.setdefault("no_sync_waits", []).append(bucketer.wait())
    out["no_sync_vs_ddp"] = (flat_grads(list(m.parameters())) - flat_grads(list(d.module.parameters()))).abs().max()
    out["no_sync_vs_ddp"] = out["no_sync_vs_ddp"].item()
    out["no_sync_collectives"] = bucketer.collectives
    out["no_sync_buckets"] = len(bucketer.buckets)
    return out


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def dgr(steps: int, bucket_mb: float) -> dict:
    """DGR-sync (updates inside backward) on bucketed averages vs DDP + the same optimizer."""
    from macroarch.dgr import DGRWrapper

    rank = dist.get_rank()
    model = TINY.model()
    batches = TINY.batches(rank, steps)
    ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    wrapper = DGRWrapper(copy.deepcopy(model), group_size=1, example_inputs={"input_ids": batches[0],
                                                                            "labels": batches[0]})
    bucketer = GradientBucketer(wrapper, bucket_mb=bucket_mb, timeout=30)
    opt = wrapper.optimizer(torch.optim.AdamW, lr=1e-2)
    early = None
    try:
        GradientBucketer(wrapper, bucket_mb=bucket_mb)
    except ValueError as exc:
        early = str(exc)
    for ids in batches:
        lm_loss(ddp, ids).backward()
        ddp_opt.step()
        ddp_opt.zero_grad()
        lm_loss(wrapper, ids).backward()
        opt.step()
        opt.zero_grad()
    diff = max((a - b).abs().max().item() for a, b in zip(wrapper.module.parameters(), ddp.module.parameters()))
    moved = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ddp.module.parameters()))
    groups = {g.index: {id(p) for p in g.params} for g in wrapper.grouping}
    straddle = sum(len({gi for gi, ids_ in groups.items() for p in _bucket_params(bucketer, b) if id(p) in ids_}) > 1
                   for b in range(len(bucketer.buckets)))
    return {"weights_vs_ddp": diff, "weights_moved": moved, "groups": len(groups), "buckets": len(bucketer.buckets),
            "buckets_straddling_groups": straddle, "second_bucketer_error": early, "reductions": bucketer.reductions}


def _bucket_params(bucketer: GradientBucketer, bucket: int) -> list[torch.Tensor]:
    return [p for p, pieces in zip(bucketer.params, bucketer._pieces) if any(b == bucket for b, _ in pieces)]


def window(window_ms: float, sleep_s: float, micro_steps: int) -> dict:
    """Window mode with a known micro-step time: when it reduces, how often, and what it averages."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = TINY.model()
    local = copy.deepcopy(model)  # accumulates the same micro-batches without communication
    bucketer = GradientBucketer(model, bucket_mb=0.02, window_ms=window_ms, timeout=30)
    synced, ks, errors, ends = [], [], [], []
    in_window = 0
    for ids in TINY.batches(rank, micro_steps):
        k = bucketer.window_steps
        lm_loss(model, ids).backward()
        ends.append(time.perf_counter())  # this rank's own clock: when each backward ended
        lm_loss(local, ids).backward()
        time.sleep(sleep_s)
        in_window += 1
        done = bucketer.wait()
        synced.append(done)
        if done:
            reference = flat_grads(list(local.parameters()))
            dist.all_reduce(reference)
            reference /= world * in_window
            errors.append((flat_grads(list(model.parameters())) - reference).abs().max().item())
            ks.append(k)
            model.zero_grad(set_to_none=True)
            local.zero_grad(set_to_none=True)
            in_window = 0
    return {"synced": synced, "ks": ks, "history": bucketer.window_history, "errors": errors, "backward_ends": ends,
            "window_steps_after": [bucketer.window_steps],
            "collectives": bucketer.collectives, "buckets": len(bucketer.buckets),
            "reductions": bucketer.reductions, "backward_passes": bucketer.backward_passes}


def world_of_one() -> dict:
    model = TINY.model()
    plain = copy.deepcopy(model)
    ids = TINY.batches(0, 1)[0]
    bucketer = GradientBucketer(model, bucket_mb=0.01, timeout=30)
    lm_loss(model, ids).backward()
    lm_loss(plain, ids).backward()
    return {"synced": bucketer.wait(), "collectives": bucketer.collectives, "world_size": bucketer.world_size,
            "diff": (flat_grads(list(model.parameters())) - flat_grads(list(plain.parameters()))).abs().max().item()}


def environment() -> dict:
    return {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                          "MASTER_PORT", "OMP_NUM_THREADS")} | {"threads": torch.get_num_threads()}


def sleep(seconds: float) -> None:
    time.sleep(seconds)


def fail_on_rank_one() -> dict:
    if dist.get_rank() == 1:
        raise ValueError("rank one fails on purpose")
    return {"ok": True}
