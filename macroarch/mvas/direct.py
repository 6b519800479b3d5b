"""Calling a compiled kernel straight: the direct calls of ``macroarch.mvas.compiled``.

After its first call is checked, a kernel is called straight into the callable Inductor compiled for dynamo's
graph (``_Direct``: the graph's inputs are taken from the kernel's arguments), without dynamo's frame evaluation,
guard checks and config patch on every call; kernels run between a model's matmuls, where that per-call Python
is slow (caches cold): 233 -> 91 us per fp8 dequantisation of a 672x256 weight. It is built only where the rows
are symbolic and every graph input is an argument or its row count; elsewhere calls go through dynamo. Where
AOTAutograd's runtime wrapper only switches grad off and bumps versions (``_inductor_call``), the call goes below
it and dynamo's disable wrapper too, into Inductor's own callable: about 5 us less a call in a tight loop, 15-30
between a model's matmuls (98 kernel calls a step at 1024 tokens in ``benchmarks/mvas.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._C._dynamo.eval_frame import set_eval_frame as _set_eval_frame

_CAPTURED: dict[tuple, tuple] = {}  # kernel -> (graph, compiled callable, example inputs) from ``compiled._Inductor``


def _leaves(args: tuple) -> list[Any]:
    """A kernel's arguments with tuples flattened (one level, as ``_signature`` reads them)."""
    return [leaf for a in args for leaf in (a if type(a) is tuple else (a,))]


def _inductor_call(fn: Callable[..., Any]) -> tuple[Callable[[list], Any], tuple[int, ...]] | None:
    """Inductor's own callable inside ``fn`` (what the backend returned for dynamo's graph: dynamo's disable wrapper
    around AOTAutograd's runtime wrapper around a ``CompiledFxGraph``) and the indices of the inputs it writes, where
    the wrappers do no more than ``_Direct.invoke`` does in their place: switch grad mode off, leave dynamo's frame
    evaluation, bump the version counters of the inputs written in place (and mark the output's dynamic dimensions
    for a dynamo trace, which a direct call never feeds). Anything else in AOTAutograd's generated wrapper
    (mutations applied after the call, outputs that alias inputs, autocast off, ...) or an input Inductor checks for
    alignment: None (the call keeps the wrappers). Read from the wrappers' closures (torch 2.14's layout; another
    layout finds nothing and answers None)."""
    from torch._inductor.output_code import CompiledFxGraph

    orchestration = None
    inner = fn
    while hasattr(inner, "__wrapped__"):
        cells = getattr(inner, "__closure__", None) or ()
        names = getattr(getattr(inner, "__code__", None), "co_freevars", ())
        for name, cell in zip(names, cells):
            if name == "_codegen_runtime_wrapper":
                orchestration = cell.cell_contents
        inner = inner.__wrapped__
    if not isinstance(inner, CompiledFxGraph) or orchestration is None or inner.inputs_to_check \
            or not getattr(inner, "_boxed_call", False) or inner.current_callable is None:
        return None
    used = {name for name in orchestration.__globals__ if not name.startswith("__")}
    if used - {"torch", "_mark_dynamic_", "_increment_version_"} - {n for n in used if n.startswith("_dyn_dims_")}:
        return None
    return inner.current_callable, tuple(inner.mutated_input_idxs)


def without_grad(fn: Callable[..., Any], inputs: list[Any]) -> Any:
    """``fn(*inputs)`` with grad mode off: ``torch.no_grad()`` without its context manager, whose ~1.4 us of Python
    sit on the path of every compiled kernel call (each weight read, each step of a tensor)."""
    grad = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)
    try:
        return fn(*inputs)
    finally:
        torch._C._set_grad_enabled(grad)


class _Direct:
    """A compiled kernel called straight: the callable Inductor made for dynamo's graph, given the graph's inputs
    (tensors, and the row counts of the symbolic sizes) taken from the kernel's arguments, without dynamo's frame
    evaluation, guards and config patch around each call. Interleaved with a model's matmuls (caches cold), that
    is 233 against 74 us per fp8 dequantisation of a 672x256 weight (measured, one core), and the matmul after it
    runs faster too. Built once per kernel signature (``_check``) and only where every graph input is an argument,
    or the first (row) dimension of a 2-D one, and the rows are symbolic: any tensor of that signature then
    satisfies the graph's guards (dtypes, devices and row lengths are the signature, contiguity ``_eligible``)."""

    __slots__ = ("fn", "plan", "returns", "inner", "written")

    def __init__(self, fn: Callable[..., Any], plan: list[tuple[int, int | None]], returns: bool) -> None:
        self.fn, self.plan, self.returns = fn, plan, returns
        found = _inductor_call(fn)
        self.inner, self.written = found if found is not None else (None, ())

    def __call__(self, args: tuple) -> Any:
        return self.invoke(self.inputs(args))

    def invoke(self, inputs: list[Any]) -> Any:
        """The kernel on its graph inputs ``inputs`` (left as they are): straight into Inductor's callable where
        ``_inductor_call`` found it (each wrapper layer costs 5 us a call in a tight loop, 15-30 us between a model's
        matmuls), else through the wrappers."""
        if self.inner is None:
            outputs = without_grad(self.fn, inputs)
        else:
            prior = _set_eval_frame(None)  # what dynamo's disable wrapper does: no frame below is traced
            grad = torch.is_grad_enabled()
            torch._C._set_grad_enabled(False)
            try:
                outputs = self.inner(list(inputs))  # Inductor's call empties the list it is given
            finally:
                torch._C._set_grad_enabled(grad)
                if prior is not None:
                    _set_eval_frame(prior)
            if self.written:  # as AOTAutograd's wrapper does: autograd sees the in-place writes
                torch.autograd.graph.increment_version([inputs[i] for i in self.written])
        return outputs[0] if self.returns else None

    def inputs(self, args: tuple) -> list[Any]:
        """The graph's inputs taken from the kernel's arguments ``args``."""
        leaves = _leaves(args)
        return [leaves[i] if dim is None else leaves[i].shape[dim] for i, dim in self.plan]

    def bind(self, args: tuple) -> Callable[[], Any]:
        """The call on ``args``, its graph inputs gathered once (a caller that keeps it skips even that)."""
        invoke, inputs = self.invoke, self.inputs(args)
        return lambda: invoke(inputs)

    @staticmethod
    def build(key: tuple, args: tuple, result: Any) -> _Direct | None:
        """The direct call of kernel ``key`` as just compiled by a call on ``args`` that returned ``result`` (a
        tensor or None), or None where it is not safe (then calls go through dynamo)."""
        captured = _CAPTURED.pop(key, None)
        if captured is None or not (result is None or isinstance(result, torch.Tensor)):
            return None
        gm, fn, example = captured
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        outputs = gm.graph.output_node().args[0]
        if len(placeholders) != len(example) or len(outputs) != (result is not None) or any(
                getattr(o, "op", None) not in ("call_function", "call_method") for o in outputs):
            return None
        leaves = _leaves(args)
        where = {id(t): i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)}
        symbols: dict[str, tuple[int, int]] = {}
        plan: list[Any] = []
        for node, value in zip(placeholders, example):
            if isinstance(value, torch.SymInt):
                plan.append(str(value.node.expr))
                continue
            fake = node.meta.get("example_value")
            index = where.get(id(value)) if isinstance(value, torch.Tensor) else None
            if index is None or not isinstance(fake, torch.Tensor) or fake.dim() != value.dim():
                return None
            for dim, size in enumerate(fake.shape):
                if isinstance(size, torch.SymInt):
                    if dim != 0 or value.dim() != 2:  # only the rows are dynamic
                        return None
                    symbols.setdefault(str(size.node.expr), (index, 0))
                elif size != value.shape[dim]:
                    return None
            if value.dim() == 2 and not isinstance(fake.shape[0], torch.SymInt):
                return None  # compiled for these rows only
            plan.append((index, None))
        for i, entry in enumerate(plan):
            if isinstance(entry, str):
                if entry not in symbols:
                    return None
                plan[i] = symbols[entry]
        return _Direct(fn, plan, result is not None)
