"""Storage formats for MVAS (post section 3.2: "key parameters FP16, secondary FP8 or even FP4"), with real bytes.

A tensor is packed into a :class:`PackedTensor` whose payload really occupies the format's width: fp8 is a
``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` tensor (one byte per element), fp4 e2m1 is a ``uint8`` tensor
holding two 4-bit codes per byte, bf16/fp16 are plain casts. ``nbytes`` counts everything held.

- **Block scales** (OCP Microscaling (MX) spec v1.0; torchao's low-bit optimizers store their state the same
  way): the flattened tensor is cut into contiguous blocks of ``block_size`` elements and each block gets
  ``scale = absmax / max_normal``, so the block's largest magnitude maps onto the format's largest normal
  value. Scales are stored in **float32** (4 bytes per block, counted in ``nbytes``). Deviation from MX: MX
  uses power-of-two E8M0 scales (1 byte); an fp32 scale costs more (fp8 with blocks of 32 takes
  1.125 bytes per element, MX 1.03125) but uses the whole range of the format. Blocks of 128 bring the
  overhead down to 1/32 byte per element. ``block_size=None`` (or -1) means one scale for the whole tensor.
  A ``numel`` that ``block_size`` does not divide is an error (no padding). bf16, fp16 and fp32 carry no
  scales; ``block_size`` is accepted and ignored for them.
- **fp8**: after scaling (and clamping to +-max, since torch turns out-of-range values into NaN for
  e4m3fn), round-to-nearest is torch's own conversion (nearest, ties to even), bit for bit.
- **fp4 e2m1** (MX spec, section 5.3.3): magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6} are codes 0..7, bit 3 is
  the sign. Round-to-nearest breaks ties towards the even code (the even mantissa, as IEEE does: 0.25 -> 0,
  0.75 -> 1, 5 -> 4). Two codes per byte, element ``2i`` in the low nibble and ``2i + 1`` in the high nibble
  (the layout of ``torch.float4_e2m1fn_x2``); an odd element count gets one zero nibble of padding.

The element arithmetic (rounding, fp8 and fp4 codes, ``encode`` / ``decode``) and the table of formats live
in ``macroarch.mvas.codecs``; this module holds the packed tensor and ``pack`` (which builds one: it lives beside
the class it returns, so the codecs never import the packed layer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from macroarch.mvas import _kernels
from macroarch.mvas.codecs.codes import cast, decode, draw_noise, encode
from macroarch.mvas.codecs.formats import ROUNDINGS, Format, check_block_size, get_format, is_fake

__all__ = ["CHUNK_NUMEL", "PackedTensor", "bad_scales", "nonfinite_codes", "pack", "quantization_error",
           "quantize_dequantize", "unpack", "write_range"]

CHUNK_NUMEL = 1 << 22  # elements decoded or updated at a time in large tensors (16 MB of float32)

@dataclass(frozen=True, eq=False)
class PackedTensor:
    """A tensor held in a storage format: ``payload`` (flat) and, for scaled formats, fp32 ``scales``.

    ``block_size`` is None for unscaled formats and for one scale per tensor. Use :func:`pack` to build one.
    """

    format: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    block_size: int | None
    payload: torch.Tensor
    scales: torch.Tensor | None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """True storage: payload plus scales."""
        n = self.payload.numel() * self.payload.element_size()
        if self.scales is not None:
            n += self.scales.numel() * self.scales.element_size()
        return n

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The values as a dense tensor of ``dtype`` (default: the dtype the tensor was packed from).

        Large tensors are decoded in chunks of about ``CHUNK_NUMEL`` elements straight into the output, so the
        float32 temporaries stay bounded (a 32000 x 8192 embedding would otherwise take 2 GB of them). Where
        ``macroarch.mvas._kernels`` may compile, one fused kernel decodes straight into ``dtype`` (no temporaries);
        ``MACROARCH_COMPILE=0`` keeps this eager path."""
        dtype = self.dtype if dtype is None else dtype

        if self.scales is None and self.payload.is_floating_point():  # fp32, bf16, fp16: a cast, never a view
            return cast(self.payload, dtype).view(self.shape)
        if _kernels.compile_enabled():
            fused = _kernels.dequantize(self.payload, self.scales, self.format, self.block_size, self.numel, dtype,
                                       eager_fallback=False)
            if fused is not None:
                return fused.view(self.shape)
        return self.decoded(dtype)

    def decoded(self, dtype: torch.dtype) -> torch.Tensor:
        """``dequantize``'s eager path (in chunks of about ``CHUNK_NUMEL``), for a scaled format; also for a caller
        that already asked the compiled kernel itself (``MVASWeight.dequantize``)."""
        chunk = self.chunk_numel()
        if chunk is None or self.numel <= chunk:
            return self.dequantize_range(0, self.numel).reshape(self.shape).to(dtype)
        out = torch.empty(self.numel, dtype=dtype, device=self.payload.device)
        if is_fake(self.payload):
            # no values to decode, only bytes to count: chunks run one after another, each freeing what it
            # allocated, so the output plus the first (largest) chunk's temporaries is everything the loop ever
            # holds at once. One chunk keeps those bytes exact at a fraction of the loop's dispatches (a 65B
            # model's fake step would otherwise decode ~1000 chunks).
            out[:chunk] = self.dequantize_range(0, chunk)
            return out.view(self.shape)
        for start in range(0, self.numel, chunk):
            stop = min(start + chunk, self.numel)
            out[start:stop] = self.dequantize_range(start, stop)
        return out.view(self.shape)

    def chunk_numel(self) -> int | None:
        """Elements per chunk that cut the payload and the scales at whole bytes and blocks (None: cannot)."""
        block = self.block_size if self.scales is not None else 1
        if block is None:  # one scale for the whole tensor
            block = 1
        unit = block * 2 // math.gcd(block, 2)  # whole blocks and whole fp4 bytes
        return max(unit, CHUNK_NUMEL // unit * unit)

    def dequantize_range(self, start: int, stop: int) -> torch.Tensor:
        """Elements ``start:stop`` of the flattened tensor as float32 (a new tensor, never a view of the payload);
        ``start`` must be a multiple of ``chunk_numel()``'s unit (whole blocks, whole fp4 bytes)."""
        fmt = get_format(self.format)
        block = self.block_size
        if fmt.name == "fp4_e2m1":
            payload = self.payload[start // 2:(stop + 1) // 2]
        else:
            payload = self.payload[start:stop]
        scales = self.scales
        if scales is not None and block is not None:
            scales = scales[start // block:stop // block]
        return decode(payload, scales, fmt, block, stop - start)

    def to_dict(self) -> dict[str, Any]:
        """Tensors and plain values only, so ``torch.save`` / ``torch.load(weights_only=True)`` round-trip it."""
        return {"format": self.format, "shape": list(self.shape), "dtype": str(self.dtype).removeprefix("torch."),
                "block_size": self.block_size, "payload": self.payload, "scales": self.scales}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PackedTensor:
        keys = {"format", "shape", "dtype", "block_size", "payload", "scales"}
        if set(d) != keys:
            raise ValueError(f"a packed tensor dict has keys {sorted(keys)}; got {sorted(d)}")
        dtype = getattr(torch, d["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {d['dtype']!r} in a packed tensor dict")
        fmt = get_format(d["format"])
        payload, scales = d["payload"], d["scales"]
        if payload.dtype != fmt.storage_dtype or (scales is None) == fmt.block_scaled:
            raise ValueError(f"the {fmt.name} payload is {fmt.storage_dtype}"
                             f"{' with scales' if fmt.block_scaled else ' without scales'}; got {payload.dtype}"
                             f"{' without scales' if scales is None else ' with scales'}")
        return cls(fmt.name, tuple(int(s) for s in d["shape"]), dtype, d["block_size"], payload, scales)


# ------------------------------------------------------------------------------------------------ validation
# the sign-less bits that make a stored code NaN or infinite: e4m3fn has no infinities and one NaN code per sign
# (0x7F, 0xFF); e5m2's all-ones exponent is +-inf (0x7C, 0xFC) or NaN (0x7D-0x7F, 0xFD-0xFF)
_NONFINITE_MASKS = {torch.float8_e4m3fn: 0x7F, torch.float8_e5m2: 0x7C}


@torch.no_grad()
def nonfinite_codes(payload: torch.Tensor) -> int:
    """How many elements of a stored payload decode to NaN or infinity, whatever its scales: fp8 codes are tested
    as bytes (``pack`` never writes these codes: it clamps to the format's range), bf16/fp16 payloads for NaN
    (an fp16 weight may hold inf where its value overflowed the format), fp4 e2m1 bytes have no such code. Zero for
    fake and meta tensors (no values). For loaders: a checkpoint holding such a code is corrupt."""
    if is_fake(payload) or payload.numel() == 0:
        return 0
    mask = _NONFINITE_MASKS.get(payload.dtype)
    if mask is not None:
        return int(((payload.reshape(-1).view(torch.uint8) & mask) == mask).sum())
    if payload.dtype in (torch.bfloat16, torch.float16, torch.float32):
        return int(torch.isnan(payload).sum())
    return 0


@torch.no_grad()
def bad_scales(scales: torch.Tensor | None) -> int:
    """How many block scales are NaN, infinite or negative (``pack`` writes finite scales >= 0); zero for none and
    for fake tensors."""
    if scales is None or is_fake(scales) or scales.numel() == 0:
        return 0
    return int((~torch.isfinite(scales) | (scales < 0)).sum())


# ------------------------------------------------------------------------------------------------ pack
@torch.no_grad()
def pack(tensor: torch.Tensor, fmt: str | Format, block_size: int | None = 32, rounding: str = "nearest",
         generator: torch.Generator | None = None) -> PackedTensor:
    """Store ``tensor`` in ``fmt`` with per-block fp32 scales (see the module docstring for every rule)."""
    fmt = get_format(fmt)
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {', '.join(ROUNDINGS)}; got {rounding!r}")
    if not tensor.is_floating_point():
        raise ValueError(f"pack needs a floating-point tensor; got {tensor.dtype}")
    block_size = check_block_size(fmt, tensor.numel(), block_size)
    x = tensor.detach().reshape(-1).float()
    if fmt.block_scaled and not is_fake(x) and not torch.isfinite(x).all():
        raise ValueError(f"cannot pack a tensor with inf or NaN values into {fmt.name} (block scales need finite "
                         "values)")
    noise = None
    if rounding == "stochastic" and fmt.storage_dtype != torch.float32:
        noise = draw_noise(x.numel(), fmt, generator, x.device)
    payload, scales = encode(x, fmt, block_size, noise)
    # a float32 tensor packed to fp32 must not alias it (fake tensors have no data pointer to compare)
    if payload.dtype == tensor.dtype and (is_fake(tensor) or payload.data_ptr() == tensor.data_ptr()):
        payload = payload.clone()
    return PackedTensor(fmt.name, tuple(tensor.shape), tensor.dtype, block_size, payload, scales)


def write_range(payload: torch.Tensor, scales: torch.Tensor | None, packed: PackedTensor, start: int,
                stop: int) -> None:
    """Copy ``packed`` (elements ``start:stop`` of a larger flat tensor, packed alone with the same format and
    block size) into that tensor's ``payload`` and ``scales`` in place. The range must cover whole blocks and,
    for fp4, whole bytes; with one scale per tensor it must be the whole tensor."""
    if packed.format == "fp4_e2m1":
        payload[start // 2:start // 2 + packed.payload.numel()].copy_(packed.payload)
    else:
        payload.view(-1)[start:stop].copy_(packed.payload)
    if packed.scales is not None:
        if packed.block_size is None:
            scales.copy_(packed.scales)
        else:
            scales[start // packed.block_size:stop // packed.block_size].copy_(packed.scales)


def unpack(packed: PackedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``packed.dequantize(dtype)``."""
    return packed.dequantize(dtype)


def quantize_dequantize(tensor: torch.Tensor, fmt: str | Format, block_size: int | None = 32,
                        rounding: str = "nearest", generator: torch.Generator | None = None) -> torch.Tensor:
    """What ``tensor`` reads back as after storage in ``fmt`` (same shape and dtype)."""
    return pack(tensor, fmt, block_size, rounding, generator).dequantize()


@torch.no_grad()
def quantization_error(tensor: torch.Tensor, fmt: str | Format, block_size: int | None = 32) -> float:
    """Squared L2 error ``||q(x) - x||^2`` of round-to-nearest storage in ``fmt``, summed in float64."""
    q = pack(tensor, fmt, block_size).dequantize(torch.float32)
    return float((q.double() - tensor.detach().double()).square().sum())
