"""What the store and every loader share, below them all: the flat packed form of a state dict, a model's registered
parameters, and snapshots of what a load writes in place.

- **flat packed form** (``checkpoint.packed_state_dict``, ``dcp``): a managed weight ``<key>`` is stored as the
  plain tensors ``<key>__mvas_payload`` (its codes) and ``<key>__mvas_scales`` (its fp32 block scales, if any);
  ``format_of`` reads the format and block size back from the payload's dtype and the number of scales;
- **registered parameters**: ``registered_parameters(model)`` lists ``(module, name, parameter)`` under every
  module that holds each (tied ones more than once), and ``restore_parameters`` registers those very objects
  again: how ``store.remove(restore=...)`` and the loaders undo a refused load;
- ``TensorSnapshot``: copies of tensors a loader writes in place, put back bit for bit if the load fails part-way.

Everything here uses public torch API only (``named_parameters(recurse=False)``, ``register_parameter``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from macroarch.mvas.codecs.formats import FORMATS, is_fake

__all__ = ["PAYLOAD_SUFFIX", "SCALES_SUFFIX", "TensorSnapshot", "format_of", "is_packed_buffer",
           "registered_parameters", "restore_parameters"]

PAYLOAD_SUFFIX = "__mvas_payload"
SCALES_SUFFIX = "__mvas_scales"


def is_packed_buffer(name: str) -> bool:
    """Whether a state-dict key is the flat payload or scales of a packed tensor (``packed_state_dict``)."""
    return name.endswith(PAYLOAD_SUFFIX) or name.endswith(SCALES_SUFFIX)


def format_of(payload: torch.Tensor, scales: torch.Tensor | None, numel: int) -> tuple[str, int | None]:
    """The (format, block size) a flat packed payload was stored in, from its dtype and the number of scales
    (one scale: one block covering the tensor, i.e. ``None``)."""
    for fmt in FORMATS.values():
        if fmt.storage_dtype == payload.dtype:
            if not fmt.block_scaled:
                return fmt.name, None
            n_scales = 0 if scales is None else scales.numel()
            return fmt.name, (None if n_scales <= 1 else numel // n_scales)
    raise ValueError(f"a packed payload of dtype {payload.dtype} matches no MVAS format")


def registered_parameters(model: nn.Module) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """``(module, name, parameter)`` for every parameter registered in ``model``, under every module that holds it
    (tied ones more than once): ``restore_parameters`` puts these very objects back."""
    return [(m, name, p) for m in model.modules()
            for name, p in m.named_parameters(recurse=False, remove_duplicate=False)]


def restore_parameters(registered: list[tuple[nn.Module, str, nn.Parameter]]) -> None:
    """Register each parameter of ``registered`` (``registered_parameters``) where it was."""
    for module, name, p in registered:
        module.register_parameter(name, p)


class TensorSnapshot:
    """Copies of tensors that a loader writes in place, to put back bit for bit if the load fails part-way
    (``restore``): a managed weight's packed storage is cloned and copied back as it is (``MVASWeight.copy_`` of
    the same format), anything else by value. Each tensor once, however often it is passed."""

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        seen: set[int] = set()
        self.saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        with torch.no_grad():
            for t in tensors:
                if torch.is_tensor(t) and id(t) not in seen and not is_fake(t):
                    seen.add(id(t))
                    self.saved.append((t, t.detach().clone()))

    @torch.no_grad()
    def restore(self) -> None:
        for t, copy in self.saved:
            t.copy_(copy)
