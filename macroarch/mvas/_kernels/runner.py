"""Running an MVAS kernel compiled by ``torch.compile``, or eagerly, each kernel checked once against its eager source.

A kernel is a function of plain tensor ops registered here (``register``); ``run`` calls it compiled by plain
``torch.compile`` (Inductor: C++/OpenMP on CPU, Triton on CUDA) or eagerly, and counts what it did
(``compile_stats``).

**Compilation.** The number of rows is dynamic: one kernel serves every tensor length, so a model compiles one
kernel per storage combination (weight format and block size, moment format, gradient dtype, rounding), a handful;
the step's scalars (learning rate, bias corrections) are graph inputs, so a new step or LR never recompiles.
``compile=False`` on a call, or ``MACROARCH_COMPILE=0``, runs the eager path. The eager path also runs where a
compiled kernel cannot: fake or meta tensors (memory measurements), under a dispatch mode (memory tracker, op
counters), inside a ``torch.compile`` of the model (the same code is then traced into the model's graph), on devices
other than CPU and CUDA. A kernel that cannot compile at all (no working C++ compiler, an Inductor error) warns once
and runs eagerly for the rest of the process: the same values, slower.

**The vector ISA and Inductor's cache.** On CPU the kernels compile with ``cpp.simdlen`` set to the width of the
vector ISA ATen dispatches to (``torch.backends.cpu.get_cpu_capability()``): the option is part of Inductor's cache
key, so code generated for one width is never loaded by a process running another (the CPU cache key holds no ISA
otherwise, and such code writes half its output or past its end: ``docs/upstream/inductor-cpu-cache-key-isa.md``).
And with ``cpp.dynamic_threads``, each call asks OpenMP for the thread count instead of running with the count of
the process that compiled it (``docs/upstream/inductor-threads-baked-in.md``).

**Guard.** A miscompile on some ISA, compiler or torch release must not corrupt a user's weights silently: the first
compiled call of each kernel (``signature``: static arguments, dtypes, row lengths) in a process is compared with
the eager source on the same inputs. The dequantisation compares bitwise; the step runs compiled on copies of what it
writes and eagerly on the caller's tensors, and compares within ``guard.step_difference``'s bounds; where they agree
the caller's tensors get the compiled values (a run does not depend on whether its kernels were checked earlier in the
process). On a mismatch the eager values stay, it warns once, naming the kernel, the ISA and what differed, and that
kernel runs eagerly for the rest of the process.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from macroarch._progress import SlowNotice
from macroarch.mvas._kernels.guard import bitwise_difference, failure, step_difference

__all__ = ["ENV", "CompileFailed", "compile_enabled", "compile_stats", "eligible", "register", "reset_compile_stats",
           "run", "signature", "unwatched", "vec_isa"]

ENV = "MACROARCH_COMPILE"
"""Set to ``0`` (or ``false``, ``no``, ``off``) to run every kernel eagerly."""
RECOMPILE_LIMIT = 64  # storage combinations one kernel source may compile in a process
NOTICE_AFTER_S = 5.0  # a first call still compiling after this long says so on screen (macroarch._progress)
_DEVICES = ("cpu", "cuda")
_STATS = {"compile_seconds": 0.0, "compiles": 0, "compiled_calls": 0, "eager_calls": 0, "checks": 0,
          "check_seconds": 0.0, "mismatches": 0, "compile_failures": 0}
_SOURCES: dict[str, Callable[..., Any]] = {}  # kernel name -> its eager source
_COMPILED: dict[str, Callable[..., Any]] = {}  # kernel name -> torch.compile of its source
_VERIFIED: dict[tuple, bool] = {}  # (name, signature) -> its first compiled call agreed with eager (False: eager)
_FAILED: dict[str, str] = {}  # kernel name -> why it could not be compiled in this process


class CompileFailed(Exception):
    """Compiling a kernel, or its first compiled call, raised (its ``__cause__``): before anything was written."""


def compile_enabled(compile: bool | None = None) -> bool:
    """``compile`` if given, else whether ``MACROARCH_COMPILE`` allows it (default: yes)."""
    if compile is not None:
        return bool(compile)
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def compile_stats() -> dict[str, float]:
    """Since the process started (or ``reset_compile_stats``): seconds spent in calls that compiled
    (``compile_seconds``), distinct kernels compiled (``compiles``), calls that ran compiled (``compiled_calls``) or
    eagerly (``eager_calls``), first-call checks (``checks``, ``check_seconds``, ``mismatches``) and kernels that
    could not compile (``compile_failures``)."""
    return dict(_STATS)


def reset_compile_stats() -> None:
    """Zero every count of ``compile_stats``."""
    for key in _STATS:
        _STATS[key] = 0.0 if key.endswith("_seconds") else 0


def vec_isa() -> str:
    """The CPU vector ISA ATen dispatches to (``AVX512``, ``AVX2``, ``DEFAULT`` ...), which the CPU kernels target."""
    return torch.backends.cpu.get_cpu_capability()


def register(name: str, source: Callable[..., Any]) -> None:
    """Make ``source`` (plain tensor ops, the eager reference) the kernel ``name`` that ``run`` calls."""
    _SOURCES[name] = source
    _COMPILED.pop(name, None)


def source(name: str) -> Callable[..., Any]:
    """The eager source of kernel ``name``."""
    return _SOURCES[name]


def unwatched() -> bool:
    """No dispatch mode watches and no ``torch.compile`` traces: what a compiled kernel needs beyond its tensors."""
    if torch.compiler.is_compiling():
        return False
    from macroarch._compat.subclass import dispatch_modes_active

    return not dispatch_modes_active()


def eligible(tensors: list[torch.Tensor | None]) -> bool:
    """Whether a compiled kernel may run on ``tensors`` now (module docstring: where the eager path runs)."""
    if not unwatched():
        return False
    for t in tensors:
        if t is None:
            continue
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type not in _DEVICES or not t.is_contiguous():
            return False
    return True


def _leaves(args: tuple) -> list[Any]:
    """The arguments of a kernel call, one level of tuples flattened (the ``(payload, scales)`` pairs)."""
    return [leaf for a in args for leaf in (a if type(a) is tuple else (a,))]


def _map(fn: Callable[[Any], Any], args: tuple) -> tuple:
    return tuple(tuple(fn(x) for x in a) if type(a) is tuple else fn(a) for a in args)


def signature(args: tuple) -> tuple:
    """What makes a distinct compiled kernel: the static arguments, and the dtype, device and row length (not the
    number of rows, which is symbolic) of every tensor."""
    return tuple((leaf.dtype, leaf.device.type, leaf.shape[1] if leaf.dim() == 2 else tuple(leaf.shape))
                 if isinstance(leaf, torch.Tensor) else leaf for leaf in _leaves(args))


def _options(args: tuple) -> dict[str, Any]:
    """Inductor options on CPU, each a workaround for an Inductor problem drafted as an upstream issue: ``cpp.simdlen``
    pinned to the ISA's width (``docs/upstream/inductor-cpu-cache-key-isa.md``: the FX-graph cache key holds no ISA),
    and ``cpp.dynamic_threads``, so that each call asks OpenMP for the thread count
    (``docs/upstream/inductor-threads-baked-in.md``: otherwise the compiling process's count is written into the
    code, and dynamo's guards do not see ``torch.set_num_threads``)."""
    if not any(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in _leaves(args)):
        return {}
    width = {"AVX512": 512, "AVX2": 256}.get(vec_isa())
    return {"cpp.dynamic_threads": True, **({"cpp.simdlen": width} if width else {})}


def _compiled(name: str, args: tuple, first: bool) -> Any:
    """Call the compiled kernel ``name``; ``first``: its signature's first call in this process (it may compile)."""
    from macroarch._compat.compile import below_autograd, kernel_config, mark_rows_dynamic

    for t in _leaves(args[:-1]):  # the number of rows is symbolic; formats, blocks and row lengths are static
        if isinstance(t, torch.Tensor) and t.dim() == 2:
            mark_rows_dynamic(t)
    start = time.perf_counter()
    # Kernels need neither autograd nor subclass torch functions; one state for every caller (forward inside
    # MVASWeight's dispatch runs below autograd, the optimizer under no_grad) keeps one compiled kernel for all.
    # A first call may compile for a minute or more (a cold Inductor cache on a small CPU): past NOTICE_AFTER_S it
    # says so on screen, and how long it took; a warm cache answers in well under that, silently.
    notice = SlowNotice(f"compiling the MVAS {name} kernel with torch.compile", after=NOTICE_AFTER_S,
                        detail="its first call for these storage formats in this process; Inductor caches the code, "
                               "so the next run starts in seconds", prefix="macroarch.mvas") if first else None
    try:
        with notice or contextlib.nullcontext():
            if name not in _COMPILED:
                _COMPILED[name] = torch.compile(_SOURCES[name], dynamic=False, fullgraph=True,
                                                options=_options(args))
            with kernel_config(RECOMPILE_LIMIT), torch.no_grad(), below_autograd():
                result = _COMPILED[name](*args)
    except Exception as exc:  # noqa: BLE001  (whatever compiling raised: ``run`` answers eagerly)
        if not first:
            raise
        raise CompileFailed() from exc
    if first:
        _STATS["compile_seconds"] += time.perf_counter() - start
        _STATS["compiles"] += 1
    _STATS["compiled_calls"] += 1
    return result


def run(name: str, rows: int | None, args: tuple, eager_args: tuple | None = None,
        written: Callable[[tuple], list[tuple[Any, str]]] | None = None) -> Any:
    """Run kernel ``name`` compiled on ``args`` (every tensor as ``rows`` rows), or, ``rows`` None (the caller found
    that no compiled kernel may run: ``compile_enabled``, ``eligible``), eagerly on ``eager_args`` (default
    ``args``). ``written``: a function of ``args`` giving the tensors the kernel writes in place with their formats
    (the step), None for a kernel that returns its result (the dequantisation)."""
    eager = _SOURCES[name]
    eager_args = args if eager_args is None else eager_args
    if rows is None or name in _FAILED:
        _STATS["eager_calls"] += 1
        return eager(*eager_args)
    key = (name, signature(args))
    verdict = _VERIFIED.get(key)
    if verdict is True:
        return _compiled(name, args, first=False)
    if verdict is False:
        _STATS["eager_calls"] += 1
        return eager(*eager_args)
    try:
        return _check(name, key, args, eager_args, None if written is None else written(args))
    except CompileFailed as failed:  # raised before anything was written: the caller's tensors are as they were
        _FAILED[name] = failure(failed.__cause__)
        _STATS["compile_failures"] += 1
        _STATS["eager_calls"] += 1
        warnings.warn(f"macroarch.mvas: the {name} kernel could not be compiled ({_FAILED[name]}); this process runs "
                      f"it eagerly from now on (the same values, slower). torch.compile needs a C++ compiler on CPU; "
                      f"{ENV}=0 skips compiling.", RuntimeWarning, stacklevel=4)
        return eager(*eager_args)


def _check(name: str, key: tuple, args: tuple, eager_args: tuple, written: list[tuple[Any, str]] | None) -> Any:
    """The first compiled call of a kernel, compared with the eager source (module docstring, Guard)."""
    if written is None:
        result = _compiled(name, args, first=True)
        start = time.perf_counter()  # the compiled call is the caller's own; the check costs the rest
        expected = _SOURCES[name](*eager_args).view(result.shape)
        problem = bitwise_difference(result, expected)
        result = expected
    else:
        originals = [t for t, _ in written if t is not None]
        copies = {id(t): t.clone() for t in originals}
        compiled_args = _map(lambda t: copies.get(id(t), t) if isinstance(t, torch.Tensor) else t, args)
        _compiled(name, compiled_args, first=True)
        start = time.perf_counter()
        result = _SOURCES[name](*eager_args)
        _STATS["eager_calls"] += 1
        problem = None
        for t, fmt in written:
            if t is not None and problem is None:
                problem = step_difference(copies[id(t)], t, fmt)
        if problem is None:  # what later calls compute, from the first step on
            for t in originals:
                t.copy_(copies[id(t)])
    _STATS["check_seconds"] += time.perf_counter() - start
    _STATS["checks"] += 1
    _VERIFIED[key] = problem is None
    if problem is not None:
        _STATS["mismatches"] += 1
        spec = args[-1] if name == "adamw_step" else "format {}, block {}, {}".format(*args[2:5])
        warnings.warn(f"macroarch.mvas: the compiled {name} kernel for {spec} differs from the eager path on vector "
                      f"ISA {vec_isa()!r} ({problem}); this process runs that kernel eagerly from now on.",
                      RuntimeWarning, stacklevel=4)
    return result
