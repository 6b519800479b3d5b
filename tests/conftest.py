"""Shared fixtures: every test writes results, W&B runs and papers under its own tmp folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("MPLBACKEND", "Agg")


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """Results, W&B offline runs and the project root all under ``tmp_path`` (env, so kernels inherit it)."""
    monkeypatch.setenv("MACROARCH_OUT", str(tmp_path / "out"))
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return tmp_path
