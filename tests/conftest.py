"""Shared fixtures: every test writes results, W&B runs and papers under its own tmp folder."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("MACROARCH_COMPILE", "0")  # the eager kernels, the reference; tests/mvas/test_kernels.py compiles


@pytest.fixture(autouse=True)
def one_thread():
    """Tests use tiny models: intra-op threads only add contention (on a shared 2-core machine, 10-100x slower).
    Notebooks run in their own kernels and keep torch's default."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """Results, data, W&B offline runs all under ``tmp_path`` (set in the environment, so kernels inherit it)."""
    monkeypatch.setenv("MACROARCH_OUT", str(tmp_path / "out"))
    monkeypatch.setenv("MACROARCH_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR"):  # staging, caches, settings
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return tmp_path


PROFILE_ONLY = 'profile: str = "cpu"  # ci | cpu | gpu: every parameter left None takes this profile\'s value\n'
PARAMETERS = PROFILE_ONLY + "size: int = None  # a size that differs by profile\n"
RECORDING = '''
from macroarch.repro.claims import get_claim
from macroarch.repro.notebook import resolve_parameters
from macroarch.repro.tracking import start_run
params = resolve_parameters("02_memory_wall", globals())
MACHINE = {"cpu_model": "test"}  # given, so that the fixture kernel does not import torch to probe the machine
with start_run("C4", profile, {**params, "machine": MACHINE}) as run:
    run.summary(post_accounting_bytes=1.4e12 * size, mixed_precision_bytes=2.8e12)
    run.verdict(get_claim("C4").grade(run.metrics, scale=f"size {size}"))
'''
FAILING = '''
raise RuntimeError("deliberate failure " + profile + "\\nsecond line")
'''


def write_notebook(path, *bodies, params=PARAMETERS):
    """A notebook: a ``parameters`` cell and one code cell per body."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    cell = nbformat.v4.new_code_cell(params)
    cell.metadata["tags"] = ["parameters"]
    nb.cells = [cell, *(nbformat.v4.new_code_cell(b) for b in bodies)]
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)


@pytest.fixture
def project(isolated, monkeypatch):
    """A throw-away project: a recording C4 notebook (annotated parameters, sizes from the profile: ci 1,
    cpu 2) and a failing one under the registry's stems."""
    root = isolated / "project"
    monkeypatch.setenv("MACROARCH_ROOT", str(root))
    monkeypatch.setenv("WANDB_MODE", "disabled")  # W&B is covered by the tracking tests
    write_notebook(root / "notebooks" / "02_memory_wall.ipynb", RECORDING)
    write_notebook(root / "notebooks" / "01_gradient_explosion.ipynb", FAILING, params=PROFILE_ONLY)
    write_profile(root, "ci", [{"notebook": "01_gradient_explosion"},
                               {"notebook": "02_memory_wall", "parameters": {"size": 1}}])
    write_profile(root, "cpu", [{"notebook": "02_memory_wall", "parameters": {"size": 2}}])
    return root


def write_profile(root, name, entries, **top):
    import yaml

    p = root / "papermill_runs" / f"{name}.yaml"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(yaml.safe_dump({"description": "test", **top, "notebooks": entries}))
