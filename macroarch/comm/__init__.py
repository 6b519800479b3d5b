"""Communication: what runs across processes in a user's training loop.

- ``layout``: ``plan_buckets``, the flat buffers cut into buckets of exactly ``bucket_mb`` MiB;
- ``bucketer``: ``GradientBucketer`` (gradients all-reduced in flat buckets of a fixed size as backward fills
  them, optional time windows, per-collective timeouts, composes with DGR), ``ddp_with_buckets``. It is the
  instrument of claim C9, not a replacement for DDP;
- ``launch``: run a function on N local ranks with torchrun's environment and a hard timeout.

The measurements built on these (the ZeRO-3 model, its calibration, the bucket benchmarks) live in
``macroarch.measure``.
"""

from macroarch.comm.bucketer import CollectiveError, GradientBucketer, ddp_bucket_bytes, ddp_with_buckets
from macroarch.comm.launch import LaunchError, RankOutcome, launch
from macroarch.comm.layout import BUCKET_MULTIPLE_MB, Bucket, MiB, check_bucket_mb, plan_buckets

__all__ = [
    "BUCKET_MULTIPLE_MB",
    "Bucket",
    "CollectiveError",
    "GradientBucketer",
    "LaunchError",
    "MiB",
    "RankOutcome",
    "check_bucket_mb",
    "ddp_bucket_bytes",
    "ddp_with_buckets",
    "launch",
    "plan_buckets",
]
