"""Communication (post sections 2.2 and 4.2, claims C5 and C9), on torch.distributed (gloo on CPU, NCCL on GPUs).

- ``layout``: ``plan_buckets``, the flat buffers cut into buckets of exactly ``bucket_mb`` MiB;
- ``bucketer``: ``GradientBucketer`` (gradients all-reduced in flat buckets of a fixed size as backward fills
  them, optional time windows, per-collective timeouts, composes with DGR), ``ddp_with_buckets``;
- ``zero3``: the ZeRO-3 / FSDP communication model (alpha-beta ring collectives, FLOPs, overlapped schedule),
  ``fit_alpha_beta`` to calibrate it;
- ``calibrate``: collectives and a real FSDP2 (``fully_shard``) step timed on launched ranks;
- ``bench``: bucket sizes and windows against DDP, and the dead-rank demonstrations;
- ``launch``: run a function on N local ranks with torchrun's environment and a hard timeout.
"""

from macroarch.comm._workload import Workload
from macroarch.comm.bench import all_reduce_times, bucket_summary, compare_bucketing, dead_rank
from macroarch.comm.bucketer import CollectiveError, GradientBucketer, ddp_bucket_bytes, ddp_with_buckets
from macroarch.comm.calibrate import measure_zero3
from macroarch.comm.launch import LaunchError, RankOutcome, launch
from macroarch.comm.layout import BUCKET_MULTIPLE_MB, Bucket, MiB, check_bucket_mb, plan_buckets
from macroarch.comm.zero3 import (
    Cluster,
    StepTime,
    Unit,
    all_gather_time,
    all_reduce_time,
    fit_alpha_beta,
    fsdp_units,
    latency_for_share,
    reduce_scatter_time,
    sync_share,
    training_flops,
    zero3_step,
)

__all__ = [
    "BUCKET_MULTIPLE_MB",
    "Bucket",
    "Cluster",
    "CollectiveError",
    "GradientBucketer",
    "LaunchError",
    "MiB",
    "RankOutcome",
    "StepTime",
    "Unit",
    "Workload",
    "all_gather_time",
    "all_reduce_times",
    "all_reduce_time",
    "bucket_summary",
    "check_bucket_mb",
    "compare_bucketing",
    "ddp_bucket_bytes",
    "ddp_with_buckets",
    "dead_rank",
    "fit_alpha_beta",
    "fsdp_units",
    "latency_for_share",
    "launch",
    "measure_zero3",
    "plan_buckets",
    "reduce_scatter_time",
    "sync_share",
    "training_flops",
    "zero3_step",
]
