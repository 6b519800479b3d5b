"""What the CPU runs natively in 16 bits, from oneDNN's private probes where they exist, else from public facts.

``measure.machine`` records whether bf16 and fp16 matmuls are native on this CPU (every run's ``machine``
entry, and the compute dtype a harness picks). oneDNN answers through private ops (``torch.ops.mkldnn.
_is_mkldnn_bf16_supported``, ``_is_mkldnn_fp16_supported``) and torch exposes the CPU's own flags through private
functions (``torch.cpu._is_avx512_bf16_supported``, ``_is_amx_tile_supported``). None of them has a public
equivalent, so each is looked up by name on use and, where it is missing or raises, the answer comes from public
facts instead (oneDNN: ``torch.backends.mkldnn.is_available()`` with ``torch.backends.cpu.get_cpu_capability()``,
or the CPU's flags in ``/proc/cpuinfo``), or is None for the caller to decide. Nothing here raises: a run never
fails because a probe moved.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

from macroarch._compat import version


def _probe(owner: object, name: str) -> Callable[[], bool] | None:
    probe = getattr(owner, name, None)
    return probe if callable(probe) else None


def _ask(probe: Callable[[], bool] | None) -> bool | None:
    """The probe's answer, or None when it does not exist here or fails."""
    if probe is None:
        return None
    try:
        return bool(probe())
    except Exception:  # a moved or broken private probe falls back to the public facts
        return None


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``/proc/cpuinfo``; empty where that file does not exist)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _mkldnn(name: str) -> bool | None:
    import torch

    if not torch.backends.mkldnn.is_available():
        return False
    version.check("macroarch._compat.cpu (oneDNN probes)")
    # private: oneDNN's own answer (the op exists in every CPU build of torch 2.13-2.14)
    return _ask(_probe(torch.ops.mkldnn, name))


def onednn_bf16() -> bool:
    """Whether oneDNN runs bf16 (natively or emulated: it says yes on every AVX-512 CPU). Fallback: oneDNN is built
    in and torch dispatches to AVX-512 kernels."""
    import torch

    answer = _mkldnn("_is_mkldnn_bf16_supported")
    if answer is not None:
        return answer
    return torch.backends.mkldnn.is_available() and torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def onednn_fp16() -> bool:
    """Whether oneDNN runs fp16 matmuls. Fallback: the CPU has AVX-512 FP16 or AMX-FP16."""
    answer = _mkldnn("_is_mkldnn_fp16_supported")
    if answer is not None:
        return answer
    return bool(cpu_flags() & {"avx512_fp16", "amx_fp16"})


def bf16_instructions() -> bool | None:
    """Whether the CPU has bf16 instructions (AVX-512 BF16 or AMX), from torch's probes (private); None where torch
    lacks them or they fail (``measure.machine`` then keeps oneDNN's answer)."""
    import torch

    # private: torch.cpu's probes of the CPU's own flags (cpuinfo), the same on every OS torch runs on
    answers = [_ask(_probe(torch.cpu, name)) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if any(a is None for a in answers):
        return None
    return any(answers)
