"""Where things live: the checkout, run outputs, W&B's folder; and the profiles a run can have.

A leaf module that every layer may import (the data loaders find ``data/`` here, the reproduction machinery
finds ``papermill_runs/``). Environment variables override each location, so tests and users can redirect
outputs without touching the checkout.
"""

from __future__ import annotations

import os
from pathlib import Path

from macroarch.config import ConfigError

PROFILES = ("ci", "cpu", "gpu")


def project_root() -> Path:
    """The checkout this package runs from (``MACROARCH_ROOT`` overrides), else the working directory."""
    if env := os.environ.get("MACROARCH_ROOT"):
        return Path(env).resolve()
    here = Path(__file__).resolve().parent.parent
    return here if (here / "pyproject.toml").is_file() else Path.cwd().resolve()


def out_root() -> Path:
    """Where executed notebooks and result files go (``MACROARCH_OUT`` overrides)."""
    if env := os.environ.get("MACROARCH_OUT"):
        return Path(env).resolve()
    return project_root() / "papermill_runs" / "out"


def wandb_root() -> Path:
    """The folder W&B writes its ``wandb/`` directory into (W&B's own ``WANDB_DIR`` overrides)."""
    if env := os.environ.get("WANDB_DIR"):
        return Path(env).resolve()
    return project_root()


def check_profile(profile: str) -> str:
    if profile not in PROFILES:
        raise ConfigError(f"unknown profile {profile!r}; expected one of {', '.join(PROFILES)}")
    return profile
