"""Topology-aware parameter groups for DGR (post section 3.1), read off the autograd graph of one forward pass.

The post's DGR wraps a model as ``DGRWrapper(module, group_size=8)`` and updates parameters group by group
as backward produces their gradients. This module decides the groups:

1. **Backward order.** One forward pass is run (or its output handed in) and the autograd graph is walked
   back from the output, iteratively, through ``grad_fn.next_functions`` down to the ``AccumulateGrad``
   nodes of the leaves. The autograd engine runs ready nodes by decreasing sequence number (their creation
   order in forward) and an ``AccumulateGrad`` node, whose priority is the highest, as soon as it is
   ready; so a parameter's gradient is complete right after the *lowest-numbered node that consumes it*.
   Parameters are ranked by that node (``position`` 0 first); parameters fed by one node share a position
   (their relative order is up to the engine). This holds for backward on one device thread (CPU, or a
   model on one GPU); the tests check it against ``register_post_accumulate_grad_hook`` on Llama, BERT,
   ViT and CLIP. Reentrant activation checkpointing adds nodes during backward and is not modelled.
2. **Layers.** The blocks of every repeated container (``find_repeated_layers``, applied again to the parts
   of the model outside each container found, so both towers of a CLIP count) are cut into runs of
   ``group_size`` consecutive blocks, input side first: one group per run.
3. **Everything else** (embeddings, heads, final norms, CLIP's projections and ``logit_scale``) is grouped
   by backward order: the parameters outside the blocks whose gradients arrive between two block groups
   form one group. For a decoder LM that is one output-side group (head, final norm) and one input-side
   group (embeddings); a model with no repeated container is one group (with a warning).
4. **Unused** parameters (trainable but not reached by the graph) form a last group of their own, with a
   warning: they never get a gradient from this kind of batch.

Shared parameters appear once. A tensor registered under several names (tied input/output embeddings) is
placed by the modules that own it: owners all outside the blocks (the usual tied LM) mean it simply joins
the outside group at its backward position, which is after its last use, at the input side. Owners in
different block groups (weights shared across distant layers) are ambiguous: with ``strict=True`` that
raises; otherwise the tensor goes to the candidate group that completes last in backward, so that no group
waits for it. Groups are numbered by the order in which they complete in backward (0 = output side).

No paper defines these groups. Deviation from the post: it gives no rule for what a "topology-aware" group
is; grouping by consecutive layers and by gradient arrival is this project's reading (DESIGN.md, DGR).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from macroarch._compat.autograd import sequence_nr
from macroarch._table import format_table
from macroarch.layers import find_repeated_layers

_OUTSIDE = "outside"


@dataclass(frozen=True)
class ParamGroup:
    """One DGR group.

    Attributes:
        index: completion order in backward (0 completes first).
        kind: ``"blocks"`` (consecutive blocks of a repeated container), ``"outside"`` (parameters outside
            the blocks) or ``"unused"`` (not reached by the graph).
        layers: the block names, or for other kinds the modules that own the parameters.
        names: parameter names (the first name of a shared tensor), in backward order.
        params: the parameters, in the order of ``names``.
        positions: each parameter's backward position (None for unused ones).
    """

    index: int
    kind: str
    layers: tuple[str, ...]
    names: tuple[str, ...]
    params: tuple[nn.Parameter, ...]
    positions: tuple[int | None, ...]

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params)

    @property
    def label(self) -> str:
        """``"<kind>: <layers>"``: the block range, or the first few owning modules (``<root>``: the model)."""
        if self.kind == "blocks":
            shown = self.layers[0] if len(self.layers) == 1 else f"{self.layers[0]} .. {self.layers[-1]}"
        else:
            shown = ", ".join(name or "<root>" for name in self.layers[:3])
            shown += f" (+{len(self.layers) - 3})" if len(self.layers) > 3 else ""
        return f"{self.kind}: {shown}"


@dataclass(frozen=True)
class Grouping:
    """The groups of a model's trainable parameters: disjoint, covering, in backward completion order.

    Attributes:
        groups: the groups; ``groups[i].index == i``.
        group_size: blocks per block group.
        stacks: the block names of each repeated container found.
        aliases: for each shared tensor, its first name -> its other names.
    """

    groups: tuple[ParamGroup, ...]
    group_size: int
    stacks: tuple[tuple[str, ...], ...]
    aliases: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.groups)

    def __iter__(self) -> Iterator[ParamGroup]:
        return iter(self.groups)

    def describe(self) -> str:
        """A table: group, kind, layers, tensors, parameters, bytes, backward positions (first-last)."""
        rows: list[list[object]] = [["group", "kind", "layers", "tensors", "params", "bytes", "backward"]]
        for g in self.groups:
            used = [p for p in g.positions if p is not None]
            span = f"{min(used)}-{max(used)}" if used else "never"
            rows.append([g.index, g.kind, g.label.removeprefix(f"{g.kind}: "), len(g.params), f"{g.numel:,}",
                         f"{g.nbytes:,}", span])
        return format_table(rows)

    def __str__(self) -> str:
        return self.describe()


# ------------------------------------------------------------------------------------------ graph walk
def _output_tensors(output: Any) -> list[torch.Tensor]:
    """Every tensor in ``output`` (nested tuples, lists, dicts, ModelOutputs) that has a gradient path."""
    found, pending = [], [output]
    while pending:
        item = pending.pop()
        if isinstance(item, torch.Tensor):
            if item.requires_grad:
                found.append(item)
        elif isinstance(item, Mapping):
            pending.extend(item.values())
        elif isinstance(item, list | tuple):
            pending.extend(item)
    return found


def backward_order(output: Any) -> list[tuple[torch.Tensor, int]]:
    """The leaves that ``output``'s graph reaches, with the position at which backward completes their grad.

    ``output`` is a tensor or any nesting of tuples, lists and dicts of tensors (all of them are roots).
    Positions are dense ranks, 0 first; leaves whose last consumer is the same node share a position.
    """
    roots = _output_tensors(output)
    if not roots:
        raise ValueError(
            "the output has no tensor that requires grad, so it has no backward graph: run the forward with "
            "gradients enabled and trainable parameters, or pass a loss_fn that returns the loss"
        )
    last_use: dict[int, tuple[torch.Tensor, int]] = {}  # id(leaf) -> (leaf, sequence number of its last consumer)
    first = 2**64  # a root that is itself a leaf is complete before any node runs
    for t in roots:
        if t.grad_fn is None:
            last_use[id(t)] = (t, first)
    nodes = [t.grad_fn for t in roots if t.grad_fn is not None]
    seen = {id(n) for n in nodes}
    stack = list(nodes)
    while stack:  # iterative: a 1000-layer graph is far deeper than Python's recursion limit
        node = stack.pop()
        seq = sequence_nr(node)  # the engine runs the ready node with the highest first (private: _compat.autograd)
        for child, _ in node.next_functions:
            if child is None:
                continue
            leaf = getattr(child, "variable", None)  # only AccumulateGrad nodes carry one
            if leaf is not None:
                if id(leaf) not in last_use or seq < last_use[id(leaf)][1]:
                    last_use[id(leaf)] = (leaf, seq)
            elif id(child) not in seen:
                seen.add(id(child))
                nodes.append(child)  # keeps the Python node objects, and so their ids, alive during the walk
                stack.append(child)
    ranks = {seq: r for r, seq in enumerate(sorted({seq for _, seq in last_use.values()}, reverse=True))}
    return sorted(((leaf, ranks[seq]) for leaf, seq in last_use.values()), key=lambda item: item[1])


def _find_stacks(model: nn.Module) -> list[list[str]]:
    """Block names of every disjoint repeated container: the largest, then the largest in what is left."""
    stacks: list[list[str]] = []
    pending: list[tuple[str, nn.Module]] = [("", model)]
    while pending:
        prefix, module = pending.pop()
        blocks = find_repeated_layers(module)
        if not blocks:
            continue
        stacks.append([f"{prefix}.{name}" if prefix else name for name, _ in blocks])
        container = blocks[0][0].rpartition(".")[0]
        node, node_prefix = module, prefix
        for part in container.split(".") if container else []:  # siblings along the path to the container
            for name, child in node.named_children():
                if name != part:
                    pending.append((f"{node_prefix}.{name}" if node_prefix else name, child))
            node, node_prefix = getattr(node, part), f"{node_prefix}.{part}" if node_prefix else part
    return stacks


# ---------------------------------------------------------------------------------------------- grouping
def check_group_size(group_size: Any) -> int:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size={group_size!r} must be a positive int (blocks per group)")
    return group_size


def group_parameters(module: nn.Module, output: Any, group_size: int = 8, *, strict: bool = False) -> Grouping:
    """Group ``module``'s trainable parameters from ``output``, the result of a forward pass (module docstring)."""
    check_group_size(group_size)
    names_of: dict[int, list[str]] = {}
    param_of: dict[int, nn.Parameter] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if p.requires_grad:
            names_of.setdefault(id(p), []).append(name)
            param_of[id(p)] = p
    if not param_of:
        raise ValueError(f"module: {type(module).__name__} has no trainable parameters (requires_grad=True); "
                         "there is nothing to group or update")
    stacks = _find_stacks(module)
    if not stacks:
        warnings.warn(f"{type(module).__name__} has no repeated container (nn.ModuleList/nn.Sequential of >= 2 "
                      "blocks of one class): all its parameters form one group", stacklevel=2)
    block_key = {block: (s, i // group_size) for s, stack in enumerate(stacks) for i, block in enumerate(stack)}

    def unit(name: str) -> Any:  # the block group that owns a parameter name, or _OUTSIDE
        parts = name.split(".")
        for k in range(1, len(parts)):
            key = block_key.get(".".join(parts[:k]))
            if key is not None:
                return key
        return _OUTSIDE

    position = {id(leaf): pos for leaf, pos in backward_order(output) if id(leaf) in param_of}
    units = {pid: list(dict.fromkeys(unit(n) for n in names)) for pid, names in names_of.items()}
    shared = {pid: u for pid, u in units.items() if len(u) > 1}
    if strict and shared:
        pid, u = next(iter(shared.items()))
        raise ValueError(
            f"strict=True: parameter {names_of[pid][0]!r} is shared by {names_of[pid]}, which fall in different "
            f"groups ({[_unit_label(x, stacks, group_size) for x in u]}); untie it, choose a group_size that keeps "
            "its owners together, or pass strict=False to place it in the group that completes last"
        )
    completion: dict[Any, int] = {}
    for pid, u in units.items():
        if len(u) == 1 and u[0] != _OUTSIDE and pid in position:
            completion[u[0]] = max(completion.get(u[0], -1), position[pid])
    assigned: dict[int, Any] = {}
    for pid, u in units.items():
        # Shared across groups: the candidate that completes last; outside means "at its own position".
        assigned[pid] = max(u, key=lambda x: position.get(pid, -1) if x == _OUTSIDE else completion.get(x, -1))

    # Outside parameters split into runs wherever a block group's gradient arrives in between.
    order = sorted((pid for pid in param_of if pid in position),
                   key=lambda pid: (position[pid], assigned[pid] != _OUTSIDE))
    members: dict[Any, list[int]] = {}
    run = 0
    for pid in order:
        if assigned[pid] == _OUTSIDE:
            members.setdefault((_OUTSIDE, run), []).append(pid)
        else:
            run += 1 if members.get((_OUTSIDE, run)) else 0
            members.setdefault(assigned[pid], []).append(pid)
    unused = [pid for pid in param_of if pid not in position]
    if unused:
        warnings.warn(f"{len(unused)} trainable parameter(s) are not reached by the forward pass's graph and form "
                      f"a group of their own: {[names_of[pid][0] for pid in unused][:8]}", stacklevel=2)

    def make(index: int, key: Any, pids: list[int]) -> ParamGroup:
        names = tuple(names_of[pid][0] for pid in pids)
        if key == "unused" or key[0] == _OUTSIDE:
            kind = "unused" if key == "unused" else _OUTSIDE
            layers = tuple(dict.fromkeys(n.rpartition(".")[0] for n in names))
        else:
            kind, layers = "blocks", tuple(stacks[key[0]][key[1] * group_size:(key[1] + 1) * group_size])
        return ParamGroup(index, kind, layers, names, tuple(param_of[pid] for pid in pids),
                          tuple(position.get(pid) for pid in pids))

    keyed = sorted(members.items(), key=lambda kv: max(position[pid] for pid in kv[1]))
    if unused:
        keyed.append(("unused", unused))
    return Grouping(
        groups=tuple(make(i, key, pids) for i, (key, pids) in enumerate(keyed)),
        group_size=group_size,
        stacks=tuple(tuple(s) for s in stacks),
        aliases={names[0]: tuple(names[1:]) for names in names_of.values() if len(names) > 1},
    )


def _unit_label(unit: Any, stacks: list[list[str]], group_size: int) -> str:
    if unit == _OUTSIDE:
        return "outside the blocks"
    blocks = stacks[unit[0]][unit[1] * group_size:(unit[1] + 1) * group_size]
    return f"{blocks[0]} .. {blocks[-1]}"


def run_example(module: nn.Module, example: Any = None, loss_fn: Callable[..., Any] | None = None) -> Any:
    """The forward output used for grouping: ``loss_fn(module, example)``, ``loss_fn(module)``, or
    ``module(example)`` for a tensor, ``module(*example)`` for a tuple/list, ``module(**example)`` for a dict."""
    if loss_fn is not None:
        return loss_fn(module) if example is None else loss_fn(module, example)
    if example is None:
        raise ValueError("example and loss_fn are both None: pass an example input (tensor, tuple of args or "
                         "dict of kwargs) or a loss_fn(module[, example]) that runs the forward pass")
    if isinstance(example, Mapping):
        return module(**example)
    if isinstance(example, list | tuple):
        return module(*example)
    return module(example)


def build_groups(
    module: nn.Module,
    example: Any = None,
    *,
    loss_fn: Callable[..., Any] | None = None,
    group_size: int = 8,
    strict: bool = False,
) -> Grouping:
    """Run one forward pass of ``module`` (see ``run_example``) and group its parameters from its graph.

    The pass leaves the module as it found it: the RNG (CPU, and the CUDA devices of the parameters) is
    forked, so dropout draws nothing from the training stream, and buffers (BatchNorm statistics) are
    restored. No backward pass is run.
    """
    check_group_size(group_size)
    devices = sorted({p.device.index or 0 for p in module.parameters() if p.device.type == "cuda"})
    saved = {name: b.detach().clone() for name, b in module.named_buffers()}
    with torch.random.fork_rng(devices=devices), torch.enable_grad():
        output = run_example(module, example, loss_fn)
        grouping = group_parameters(module, output, group_size, strict=strict)
    with torch.no_grad():
        for name, b in module.named_buffers():
            if name in saved:
                b.copy_(saved[name])
    return grouping
