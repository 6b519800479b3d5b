"""Checkpoints of MVAS models in the forms other tools read: dense, or packed for safetensors.

``model.state_dict()`` of an MVAS model holds ``MVASWeight`` s, which ``torch.save`` keeps packed and exact
(``macroarch.mvas.store``). Other tools need plain tensors:

- **dense** (the default everywhere a user does not ask for packed storage): ``dense_state_dict(model)`` is the
  state dict with every managed weight dequantised to its compute (training) dtype, the values the model
  computes with, so a dense model of the same architecture loads it and gives the same outputs.
  ``model.save_pretrained`` / ``Trainer.save_model`` write exactly this (they call ``.contiguous()`` on each
  tensor, which a managed weight answers with its dense value); for safetensors directly,
  ``safetensors.torch.save_file(dense_state_dict(model), path)``.
- **packed, on request**: ``packed_state_dict(model)`` flattens each managed weight into
  ``<key>__mvas_payload`` (fp8 / uint8 codes) and ``<key>__mvas_scales`` (fp32), one copy per tied weight;
  ``save_packed(model, path)`` writes it as safetensors under a name no dense loader picks up, with the
  compute dtype in the metadata. ``load_packed(model, path)`` restores it bit for bit: into a model already
  under ``mvas.apply`` (the formats are checked as for any load), or into a dense model, which it first puts
  under the checkpoint's own plan (read from the payload dtypes and scale counts).

A packed file never loads silently wrong: a dense loader finds no weights file it knows; ``load_state_dict``
refuses another plan, another shape, or corrupt scales before copying anything.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn

from macroarch.mvas.codecs.formats import dtype_format
from macroarch.mvas.plan.policy import PrecisionPlan, TensorPlan
from macroarch.mvas.store import PAYLOAD_SUFFIX, SCALES_SUFFIX, MVASStore, apply, format_of
from macroarch.mvas.packed.weight import MVASWeight

PACKED_WEIGHTS_NAME = "mvas_model.safetensors"
"""File name ``save_packed`` uses inside a directory: not ``model.safetensors``, so that a dense loader
(``from_pretrained``) does not take it for a checkpoint of its own."""


def dense_state_dict(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with each managed weight dequantised (in its compute dtype, or ``dtype``)."""
    return {k: v.dequantize(dtype) if isinstance(v, MVASWeight) else v for k, v in model.state_dict().items()}


def packed_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Plain tensors only: managed weights as ``<key>__mvas_payload`` and ``<key>__mvas_scales``, a tied weight
    under its first key only (safetensors refuses shared tensors; loading fills the other keys)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, value in model.state_dict(keep_vars=True).items():
        if not isinstance(value, MVASWeight):
            out[key] = value.detach()
            continue
        if id(value) in seen:
            continue
        seen.add(id(value))
        out[key + PAYLOAD_SUFFIX] = value.payload.detach()
        if value.scales is not None:
            out[key + SCALES_SUFFIX] = value.scales.detach()
    return out


def _compute_dtypes(model: nn.Module) -> dict[str, str]:
    return {name: str(p.dtype).removeprefix("torch.") for name, p in model.named_parameters()
            if isinstance(p, MVASWeight)}


def save_packed(model: nn.Module, path: str | os.PathLike) -> str:
    """Write ``packed_state_dict(model)`` as safetensors (a directory gets ``PACKED_WEIGHTS_NAME``); returns the
    file written."""
    from safetensors.torch import save_file

    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, PACKED_WEIGHTS_NAME)
    tensors = {k: v.contiguous() for k, v in packed_state_dict(model).items()}
    save_file(tensors, path, metadata={"format": "pt", "mvas_compute_dtypes": json.dumps(_compute_dtypes(model))})
    return path


def plan_of_packed(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> PrecisionPlan:
    """The plan a packed state dict was saved under, for the (dense) ``model`` it belongs to."""
    tensors = []
    for name, p in model.named_parameters():
        payload = state_dict.get(name + PAYLOAD_SUFFIX)
        if payload is None:
            tensors.append(TensorPlan(name, p.numel(), p.dtype, dtype_format(p.dtype).name, None, "checkpoint"))
            continue
        fmt, block = format_of(payload, state_dict.get(name + SCALES_SUFFIX), p.numel())
        tensors.append(TensorPlan(name, p.numel(), p.dtype, fmt, block, "checkpoint"))
    return PrecisionPlan(tuple(tensors))


def load_packed(model: nn.Module, path: str | os.PathLike, *, strict: bool = True) -> MVASStore | None:
    """Load a ``save_packed`` file into ``model``, exactly; returns the store it made, if any.

    A model under ``mvas.apply`` must have the checkpoint's plan (else the load is refused, nothing copied); a
    model with no managed weight is first put under the checkpoint's plan, in the compute dtype it was saved
    with, and that new store is returned.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, PACKED_WEIGHTS_NAME)
    with safe_open(path, framework="pt") as f:
        metadata: dict[str, Any] = f.metadata() or {}
    if "mvas_compute_dtypes" not in metadata:
        raise ValueError(f"{path} is not a packed MVAS checkpoint (written by save_packed): no mvas metadata")
    state_dict = load_file(path, device=str(next(model.parameters()).device))
    store = None
    if not any(isinstance(p, MVASWeight) for p in model.parameters()):
        compute = {getattr(torch, d) for d in json.loads(metadata["mvas_compute_dtypes"]).values()}
        if len(compute) > 1:
            raise ValueError(f"{path}: the managed weights compute in several dtypes {sorted(map(str, compute))}; "
                             "apply the plan yourself (mvas.apply, then load_packed)")
        store = apply(model, plan_of_packed(model, state_dict), compute_dtype=next(iter(compute), None))
    model.load_state_dict(state_dict, strict=strict)
    return store
