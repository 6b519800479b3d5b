"""Bytes of FSDP2 training with MVAS packed weights against FSDP2 in bf16, measured on the ranks (issue 18; the
post's C5 ZeRO-3 synchronisation claim with packed all-gathers).

Nothing here is computed from formulas:

- ``count_collectives``: a context that wraps the collectives FSDP2 calls (``all_gather_single`` /
  ``all_gather_into_tensor``, ``reduce_scatter_single`` / ``reduce_scatter_tensor``, looked up on
  ``torch.distributed`` at call time) and records each call's input and output bytes as they are handed to the
  process group: the all-gather payload per step is what went to the wire, packed or not;
- ``rank_bytes``: the bytes of the storages a rank holds for its weights (the local shards; an MVAS shard's
  payload and scales), its gradients and its optimizer state, each storage counted once (``untyped_storage``
  sizes, so a view of a larger buffer counts the buffer it keeps alive);
- ``measure_fsdp`` (run on every rank by ``macroarch.comm.launch``): trains the same MLP (``Workload.mlp``) for a
  few steps under FSDP2 + MVAS (fp8 or fp4 weights, ``MVASAdamW`` with fp8 moments on each rank's shard) and under
  FSDP2 with bf16 weights (torch's AdamW, bf16 state), and returns both sets of numbers.

Deviation: gradients under MVAS are dense in the compute dtype (FSDP2 reduce-scatters them as it does any
gradient), so the gradient bytes are those of the compute dtype (fp32 here, bf16 with a bf16 compute dtype).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

_GATHERS = ("all_gather_single", "all_gather_into_tensor")
_SCATTERS = ("reduce_scatter_single", "reduce_scatter_tensor")


@dataclass
class CollectiveLog:
    """Calls seen by ``count_collectives``: ``(name, input bytes, output bytes)`` each, in call order."""

    calls: list[tuple[str, int, int]] = field(default_factory=list)

    def input_bytes(self, names: Iterable[str]) -> int:
        names = set(names)
        return sum(sent for name, sent, _ in self.calls if name in names)

    @property
    def all_gather_bytes(self) -> int:
        """Bytes this rank contributed to all-gathers (its shards), summed over calls."""
        return self.input_bytes(_GATHERS)

    @property
    def all_gather_output_bytes(self) -> int:
        """Bytes the all-gathers delivered to this rank (every rank's shards)."""
        return sum(received for name, _, received in self.calls if name in _GATHERS)

    @property
    def reduce_scatter_bytes(self) -> int:
        return self.input_bytes(_SCATTERS)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@contextlib.contextmanager
def count_collectives() -> Iterator[CollectiveLog]:
    """Record every all-gather and reduce-scatter made through ``torch.distributed`` inside the context."""
    log = CollectiveLog()
    originals = {name: getattr(dist, name) for name in (*_GATHERS, *_SCATTERS) if hasattr(dist, name)}

    def wrap(name: str, fn: Any) -> Any:
        def counted(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            log.calls.append((name, _nbytes(input), _nbytes(output)))
            return fn(output, input, *args, **kwargs)
        return counted

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield log
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _storages(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (an MVAS weight: its payload's and scales')."""
    from torch.distributed.tensor import DTensor

    from macroarch.mvas import MVASWeight

    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, DTensor):
            with torch.no_grad():  # without grad, to_local() is the rank's shard itself, not an autograd view
                t = t.to_local()
        inner = [t.payload, t.scales] if isinstance(t, MVASWeight) else [t]
        for x in inner:
            if x is not None and x.numel():
                storage = x.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def rank_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes this rank holds for ``model``'s parameters (its shards), their gradients, and ``optimizer``'s state."""
    params = list(model.parameters())
    state: list[torch.Tensor] = []
    if optimizer is not None:
        for s in optimizer.state.values():
            state.extend(v for v in s.values() if torch.is_tensor(v))
    return {"weights": _storages(params), "grads": _storages(p.grad for p in params if p.grad is not None),
            "optimizer": _storages(state)}


def measure_fsdp(d_model: int = 64, n_layers: int = 2, tokens: int = 8, steps: int = 2, weight_format: str = "fp8",
                 block_size: int = 32, lr: float = 1e-3) -> dict[str, Any]:
    """On every rank of a launch: bytes per rank and all-gather bytes per step, FSDP2 + MVAS vs FSDP2 bf16. Both
    compute in bf16 (the MVAS weights are packed from the bf16 model; biases stay bf16 in both), so the gradients
    are the same size and the weights and moments are what differ."""
    from torch.distributed.fsdp import fully_shard

    from macroarch.measure.workload import Workload
    from macroarch.mvas import MVASAdamW, apply, plan_from_rules
    from macroarch.mvas.interop import fsdp as mvas_fsdp

    work = Workload(d_model=d_model, n_layers=n_layers, seq_len=tokens, batch_size=1)
    batches = work.mlp_batches(dist.get_rank(), steps)
    out: dict[str, Any] = {"world_size": dist.get_world_size(), "steps": steps, "format": weight_format,
                           "block_size": block_size}
    for name in ("mvas", "bf16"):
        model = work.mlp().to(torch.bfloat16)
        if name == "mvas":
            apply(model, plan_from_rules(model, [("*.weight", weight_format)], block_size=block_size, min_numel=0))
            shard = mvas_fsdp.fully_shard
        else:
            shard = fully_shard
        for layer in model:
            shard(layer)
        shard(model)
        if name == "mvas":  # each rank's moments quantised on its shard
            optimizer: torch.optim.Optimizer = MVASAdamW(model.parameters(), lr=lr, rounding="nearest",
                                                          min_state_numel=0, seed=0)
        else:
            optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        with count_collectives() as log:
            for x in batches:
                optimizer.zero_grad(set_to_none=True)  # before, not after: the step's gradients are measured
                model(x.to(torch.bfloat16)).float().square().mean().backward()
                optimizer.step()
        held = rank_bytes(model, optimizer)
        out[name] = {**held, "all_gather_bytes_per_step": log.all_gather_bytes // steps,
                     "all_gather_received_per_step": log.all_gather_output_bytes // steps,
                     "reduce_scatter_bytes_per_step": log.reduce_scatter_bytes // steps,
                     "all_gathers_per_step": sum(1 for c in log.calls if c[0] in _GATHERS) / steps,
                     "parameters": sum(p.numel() for p in model.parameters())}
        optimizer.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
    return out
