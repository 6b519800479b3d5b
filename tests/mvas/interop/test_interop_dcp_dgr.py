"""DGR through ``macroarch.mvas.interop.dcp``: DGR + MVAS (``MVASAdamW``, fp8 moments, stochastic rounding) and
DGR + ``CompensatedAdamW`` with bf16 weights and fp32 master copies, stopped at step k and resumed, equal the run
that was never stopped, bit for bit: weights (packed payloads and scales, dense tensors), every optimizer state
tensor in its stored dtype and bytes, step counters, the param groups with their scheduled learning rates, the
LR scheduler, and the stochastic-rounding stream (the resumed steps round as the uninterrupted ones did).

In one process for both DGR modes; and across world sizes as ``test_interop_dcp`` does for MVAS alone: saved on 2
gloo ranks under FSDP2 (``fully_shard_groups``), loaded by one process (the shards' bytes, concatenated), saved
again, loaded on 2 ranks (each rank's bytes as it saved them) and continued: the 2-rank run never stopped. The
resumed runs are built from other weights and seeds: only the checkpoint can make them match."""

import copy
import functools
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from macroarch import mvas
from macroarch.comm import launch
from macroarch.dgr import DGRWrapper, GradientCompensator
from macroarch.mvas.interop import dcp as mvas_dcp
from macroarch.optim import CompensatedAdamW

HERE = Path(__file__).resolve().parent
STOP, MORE = 3, 3
KINDS = ["mvas", "master"]


class Net(nn.Module):
    """Three residual blocks (DGR's repeated stack) between an input and an output layer; every dim 0 even, so that
    FSDP2's dim-0 shards of the packed weights are whole blocks on 2 ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(48, 96)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(96), nn.Linear(96, 96), nn.GELU()) for _ in range(3))
        self.out = nn.Linear(96, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = x + layer(x)
        return self.out(x)


def _batches(n, seed=0):
    g = torch.Generator().manual_seed(123 + seed)
    return [(torch.randn(6, 48, generator=g), torch.randint(0, 6, (6,), generator=g)) for _ in range(n)]


def _model(seed, kind):
    torch.manual_seed(seed)
    model = Net()
    if kind == "mvas":
        mvas.apply(model, mvas.plan_from_rules(model, [("layers.1.*", "fp4"), ("*.weight", "fp8_e5m2"),
                                                       ("*", "fp8")], block_size=16, min_numel=512))
    else:
        model.to(torch.bfloat16)
    return model


def _optimizer_cls(kind):
    """The per-group optimizer and its settings; MVASAdamW's and CompensatedAdamW's seeds are drawn from the global
    generator (another build seed, another stream). Moments of 1024+ elements are fp8 on one rank and on two."""
    if kind == "mvas":
        return mvas.MVASAdamW, {"lr": 3e-3, "weight_decay": 0.01, "min_state_numel": 1024}
    return CompensatedAdamW, {"lr": 3e-3, "master_weights": True}


def _wrapper(model, mode):
    x0 = _batches(1)[0][0].to(next(model.parameters()).dtype)
    compensator = GradientCompensator(adaptive=True) if mode == "interleaved" else None
    return DGRWrapper(model, group_size=1, mode=mode, compensator=compensator, example_inputs=x0)


def _build(seed, kind, mode="sync"):
    model = _model(seed, kind)
    net = _wrapper(model, mode)
    cls, kwargs = _optimizer_cls(kind)
    opt = net.optimizer(cls, **kwargs)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=STOP + MORE + 2)
    return model, net, opt, sched


def _train(net, opt, sched, batches):
    dtype = next(net.parameters()).dtype
    for x, y in batches:
        nn.functional.cross_entropy(net(x.to(dtype)).float(), y).backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()


def _local(t):
    return getattr(t, "_local_tensor", t)


def _bits(t):
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()).hex() if t.numel() else ""


def _flat(obj, prefix=""):
    """Every leaf of a (nested) state: a tensor as (dtype, shape, bytes), anything else as its repr."""
    if torch.is_tensor(obj):
        t = _local(obj)
        return {prefix: [str(t.dtype), list(t.shape), _bits(t)]}
    if isinstance(obj, dict):
        return {k: v for key, value in obj.items() for k, v in _flat(value, f"{prefix}.{key}").items()}
    if isinstance(obj, list | tuple):
        return {k: v for i, value in enumerate(obj) for k, v in _flat(value, f"{prefix}[{i}]").items()}
    return {prefix: repr(obj)}


def everything(model, opt):
    """This process's bytes of every weight (a packed one's payload and scales apart), every optimizer state tensor
    (dtype, shape, bytes) keyed by parameter name, and the optimizer's other state (param groups, seeds, DGR's)."""
    out = {}
    names = {id(p): n for n, p in model.named_parameters()}
    for name, p in model.named_parameters():
        w = _local(p)
        if isinstance(w, mvas.MVASWeight):
            out[f"{name}:payload"], out[f"{name}:scales"] = _flat(w.payload)[""], _flat(w.scales)[""]
        else:
            out[name] = _flat(w)[""]
    for p, state in opt.state.items():
        for key, v in state.items():
            out.update(_flat(v, f"{names[id(p)]}.{key}"))
    out.update(_flat(mvas_dcp.optimizer_extras(opt), "extras"))
    return out


def _moment_dtypes(opt):
    return sorted({str(v.dtype) for s in opt.state.values() for k, v in s.items()
                   if torch.is_tensor(v) and k in ("exp_avg", "exp_avg_sq", "master")})


# ---------------------------------------------------------------------------------------------- one process
@pytest.mark.parametrize("mode", ["sync", "interleaved"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_dgr_run_resumed_from_dcp_is_the_uninterrupted_one(tmp_path, kind, mode):
    batches = _batches(STOP + MORE)
    model, net, opt, sched = _build(0, kind, mode)
    _train(net, opt, sched, batches[:STOP])
    mvas_dcp.save(tmp_path / "ckpt", model, opt)
    saved, sched_state = everything(model, opt), copy.deepcopy(sched.state_dict())
    _train(net, opt, sched, batches[STOP:])

    model2, net2, opt2, sched2 = _build(7, kind, mode)
    assert everything(model2, opt2) != saved
    mvas_dcp.load(tmp_path / "ckpt", model2, opt2)
    assert everything(model2, opt2) == saved  # moments in their stored dtype and bytes, counters, seeds, groups
    assert _moment_dtypes(opt2) == (["torch.float32", "torch.float8_e4m3fn"] if kind == "mvas" else
                                    ["torch.float32"])
    sched2.load_state_dict(sched_state)  # the scheduler is the caller's, as with torch's own loops
    _train(net2, opt2, sched2, batches[STOP:])
    assert everything(model2, opt2) == everything(model, opt)
    assert sched2.state_dict() == sched.state_dict()


# ------------------------------------------------------------------------------------------ 2 ranks -> 1 -> 2
def _sharded(seed, kind):
    from macroarch.dgr.distributed import fully_shard_groups, shard_blocks
    from macroarch.mvas.interop.fsdp import fully_shard as packed

    model = _model(seed, kind)
    net = _wrapper(model, "sync")
    shard = functools.partial(shard_blocks, blocks=[n for stack in net.grouping.stacks for n in stack],
                              shard=packed if kind == "mvas" else None)
    cls, kwargs = _optimizer_cls(kind)
    run = fully_shard_groups(net, cls, shard=shard, **kwargs)
    return model, run.model, run.optimizer


def rank_save(path, kind):
    """Train STOP steps on 2 ranks (each its own batches), save, train MORE: this rank's state at STOP, at the end."""
    import torch.distributed as dist

    model, net, opt = _sharded(0, kind)
    batches = _batches(STOP + MORE, seed=dist.get_rank())
    _train(net, opt, None, batches[:STOP])
    mvas_dcp.save(path, model, opt)
    at_stop = everything(model, opt)
    _train(net, opt, None, batches[STOP:])
    return {"stop": at_stop, "end": everything(model, opt), "dtypes": _moment_dtypes(opt)}


def rank_resume(path, kind):
    """Build from other weights and seeds on 2 ranks, load, train the last MORE steps."""
    import torch.distributed as dist

    model, net, opt = _sharded(5, kind)
    mvas_dcp.load(path, model, opt)
    loaded = everything(model, opt)
    _train(net, opt, None, _batches(STOP + MORE, seed=dist.get_rank())[STOP:])
    return {"stop": loaded, "end": everything(model, opt), "dtypes": _moment_dtypes(opt)}


def _run(target, **kwargs):
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    outcomes = launch(f"test_interop_dcp_dgr:{target}", 2, kwargs=kwargs, timeout=240, pg_timeout=120, env=env)
    return [o.result for o in outcomes]


def _whole(key, ranks):
    """The whole tensor's entry from the two ranks' shards (dim 0: flat payloads and scales, dense tensors and
    moments), or the replicated value (step counters, scalars, non-tensor state)."""
    first, second = ranks[0][key], ranks[1][key]
    if not isinstance(first, list) or first[1] == []:  # not a tensor, or a 0-d one: every rank holds it alike
        assert first == second, key
        return first
    shape = [first[1][0] + second[1][0], *first[1][1:]]
    return [first[0], shape, first[2] + second[2]]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_two_ranks_to_one_and_back_resume_exactly(tmp_path, kind):
    two, one = str(tmp_path / "two"), str(tmp_path / "one")
    saved = _run("rank_save", path=two, kind=kind)
    assert saved[0]["stop"] != saved[1]["stop"]  # each rank its own shard

    # 2 -> 1: this process, no process group, an unsharded model and optimizer
    model, _, opt, _ = _build(2, kind)
    mvas_dcp.load(two, model, opt)
    here = everything(model, opt)
    assert here.keys() == saved[0]["stop"].keys()
    for key, value in here.items():
        if isinstance(value, str) and not key.startswith("extras"):
            continue  # a per-parameter fact of this layout (MVASAdamW's "numel": the shard's), not saved state
        assert value == _whole(key, [r["stop"] for r in saved]), key
    mvas_dcp.save(one, model, opt)

    # 1 -> 2: each rank's bytes as it saved them, and the last MORE steps as the run that never stopped
    resumed = _run("rank_resume", path=one, kind=kind)
    for rank in range(2):
        assert resumed[rank]["stop"] == saved[rank]["stop"], rank
        assert resumed[rank]["dtypes"] == saved[rank]["dtypes"]
        assert resumed[rank]["end"] == saved[rank]["end"], rank
