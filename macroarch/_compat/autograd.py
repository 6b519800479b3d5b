"""Private autograd facts that in-backward work needs: the running pass's id and a callback at its end, the order
in which graph nodes were made, and whether a tensor is a view of another's memory.

DGR steps a group's optimizer as soon as its gradients are complete, the GradientBucketer launches an
all-reduce as soon as a bucket is full, and the gradient recorder closes one record per pass. All three must
know (a) whether a gradient belongs to the backward pass they already saw or to a new one, and (b) when the
pass has ended, to finish what it left open. Public hooks cannot tell either: a post-accumulate-grad hook
gets the parameter only, and ``register_multi_grad_hook`` fires per set of tensors, not at the end of the
engine's pass (nor when some parameters receive no gradient). The engine knows both: its graph-task id and
its final-callback queue (the same calls DDP's reducer and FSDP use). Neither has a public equivalent nor a
fallback, so a torch without them gets an error naming the call and the release (``version.missing``).

DGR's grouping predicts the order in which backward completes each parameter's gradient from the nodes'
sequence numbers (``sequence_nr``), the order the engine itself runs ready nodes in; DGR's pipeline copies a
gradient that is a view into another tensor's memory before queueing it (``is_view``). Each name is looked up on
first use, not when this module is imported.
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


def sequence_nr(node: object) -> int:
    """The sequence number of an autograd graph node (``tensor.grad_fn``): the order the forward pass created the
    nodes in. The engine runs the ready node with the highest number first, so it orders backward."""
    version.check("macroarch._compat.autograd")
    # private: Node._sequence_nr, the engine's own priority (torch/csrc/autograd/function.h); torch.autograd.graph.Node
    # exposes name(), next_functions and hooks but no order (no upstream issue asks for one). Fallback: none (a
    # topological order of the graph is not the engine's order), so a torch without it gets an error naming it
    try:
        return node._sequence_nr()
    except AttributeError as err:
        raise version.missing("torch.autograd.graph.Node._sequence_nr", "the order of DGR's gradient groups",
                              err) from err


def is_view(tensor: object) -> bool:
    """Whether ``tensor`` is a view of another tensor's memory (autograd's view tracking: it has a base)."""
    # private: Tensor._base, which torch's own "Tensor Views" documentation uses to explain views; there is no
    # public is_view (pytorch/pytorch#18197 added _is_view "for debugging"; storage pointers cannot tell a view of
    # a whole storage from its owner). Fallback: True, so that a caller that copies views copies every tensor
    # (correct, one copy more), with a warning once
    try:
        return tensor._base is not None
    except AttributeError:
        _warn_no_views()
        return True


@functools.cache
def _warn_no_views() -> None:
    import warnings

    import torch

    warnings.warn(f"torch {torch.__version__} has no Tensor._base: every gradient DGR queues is copied, as if it "
                  "viewed another tensor's memory", RuntimeWarning, stacklevel=3)
