"""compose.apply(..., distributed=...): the documented stacks under DDP and FSDP2 on 2 gloo ranks launched as
torchrun launches them, against the same stack in one process on the whole batch; the refusals in-process."""

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from macroarch import compose
from macroarch.comm import launch
from macroarch.config import ConfigError

HERE = Path(__file__).resolve().parent
STEPS, BATCH = 3, 8
DGR = {"dgr": {"group_size": 2}, "optim": {"lr": 1e-2}}
MVAS_DGR = {"dgr": {"group_size": 2}, "optim": {"lr": 1e-2},
            "mvas": {"precision_policy": {"blocks": "fp8"}, "min_numel": 0, "block_size": 16, "master_weights": True}}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4))
        self.head = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def batches() -> list[torch.Tensor]:
    return [torch.randn(BATCH, 32, generator=torch.Generator().manual_seed(10 + s)) for s in range(STEPS)]


def train(config: dict, distributed: str | None) -> tuple[list[float], list[str]]:
    import torch.distributed as dist

    torch.manual_seed(0)
    model = Net()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    first = batches()[0].chunk(world)[rank]
    stack = compose.apply(model, config, loss_fn=lambda m: loss_of(m, first), seed=0, distributed=distributed)
    losses = []
    for x in batches():
        loss = loss_of(stack.model, x.chunk(world)[rank])
        loss.backward()
        stack.optimizer.step()
        stack.optimizer.zero_grad()
        total = loss.detach().clone()
        if distributed:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    kinds = sorted({f"{type(p).__name__}({type(getattr(p, '_local_tensor', p)).__name__})" for p in model.parameters()})
    return losses, kinds


def rank_checks() -> dict:
    refused = ""
    try:
        compose.apply(Net(), MVAS_DGR, loss_fn=lambda m: loss_of(m, batches()[0]), distributed="ddp")
    except ConfigError as e:
        refused = str(e)
    runs = {"ddp_dgr": train(DGR, "ddp"), "one_dgr": train(DGR, None), "fsdp2_mvas_dgr": train(MVAS_DGR, "fsdp2"),
            "one_mvas_dgr": train(MVAS_DGR, None)}
    return {name: losses for name, (losses, _) in runs.items()} | {"refused": refused,
                                                                    "fsdp2_kinds": runs["fsdp2_mvas_dgr"][1]}


@pytest.fixture(scope="module")
def two_ranks():
    env = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    return [o.result for o in launch("test_compose_distributed:rank_checks", 2, timeout=150, pg_timeout=60, env=env)]


@pytest.mark.distributed
def test_ddp_with_dgr_trains_as_one_process_on_the_whole_batch(two_ranks):
    for r in two_ranks:
        # the mean of two half-batch gradients is the whole batch's up to the order of the sums
        torch.testing.assert_close(r["ddp_dgr"], r["one_dgr"], rtol=1e-5, atol=0)
        assert r["ddp_dgr"][-1] < r["ddp_dgr"][0]


@pytest.mark.distributed
def test_fsdp2_with_mvas_and_dgr_trains_as_one_process(two_ranks):
    for r in two_ranks:
        # fp32 masters (no stochastic draws, which would differ between a shard and the whole weight); fp8
        # weights and moments in blocks that cut each shard where they cut the whole tensor
        torch.testing.assert_close(r["fsdp2_mvas_dgr"], r["one_mvas_dgr"], rtol=1e-5, atol=0)
        assert r["fsdp2_mvas_dgr"][-1] < r["fsdp2_mvas_dgr"][0]
    assert two_ranks[0]["fsdp2_mvas_dgr"] == two_ranks[1]["fsdp2_mvas_dgr"]
    # the blocks' weights are packed shards, the rest dense shards
    assert two_ranks[0]["fsdp2_kinds"] == ["DTensor(MVASWeight)", "DTensor(Tensor)"]


@pytest.mark.distributed
def test_mvas_under_ddp_is_refused_with_the_way_out(two_ranks):
    assert all("use distributed='fsdp2'" in r["refused"] for r in two_ranks)


def test_distributed_needs_a_known_strategy_and_a_process_group():
    model = Net()
    with pytest.raises(ConfigError, match="must be one of"):
        compose.apply(model, DGR, loss_fn=lambda m: loss_of(m, batches()[0]), distributed="zero3")
    with pytest.raises(ConfigError, match="torchrun"):
        compose.apply(model, MVAS_DGR, loss_fn=lambda m: loss_of(m, batches()[0]), distributed="fsdp2")
    assert all(type(p) is nn.Parameter for p in model.parameters())  # untouched
