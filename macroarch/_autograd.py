"""The two private autograd calls that in-backward work needs, in one place.

DGR steps a group's optimizer as soon as its gradients are complete, the GradientBucketer launches an
all-reduce as soon as a bucket is full, and the gradient recorder closes one record per pass. All three must
know (a) whether a gradient belongs to the backward pass they already saw or to a new one, and (b) when the
pass has ended, to finish what it left open. Public hooks cannot tell either: a post-accumulate-grad hook
gets the parameter only, and ``register_multi_grad_hook`` fires per set of tensors, not at the end of the
engine's pass (nor when some parameters receive no gradient). The engine knows both: its graph-task id and
its final-callback queue (the same calls DDP's reducer and FSDP use). They are private and may change between
torch releases; keeping them here means one place to fix.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def backward_pass_id() -> int:
    """The id of the backward pass (autograd graph task) now running on this thread; -1 outside one."""
    return torch._C._current_graph_task_id()


def at_backward_end(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the backward pass now running has finished (must be called from inside it)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)
