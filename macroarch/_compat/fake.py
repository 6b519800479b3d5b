"""Fake tensors: shapes, dtypes and devices without data, so a full-size model is built and measured in no memory.

``FakeTensorMode`` is what ``torch.compile`` and ``torch.export`` trace with; torch documents it, but it lives in the
private ``torch._subclasses.fake_tensor`` and has no public path. It is imported when a fake mode is asked for,
never at ``import macroarch``; a torch without it gets an error naming the release. ``is_fake`` needs no private
name: it asks the same class, and is False when fake tensors do not exist here.
"""

from __future__ import annotations

import functools
from typing import Any

from macroarch._compat import version


@functools.cache
def _fake_tensor_classes() -> tuple[type, type]:
    version.check("macroarch._compat.fake (fake tensors)")
    try:
        # private module, documented class: the mode that makes every new tensor fake, and the fake tensor type
        from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    except ImportError as err:
        raise version.missing("torch._subclasses.fake_tensor.FakeTensorMode", "building a model from fake tensors",
                              err) from err
    return FakeTensorMode, FakeTensor


def fake_tensor_mode(**kwargs: Any) -> Any:
    """A new ``FakeTensorMode(**kwargs)``: inside ``with``, factory functions and modules make fake tensors."""
    mode, _ = _fake_tensor_classes()
    return mode(**kwargs)


def is_fake(tensor: Any) -> bool:
    """Whether ``tensor`` is a fake tensor (one made under ``fake_tensor_mode``)."""
    try:
        _, fake_tensor = _fake_tensor_classes()
    except RuntimeError:
        return False
    return isinstance(tensor, fake_tensor)
