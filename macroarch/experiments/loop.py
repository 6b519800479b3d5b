"""A plain causal-LM training loop and evaluation, shared by notebooks and benchmarks.

``train_lm`` is the loop every comparison here needs (``train_round_robin`` runs several in lock step):
forward with labels, ``loss.backward()``,
``optimizer.step()``, ``zero_grad``, with the wall time of each step (forward to end of step) and an optional
callback after each step (an MVAS schedule, a scheduler). ``evaluate_lm`` gives the token-weighted mean
cross-entropy and the next-token accuracy (the argmax of the logits at position t equals the token at t + 1)
on held-out batches, with gradients off and the model in eval mode (restored afterwards).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm


@dataclass
class TrainLog:
    """Per-step training loss and wall seconds."""

    losses: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    def step_time(self, skip: int = 2) -> float:
        """Median seconds per step, the first ``skip`` steps (warm-up: allocation, lazy state) left out."""
        times = sorted(self.seconds[skip:] if len(self.seconds) > skip else self.seconds)
        if not times:
            raise ValueError("no steps were timed")
        return times[len(times) // 2]


@dataclass(frozen=True)
class EvalResult:
    loss: float
    accuracy: float
    tokens: int


def train_lm(model: nn.Module, optimizer: torch.optim.Optimizer, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
             *, after_step: Callable[[int, float], Any] | None = None, desc: str | None = None,
             mininterval: float = 10.0) -> TrainLog:
    """Train on every ``(input_ids, labels)`` batch; ``after_step(step, loss)`` runs after each step."""
    log = TrainLog()
    model.train()
    for step, (input_ids, labels) in enumerate(tqdm(batches, desc=desc, mininterval=mininterval, disable=desc is None)):
        loss, seconds = _one_step(model, optimizer, input_ids, labels)
        if not math.isfinite(loss):
            raise FloatingPointError(f"training loss is {loss} at step {step}")
        log.losses.append(loss)
        log.seconds.append(seconds)
        if after_step is not None:
            after_step(step, loss)
    return log


def _one_step(model: nn.Module, optimizer: torch.optim.Optimizer, input_ids: torch.Tensor,
              labels: torch.Tensor) -> tuple[float, float]:
    start = time.perf_counter()
    loss = model(input_ids=input_ids, labels=labels).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item(), time.perf_counter() - start


def train_round_robin(runs: Mapping[str, tuple[nn.Module, torch.optim.Optimizer]],
                      batches: Iterable[tuple[torch.Tensor, torch.Tensor]], *,
                      after_step: Mapping[str, Callable[[int, float], Any]] | None = None, desc: str | None = None,
                      mininterval: float = 10.0) -> dict[str, TrainLog]:
    """Train several ``(model, optimizer)`` pairs on the same batches, one step of each in turn, so that load
    from other processes on a shared machine hits all of them alike and their step times compare fairly."""
    logs = {name: TrainLog() for name in runs}
    after_step = after_step or {}
    for model, _ in runs.values():
        model.train()
    for step, (input_ids, labels) in enumerate(tqdm(batches, desc=desc, mininterval=mininterval, disable=desc is None)):
        for name, (model, optimizer) in runs.items():
            loss, seconds = _one_step(model, optimizer, input_ids, labels)
            if not math.isfinite(loss):
                raise FloatingPointError(f"{name}: training loss is {loss} at step {step}")
            logs[name].losses.append(loss)
            logs[name].seconds.append(seconds)
            if name in after_step:
                after_step[name](step, loss)
    return logs


@torch.no_grad()
def evaluate_lm(model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> EvalResult:
    """Token-weighted cross-entropy and next-token accuracy of a causal LM on ``batches``."""
    was_training = model.training
    model.eval()
    total_loss, correct, tokens = 0.0, 0, 0
    try:
        for input_ids, labels in batches:
            logits = model(input_ids=input_ids).logits[:, :-1].float()  # (B, T-1, V): predicts positions 1..T-1
            target = labels[:, 1:]
            mask = target != -100
            total_loss += float(F.cross_entropy(logits[mask], target[mask], reduction="sum"))
            correct += int((logits.argmax(-1)[mask] == target[mask]).sum())
            tokens += int(mask.sum())
    finally:
        model.train(was_training)
    if tokens == 0:
        raise ValueError("evaluate_lm: the batches hold no target tokens")
    return EvalResult(total_loss / tokens, correct / tokens, tokens)
