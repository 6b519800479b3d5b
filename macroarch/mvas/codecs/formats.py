"""The table of MVAS storage formats and what a format costs in bytes.

A :class:`Format` names an element encoding (bf16/fp16/fp32 casts, fp8 e4m3 and e5m2, fp4 e2m1) and the dtype
its payload is stored in. Scaled formats carry one fp32 scale per block of ``block_size`` elements (4 bytes per
block, counted by ``storage_bytes``); a block size that does not divide the element count is an error (no padding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ALIASES", "DTYPE_FORMATS", "FORMATS", "ROUNDINGS", "SCALE_BYTES", "SCALE_DTYPE", "Format",
           "bytes_per_element", "check_block_size", "dtype_format", "get_format", "is_fake", "storage_bytes"]

ROUNDINGS = ("nearest", "stochastic")
SCALE_DTYPE = torch.float32


@dataclass(frozen=True)
class Format:
    """One storage format.

    Attributes:
        name: canonical name (``get_format`` also accepts the aliases ``fp8`` and ``fp4``).
        bits: storage bits per element (the payload, without scales).
        exponent_bits / mantissa_bits: the element encoding (fp4 e2m1: 2 and 1).
        max_normal: the largest finite magnitude; block scales map a block's absmax onto it.
        block_scaled: whether the format stores per-block scales.
        storage_dtype: dtype of the payload tensor (``uint8`` for fp4, two codes per byte).
    """

    name: str
    bits: int
    exponent_bits: int
    mantissa_bits: int
    max_normal: float
    block_scaled: bool
    storage_dtype: torch.dtype


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("fp32", 32, 8, 23, torch.finfo(torch.float32).max, False, torch.float32),
        Format("bf16", 16, 8, 7, torch.finfo(torch.bfloat16).max, False, torch.bfloat16),
        Format("fp16", 16, 5, 10, torch.finfo(torch.float16).max, False, torch.float16),
        Format("fp8_e4m3", 8, 4, 3, torch.finfo(torch.float8_e4m3fn).max, True, torch.float8_e4m3fn),
        Format("fp8_e5m2", 8, 5, 2, torch.finfo(torch.float8_e5m2).max, True, torch.float8_e5m2),
        Format("fp4_e2m1", 4, 2, 1, 6.0, True, torch.uint8),
    )
}
ALIASES = {"fp8": "fp8_e4m3", "fp4": "fp4_e2m1"}
DTYPE_FORMATS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def get_format(name: str | Format) -> Format:
    """The :class:`Format` called ``name`` (or an alias); unknown names raise ValueError listing the known ones."""
    if isinstance(name, Format):
        return name
    fmt = FORMATS.get(ALIASES.get(name, name)) if isinstance(name, str) else None
    if fmt is None:
        known = ", ".join([*FORMATS, *(f"{a} (= {c})" for a, c in ALIASES.items())])
        raise ValueError(f"unknown format {name!r}; known formats: {known}")
    return fmt


def dtype_format(dtype: torch.dtype) -> Format:
    """The unscaled format that stores ``dtype`` as it is (fp32, bf16 or fp16)."""
    if dtype not in DTYPE_FORMATS:
        raise ValueError(f"no storage format holds {dtype} as it is; supported: fp32, bf16, fp16 tensors")
    return FORMATS[DTYPE_FORMATS[dtype]]


def is_fake(t: torch.Tensor) -> bool:
    """Fake and meta tensors have no values, so value checks are skipped for them (full-size memory runs)."""
    return t.device.type == "meta" or type(t).__name__ == "FakeTensor"


SCALE_BYTES = 4


def check_block_size(fmt: Format, numel: int, block_size: int | None) -> int | None:
    """``block_size`` normalised (None: one scale per tensor, or no scales); raises on a bad or non-dividing one."""
    if block_size is None or block_size == -1:
        return None
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, or None/-1 for one scale per tensor; got {block_size!r}")
    if not fmt.block_scaled:
        return None
    if numel % block_size:
        raise ValueError(
            f"block_size {block_size} does not divide the tensor's {numel} elements; pick a block size that "
            f"divides {numel}, or block_size=None for one scale per tensor"
        )
    return block_size


def storage_bytes(numel: int, fmt: str | Format, block_size: int | None = 32) -> int:
    """Exact bytes of a packed tensor of ``numel`` elements: payload (rounded up to whole bytes) plus scales."""
    fmt = get_format(fmt)
    block_size = check_block_size(fmt, numel, block_size)
    payload = (numel * fmt.bits + 7) // 8
    if not fmt.block_scaled:
        return payload
    n_scales = 1 if block_size is None else numel // block_size
    return payload + n_scales * SCALE_BYTES


def bytes_per_element(fmt: str | Format, block_size: int | None = 32) -> float:
    """Bytes per element including the scale overhead (exact for any numel that ``block_size`` divides)."""
    fmt = get_format(fmt)
    if not fmt.block_scaled:
        return fmt.bits / 8
    block_size = check_block_size(fmt, 0, block_size)
    if block_size is None:
        raise ValueError(f"{fmt.name} with one scale per tensor has an overhead that depends on numel; "
                         "use storage_bytes(numel, fmt, None)")
    return fmt.bits / 8 + SCALE_BYTES / block_size


