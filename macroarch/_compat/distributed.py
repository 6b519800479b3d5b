"""The default process group's key-value store, for processes that must signal each other outside collectives.

``measure.comm_bench``'s dead-rank demonstration has one rank tell the others, through the rendezvous store, that
it is about to stall, so that the survivors' collective timeout is what is measured. ``init_process_group``
creates that store and keeps it; torch returns it only through the private
``torch.distributed.distributed_c10d._get_default_store``. No public fallback exists (a new ``TCPStore`` would need
its own port and rendezvous), so a torch without it gets an error naming the release. Looked up on use.
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
