"""The bucket layout of ``GradientBucketer``: gradients in one flat buffer per dtype, cut into equal buckets.

The post's rule (section 4.2): make gradient buckets an integer multiple of 8 MB. ``plan_buckets`` lays the
parameters out in the order their gradients arrive and cuts each dtype's buffer into buckets of exactly the
asked size, splitting a parameter across two buckets where needed (DDP, by contrast, keeps parameters whole
and closes a bucket once it exceeds its cap). ``check_bucket_mb`` validates a size in MiB and warns when it
is not a multiple of 8.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

MiB = 1 << 20
BUCKET_MULTIPLE_MB = 8  # the post: "梯度打包大小设置为8MB的整数倍"


@dataclass(frozen=True)
class Bucket:
    """One flat bucket: elements ``[start, end)`` of its dtype's buffer, all-reduced as one collective.

    Attributes:
        index: launch order (the order in which buckets fill in backward).
        dtype: the gradients' dtype.
        start, end: element range in the dtype's flat buffer.
        names: the parameters it holds, with ``[a:b]`` when it holds only those elements of one.
    """

    index: int
    dtype: torch.dtype
    start: int
    end: int
    element_size: int
    names: tuple[str, ...]

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size


def check_bucket_mb(bucket_mb: Any) -> float:
    """``bucket_mb`` as a positive number of MiB; a warning if it is not a multiple of 8 (the post's rule)."""
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, int | float) or not math.isfinite(bucket_mb) \
            or bucket_mb <= 0:
        raise ValueError(f"bucket_mb={bucket_mb!r} must be a positive number of MiB (the post uses multiples of 8)")
    if bucket_mb % BUCKET_MULTIPLE_MB:
        warnings.warn(f"bucket_mb={bucket_mb:g} is not a multiple of {BUCKET_MULTIPLE_MB} MiB (the post's rule); "
                      "using it as given", UserWarning, stacklevel=3)
    return float(bucket_mb)


def plan_buckets(params: Sequence[torch.Tensor], bucket_bytes: int, names: Sequence[str] | None = None,
                 breaks: Collection[int] = ()) -> tuple[list[Bucket], list[int], list[list[tuple[int, int]]]]:
    """Lay ``params`` out, in order, in one flat buffer per dtype, cut into buckets of ``bucket_bytes``.

    A bucket closes when it is full, before a parameter whose index is in ``breaks`` (a group starts), and
    at the end (open buckets close in the order they opened). Returns the buckets in closing order, each
    parameter's element offset in its dtype's buffer, and each parameter's ``(bucket index, elements)``
    pieces.
    """
    names = list(names) if names is not None else [f"param{i}" for i in range(len(params))]
    buckets: list[Bucket] = []
    offsets: list[int] = []
    pieces: list[list[tuple[int, int]]] = [[] for _ in params]
    end: dict[torch.dtype, int] = {}  # next free element of each dtype's buffer
    open_: dict[torch.dtype, dict[str, Any]] = {}  # dtype -> the bucket being filled, in opening order

    def close(dtype: torch.dtype) -> None:
        b = open_.pop(dtype)
        index = len(buckets)
        buckets.append(Bucket(index, dtype, b["start"], b["start"] + b["filled"], b["size"], tuple(b["names"])))
        for i, count in b["pieces"]:
            pieces[i].append((index, count))

    for i, p in enumerate(params):
        if i in breaks:
            for dtype in list(open_):
                close(dtype)
        size = p.element_size()
        capacity = bucket_bytes // size
        if capacity < 1:
            raise ValueError(f"a bucket of {bucket_bytes} bytes cannot hold one {p.dtype} element")
        offset = end.get(p.dtype, 0)
        offsets.append(offset)
        end[p.dtype] = offset + p.numel()
        done = 0
        while done < p.numel():
            b = open_.setdefault(p.dtype, {"start": offset + done, "filled": 0, "size": size, "names": [],
                                           "pieces": []})
            take = min(p.numel() - done, capacity - b["filled"])
            whole = take == p.numel()
            b["names"].append(names[i] if whole else f"{names[i]}[{done}:{done + take}]")
            b["pieces"].append((i, take))
            b["filled"] += take
            done += take
            if b["filled"] == capacity:
                close(p.dtype)
    for dtype in list(open_):
        close(dtype)
    return buckets, offsets, pieces
