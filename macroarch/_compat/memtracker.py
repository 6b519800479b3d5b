"""MemTracker, reporting every change to a tracked storage as it happens (``macroarch.measure.memory.measured``).

``torch.distributed._tools.mem_tracker.MemTracker`` files every live tensor storage under a kind (parameter,
gradient, activation, optimizer state...) and follows it as autograd and the optimizer create, retag, resize and
free it. Its public API gives snapshots; a report by finer categories (master weights apart from Adam's moments)
with exact maxima needs each change as it happens, which only its private ``_update_snap`` sees. This shim makes
that one subclass: ``tracker(on_change)`` calls ``on_change(key, old_kind, old_bytes, new_kind, new_bytes)`` for
every change, where ``key`` identifies a storage (weak-referenceable, stable while it lives) and a kind is one of
:data:`KINDS` (``None`` before it exists and after it is freed).

The whole module ``torch.distributed._tools`` is private; it is imported on the first ``tracker()``, never at
``import macroarch``, and a torch that lacks any of the names gets an error naming it and the release.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from macroarch._compat import version

#: the kinds MemTracker files a storage under, by the names this shim reports
KINDS = ("param", "buffer", "grad", "act", "temp", "opt", "other")

OnChange = Callable[[Any, "str | None", int, "str | None", int], None]


def tracker(on_change: OnChange, *, defer: Callable[[tuple[type, ...]], bool] | None = None) -> Any:
    """A MemTracker (a context manager; ``track_external(*modules_optimizers_tensors)`` as torch's) that calls
    ``on_change`` for every change to a tracked storage, and whose ``storages(tensor)`` lists ``(key, kind, bytes)``
    of a tracked tensor's storages. ``defer(types)``: return True to pass an op on a tensor subclass back to the
    subclass (``NotImplemented``), so the plain ops it runs instead are the ones counted."""
    return _tracker_class()(on_change, defer)


@functools.cache
def _tracker_class() -> type:
    version.check("macroarch._compat.memtracker (measured memory)")
    try:
        # private: the storages behind a tensor (a wrapper subclass has several), as MemTracker keys them
        from torch.distributed._tools.common_utils import get_untyped_storages

        # private: MemTracker is public in name only (torch.distributed._tools); _MemRefType and _UpdateType are
        # the arguments of the _update_snap it calls on every change, _TOTAL_KEY the total in its snapshots
        from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType, _UpdateType
    except ImportError as err:
        raise version.missing("torch.distributed._tools.mem_tracker (MemTracker, _MemRefType, _UpdateType)",
                              "measured memory by category", err) from err

    kinds = dict(zip((_MemRefType.PARAM, _MemRefType.BUFFER, _MemRefType.GRAD, _MemRefType.ACT, _MemRefType.TEMP,
                      _MemRefType.OPT, _MemRefType.OTH), KINDS))

    class _ReportingTracker(MemTracker):
        def __init__(self, on_change: OnChange, defer: Callable[[tuple[type, ...]], bool] | None) -> None:
            super().__init__()
            self._on_change = on_change
            self._defer = defer

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if self._defer is not None and self._defer(types):
                return NotImplemented
            return super().__torch_dispatch__(func, types, args, kwargs)

        # private override: MemTracker calls this on every change to a tracked storage (winfo: the storage's
        # record, with its reftype and bytes); the signature is the same in torch 2.13 and 2.14
        def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None) -> None:  # type: ignore[override]
            super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
            kind, nbytes = kinds[winfo.reftype], winfo.mem_consumed
            if u_type == _UpdateType.ADD:
                self._on_change(winfo, None, 0, kind, nbytes)
            elif u_type == _UpdateType.DEL:
                self._on_change(winfo, kind, nbytes, None, 0)
            elif u_type == _UpdateType.SIZE:
                self._on_change(winfo, kind, old_mem_consumed, kind, nbytes)
            elif u_type == _UpdateType.REF:
                self._on_change(winfo, kinds[old_reftype], nbytes, kind, nbytes)

        # private override: MemTracker also refreshes a peak snapshot for every active module here, scanning all
        # modules after every op: quadratic in depth (its cost on a GPT-3 175B step: docs/benchmarks.md). Only the
        # global peak is kept (the per-module snapshots are not reported).
        def _update_peak_stats(self, peak_state) -> None:  # type: ignore[override]
            for device, snapshot in self._curr_mem_snap.items():
                if self._peak_mem.get(device, 0) < snapshot[_TOTAL_KEY]:
                    self._peak_mem[device] = snapshot[_TOTAL_KEY]
                    self._peak_mem_snap[device] = dict(snapshot)

        def storages(self, tensor: Any) -> list[tuple[Any, str, int]]:
            """``(key, kind, bytes)`` of each storage behind an already tracked ``tensor``."""
            out = []
            for storage in get_untyped_storages(tensor):
                winfo, _ = self._WINFO[storage]  # private: MemTracker's storage -> record map
                out.append((winfo, kinds[winfo.reftype], winfo.mem_consumed))
            return out

    return _ReportingTracker
