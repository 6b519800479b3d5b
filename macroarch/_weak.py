"""References to tensors that never keep them alive: a map weak on its tensor keys (by identity), and a tensor on
another's storage that holds no reference to it. What caches keyed on a tensor (``macroarch.mvas._kernels``' kept
plans) need so that a weight they once served can still be freed."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["WeakById", "rows_alias"]


class WeakById:
    """A map weak on its tensor keys, by identity: torch's ``WeakIdKeyDictionary`` without its cost per lookup (a
    ``WeakIdRef`` object built for each; ~1 us, on the path of every read of a managed weight). An entry goes when
    its key dies (the reference's callback; a later object given the same id never sees it)."""

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, Any]] = {}

    def get(self, key: torch.Tensor, default: Any = None) -> Any:
        entry = self._entries.get(id(key))
        return entry[1] if entry is not None and entry[0]() is key else default

    def __getitem__(self, key: torch.Tensor) -> Any:
        entry = self._entries.get(id(key))
        if entry is None or entry[0]() is not key:
            raise KeyError(key)
        return entry[1]

    def __contains__(self, key: torch.Tensor) -> bool:
        entry = self._entries.get(id(key))
        return entry is not None and entry[0]() is key

    def __setitem__(self, key: torch.Tensor, value: Any) -> None:
        entries, ident = self._entries, id(key)

        def forget(ref: weakref.ref, entries: dict = entries, ident: int = ident) -> None:
            if entries.get(ident, (None,))[0] is ref:
                del entries[ident]

        self._entries[ident] = (weakref.ref(key, forget), value)

    def pop(self, key: torch.Tensor, default: Any = None) -> Any:
        value = self.get(key, self)
        if value is self:
            return default
        del self._entries[id(key)]
        return value

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter([key for key in (ref() for ref, _ in list(self._entries.values())) if key is not None])

    def __len__(self) -> int:
        return sum(1 for _ in self)


def rows_alias(t: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """``t`` (contiguous) as ``rows`` rows on its storage, holding no reference to ``t`` itself (a view would, through
    its ``_base``): what a cache weak on ``t`` may hold."""
    if t is None:
        return None
    length = t.numel() // rows
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(),
                                                               (rows, length), (length, 1))
