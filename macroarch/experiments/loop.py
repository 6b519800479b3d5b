"""The project's one language-model training loop and evaluation; every experiment trains through it.

``train_lm`` runs one step per batch: by default the plain causal-LM step (:func:`lm_step`: forward with labels,
``loss.backward()``, ``optimizer.step()``, ``zero_grad``); an experiment that needs more in its step (micro-batch
accumulation, autocast and a loss scale, a spike guard watching the loss before backward) passes its own
``step(model, optimizer, batch) -> loss``, and the loop stays the same: the wall time of each step, the loss of
each step, a callback after it (an MVAS schedule, an LR scheduler, logging), a progress bar, and what a
non-finite loss does (``on_nonfinite="raise"``, or ``"stop"``: the run ends there and ``TrainLog.diverged_at``
says where). ``train_round_robin`` runs several (model, optimizer) pairs in lock step, one step of each in turn.

``mvas_kernels(compiled=...)`` runs a block with MVAS's kernels compiled by ``torch.compile`` or eager (tiny models in
short runs: a compile costs more than it saves).

``evaluate_lm`` gives the token-weighted mean cross-entropy and the next-token accuracy (the argmax of the logits at
position t equals the token at t + 1) on held-out batches, with gradients off, the model in eval mode (restored
afterwards) and optionally under autocast. Batches move to the model's device in both.

Not here: the communication measurements (``macroarch.measure.comm_bench``, ``calibrate``) time forward, backward
and a gradient synchronisation inside launched ranks, without an optimizer step; that is a benchmark of the
synchronisation, not a training loop.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from macroarch._progress import tqdm
from macroarch.measure.workload import lm_loss

Batch = tuple[torch.Tensor, torch.Tensor]
Step = Callable[[nn.Module, torch.optim.Optimizer, Batch], float]
NONFINITE = ("raise", "stop")


@dataclass
class TrainLog:
    """Per-step training loss and wall seconds; where the run stopped on a non-finite loss (None: it did not)."""

    losses: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    diverged_at: int | None = None
    wall_seconds: float = 0.0
    """The whole loop: steps, callbacks and progress bar."""

    @property
    def diverged(self) -> bool:
        return self.diverged_at is not None

    def step_time(self, skip: int = 2) -> float:
        """Median seconds per step, the first ``skip`` steps (warm-up: allocation, lazy state) left out."""
        times = sorted(self.seconds[skip:] if len(self.seconds) > skip else self.seconds)
        if not times:
            raise ValueError("no steps were timed")
        return times[len(times) // 2]


@dataclass
class RunResult:
    """What one training run measured (the C8 and C10 sweeps keep one per run).

    Attributes:
        losses: training loss of each update (mean over its micro-batches); stops where the run diverged.
        eval_loss: held-out loss at the end (``evaluate_lm``); NaN if the run diverged.
        diverged_at: index of the first update with a non-finite loss (the run stops there), or None.
        seconds: wall time of the training loop.
        metrics: run-specific numbers (lost-update fraction, overflows, underflow...).
        series: run-specific per-update series (the scale...).
    """

    losses: list[float]
    eval_loss: float
    diverged_at: int | None
    seconds: float
    metrics: dict[str, float] = field(default_factory=dict)
    series: dict[str, list[float]] = field(default_factory=dict)

    @property
    def diverged(self) -> bool:
        return self.diverged_at is not None


@dataclass(frozen=True)
class EvalResult:
    loss: float
    accuracy: float
    tokens: int


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


PHASES = ("forward", "backward", "optimizer step")
"""The phases ``lm_step`` times when given a ``phases`` list (``zero_grad`` counted with the optimizer step)."""


def lm_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch,
            phases: list[tuple[float, float, float]] | None = None) -> float:
    """The plain step: forward with labels, backward, ``optimizer.step()``, ``zero_grad``; returns the loss. With
    ``phases``, the seconds of each of ``PHASES`` are appended to it (where a step's time goes)."""
    start = time.perf_counter()
    loss = lm_loss(model, batch)
    forward = time.perf_counter()
    loss.backward()
    backward = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if phases is not None:
        phases.append((forward - start, backward - forward, time.perf_counter() - backward))
    return loss.item()


def _check(on_nonfinite: str) -> None:
    if on_nonfinite not in NONFINITE:
        raise ValueError(f"on_nonfinite={on_nonfinite!r} must be one of {NONFINITE}")


def _timed(step: Step, model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch) -> tuple[float, float]:
    start = time.perf_counter()
    loss = step(model, optimizer, batch)
    return loss, time.perf_counter() - start


def train_lm(model: nn.Module, optimizer: torch.optim.Optimizer | None, batches: Iterable[Batch], *,
             step: Step = lm_step, after_step: Callable[[int, float], Any] | None = None,
             on_nonfinite: str = "raise", desc: str | None = None, mininterval: float = 10.0) -> TrainLog:
    """Train on every batch with ``step`` (default :func:`lm_step`); ``after_step(index, loss)`` runs after each.

    A non-finite loss raises ``FloatingPointError`` (``on_nonfinite="raise"``) or ends the run
    (``"stop"``: the loss is not recorded, ``after_step`` is not called, ``log.diverged_at`` is its index).
    ``desc`` shows a progress bar (refreshed at most every ``mininterval`` seconds).
    """
    _check(on_nonfinite)
    log = TrainLog()
    model.train()
    start = time.perf_counter()
    for index, batch in enumerate(tqdm(batches, desc=desc, mininterval=mininterval, disable=desc is None)):
        loss, seconds = _timed(step, model, optimizer, batch)
        if not math.isfinite(loss):
            if on_nonfinite == "raise":
                raise FloatingPointError(f"training loss is {loss} at step {index}")
            log.diverged_at = index
            break
        log.losses.append(loss)
        log.seconds.append(seconds)
        if after_step is not None:
            after_step(index, loss)
    log.wall_seconds = time.perf_counter() - start
    return log


def train_round_robin(runs: Mapping[str, tuple[nn.Module, torch.optim.Optimizer]], batches: Iterable[Batch], *,
                      after_step: Mapping[str, Callable[[int, float], Any]] | None = None, step: Step = lm_step,
                      desc: str | None = None, mininterval: float = 10.0) -> dict[str, TrainLog]:
    """Train several ``(model, optimizer)`` pairs on the same batches, one step of each in turn, so that load
    from other processes on a shared machine hits all of them alike and their step times compare fairly.
    A non-finite loss raises ``FloatingPointError`` naming the run."""
    logs = {name: TrainLog() for name in runs}
    after_step = after_step or {}
    for model, _ in runs.values():
        model.train()
    start = time.perf_counter()
    for index, batch in enumerate(tqdm(batches, desc=desc, mininterval=mininterval, disable=desc is None)):
        for name, (model, optimizer) in runs.items():
            loss, seconds = _timed(step, model, optimizer, batch)
            if not math.isfinite(loss):
                raise FloatingPointError(f"{name}: training loss is {loss} at step {index}")
            logs[name].losses.append(loss)
            logs[name].seconds.append(seconds)
            if name in after_step:
                after_step[name](index, loss)
    for log in logs.values():
        log.wall_seconds = time.perf_counter() - start
    return logs


@torch.no_grad()
def evaluate_lm(model: nn.Module, batches: Iterable[Batch], *, autocast_dtype: torch.dtype | None = None) -> EvalResult:
    """Token-weighted cross-entropy and next-token accuracy of a causal LM on ``batches`` (labels -100 are
    ignored), optionally under ``torch.autocast`` to ``autocast_dtype``. A model whose logits are not finite
    gives a NaN loss, not an error."""
    was_training = model.training
    model.eval()
    device = _device(model)
    total_loss, correct, tokens = 0.0, 0, 0
    try:
        for input_ids, labels in batches:
            with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                logits = model(input_ids=input_ids.to(device)).logits
            logits = logits[:, :-1].float()  # (B, T-1, V): predicts positions 1..T-1
            target = labels[:, 1:].to(device)
            mask = target != -100
            total_loss += float(F.cross_entropy(logits[mask], target[mask], reduction="sum"))
            correct += int((logits.argmax(-1)[mask] == target[mask]).sum())
            tokens += int(mask.sum())
    finally:
        model.train(was_training)
    if tokens == 0:
        raise ValueError("evaluate_lm: the batches hold no target tokens")
    return EvalResult(total_loss / tokens, correct / tokens, tokens)


@contextlib.contextmanager
def mvas_kernels(*, compiled: bool) -> Iterator[None]:
    """MVAS's kernels compiled (``torch.compile``) or eager for the block: ``macroarch.mvas.COMPILE_ENV`` set, and
    restored after."""
    from macroarch.mvas import COMPILE_ENV

    old = os.environ.get(COMPILE_ENV)
    os.environ[COMPILE_ENV] = "1" if compiled else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(COMPILE_ENV, None)
        else:
            os.environ[COMPILE_ENV] = old
