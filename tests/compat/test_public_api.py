"""``import macroarch``, every public module and every name a package's ``__all__`` lists resolve on this torch."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

import macroarch

# Extras a name may need (pyproject's optional-dependencies); the compat venv holds none of them.
OPTIONAL = {"transformers", "timm", "open_clip", "torchvision", "wandb", "papermill", "nbformat", "nbclient",
            "matplotlib", "safetensors", "accelerate", "scipy", "IPython", "ipykernel", "jupyterlab"}

PACKAGE_DIR = Path(macroarch.__file__).parent


def _public_modules() -> list[str]:
    """Every module of the package whose dotted name has no ``_private`` part (``__init__`` names its package)."""
    names = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = ("macroarch", *path.relative_to(PACKAGE_DIR).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not any(p.startswith("_") for p in parts):
            names.append(".".join(parts))
    return names


MODULES = _public_modules()


def _resolve(module: str, name: str) -> object:
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as err:  # an extra this environment lacks is a skip; anything else is a failure
        if (err.name or "").split(".")[0] in OPTIONAL:
            pytest.skip(f"{module}.{name} needs the optional {err.name} (not installed here)")
        raise


def test_the_torch_release_is_supported():
    major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    assert (2, 13) <= (major, minor) < (2, 15), f"torch {torch.__version__} is outside pyproject's range"


@pytest.mark.parametrize("name", macroarch.__all__)
def test_every_top_level_name_resolves(name):
    assert _resolve("macroarch", name) is not None


@pytest.mark.parametrize("module", MODULES)
def test_every_public_module_imports_and_exports_what_it_lists(module):
    try:
        imported = importlib.import_module(module)
    except ModuleNotFoundError as err:
        if (err.name or "").split(".")[0] in OPTIONAL:
            pytest.skip(f"{module} needs the optional {err.name} (not installed here)")
        raise
    missing = [n for n in getattr(imported, "__all__", ()) if not hasattr(imported, n)]
    assert not missing, f"{module}.__all__ lists names it does not define: {missing}"
