"""What the benchmarks share: timing with warm-up and median, the machine they ran on, sizes on the command line,
plain-text tables.

A speed ratio means nothing without the hardware: ``machine_lines`` prints the CPU model, torch's vector
capability, the ISA flags that decide bf16 speed (AVX-512 BF16, AMX) and which reference is fair there
(``fair_reference``: on a CPU that emulates bf16, a bf16 matmul is 20-30x slower than fp32, so a method that
computes in bf16 is compared with fp32 AdamW as well). ``machine_info`` itself is
``macroarch.measure.machine.machine_info``, the one every notebook run records.
"""

from __future__ import annotations

import contextlib
import os
import re
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from macroarch.measure.machine import machine_info
from macroarch.repro.tracking import write_json_atomic

try:
    from macroarch.mvas._kernels import kernels
except ImportError:  # a checkout from before issue 41's layout (benchmarks/step_ab.py times one against this one)
    from macroarch.mvas import kernels

#: /proc/cpuinfo flags that decide how fast bf16, fp16 and wide vectors run on a CPU
SPEED_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile",
               "amx_bf16", "amx_int8")

BF16_REFERENCE = "AdamW bf16 + fp32 master"
FP32_REFERENCE = "AdamW fp32"
FOREACH_REFERENCE = "torch AdamW fp32 foreach"  # the optimizer-step benchmark's reference

_SUFFIX = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


@dataclass
class Timing:
    """Seconds of the untimed warm-up calls and of the timed ones."""

    warmup: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        if not self.times:
            raise ValueError("Timing.median: no timed calls")
        return statistics.median(self.times)

    @property
    def first(self) -> float:
        """The first call's seconds (compilation, allocation), warm-up or not."""
        return (self.warmup or self.times)[0]


def time_calls(fn: Callable[[], Any], *, warmup: int = 1, repeats: int = 5,
               clock: Callable[[], float] = time.perf_counter) -> Timing:
    """``fn()`` called ``warmup`` times untimed-for-the-median, then ``repeats`` times; every call's seconds."""
    check_count("warmup", warmup, minimum=0)
    check_count("repeats", repeats, minimum=1)
    timing = Timing()
    for i in range(warmup + repeats):
        start = clock()
        fn()
        (timing.warmup if i < warmup else timing.times).append(clock() - start)
    return timing


def check_count(name: str, value: Any, *, minimum: int = 1) -> int:
    """``value`` as an int >= ``minimum``, or a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}")
    return value


def parse_sizes(text: str, *, name: str = "sizes", multiple_of: int = 1) -> list[int]:
    """``"1M,4M,64M"`` -> ``[1048576, 4194304, 67108864]``; suffixes k/M/G are powers of 1024, plain ints as
    written. Each size must be positive and a multiple of ``multiple_of``; ValueError naming ``name`` otherwise."""
    sizes = []
    for item in str(text).split(","):
        match = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)\s*", item)
        if not match:
            raise ValueError(f"{name}: {item.strip()!r} is not a size (an int, optionally with k, M or G)")
        size = int(match.group(1)) * _SUFFIX[match.group(2).lower()]
        if size < 1 or size % multiple_of:
            raise ValueError(f"{name}: {item.strip()} must be a positive multiple of {multiple_of}")
        sizes.append(size)
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"{name}: {text!r} repeats a size")
    return sizes


def format_size(n: int) -> str:
    """``67108864`` -> ``"64M"``; sizes that are not whole k/M/G as plain ints."""
    for suffix, unit in (("G", 1 << 30), ("M", 1 << 20), ("k", 1 << 10)):
        if n >= unit and n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)


def all_threads() -> int:
    """The cores this process may run on (its affinity, so ``taskset -c 1`` gives 1)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_flags(cpuinfo: str | None = None) -> list[str]:
    """The ``SPEED_FLAGS`` this CPU has (``/proc/cpuinfo``; empty where it cannot be read)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return []
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            have = set(line.split(":", 1)[1].split())
            return [f for f in SPEED_FLAGS if f in have]
    return []


def fair_reference(info: dict[str, Any]) -> str:
    """The fair speed reference for a method that computes in bf16: the bf16 + fp32-master AdamW where bf16 is
    native, fp32 AdamW where it is emulated (there the bf16 reference is itself slow and flatters a method)."""
    return BF16_REFERENCE if info.get("native_bf16") else FP32_REFERENCE


def emulation() -> dict[str, str]:
    """The environment settings that make this CPU pose as a lesser one (an AVX-512 machine run as AVX2)."""
    return {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA") if k in os.environ}


def machine_record() -> dict[str, Any]:
    """``machine_info()`` with ``emulating`` (``emulation()``): what a benchmark's JSON says it ran on."""
    return {**machine_info(), "emulating": emulation()}


def machine_lines(info: dict[str, Any] | None = None, flags: Sequence[str] | None = None) -> list[str]:
    """Lines that name the machine a benchmark ran on: model, capability, speed flags, threads, fair reference."""
    info = machine_info() if info is None else info
    flags = cpu_flags() if flags is None else flags
    bf16 = "native" if info.get("native_bf16") else "emulated"
    lines = [f"CPU: {info['cpu_model']}; torch {info['torch']} dispatches to {info['cpu_capability']}; bf16 {bf16}, "
             f"fp16 {'native' if info.get('native_fp16') else 'emulated'}",
             f"CPU flags: {' '.join(flags) if flags else '(none of ' + ', '.join(SPEED_FLAGS[:3]) + ', ... found)'}; "
             f"{all_threads()} core(s) available to this process"]
    if info.get("gpu"):
        lines.append(f"GPU: {info['gpu']}")
    env = emulation()
    if env:
        lines.append("emulating: " + " ".join(f"{k}={v}" for k, v in env.items()))
    return lines


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, floats: str = ".2f") -> str:
    """A plain-text table: the first column left-aligned, the others right-aligned; floats formatted with
    ``floats``, None as ``-``. Every row must have as many cells as ``headers``."""
    for i, row in enumerate(rows):
        if len(row) != len(headers):
            raise ValueError(f"format_table: row {i} has {len(row)} cells, the headers {len(headers)}")

    def cell(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return format(value, floats)
        return str(value)

    text = [[str(h) for h in headers]] + [[cell(v) for v in row] for row in rows]
    widths = [max(len(r[c]) for r in text) for c in range(len(headers))]
    lines = []
    for r in text:
        lines.append("  ".join(v.ljust(widths[0]) if c == 0 else v.rjust(widths[c]) for c, v in enumerate(r)))
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path: str | Path, data: Any) -> None:
    """``data`` as JSON in ``path``, whole or not at all (``macroarch.repro.tracking.write_json_atomic``, the one
    results use), NaN allowed: an interrupted run leaves no half-written result that looks complete."""
    write_json_atomic(Path(path), data, allow_nan=True)


@contextlib.contextmanager
def compile_switch(flag: bool | None) -> Iterator[None]:
    """The MVAS kernels' environment switch (``MACROARCH_COMPILE``) set to ``flag`` for the block, then put back;
    ``flag`` None: nothing changes."""
    if flag is None:
        yield
        return
    old = os.environ.get(kernels.ENV)
    os.environ[kernels.ENV] = "1" if flag else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(kernels.ENV, None)
        else:
            os.environ[kernels.ENV] = old


def kernel_stats() -> dict[str, float]:
    """``macroarch.mvas.compile_stats()`` (compile seconds, kernels compiled, compiled and eager calls)."""
    return dict(kernels.compile_stats())


def dynamo_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far (a rise between two points is a recompile)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
