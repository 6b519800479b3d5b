"""DGR and CompensatedAdamW under DDP and FSDP2 on 2 gloo ranks, launched with torchrun's environment.

The functions without ``test_`` run on the launched ranks (``macroarch.comm.launch`` imports this module
there); they return numbers, and the tests assert on them here, so a failure shows what was measured.

References: DDP with a plain optimizer step (``torch.optim.AdamW`` / ``CompensatedAdamW``), FSDP2 with a plain
step, and one process training on the global batch.
"""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from macroarch.comm import launch
from macroarch.measure.workload import Workload, lm_loss
from macroarch.models import HCTransformerLM, find_repeated_layers

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.distributed

VOCAB, SEQ, BATCH = 64, 8, 2
STEPS = 3
LR = 1e-2


def tiny_lm() -> nn.Module:
    """A 3-layer GPT-style LM with tied input/output embeddings (macroarch's own: no transformers import, which
    costs each launched rank seconds)."""
    torch.manual_seed(0)
    model = HCTransformerLM(VOCAB, d_model=32, n_layers=3, n_heads=2, max_seq_len=SEQ)
    model.head.weight = model.wte.weight
    return model


def token_batches(rank: int, count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + rank)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator) for _ in range(count)]


def _run(target: str, world_size: int = 2, check: bool = True, pg_timeout: float = 30, **kwargs):
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    return launch(f"test_distributed:{target}", world_size, kwargs=kwargs, timeout=120, pg_timeout=pg_timeout,
                  env=env, check=check)


# ------------------------------------------------------------------------------------------ on the ranks
def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    return max((full(x).detach() - full(y).detach()).abs().max().item() for x, y in zip(a, b))


def _train(model_call, optimizer, batches, after_backward=None) -> None:
    for ids in batches:
        lm_loss(model_call, ids).backward()
        if after_backward is not None:
            after_backward()
        optimizer.step()
        optimizer.zero_grad()


def _wrapper(model: nn.Module, ids: torch.Tensor):
    from macroarch.dgr import DGRWrapper

    return DGRWrapper(copy.deepcopy(model), group_size=1, example_inputs={"input_ids": ids, "labels": ids})


def _ddp_dgr(model, batches, optimizer_cls, ddp_kwargs) -> dict:
    """DDP + plain step vs DDP + DGR-sync (groups stepped from the comm hook) with the same DDP settings."""
    from macroarch.dgr.distributed import data_parallel

    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(model), **ddp_kwargs)
    ref_opt = optimizer_cls(ref.parameters(), lr=LR)
    _train(ref, ref_opt, batches)
    run = data_parallel(_wrapper(model, batches[0]), optimizer_cls, ddp_kwargs=ddp_kwargs, lr=LR)
    inside = []  # per group step: (in a backward pass, buckets all-reduced by then)
    passes = [0]  # buckets all-reduced by the end of each backward pass
    for inner in run.optimizer._inner:
        step = inner.step

        def recorded(*args, step=step, **kwargs):
            inside.append((torch._C._current_graph_task_id() != -1, run.ddp_steps.buckets_reduced))
            return step(*args, **kwargs)

        inner.step = recorded
    _train(run.model, run.optimizer, batches, lambda: passes.append(run.ddp_steps.buckets_reduced))
    return {"vs_ddp": _max_diff(list(run.wrapper.module.parameters()), list(ref.module.parameters())),
            "moved": _max_diff(list(model.parameters()), list(ref.module.parameters())),
            "groups": len(run.wrapper.grouping), "buckets_reduced": run.ddp_steps.buckets_reduced,
            "inside": inside, "passes": passes}


def _naive_ddp_dgr(model, batches) -> float:
    """The wrong way, for contrast: DGR's own hooks under DDP step on this rank's unreduced gradients."""
    ref = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    _train(ref, ref_opt, batches)
    wrapper = _wrapper(model, batches[0])
    ddp = nn.parallel.DistributedDataParallel(wrapper)
    _train(ddp, wrapper.optimizer(torch.optim.AdamW, lr=LR), batches)
    return _max_diff(list(wrapper.module.parameters()), list(ref.module.parameters()))


def _fsdp_dgr(model, batches, optimizer_cls) -> dict:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from macroarch.dgr.distributed import fully_shard_groups

    ref = copy.deepcopy(model)
    for _, block in find_repeated_layers(ref):
        fully_shard(block)
    fully_shard(ref)
    _train(ref, optimizer_cls(ref.parameters(), lr=LR), batches)
    run = fully_shard_groups(_wrapper(model, batches[0]), optimizer_cls, lr=LR)
    inside = []
    for inner in run.optimizer._inner:
        step = inner.step

        def recorded(*args, step=step, **kwargs):
            inside.append(torch._C._current_graph_task_id() != -1)
            return step(*args, **kwargs)

        inner.step = recorded
    _train(run.model, run.optimizer, batches)
    params = list(run.wrapper.module.parameters())
    return {"vs_fsdp": _max_diff(params, list(ref.parameters())), "groups": len(run.wrapper.grouping),
            "sharded": all(isinstance(p, DTensor) for p in params),
            "local_fraction": sum(p.to_local().numel() for p in params) / sum(p.numel() for p in params),
            "inside": inside}


def _compensated_global_batch(model, rank: int, world: int) -> dict:
    """CompensatedAdamW (2 accumulation steps, the 2^5/max_grad_norm loss scale, weight decay) under DDP vs one
    process with the same optimizer on the global batch: every micro-batch is the ranks' batches concatenated."""
    from macroarch.optim import CompensatedAdamW

    kwargs = dict(lr=LR, weight_decay=0.1, accumulation_steps=2, grad_scale="norm")
    micro = [token_batches(r, 2 * STEPS) for r in range(world)]  # every rank draws every rank's batches
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    opt = CompensatedAdamW(ddp.parameters(), **kwargs)
    single = copy.deepcopy(model)
    single_opt = CompensatedAdamW(single.parameters(), **kwargs)
    for i in range(2 * STEPS):  # DDP reduces every micro-batch: the optimizer accumulates the averages
        opt.scale_loss(lm_loss(ddp, micro[rank][i])).backward()
        opt.step()
        opt.zero_grad()
        opt_loss = lm_loss(single, torch.cat([m[i] for m in micro]))
        single_opt.scale_loss(opt_loss).backward()
        single_opt.step()
        single_opt.zero_grad()
    return {"vs_single": _max_diff(list(ddp.module.parameters()), list(single.parameters())),
            "moved": _max_diff(list(model.parameters()), list(single.parameters())),
            "updates": [opt.stats["updates"], single_opt.stats["updates"]],
            "scales": [opt.grad_scaler.applied_scale, single_opt.grad_scaler.applied_scale]}


def _global_batch_run(model, rank: int, world: int, mode: str, delays: int | None, distribute) -> dict:
    """DGR (``mode``, ``delays``) across the ranks, built by ``distribute(wrapper)`` (``data_parallel`` or
    ``fully_shard_groups``), vs one process running the same DGR on the global batch (every rank's batches
    concatenated): the engines' averaged gradients are the global batch's up to summation order, so the two agree
    to rounding, and every replica holds the same weights."""
    from macroarch.dgr import DGRWrapper

    batches = [token_batches(r, STEPS + 2) for r in range(world)]
    example = {"input_ids": batches[rank][0], "labels": batches[rank][0]}
    run = distribute(DGRWrapper(copy.deepcopy(model), group_size=1, mode=mode, delays=delays, example_inputs=example))
    _train(run.model, run.optimizer, batches[rank])
    single = DGRWrapper(copy.deepcopy(model), group_size=1, mode=mode, delays=delays, example_inputs=example)
    _train(single, single.optimizer(torch.optim.AdamW, lr=LR), [torch.cat(b) for b in zip(*batches)])
    params = list(run.wrapper.module.parameters())
    mine = torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1) for p in params])
    replicas = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(replicas, mine)
    return {"vs_single": _max_diff(params, list(single.module.parameters())),
            "moved": _max_diff(list(model.parameters()), list(single.module.parameters())),
            "replicas_differ": max((r - replicas[0]).abs().max().item() for r in replicas)}


def _ddp_interleaved(model, rank: int, world: int, ddp_kwargs: dict) -> dict:
    """DDP + DGR, sync (the rounding reference) and interleaved (each group applies its gradient of one step ago),
    against one process on the global batch (``_global_batch_run``)."""
    from macroarch.dgr.distributed import data_parallel

    distribute = lambda w: data_parallel(w, torch.optim.AdamW, ddp_kwargs=ddp_kwargs, lr=LR)  # noqa: E731
    return {mode: _global_batch_run(model, rank, world, mode, delays, distribute)
            for mode, delays in (("sync", None), ("interleaved", 1))}


def _fsdp_interleaved(model, rank: int, world: int) -> dict:
    """FSDP2 + DGR in interleaved mode against one process on the global batch (``_global_batch_run``)."""
    from macroarch.dgr.distributed import fully_shard_groups

    return _global_batch_run(model, rank, world, "interleaved", 1,
                             lambda w: fully_shard_groups(w, torch.optim.AdamW, lr=LR))


def equalities() -> dict:
    """Every equality check in one launch (each launch costs seconds of start-up per rank)."""
    from macroarch.optim import CompensatedAdamW

    rank, world = dist.get_rank(), dist.get_world_size()
    model = tiny_lm()
    data = token_batches(rank, STEPS)
    return {
        "ddp_adamw": _ddp_dgr(model, data, torch.optim.AdamW, {}),
        "ddp_adamw_buckets": _ddp_dgr(model, data, torch.optim.AdamW,
                                      {"bucket_cap_mb": 0.01, "gradient_as_bucket_view": True}),
        "ddp_compensated": _ddp_dgr(model, data, CompensatedAdamW, {"bucket_cap_mb": 0.01}),
        "naive_vs_ddp": _naive_ddp_dgr(model, data),
        "fsdp_adamw": _fsdp_dgr(model, data, torch.optim.AdamW),
        "compensated_global_batch": _compensated_global_batch(model, rank, world),
        "fsdp_compensated": _fsdp_dgr(model, data, CompensatedAdamW),
        "refusals": _refusals(model, data),
        "ddp_interleaved": _ddp_interleaved(model, rank, world, {}),
        "fsdp_interleaved": _fsdp_interleaved(model, rank, world),
        "ddp_interleaved_bucket_views": _ddp_interleaved(model, rank, world, {"bucket_cap_mb": 0.01,
                                                                              "gradient_as_bucket_view": True}),
    }


def _refusals(model, data) -> dict:
    """What the entry points refuse, each error message as raised."""
    from macroarch.dgr import DGRWrapper
    from macroarch.dgr.distributed import data_parallel, fully_shard_groups, regroup

    out = {}
    example = {"input_ids": data[0], "labels": data[0]}
    attempts = {
        "accumulation": lambda: data_parallel(DGRWrapper(copy.deepcopy(model), group_size=1, accumulation_steps=2,
                                                         example_inputs=example), torch.optim.AdamW),
        "no_groups": lambda: fully_shard_groups(DGRWrapper(copy.deepcopy(model), group_size=1), torch.optim.AdamW),
        "has_optimizer": lambda: data_parallel(_with_optimizer(model, example), torch.optim.AdamW),
        "regroup_other_model": lambda: regroup(_wrapper(model, data[0]).grouping, nn.Linear(2, 2)),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
            out[name] = None
        except ValueError as exc:
            out[name] = str(exc)
    return out


def _with_optimizer(model, example):
    from macroarch.dgr import DGRWrapper

    wrapper = DGRWrapper(copy.deepcopy(model), group_size=1, example_inputs=example)
    wrapper.optimizer(torch.optim.AdamW, lr=LR)
    return wrapper


def rank_dies(strategy: str, die_at_step: int) -> dict | None:
    """Rank 1 exits (``os._exit``) in the middle of a backward pass; rank 0 reports what it saw and when."""
    from macroarch.dgr import DGRWrapper
    from macroarch.dgr.distributed import data_parallel, fully_shard_groups

    w = Workload(d_model=16, n_layers=4)
    rank = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    batches = w.mlp_batches(rank, die_at_step + 1)
    wrapper = DGRWrapper(w.mlp(), group_size=1, example_inputs=batches[0])
    if strategy == "ddp":
        run = data_parallel(wrapper, torch.optim.AdamW, ddp_kwargs={"bucket_cap_mb": 0.001}, lr=LR)
    else:
        run = fully_shard_groups(wrapper, torch.optim.AdamW, lr=LR)
    dying = []

    def die_in_backward(module, args, output):  # on the activation: FSDP2's parameters are not autograd leaves
        if dying:
            output.register_hook(lambda grad: os._exit(1))  # a crash halfway through backward: no clean-up

    wrapper.module[len(wrapper.module) // 2].register_forward_hook(die_in_backward)
    for step, x in enumerate(batches):
        if rank == 1 and step == die_at_step:
            dying.append(True)
        start = time.perf_counter()
        try:
            run.model(x).square().mean().backward()
            run.optimizer.step()
            run.optimizer.zero_grad()
        except Exception as exc:
            store.set("survivor_done", "1")
            return {"steps_done": step, "error_type": type(exc).__name__, "error": str(exc)[:1000],
                    "seconds_to_error": time.perf_counter() - start}
    return {"steps_done": len(batches), "error_type": None, "error": None, "seconds_to_error": None}


# ----------------------------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def ranks():
    return [o.result for o in _run("equalities")]


def test_ddp_with_dgr_sync_equals_ddp_bitwise(ranks):
    # Same averages (DDP's divide-then-sum, elementwise) and AdamW's per-element math: bitwise, whatever the
    # bucket layout. The reference differs from the start by > 1e-3, so equality is not trivial.
    for r in ranks:
        for key in ("ddp_adamw", "ddp_adamw_buckets", "ddp_compensated"):
            assert r[key]["vs_ddp"] == 0.0, key
            assert r[key]["moved"] > 1e-3
        assert r["naive_vs_ddp"] > 1e-4  # DGR's own hooks under DDP step on local gradients: not DDP
    # One bucket (DDP's default 25 MiB): every group steps at the end of backward, once it is reduced.
    one = ranks[0]["ddp_adamw"]
    assert one["passes"] == list(range(STEPS + 1)) and len(one["inside"]) == STEPS * one["groups"]
    assert all(inside for inside, _ in one["inside"])
    assert [reduced for _, reduced in one["inside"]] == [k + 1 for k in range(STEPS) for _ in range(one["groups"])]
    # Many buckets: each group steps inside backward as soon as its buckets are reduced, the first while
    # buckets of the pass are still to come (DDP's first pass uses one large bucket; it re-buckets after).
    many = ranks[0]["ddp_adamw_buckets"]
    passes, groups = many["passes"], many["groups"]
    assert all(inside for inside, _ in many["inside"]) and len(many["inside"]) == STEPS * groups
    for k in range(1, STEPS):
        reduced = [n for _, n in many["inside"][k * groups:(k + 1) * groups]]
        assert passes[k + 1] - passes[k] > groups  # more buckets than groups in this pass
        assert passes[k] < reduced[0] < passes[k + 1] and reduced == sorted(reduced)
        assert reduced[-1] == passes[k + 1]


def test_interleaved_dgr_under_ddp_and_fsdp2_matches_one_process_on_the_global_batch(ranks):
    # interleaved DGR queues each group's gradient for ``delays`` steps: under DDP the queued gradient must be the
    # averaged one, and must survive DDP reusing its buckets (gradient_as_bucket_view) for the next pass
    for r in ranks:
        for key in ("ddp_interleaved", "ddp_interleaved_bucket_views"):
            sync, interleaved = r[key]["sync"], r[key]["interleaved"]
            assert interleaved["moved"] > 1e-2, key
            # DDP's average and the global batch's gradient differ by summation order, which Adam's normalised
            # steps amplify to ~1e-4 after a few steps (the sync row measures it); a queued gradient overwritten by
            # the next pass moved the weights by 0.045, more than training did
            assert sync["vs_single"] < 1e-3 and interleaved["vs_single"] < 1e-3, (key, r[key])
            assert sync["replicas_differ"] == 0.0 and interleaved["replicas_differ"] == 0.0, key
        # FSDP2: each rank updates its shard from the reduce-scattered average; the same comparison
        fsdp = r["fsdp_interleaved"]
        assert fsdp["moved"] > 1e-2 and fsdp["vs_single"] < 1e-3, fsdp


def test_fsdp2_with_dgr_sync_equals_fsdp2_bitwise(ranks):
    for r in ranks:
        f = r["fsdp_adamw"]
        assert f["sharded"] and 0.45 < f["local_fraction"] < 0.6  # each rank holds about half of every tensor
        assert f["vs_fsdp"] == 0.0  # the same reduce-scatter outputs, the same per-element AdamW
        assert len(f["inside"]) == STEPS * f["groups"] and all(f["inside"])  # each group steps within backward


def test_compensated_adamw_per_group_under_fsdp2_equals_fsdp2(ranks):
    for r in ranks:
        assert r["fsdp_compensated"]["vs_fsdp"] == 0.0 and all(r["fsdp_compensated"]["inside"])


def test_what_cannot_work_across_processes_is_refused_with_a_reason(ranks):
    e = ranks[0]["refusals"]
    assert "accumulation_steps=2" in e["accumulation"]
    assert "no groups yet" in e["no_groups"]
    assert "already has an optimizer" in e["has_optimizer"]
    assert "not parameters of Linear" in e["regroup_other_model"]


def test_compensated_adamw_under_ddp_equals_one_process_on_the_global_batch(ranks):
    for r in ranks:
        c = r["compensated_global_batch"]
        assert c["updates"] == [STEPS, STEPS]
        # Not bitwise: the mean over 2 x 14 tokens is summed in another order than the mean of two means of
        # 14, so gradients differ in their last bits (~1e-7 relative), the loss scale (from the gradient norm)
        # too, and Adam's m / sqrt(v) carries that into the update, most where an element's gradient is near
        # zero. Bound: 1e-4 after 3 updates of lr=1e-2 (1% of one step; the weights moved by > 1e-3).
        assert c["moved"] > 1e-3
        assert c["vs_single"] <= 1e-4, c
        assert abs(c["scales"][0] / c["scales"][1] - 1) < 1e-5


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_a_rank_that_dies_mid_step_makes_the_other_fail_quickly(strategy):
    pg_timeout = 20.0
    start = time.monotonic()
    outcomes = _run("rank_dies", check=False, pg_timeout=pg_timeout, strategy=strategy, die_at_step=2)
    wall = time.monotonic() - start
    survivor, dead = outcomes
    assert dead.returncode == 1 and dead.result is None
    r = survivor.result
    assert r is not None, survivor.log
    assert r["steps_done"] == 2 and r["error_type"] is not None
    if strategy == "ddp":
        assert "all-reduce of bucket" in r["error"] and "rank 0 of 2" in r["error"], r["error"]
    assert r["seconds_to_error"] < pg_timeout  # an error, within the process group's timeout: no hang
    assert wall < pg_timeout + 30  # the whole launch, start-up included
