"""The benchmarks are scripts (``benchmarks/*.py``, importing their shared ``_common`` as a sibling module), not a
package: ``load_benchmark("optimizer_step")`` imports one by path for tests of its pure functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="session")
def load_benchmark():
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))

    def load(name: str):
        key = f"benchmarks_{name}"
        if key not in sys.modules:
            spec = importlib.util.spec_from_file_location(key, BENCHMARKS / f"{name}.py")
            module = importlib.util.module_from_spec(spec)
            sys.modules[key] = module
            spec.loader.exec_module(module)
        return sys.modules[key]

    return load
