"""What this machine computes fast, so that the experiments pick a dtype that finishes, and say which.

On a CPU with native bf16 (AVX-512 BF16 or AMX) a bf16 matmul is faster than fp32; on one without (AVX2
only), oneDNN emulates it and a bf16 matmul runs about 20-30x slower than fp32, so a notebook that trains in
bf16 there takes hours and its speed ratios mean something else. Experiments whose question is not the dtype
itself take ``compute_dtype="auto"``, which resolves here; the ones about precision keep their dtype.

``machine_info()`` is what every run records beside its config (CPU model, vector capability, whether bf16
and fp16 are native, threads, torch version, the GPU if one is used), so that a speed ratio always names
the hardware it was measured on. To see the AVX2 behaviour on a newer CPU, run with
``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` (torch's and oneDNN's own switches).
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path
from typing import Any

import torch

from macroarch._compat import cpu

COMPUTE_DTYPES = ("float32", "bfloat16", "float16")


@functools.cache
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, ``platform.processor()`` elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_capability() -> str:
    """The vector ISA torch dispatches its CPU kernels to: ``AVX512``, ``AVX2``, ``DEFAULT``..."""
    return torch.backends.cpu.get_cpu_capability()


def native_bf16_cpu() -> bool:
    """Whether oneDNN runs bf16 matmuls natively on this CPU (AVX-512 BF16 / AMX), not emulated. oneDNN's own answer
    is yes on every AVX-512 CPU, where it emulates bf16 without those instructions (a 1024 x 1024 bf16 matmul several
    times slower than fp32 on a Xeon with AVX-512 but neither), so the CPU's own flags decide too; where neither
    torch's probes nor ``/proc/cpuinfo`` can tell, oneDNN's answer stands. Never raises (``macroarch._compat.cpu``)."""
    if not cpu.onednn_bf16():
        return False
    instructions = cpu.bf16_instructions()
    return True if instructions is None else instructions


def native_fp16_cpu() -> bool:
    """Whether oneDNN runs fp16 matmuls on this CPU. Never raises (``macroarch._compat.cpu``)."""
    return cpu.onednn_fp16()


def auto_compute_dtype(device: str = "cpu") -> str:
    """The dtype training runs compute in when the dtype is not the question: bf16 where it is native
    (a CUDA GPU that supports it, a CPU with AVX-512 BF16 or AMX), else fp32."""
    if str(device).startswith("cuda"):
        return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
    return "bfloat16" if native_bf16_cpu() else "float32"


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; an unknown name is a ``ValueError`` that lists the known ones."""
    if name not in COMPUTE_DTYPES:
        raise ValueError(f"unknown compute dtype {name!r}; expected one of {', '.join(COMPUTE_DTYPES)}")
    return getattr(torch, name)


def machine_info(device: str = "cpu") -> dict[str, Any]:
    """The hardware a run measured on, for its config and its verdict's scale."""
    info: dict[str, Any] = {
        "cpu_model": cpu_model(),
        "cpu_capability": cpu_capability(),
        "native_bf16": native_bf16_cpu(),
        "native_fp16": native_fp16_cpu(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    if str(device).startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def describe(info: dict[str, Any], compute_dtype: str | None = None) -> str:
    """One line for a verdict's scale: ``"Intel Xeon (AVX512, native bf16), fp32 compute"``."""
    native = "native bf16" if info.get("native_bf16") else "bf16 emulated"
    text = f"{info.get('gpu') or info['cpu_model']} ({info['cpu_capability']}, {native})"
    return f"{text}, {compute_dtype} compute" if compute_dtype else text
