"""The compatibility subset: what a user's environment must run on every torch release the package supports.

``make compat`` runs this folder alone in a scratch venv that holds the oldest supported torch and only the
package's own dependencies (no transformers, nbformat, W&B...), so nothing here may import more than
``macroarch`` and its declared dependencies, and only through the public API (``__all__`` of each package).
The main suite collects it too, on the lock's torch. ``--confcutdir=tests/compat`` keeps ``tests/conftest.py``
(which needs the notebook extras) out of the compat run, so the one fixture this folder needs lives here.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("MACROARCH_COMPILE", "0")  # the eager kernels; test_mvas's compiled case asks for compile=True


def pytest_report_header(config):
    import torch

    return f"macroarch compatibility subset on torch {torch.__version__}"


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: intra-op threads only add contention on a shared machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
