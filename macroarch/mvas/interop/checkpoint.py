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

A packed file never loads silently wrong: a dense loader finds no weights file it knows; ``save_packed`` writes a
sha256 of every tensor's bytes into the metadata (``CHECKSUMS_KEY``) and ``load_packed`` verifies them all before
anything reaches the model; ``load_state_dict`` refuses another plan, another shape, corrupt scales or payload codes
that decode to NaN or infinity before copying anything; and a refused ``load_packed`` leaves the model as it was (a
dense model keeps its own parameter objects, not re-quantised).

Trust: safetensors files hold a JSON header and raw bytes, and ``load_packed`` reads its metadata as data (a
compute dtype must be one of three names), so a crafted file is refused without running code. ``torch.load`` of a
state dict holding ``MVASWeight`` s needs no more than ``weights_only=True``. DCP checkpoints are another matter
(``macroarch.mvas.interop.dcp``: trusted sources only).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from macroarch.mvas.codecs.formats import dtype_format
from macroarch.mvas.interop.state_dict import (
    PAYLOAD_SUFFIX,
    SCALES_SUFFIX,
    TensorSnapshot,
    format_of,
    registered_parameters,
)
from macroarch.mvas.packed.weight import MVASWeight
from macroarch.mvas.plan.policy import PrecisionPlan, TensorPlan

if TYPE_CHECKING:
    from macroarch.mvas.store import MVASStore

PACKED_WEIGHTS_NAME = "mvas_model.safetensors"
"""File name ``save_packed`` uses inside a directory: not ``model.safetensors``, so that a dense loader
(``from_pretrained``) does not take it for a checkpoint of its own."""


CHECKSUMS_KEY = "mvas_checksums"
"""Metadata key of ``save_packed``'s checksums: JSON ``{tensor key: sha256 of its bytes}``."""
_COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def tensor_sha256(tensor: torch.Tensor) -> str:
    """The sha256 (hex) of a tensor's bytes as stored (C order), whatever its dtype."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    return hashlib.sha256(data.numpy()).hexdigest()


def save_packed(model: nn.Module, path: str | os.PathLike) -> str:
    """Write ``packed_state_dict(model)`` as safetensors (a directory gets ``PACKED_WEIGHTS_NAME``), with the compute
    dtypes and a sha256 of every tensor's bytes (``CHECKSUMS_KEY``) in its metadata; returns the file written."""
    from safetensors.torch import save_file

    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, PACKED_WEIGHTS_NAME)
    tensors = {k: v.contiguous() for k, v in packed_state_dict(model).items()}
    checksums = {k: tensor_sha256(v) for k, v in tensors.items()}
    save_file(tensors, path, metadata={"format": "pt", "mvas_compute_dtypes": json.dumps(_compute_dtypes(model)),
                                       CHECKSUMS_KEY: json.dumps(checksums, sort_keys=True)})
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


def load_packed(model: nn.Module, path: str | os.PathLike, *, strict: bool = True,
                verify: bool = True) -> MVASStore | None:
    """Load a ``save_packed`` file into ``model``, exactly; returns the store it made, if any.

    A model under ``mvas.apply`` must have the checkpoint's plan (else the load is refused, nothing copied); a
    model with no managed weight is first put under the checkpoint's plan, in the compute dtype it was saved
    with, and that new store is returned.

    All or nothing: before anything is copied, every tensor's bytes are checked against the sha256 the file
    carries (``verify=False`` skips it, for files written before checksums), the keys against the model's
    (``strict``), then shapes, plans and values (finite scales, no payload code that decodes to NaN or infinity)
    as for any load; a refused load leaves the model as it was, its own parameter objects with their bytes (a
    dense model is not left re-quantised), and raises ValueError naming the tensors.
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    from macroarch.mvas.store import apply  # the store sits above interop: a dense model is put under it on call

    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, PACKED_WEIGHTS_NAME)
    with safe_open(path, framework="pt") as f:
        metadata: dict[str, Any] = f.metadata() or {}
    if "mvas_compute_dtypes" not in metadata:
        raise ValueError(f"{path} is not a packed MVAS checkpoint (written by save_packed): no mvas metadata")
    compute = _read_compute_dtypes(path, metadata["mvas_compute_dtypes"])
    state_dict = load_file(path)  # on the CPU: checked before anything reaches the model's device
    if verify:
        verify_checksums(path, state_dict, metadata.get(CHECKSUMS_KEY))
    device = next(model.parameters()).device
    state_dict = {k: v.to(device) for k, v in state_dict.items()}
    registered = registered_parameters(model)
    store = None
    if not any(isinstance(p, MVASWeight) for p in model.parameters()):
        if len(compute) > 1:
            raise ValueError(f"{path}: the managed weights compute in several dtypes {sorted(map(str, compute))}; "
                             "apply the plan yourself (mvas.apply, then load_packed)")
        store = apply(model, plan_of_packed(model, state_dict), compute_dtype=next(iter(compute), None))
    try:
        if strict:
            _check_keys(path, model, state_dict)
        # what load_state_dict writes in place (the weights a new store just made are dropped on failure instead)
        made = set() if store is None else {id(e.param) for e in store.entries.values()}
        snapshot = TensorSnapshot(v for v in model.state_dict(keep_vars=True).values() if id(v) not in made)
        try:
            model.load_state_dict(state_dict, strict=strict)
        except BaseException:
            snapshot.restore()
            raise
    except BaseException:
        if store is not None:
            store.remove(restore=registered)
        raise
    return store


def _read_compute_dtypes(path: str, text: str) -> set[torch.dtype]:
    """The compute dtypes of the metadata's JSON ``{name: dtype}``; anything but a float dtype's name is refused."""
    try:
        names = json.loads(text)
    except ValueError:
        names = None
    if not isinstance(names, dict) or not all(isinstance(d, str) and d in _COMPUTE_DTYPES for d in names.values()):
        raise ValueError(f"{path}: the mvas_compute_dtypes metadata is not a JSON object of dtypes "
                         f"({', '.join(_COMPUTE_DTYPES)}); the file is corrupt or was not written by save_packed")
    return {_COMPUTE_DTYPES[d] for d in names.values()}


def verify_checksums(path: str, state_dict: dict[str, torch.Tensor], checksums: str | None) -> None:
    """Raise ValueError, naming each tensor, unless every tensor of ``state_dict`` has the sha256 of the
    ``CHECKSUMS_KEY`` metadata (a JSON object ``{key: hex digest}``) and no checksum names a missing tensor."""
    if checksums is None:
        raise ValueError(f"{path} carries no checksums ({CHECKSUMS_KEY}): it was written before save_packed wrote "
                         "them, or by something else. Nothing was loaded; load_packed(..., verify=False) loads it "
                         "unverified")
    try:
        expected = json.loads(checksums)
    except ValueError:
        expected = None
    if not isinstance(expected, dict):
        raise ValueError(f"{path}: the {CHECKSUMS_KEY} metadata is not a JSON object; the file is corrupt")
    problems = [f"{k}: no checksum" for k in state_dict if k not in expected]
    problems += [f"{k}: checksummed but not in the file" for k in expected if k not in state_dict]
    problems += [f"{k}: its bytes do not match its sha256" for k, v in state_dict.items()
                 if k in expected and tensor_sha256(v) != expected[k]]
    if problems:
        raise ValueError(f"{path} is corrupt ({len(problems)} tensors: " + "; ".join(problems[:5])
                         + (" ..." if len(problems) > 5 else "") + "). Nothing was loaded")


def _check_keys(path: str, model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Raise ValueError unless the file's tensors are exactly the model's state-dict keys (a packed weight stands for
    all of its tied keys)."""
    provided = {k.removesuffix(PAYLOAD_SUFFIX).removesuffix(SCALES_SUFFIX) for k in state_dict}
    by_object: dict[int, list[str]] = {}
    own = model.state_dict(keep_vars=True)
    for key, value in own.items():
        by_object.setdefault(id(value), []).append(key)
    for key, value in own.items():
        if isinstance(value, MVASWeight) and key in provided:
            provided.update(by_object[id(value)])
    missing, unexpected = sorted(set(own) - provided), sorted(provided - set(own))
    if missing or unexpected:
        raise ValueError(f"{path} does not hold this model's tensors (missing: {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''}; unexpected: {unexpected[:5]}"
                         f"{' ...' if len(unexpected) > 5 else ''}). Nothing was loaded; strict=False loads the "
                         "tensors both have")
