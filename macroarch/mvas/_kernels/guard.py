"""How the first compiled call of an MVAS kernel is compared with the eager path (``runner``'s guard): the
dequantisation bitwise, the step within the bounds of ``kernels``' Equality section; and what a kernel that cannot
compile reports (``failure``)."""

from __future__ import annotations

import torch

from macroarch.mvas.codecs.codes import FP8_DTYPES, e2m1_byte_table
from macroarch.mvas.codecs.formats import get_format

__all__ = ["CODE_FLIPS", "bitwise_difference", "failure", "step_difference"]

# Codes a compiled step may write one grid step away from the eager step's, as a fraction of the codes: an ulp of the
# reordered fp32 update flips a value that sits on a rounding midpoint. A first step from zero moments with bf16
# gradients puts many there (sqrt(v) = sqrt(1 - beta2) |g|, g of 8 significant bits, scaled to its block's largest).
# A miscompile, or a wrong rounding or noise, moves codes by more than a grid step or flips about half of them.
CODE_FLIPS = 0.02


def failure(error: BaseException | None) -> str:
    """``"Type: first line"`` of what compiling raised, dynamo's ``BackendCompilerFailed`` unwrapped to its cause."""
    while getattr(error, "inner_exception", None) is not None:
        error = error.inner_exception
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def bitwise_difference(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """None if ``got`` is ``want`` bit for bit (any NaN matching any NaN), else what differs."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"got {got.dtype} {tuple(got.shape)}, expected {want.dtype} {tuple(want.shape)}"
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    same = (got.view(ints) == want.view(ints)) | (got.isnan() & want.isnan())
    if bool(same.all()):
        return None
    bad = (~same).view(-1).nonzero()[0, 0]
    return (f"{int((~same).sum())} of {same.numel()} values not bitwise equal, the first at index {int(bad)}: "
            f"{float(got.view(-1)[bad])!r} instead of {float(want.view(-1)[bad])!r}")


def _grid_values(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    """Stored codes as the (unscaled) values they stand for, float32: fp4 bytes as their two nibbles, fp8 bytes
    (``_as_bytes``) as fp8."""
    if fmt == "fp4_e2m1":  # bytes, or the int32 words the compiled step passes them as
        return e2m1_byte_table(codes.device)[codes.contiguous().view(torch.uint8).long()].view(-1)
    if codes.dtype == torch.uint8 and get_format(fmt).storage_dtype in FP8_DTYPES:
        codes = codes.view(get_format(fmt).storage_dtype)
    return codes.float().view(-1)


def step_difference(got: torch.Tensor, want: torch.Tensor, fmt: str) -> str | None:
    """None if what the compiled step wrote (``got``) matches the eager step (``want``) within the bounds of
    ``kernels``, else what differs. fp32 (masters, scales, dense moments): within 2^-16 of the value
    or of the tensor's largest magnitude; codes: at most ``CODE_FLIPS`` of them (and 2) differ, each by at most one grid
    step."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{fmt}: got {got.dtype} {tuple(got.shape)}, expected {want.dtype} {tuple(want.shape)}"
    if fmt == "fp32":
        g, w = got.view(-1), want.view(-1)
        finite = w.isfinite()
        scale = float(w[finite].abs().max()) if bool(finite.any()) else 0.0
        ok = ((g - w).abs() <= 2.0 ** -16 * (w.abs() + scale)) | (g.isnan() & w.isnan()) | (g == w)
        if bool(ok.all()):
            return None
        bad = (~ok).nonzero()[0, 0]
        return (f"fp32: {int((~ok).sum())} of {ok.numel()} values beyond 2^-16 relative, the first at index "
                f"{int(bad)}: {float(g[bad])!r} instead of {float(w[bad])!r}")
    info = get_format(fmt)
    g, w = _grid_values(got, fmt), _grid_values(want, fmt)
    differ = (g.view(torch.int32) != w.view(torch.int32)) & ~(g.isnan() & w.isnan())
    count = int(differ.sum())
    if count == 0:
        return None
    floor = 2.0 ** (2 - 2 ** (info.exponent_bits - 1))  # the smallest normal: the subnormals' spacing below it
    spacing = torch.minimum(g.abs(), w.abs()).clamp(min=floor) * 2.0 ** -info.mantissa_bits
    far = differ & ~((g - w).abs() <= spacing * 1.0001)
    if count <= CODE_FLIPS * differ.numel() + 2 and not bool(far.any()):
        return None
    bad = (far if bool(far.any()) else differ).nonzero()[0, 0]
    return (f"{fmt}: {count} of {differ.numel()} codes differ ({int(far.sum())} by more than one grid step), the "
            f"first at element {int(bad)}: {float(g[bad])!r} instead of {float(w[bad])!r}")
