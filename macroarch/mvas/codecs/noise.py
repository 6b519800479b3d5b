"""The noise of stochastic rounding: a counter-based hash, and the stream keys that name a tensor's step.

``counter_noise`` draws the noise of element ``i`` of stream ``key`` from (key, i) alone (no generator state), so
it is bitwise the same eager and compiled, on any device and for any split of a tensor into chunks; ``MVASAdamW``
names each tensor's stream per step with ``stream_key(seed, tensor index, size, step)``, and the compiled step
(``macroarch.mvas._kernels``) draws its noise with ``counter_noise``.
"""

from __future__ import annotations

import torch

__all__ = ["counter_noise", "stream_key", "stream_key_from", "stream_prefix"]

_MASK = 0xFFFFFFFF
_GOLDEN = 0x61C88647  # 2^32 / golden ratio (negated): spreads consecutive indices over the 32 bits
_LOWBIAS = (0x7FEB352D, 0x846CA68B - (1 << 32))  # lowbias32's multipliers, the second as a signed int32


def counter_noise(counter: torch.Tensor, numel: int, bits: int, index: torch.Tensor | None = None) -> torch.Tensor:
    """Uniform int32 noise in ``[0, 2^bits)`` for elements ``counter[1] + i``, i < ``numel``, of the stream
    ``counter[0]`` (int64, a 32-bit key): Wellons' lowbias32 hash of the key and the element index, in int32
    arithmetic that wraps (two's complement, as torch's int32 ops and the compiled loops both do; the logical
    shifts are arithmetic shifts masked). Pure integer arithmetic: bitwise the same eager, compiled, on any device,
    and for any split of a tensor into chunks. Int32, not int64: a vector of int32 lanes multiplies in one
    instruction (64-bit lanes need three, or a scalar loop on AVX2).

    ``index``: the ``i`` themselves (int32, ``numel`` of them, any shape; the noise takes its shape), where the
    caller has them; default ``arange(numel)``. The compiled step passes rows of them as row starts plus lanes, which
    a compiled loop loads, rather than the consecutive indices it would build one lane at a time
    (``docs/upstream/inductor-arange-per-lane.md``)."""
    key = counter.to(torch.int32)  # (stream key, first element index), wrapped to int32
    if index is None:
        index = torch.arange(numel, dtype=torch.int32, device=counter.device)
    x = (index + key[1]) * _GOLDEN + key[0]
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * _LOWBIAS[0]
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * _LOWBIAS[1]
    x = x ^ ((x >> 16) & 0xFFFF)
    return (x >> (32 - bits)) & ((1 << bits) - 1)


def stream_key(*parts: int) -> int:
    """A 32-bit stream key from integers (seed, tensor index, step): splitmix64 over them."""
    return stream_key_from(stream_prefix(*parts[:-1]), parts[-1]) if parts else 0


def stream_prefix(*parts: int) -> int:
    """The splitmix64 state after ``parts``: ``stream_key_from(stream_prefix(*a), b) == stream_key(*a, b)``, so a
    caller that keeps the prefix of (seed, tensor index, size) mixes in only the step."""
    h = 0
    for part in parts:
        h = _mix(h, part)
    return h


def stream_key_from(prefix: int, part: int) -> int:
    """``stream_key`` of the parts of ``prefix`` and ``part``."""
    return _mix(prefix, part) & _MASK


def _mix(h: int, part: int) -> int:
    h = (h + 0x9E3779B97F4A7C15 + (int(part) & 0xFFFFFFFFFFFFFFFF)) & 0xFFFFFFFFFFFFFFFF
    h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return h ^ (h >> 31)
