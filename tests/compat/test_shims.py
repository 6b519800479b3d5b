"""The shims' guards and fallbacks (macroarch._compat), as a torch whose private names moved would meet them."""

from __future__ import annotations

import contextlib
import re
import sys
from pathlib import Path

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


# -- one version guard for every shim ---------------------------------------------------------------------------------
SHIM_DIR = Path(version.__file__).parent


def _shim_sources() -> dict[str, str]:
    return {p.stem: p.read_text() for p in sorted(SHIM_DIR.glob("*.py")) if p.stem not in ("__init__", "version")}


@pytest.mark.parametrize("shim", sorted(_shim_sources()))
def test_every_shim_checks_the_one_range(shim):
    """Each shim asks ``version.check`` (the range pyproject declares) and keeps no list of releases of its own."""
    import ast

    tree = ast.parse(_shim_sources()[shim])
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == "check" and isinstance(n.func.value, ast.Name) and n.func.value.id == "version"]
    assert calls, f"macroarch/_compat/{shim}.py never calls version.check"
    for node in tree.body:
        value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
        releases = value is not None and isinstance(value, ast.Tuple) and any(
            isinstance(e, ast.Tuple) and all(isinstance(x, ast.Constant) and isinstance(x.value, int) for x in e.elts)
            for e in value.elts)
        assert not releases, f"macroarch/_compat/{shim}.py:{node.lineno} lists releases of its own: use version"


@pytest.mark.parametrize("release", ["2.12.0", "2.16.0"])
def test_a_release_on_either_side_of_the_range_warns(monkeypatch, release):
    """Below the oldest release as above the newest (the subclass shim checked only the oldest, compile none)."""
    from macroarch._compat import compile as compile_shim

    monkeypatch.setattr(torch, "__version__", release)
    version.check.cache_clear()
    subclass.private_aten_ops.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match=re.escape(f"torch {release} is outside")):
            subclass.private_aten_ops()
        with pytest.warns(RuntimeWarning, match=re.escape(f"torch {release} is outside")):
            compile_shim.below_autograd()
    finally:
        version.check.cache_clear()
        subclass.private_aten_ops.cache_clear()


# -- the shims the audit added: autograd's node order and views, DDP's buckets, the private-named ATen ops ----------
def test_the_node_order_is_the_engines_and_a_moved_one_is_an_error_that_names_it():
    x = torch.ones(2, requires_grad=True)
    first = x.exp()
    second = first.sum()
    assert autograd.sequence_nr(second.grad_fn) > autograd.sequence_nr(first.grad_fn)  # made later, runs earlier
    with pytest.raises(RuntimeError, match=r"needs torch\.autograd\.graph\.Node\._sequence_nr"):
        autograd.sequence_nr(object())


def test_a_view_is_told_from_its_base_and_without_bases_everything_counts_as_one():
    base = torch.zeros(8)
    assert autograd.is_view(base[2:4]) and autograd.is_view(base.view(2, 4)) and not autograd.is_view(base)
    assert not autograd.is_view(base[2:4].clone())
    autograd._warn_no_views.cache_clear()
    with pytest.warns(RuntimeWarning, match="has no Tensor._base"):
        assert autograd.is_view(object()) is True  # copied by the caller: correct, one copy more
    autograd._warn_no_views.cache_clear()


def test_ddps_buckets_without_the_reducer_call_are_an_error_that_names_it():
    from types import SimpleNamespace

    from macroarch._compat import distributed

    with pytest.raises(RuntimeError, match=r"sizes of DDP's buckets needs torch\.distributed\.Reducer\."):
        distributed.ddp_bucket_buffers(SimpleNamespace(reducer=object()))
    buckets = [SimpleNamespace(buffer=lambda n=n: torch.zeros(n)) for n in (3, 5)]
    ddp = SimpleNamespace(reducer=SimpleNamespace(_get_zeros_like_grad_buckets=lambda: buckets))
    assert [b.numel() for b in distributed.ddp_bucket_buffers(ddp)] == [3, 5]


def test_the_private_named_aten_ops_are_what_casts_and_reshapes_dispatch_as():
    """A dispatch mode sees ``.to(dtype)`` as the one, and ``reshape`` of a tensor it cannot view (a copy, then this
    op) as the other."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    x = torch.randn(4, 4).t()  # not contiguous: reshape cannot view it
    with Record():
        x.to(torch.float16)
        x.reshape(16)
    ops = subclass.private_aten_ops()
    assert ops.to_copy in seen and ops.unsafe_view in seen
