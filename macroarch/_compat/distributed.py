"""Two things ``torch.distributed`` keeps private: the default process group's key-value store, and the buckets
DDP's reducer has built.

``measure.comm_bench``'s dead-rank demonstration has one rank tell the others, through the rendezvous store, that
it is about to stall, so that the survivors' collective timeout is what is measured. ``init_process_group``
creates that store and keeps it; torch returns it only through the private
``torch.distributed.distributed_c10d._get_default_store``. No public fallback exists (a new ``TCPStore`` would need
its own port and rendezvous), so a torch without it gets an error naming the release.

``comm.bucketer.ddp_bucket_bytes`` reports the bucket sizes DDP actually uses (C9 compares them with the
bucketer's): DDP rebuilds its buckets after the first iteration, in the order gradients arrived, and only the
reducer knows the result (``Reducer._get_zeros_like_grad_buckets``; DDP's logging data reports the sizes at
construction). A communication hook sees each bucket (``GradBucket.buffer()``, public) but takes over the
all-reduce, so it is no fallback; a torch without the call gets an error naming it. Both are looked up on use.
"""

from __future__ import annotations

from typing import Any

from macroarch._compat import version


def default_store() -> Any:
    """The ``torch.distributed.Store`` of the default process group (which must be initialised)."""
    import torch.distributed as dist

    version.check("macroarch._compat.distributed (the default store)")
    # private: the store init_process_group made; DDP and elastic agents read it the same way
    get = getattr(dist.distributed_c10d, "_get_default_store", None)
    if get is None:
        raise version.missing("torch.distributed.distributed_c10d._get_default_store",
                              "signalling between ranks outside collectives")
    return get()


def ddp_bucket_buffers(ddp: Any) -> list[Any]:
    """A tensor shaped like each bucket ``DistributedDataParallel`` ``ddp`` uses now (zeros, the bucket's flat
    dtype and length), in bucket order."""
    version.check("macroarch._compat.distributed (DDP's buckets)")
    # private: the reducer's buckets as GradBucket objects (their public buffer() is the flat bucket); no public API
    # lists the buckets DDP rebuilt after its first iteration (no upstream issue asks for one)
    get = getattr(ddp.reducer, "_get_zeros_like_grad_buckets", None)
    if get is None:
        raise version.missing("torch.distributed.Reducer._get_zeros_like_grad_buckets", "the sizes of DDP's buckets")
    return [bucket.buffer() for bucket in get()]
