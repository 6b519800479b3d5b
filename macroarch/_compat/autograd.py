"""The two private autograd calls that in-backward work needs: the running pass's id and a callback at its end.

DGR steps a group's optimizer as soon as its gradients are complete, the GradientBucketer launches an
all-reduce as soon as a bucket is full, and the gradient recorder closes one record per pass. All three must
know (a) whether a gradient belongs to the backward pass they already saw or to a new one, and (b) when the
pass has ended, to finish what it left open. Public hooks cannot tell either: a post-accumulate-grad hook
gets the parameter only, and ``register_multi_grad_hook`` fires per set of tensors, not at the end of the
engine's pass (nor when some parameters receive no gradient). The engine knows both: its graph-task id and
its final-callback queue (the same calls DDP's reducer and FSDP use). Neither has a public equivalent nor a
fallback, so a torch without them gets an error naming the call and the release (``version.missing``); each is
looked up once, on first use, not when this module is imported.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from macroarch._compat import version


@functools.cache
def _graph_task_id() -> Callable[[], int]:
    import torch

    version.check("macroarch._compat.autograd")
    try:
        # private: the autograd engine's id of the graph task running on this thread (-1 outside backward); DDP's
        # reducer and FSDP read it to tell passes apart, no public API exposes it
        return torch._C._current_graph_task_id
    except AttributeError as err:
        raise version.missing("torch._C._current_graph_task_id", "telling backward passes apart (DGR, bucketer)",
                              err) from err


@functools.cache
def _queue_callback() -> Callable[[Callable[[], None]], None]:
    import torch

    version.check("macroarch._compat.autograd")
    try:
        # private: the engine's final-callback queue, run once the whole pass has finished (FSDP's post-backward
        # uses it); register_multi_grad_hook fires per tensor set, not at the end of the pass
        return torch.autograd.Variable._execution_engine.queue_callback
    except AttributeError as err:
        raise version.missing("torch.autograd.Variable._execution_engine.queue_callback",
                              "work at the end of a backward pass (DGR, bucketer, gradient recorder)", err) from err


def backward_pass_id() -> int:
    """The id of the backward pass (autograd graph task) now running on this thread; -1 outside one."""
    return _graph_task_id()()


def at_backward_end(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the backward pass now running has finished (must be called from inside it)."""
    _queue_callback()(callback)
