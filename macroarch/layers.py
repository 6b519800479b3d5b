"""Layer discovery: the repeated blocks of any ``nn.Module`` (a transformer's layers, a ViT's blocks).

DGR groups consecutive blocks, MVAS carries a plan across blocks by relative depth, and the gradient analysis
records norms per block; all of them find the blocks here, the way the post's own code does: the children of
the largest repeated ``nn.ModuleList`` / ``nn.Sequential``.
"""

from __future__ import annotations

from torch import nn


def find_repeated_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The blocks of ``model``'s largest repeated container, input side first, as ``(name, module)``.

    A repeated container is an ``nn.ModuleList`` or ``nn.Sequential`` with at least two children that hold
    parameters, all of one class; its blocks are those children (parameter-free ones such as activations
    in between are skipped). The largest has the most blocks, ties going to the most parameters, then to
    the first found. Returns ``[]`` when the model has none.
    """
    best: list[tuple[str, nn.Module]] = []
    best_key = (0, 0)
    for prefix, container in model.named_modules():
        if not isinstance(container, nn.ModuleList | nn.Sequential):
            continue
        blocks = [(f"{prefix}.{name}" if prefix else name, child) for name, child in container.named_children()
                  if next(child.parameters(), None) is not None]
        if len(blocks) < 2 or len({type(child) for _, child in blocks}) != 1:
            continue
        key = (len(blocks), sum(p.numel() for p in container.parameters()))
        if key > best_key:
            best, best_key = blocks, key
    return best
