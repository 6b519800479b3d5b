"""The shims' guards and fallbacks (macroarch._compat), as a torch whose private names moved would meet them."""

from __future__ import annotations

import contextlib
import re
import sys

import pytest
import torch

from macroarch._compat import autograd, cpu, dispatch, fake, memtracker, subclass, version
from macroarch.measure import machine


def test_the_release_is_parsed_from_torch_version(monkeypatch):
    for text, release in (("2.14.1+cu130", (2, 14)), ("2.13.0", (2, 13)), ("2.15.0a0+git1234", (2, 15))):
        monkeypatch.setattr(torch, "__version__", text)
        assert version.torch_release() == release
    monkeypatch.setattr(torch, "__version__", "2.15.0a0+git1234")
    assert not version.tested()


def test_the_error_names_the_private_name_the_release_and_the_range(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.16.0")
    err = version.missing("torch._C._gone", "telling passes apart", AttributeError("no _gone"))
    text = str(err)
    for part in ("torch._C._gone", "telling passes apart", "torch 2.16.0", "outside",
                 "pip install 'torch>=2.13,<2.15'"):
        assert part in text, (part, text)


def test_an_untested_release_warns_once_per_shim(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.16.0")
    version.check.cache_clear()
    with pytest.warns(RuntimeWarning, match=re.escape("torch 2.16.0 is outside")):
        assert version.check("a shim") is False
    version.check.cache_clear()


def test_machine_info_never_raises_when_the_onednn_probe_is_gone(monkeypatch):
    """A torch without oneDNN's private probe: the public facts answer, and start_run's machine entry is built."""
    def gone():
        raise RuntimeError("no such op")

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", gone, raising=False)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", gone, raising=False)
    expected = torch.backends.mkldnn.is_available() and torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    assert cpu.onednn_bf16() is expected
    assert cpu.onednn_fp16() is bool(cpu.cpu_flags() & {"avx512_fp16", "amx_fp16"})
    info = machine.machine_info()
    assert isinstance(info["native_bf16"], bool) and isinstance(info["native_fp16"], bool)


def test_without_oneDNN_nothing_is_native(monkeypatch):
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert not machine.native_bf16_cpu() and not machine.native_fp16_cpu()


def test_the_torch_function_fallback_is_a_plain_context(monkeypatch):
    """DGR reads .grad inside subclass.torch_function_disabled(); without the private guard, a plain context."""
    monkeypatch.delattr(torch._C, "DisableTorchFunctionSubclass")
    context = subclass.torch_function_disabled()
    assert isinstance(context, contextlib.nullcontext)
    with context:
        assert torch.ones(2).sum().item() == 2


def test_tensors_in_finds_every_tensor_of_an_ops_arguments():
    a, b, c = torch.ones(1), torch.zeros(2), torch.ones(3)
    tree = ((a, [1, b]), {"x": c, "y": "s"}, torch.return_types.max((a, b)))
    assert [t.shape for t in dispatch.tensors_in(tree)] == [a.shape, b.shape, c.shape, a.shape, b.shape]


def test_fake_tensors_have_shapes_and_no_data():
    with fake.fake_tensor_mode():
        t = torch.empty(1 << 40, dtype=torch.uint8)  # a terabyte, allocated nowhere
    assert fake.is_fake(t) and t.shape == (1 << 40,)
    assert not fake.is_fake(torch.empty(1))


def test_a_moved_autograd_call_is_an_error_that_names_it(monkeypatch):
    autograd._graph_task_id.cache_clear()
    try:
        expected = r"needs torch\._C\._current_graph_task_id, which torch " + re.escape(torch.__version__)
        with monkeypatch.context() as patch, pytest.raises(RuntimeError, match=expected):
            patch.delattr(torch._C, "_current_graph_task_id")
            autograd.backward_pass_id()
    finally:
        autograd._graph_task_id.cache_clear()
    assert autograd.backward_pass_id() == -1  # outside backward


def test_a_moved_memtracker_is_an_error_that_names_it(monkeypatch):
    memtracker._tracker_class.cache_clear()
    monkeypatch.setitem(sys.modules, "torch.distributed._tools.mem_tracker", None)  # import fails
    try:
        with pytest.raises(RuntimeError, match=r"memory by category needs torch\.distributed\._tools\.mem_tracker"):
            memtracker.tracker(lambda *change: None)
    finally:
        memtracker._tracker_class.cache_clear()


def test_the_memtracker_reports_each_storage_once_and_frees_it():
    events = []
    tracker = memtracker.tracker(lambda key, old, ob, new, nb: events.append((old, ob, new, nb)))
    tracker.track_external(torch.nn.Linear(1, 1))
    with tracker:
        x = torch.ones(1024)  # 4 KiB, freed below
        del x
    added = [e for e in events if e[0] is None and e[3] == 4096]
    freed = [e for e in events if e[2] is None and e[1] == 4096]
    assert len(added) == 1 and len(freed) == 1, events
