"""Analysis of training dynamics: what the post's claims say about gradients, measured on real modules.

``gradients``: per-layer gradient norms, controlled-spectrum stacks, Jacobian spectra, growth-rate fits
and gradient-variance estimators (claims C2 and C6).

Each submodule declares its public names in ``__all__``; they are re-exported here, so a new submodule
is one more entry in ``_SUBMODULES``.
"""

from __future__ import annotations

import importlib

_SUBMODULES = (
    "gradients",
)

__all__: list[str] = []
for _name in _SUBMODULES:
    _module = importlib.import_module(f"{__name__}.{_name}")
    if not hasattr(_module, "__all__"):
        raise ImportError(f"macroarch.analysis.{_name} must declare its public names in __all__ to be re-exported")
    _clash = set(__all__) & set(_module.__all__)
    if _clash:
        raise ImportError(f"macroarch.analysis.{_name} re-exports names already taken: {sorted(_clash)}")
    globals().update({export: getattr(_module, export) for export in _module.__all__})
    __all__ += _module.__all__
del _name, _module, _clash
