"""Fixtures of the MVAS tests."""

import pytest

from macroarch.mvas.packed.weight import MVASWeight


@pytest.fixture
def torch_function_calls(monkeypatch):
    """The functions ``MVASWeight.__torch_function__`` is called for from now on in the test: a list that grows
    (each call costs ~1.5-3 us of Python on a hot path such as a linear layer or ``zero_grad``)."""
    seen = []
    original = MVASWeight.__torch_function__.__func__

    def counting(cls, func, types, args=(), kwargs=None):
        seen.append(func)
        return original(cls, func, types, args, kwargs)

    monkeypatch.setattr(MVASWeight, "__torch_function__", classmethod(counting))
    return seen
