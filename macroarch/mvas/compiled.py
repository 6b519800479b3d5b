"""Running a kernel compiled, each kernel checked once against its eager source: the machinery of
``macroarch.mvas.kernels`` (issue 14).

A kernel is a function of plain tensor ops registered here (``register``); ``run`` calls it compiled by
``torch.compile`` (Inductor: C++/OpenMP on CPU, Triton on CUDA) or eagerly, counts what it did
(``compile_stats``), and checks the first compiled call of each kernel against the eager call.

**Compilation.** The number of rows is dynamic (``maybe_mark_dynamic``): one kernel serves every tensor length, so
a model compiles one kernel per storage combination (weight format and block size, moment format, gradient
dtype, rounding), a handful, not one per tensor; the scalars (learning rate, bias corrections) are graph
inputs, so a new step or LR schedule never recompiles. ``compile_stats()`` reports the seconds spent compiling
(first calls that compiled) apart from the calls that ran. Inductor's on-disk cache (FX graph and C++ code)
makes a second process start fast. ``compile=False`` on a call, or the environment variable
``MACROARCH_COMPILE=0``, runs the eager path. The eager path also runs where a compiled kernel cannot: fake or
meta tensors (memory measurements), under a dispatch mode (memory tracker, op counters), inside a
``torch.compile`` of the model (the same code is traced into the model's graph), on other devices. A
dequantisation of fewer than ``kernels.MIN_COMPILED_DEQUANTIZE`` elements runs eagerly too, where that is faster.

**Direct calls.** After the check, a kernel is called without dynamo and AOTAutograd around it where that is safe
(``macroarch.mvas.direct``).

**Native kernels.** A kernel may have hand-written stand-ins for some of its calls (``register``'s ``native``): the
step of ``MVASAdamW``'s fp8 and fp4 storages on CPU (``macroarch.mvas.native``). One runs where it covers a call, in
place of Inductor's kernel, under the same check, statistics and failure handling.

**The cache and the CPU's vector ISA.** Inductor's FX graph cache stores the generated C++ source, whose loops
are tiled for the vector width ``pick_vec_isa()`` chose at code generation (a step of 16 floats for AVX-512, 8 for
AVX2), but on CPU its key holds no ISA (``CacheBase.get_system`` hashes only GPU properties; torch 2.14). The source
is then built with the flags of the loading process's ISA. AVX-512 code built for AVX2 stores one 8-lane
``Vectorized<float>`` per 16-element step: half the output is never written (measured: elements 8-15 of every 16,
garbage or NaN: the non-finite weights of notebook 05 under ``ATEN_CPU_CAPABILITY=avx2`` with a cache filled by
an AVX-512 run); AVX2 code built for AVX-512 stores 16 lanes per 8-element step, past the end of the buffer
(measured: ``malloc(): unaligned tcache chunk detected``). No op of ``decode`` is miscompiled: with a fresh cache
the compiled kernels are exact under either ISA. The same class of omission, for the thread count, is pytorch
issues #160812 and #167463 (fixed by PRs #184444, #185312); PR #195354 gates ``aot_compile`` artifacts on the
resolved ISA for this reason; PR #123514 made ``pick_vec_isa`` honour ``ATEN_CPU_CAPABILITY``. Fix: the kernels
compile with ``cpp.simdlen`` pinned to the picked ISA's width, a config value that is part
of the cache key and selects the same ISA, so each width gets its own entry (``codegen.options``). Other
``torch.compile`` calls in a process (a compiled model) keep the exposure: one cache directory per ISA avoids it.

**Guard.** A miscompile on some other ISA, compiler or torch version must not corrupt a user's weights silently:
the first compiled call of each kernel (``_signature``: static arguments, dtypes, row lengths) in a process is
checked against the eager path on the same inputs. The dequantisation compares bitwise; the step runs compiled
on copies of what it writes and eagerly on the caller's tensors, and compares within the bounds of
``macroarch.mvas.kernels``' Equality section (fp32 within 2^-16, codes: at most 2% one grid step apart,
``guard.CODE_FLIPS``); where they agree the caller's tensors get the compiled values, as from every later call (a
run does not depend on whether its kernels were checked earlier in the process). On a mismatch the eager values
stay, it warns once, naming the kernel, ``vec_isa()`` and what differed, and that kernel runs eagerly for the rest
of the process.
Cost, once per kernel: an eager run, copies and a comparison (measured at 2^20 elements, one loaded core: 0.18 s
for an fp8 step, against 7 ms compiled; 9 ms for an fp8 dequantisation); ``compile_stats()`` reports
``checks``, ``check_seconds`` and ``mismatches``. A kernel that cannot compile at all (no working C++ compiler, which
torch.compile needs on CPU; an Inductor error) warns once and runs eagerly, the same values: ``compile_failures``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from macroarch.mvas import codegen
from macroarch.mvas.codegen import vec_isa
from macroarch.mvas.direct import _CAPTURED, _Direct, _inductor_call, _leaves, without_grad  # noqa: F401 (kernels, tests)
from macroarch.mvas.guard import CompileFailed, _bitwise_difference, _step_difference, failure

__all__ = ["ENV", "compile_enabled", "compile_stats", "register", "reset_compile_stats",
           "run", "vec_isa"]

ENV = "MACROARCH_COMPILE"
"""Set to ``0`` (or ``false``) to run every kernel eagerly."""
_RECOMPILE_LIMIT = 64  # storage combinations a process may compile (torch's default of 8 is per function)
_STATS = {"compile_seconds": 0.0, "compiles": 0, "compiled_calls": 0, "eager_calls": 0, "checks": 0,
          "check_seconds": 0.0, "mismatches": 0, "compile_failures": 0}
_FAILED: dict[str, str] = {}  # kernel name -> why it could not be compiled in this process (``_compile_failed``)
_GUARD = True  # check the first compiled call of each kernel against the eager path (``_check``)
# kernel (name, ``_signature``) -> how it runs after its first compiled call was checked: a ``_Direct`` (compiled,
# called straight) or a native kernel (``register``'s ``native``), True (compiled, through dynamo: no direct call was
# captured), False (it differed: eager)
_VERIFIED: dict[tuple, Any] = {}
_COMPILED: dict[str, Any] = {}
_PENDING: list[tuple] = []  # the kernel (name, ``_signature``) a compiled call may compile now (``_Inductor``)
_SOURCES: dict[str, Any] = {}  # kernel name -> its eager source (``register``)
_NATIVE: dict[str, Any] = {}  # kernel name -> its native kernels' factory (``register``)
_DEVICES = ("cpu", "cuda")
# os.environ's own mapping (CPython's ``os._Environ``: what os.environ, putenv and pytest's monkeypatch keep current),
# read straight: compile_enabled is on the path of every weight read, and os.environ.get costs ~0.7 us of Python
_ENVIRON = getattr(os.environ, "_data", None) if hasattr(os.environ, "encodekey") else None
_ENV_KEY = os.environ.encodekey(ENV) if _ENVIRON is not None else None


def compile_enabled(compile: bool | None = None) -> bool:
    """``compile`` if given, else whether ``MACROARCH_COMPILE`` allows it (default: yes)."""
    if compile is not None:
        return bool(compile)
    value = _ENVIRON.get(_ENV_KEY) if _ENVIRON is not None else os.environ.get(ENV)
    if value is None:
        return True
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    return value.strip().lower() not in ("0", "false", "no", "off")


def compile_stats() -> dict[str, float]:
    """Seconds spent in calls that compiled (``compile_seconds``), how many compiled (``compiles``), and the
    calls that ran compiled or eager since the process started (or ``reset_compile_stats``)."""
    return dict(_STATS)


def reset_compile_stats() -> None:
    for key in _STATS:
        _STATS[key] = 0.0 if key.endswith("_seconds") else 0


def register(name: str, source: Callable[..., Any], native: Callable[[tuple], Any] | None = None) -> None:
    """Make ``source`` (plain tensor ops, the eager reference) the kernel ``name`` that ``run`` calls. ``native``:
    given a call's compiled-kernel arguments, a hand-written kernel that computes the same for them (a callable of
    the arguments, with ``compile_seconds``; ``macroarch.mvas.native``), or None where Inductor's kernel runs. A
    native kernel stands in for the compiled one: checked against the eager path on its first call, the same way."""
    _SOURCES[name] = source
    _COMPILED.pop(name, None)
    if native is None:
        _NATIVE.pop(name, None)
    else:
        _NATIVE[name] = native


def _unwatched() -> bool:
    """No dispatch mode watches and no ``torch.compile`` traces: what ``_eligible`` needs now, beyond the tensors."""
    return not (torch._C._len_torch_dispatch_stack() or torch.compiler.is_compiling())


def _eligible(tensors: list[torch.Tensor | None]) -> bool:
    """Whether a compiled kernel may run on ``tensors`` now (module docstring: where the eager path runs)."""
    if not _unwatched():
        return False
    for t in tensors:
        if t is None:
            continue
        kind = type(t)
        if kind is not torch.Tensor and kind is not torch.nn.Parameter or t.device.type not in _DEVICES \
                or not t.is_contiguous():
            return False
    return True


def _rows(t: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """``t`` (contiguous) as ``rows`` rows: every input of a kernel has the same symbolic first dimension and a
    static second one, so the compiled loops see whole blocks without index arithmetic."""
    return None if t is None else t.view(rows, -1)


def _row_length(*units: int) -> int:
    """The shortest row of whole ``units`` (blocks, fp4 bytes): their least common multiple."""
    return math.lcm(*units)  # 1 for none


def _signature(args: tuple) -> tuple:
    """What makes a distinct compiled kernel: the static arguments, and the dtype, device and row length (not the
    number of rows, which is symbolic) of every tensor (args are tensors, None, static values and tuples of them)."""
    parts: list[Any] = []
    for a in args:
        for leaf in a if type(a) is tuple else (a,):
            if isinstance(leaf, torch.Tensor):
                parts.append((leaf.dtype, leaf.device.type, leaf.shape[1] if leaf.dim() == 2 else tuple(leaf.shape)))
            else:
                parts.append(leaf)
    return tuple(parts)


@functools.cache
def _dynamo_patch() -> Any:
    """The dynamo config the kernels compile under, built once (building one costs a class) and entered on every
    call (a ContextVar stack: re-entrant and thread-safe)."""
    return torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT, capture_scalar_outputs=True,
                                      accumulated_recompile_limit=4 * _RECOMPILE_LIMIT)


class _Inductor(torch._TorchCompileInductorWrapper):
    """``backend="inductor"`` (the same compilation, options and cache keys) that also keeps what it compiles for
    the kernel ``_compiled`` is compiling (``_PENDING``) in ``_CAPTURED``, for ``_Direct.build``."""

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list, **kwargs: Any) -> Any:
        with codegen.vector_bitcasts():
            compiled = super().__call__(gm, example_inputs, **kwargs)
        if _PENDING and _PENDING[-1] is not None:
            _CAPTURED[_PENDING[-1]] = (gm, compiled, list(example_inputs))
        return compiled


_PRIMS = False  # Inductor's prims are registered (torch._inductor.inductor_prims, 1.3 s to import: not at start-up)


def _compiled(name: str, args: tuple, mark: bool = True) -> Any:
    """Call the compiled kernel ``name``; ``mark``: mark the row dimensions dynamic (needed until the kernel of this
    signature has compiled: after that its graph's row count is symbolic and any tensor passes its guards), and
    run under the dynamo config patch. The dequantisation's graph has no ``.item()``, so once its signature has
    compiled it runs without the patch (entering it is a fifth of a small kernel's call: 27 of 165 us measured)."""
    global _PRIMS
    if name not in _COMPILED:
        try:
            from torch._inductor import inductor_prims  # noqa: F401  (registers the prim of codecs._stored_once)

            _PRIMS = True
            _COMPILED[name] = torch.compile(_SOURCES[name], dynamic=False, fullgraph=True,
                                            backend=_Inductor(None, codegen.options(), False))
        except Exception as exc:  # noqa: BLE001  (options() compiles a test program: no C++ compiler, say)
            raise CompileFailed() from exc
    if mark:
        for t in torch.utils._pytree.tree_leaves(args[:-1]):  # the number of rows is symbolic (one kernel for every
            if isinstance(t, torch.Tensor) and t.dim() == 2:  # size); formats, blocks and row lengths are static
                torch._dynamo.maybe_mark_dynamic(t, 0)
    from torch._dynamo.utils import counters

    graphs = counters["stats"]
    before = graphs["unique_graphs"]
    start = time.perf_counter()
    # Kernels never need autograd nor tensor subclasses. The same global state for every caller (forward inside
    # MVASWeight's dispatch runs below autograd with subclass torch functions off, backward without grad) keeps
    # one compiled kernel valid for all of them.
    _PENDING.append((name, _signature(args)) if mark else None)
    try:
        with _dynamo_patch() if mark or name != "dequantize" else contextlib.nullcontext(), torch.no_grad(), \
                torch._C._AutoDispatchBelowADInplaceOrView(), torch._C.DisableTorchFunctionSubclass():
            result = _COMPILED[name](*args)
    except Exception as exc:  # noqa: BLE001  (whatever compiling raised: run answers eagerly, _compile_failed)
        if not mark:  # a kernel already checked: not a compilation
            raise
        raise CompileFailed() from exc
    finally:
        _PENDING.pop()
    if graphs["unique_graphs"] != before:
        _STATS["compile_seconds"] += time.perf_counter() - start
        _STATS["compiles"] += graphs["unique_graphs"] - before
    _STATS["compiled_calls"] += 1
    return result


def run(name: str, rows: int | None, args: tuple, eager_args: tuple | None = None, written: Any = None,
        key: tuple | None = None) -> Any:
    """Run kernel ``name`` compiled on ``args`` (rows), or, ``rows`` None (the caller found that no compiled kernel
    may run: ``compile_enabled``, ``_eligible``), eagerly on ``eager_args`` (default ``args``). The first compiled
    call of each kernel (``_signature``) in a process is checked against the eager path (``_check``); ``written``: a
    function of ``args`` giving the tensors the step writes in place with their formats, None for the
    dequantisation; ``key``: ``(name, _signature(args))`` where the caller kept it."""
    source = _SOURCES[name]
    eager_args = args if eager_args is None else eager_args
    if rows is None:
        _STATS["eager_calls"] += 1
        return source(*eager_args)
    key = key or (name, _signature(args))
    verdict = _VERIFIED.get(key)
    if verdict is True:
        return _compiled(name, args, mark=False)
    if verdict:  # a _Direct
        _STATS["compiled_calls"] += 1
        return verdict(args)
    if verdict is False or name in _FAILED:  # it differed from the eager path, or could not compile: eager from then on
        _STATS["eager_calls"] += 1
        return source(*eager_args)
    try:
        native = _native(name, args)
        if _GUARD:
            return _check(name, key, args, eager_args, None if written is None else written(args), native)
        if native is not None:
            _VERIFIED[key] = native
            _STATS["compiled_calls"] += 1
            return native(args)
        return _compiled(name, args)
    except CompileFailed as failed:  # raised before anything was written: the caller's tensors are as they were
        return _compile_failed(name, failed.__cause__, source, eager_args)


def _native(name: str, args: tuple) -> Any:
    """The native kernel of ``name`` for ``args`` (built now; its build time counts as compiling), or None."""
    factory = _NATIVE.get(name)
    if factory is None:
        return None
    try:
        native = factory(args)
    except Exception as exc:  # noqa: BLE001  (no working C++ compiler, say: as a compilation that failed)
        raise CompileFailed() from exc
    if native is not None and native.compile_seconds:
        _STATS["compile_seconds"] += native.compile_seconds
        _STATS["compiles"] += 1
    return native


def _compile_failed(name: str, error: BaseException | None, source: Callable[..., Any], eager_args: tuple) -> Any:
    """Kernel ``name`` could not be compiled (module docstring): warn once, run it and its later calls eagerly."""
    _FAILED[name] = failure(error)
    _STATS["compile_failures"] += 1
    _STATS["eager_calls"] += 1
    warnings.warn(f"macroarch.mvas.kernels: the {name} kernel could not be compiled ({_FAILED[name]}); this process "
                  f"runs it eagerly from now on (the same values, slower). torch.compile needs a C++ compiler on CPU "
                  f"(torch._inductor.config.cpp.cxx); {ENV}=0 skips compiling.", RuntimeWarning, stacklevel=4)
    return source(*eager_args)


def _check(name: str, key: tuple, args: tuple, eager_args: tuple, written: list[tuple[Any, str]] | None,
           native: Any = None) -> Any:
    """The first compiled call of a kernel: the compiled kernel runs on copies of what it writes, the eager path on
    the caller's tensors, and the two results are compared (the dequantisation bitwise, the step within the bounds
    of ``macroarch.mvas.kernels``). Where they agree, the compiled values are copied into the caller's tensors: the
    step checked is then the one every later call runs, so the same training run twice in a process gives the same
    bits (with the eager values kept, the first run's first step was the eager one, whose block scales may be an
    ulp apart, and its losses drifted from the second run's in the fourth decimal within four steps). A mismatch
    keeps the eager values, warns once and sends this kernel to the eager path for the rest of the process."""
    start = time.perf_counter()
    if written is None:
        result = _compiled(name, args)
        start = time.perf_counter()  # the compiled call is the caller's own; the check costs the rest
        direct = _Direct.build(key, args, result)
        if direct is not None:  # what later calls run is what is checked
            result = direct(args)
        expected = _SOURCES[name](*eager_args).view(result.shape)
        problem = _bitwise_difference(result, expected)
        result = expected
    else:
        originals = [t for t, _ in written if t is not None]
        copies = {id(t): t.clone() for t in originals}
        swap = lambda t: copies.get(id(t), t) if isinstance(t, torch.Tensor) else t  # noqa: E731
        compiled_args = torch.utils._pytree.tree_map(swap, args)
        lap = time.perf_counter()
        if native is None:
            _compiled(name, compiled_args)
            start += time.perf_counter() - lap
            direct = _Direct.build(key, compiled_args, None)
            if direct is not None:  # the direct call, from the same values, is what later calls run: check that
                for t in originals:
                    copies[id(t)].copy_(t)
                direct(compiled_args)
        else:  # what later calls run
            native(compiled_args)
            start += time.perf_counter() - lap
            direct = native
            _STATS["compiled_calls"] += 1
        result = _SOURCES[name](*eager_args)
        _STATS["eager_calls"] += 1
        problem = None
        for t, fmt in written:
            if t is not None and problem is None:
                problem = _step_difference(copies[id(t)], t, fmt)
        if problem is None:  # what later calls compute, from the first step on
            for t in originals:
                t.copy_(copies[id(t)])
    _STATS["check_seconds"] += time.perf_counter() - start
    _STATS["checks"] += 1
    _VERIFIED[key] = False if problem is not None else direct or True
    if problem is not None:
        _STATS["mismatches"] += 1
        spec = args[-1] if name == "adamw_step" else "format {}, block {}, {}".format(*args[2:5])
        kind = "compiled" if native is None else "native"
        warnings.warn(f"macroarch.mvas.kernels: the {kind} {name} kernel for {spec} differs from the eager path "
                      f"on vector ISA {vec_isa()!r} ({problem}); this process runs that kernel eagerly from now on. "
                      "A stale Inductor cache (TORCHINDUCTOR_CACHE_DIR) written under another ISA is one cause.",
                      RuntimeWarning, stacklevel=4)
    return result
