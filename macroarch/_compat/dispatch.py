"""Dispatch below the Python API: the base class of an op-counting mode, and the tensors in an op's arguments.

- ``TorchDispatchMode`` (``measure.hardware.OpCounter`` subclasses it to see every aten op a step runs): the class
  torch documents for dispatch modes lives in the private ``torch.utils._python_dispatch``. A subclass needs its base
  when it is defined, so this one name is imported when this module is (never at ``import macroarch``: only the
  measurement modules import this shim); a torch without it gets a stand-in whose construction raises an error
  naming the release, so the importing module still imports.
- ``tensors_in(tree)``: the tensors in an op's nested arguments. torch's ``_pytree`` would do it; aten arguments and
  results are tuples, lists and dicts (``return_types`` are tuples), so a plain walk does it without a private name.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from macroarch._compat import version

version.check("macroarch._compat.dispatch (op counting)")
try:
    # private module, documented class (torch's "Extending PyTorch" guide); no public path in torch 2.13-2.14
    from torch.utils._python_dispatch import TorchDispatchMode
except ImportError as _error:  # a stand-in, so that `class OpCounter(TorchDispatchMode)` still imports
    _missing = _error

    class TorchDispatchMode:  # type: ignore[no-redef]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise version.missing("torch.utils._python_dispatch.TorchDispatchMode", "counting a step's aten ops",
                                  _missing)


def tensors_in(tree: Any) -> list[Any]:
    """Every tensor in a nesting of tuples, lists and dicts (an op's ``args``, ``kwargs`` and result), in order."""
    import torch

    return [leaf for leaf in _leaves(tree) if isinstance(leaf, torch.Tensor)]


def _leaves(tree: Any) -> Iterator[Any]:
    if isinstance(tree, tuple | list):
        for item in tree:
            yield from _leaves(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _leaves(item)
    else:
        yield tree
