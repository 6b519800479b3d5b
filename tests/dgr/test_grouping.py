"""DGR grouping: disjoint and covering groups on every model family, backward order against the hooks that
actually fire, group_size, shared and unused parameters, bad input."""

import warnings

import pytest
import torch
from torch import nn

from macroarch.dgr import backward_order, build_groups, group_parameters

MODELS = ["sequential", "llama", "gpt2_tied", "bert", "vit", "clip"]


def _check_partition(model, grouping):
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    seen = [id(p) for g in grouping for p in g.params]
    assert len(seen) == len(set(seen)), "a parameter is in two groups"
    assert set(seen) == trainable, "the groups do not cover the trainable parameters"
    assert [g.index for g in grouping] == list(range(len(grouping)))
    for g in grouping:
        assert len(g.names) == len(g.params) == len(g.positions)
        named = dict(model.named_parameters())
        assert all(named[n] is p for n, p in zip(g.names, g.params))
        if g.kind == "blocks":
            stack = next(s for s in grouping.stacks if g.layers[0] in s)
            start = stack.index(g.layers[0])
            assert start % grouping.group_size == 0
            assert list(g.layers) == list(stack[start:start + grouping.group_size])  # consecutive, <= group_size


@pytest.mark.parametrize("name", MODELS)
def test_groups_partition_and_follow_the_order_hooks_fire_in(zoo, name):
    model, loss_fn = zoo[name]()
    loss = loss_fn(model)
    grouping = group_parameters(model, loss, group_size=2)
    _check_partition(model, grouping)
    assert sum(g.kind == "blocks" for g in grouping) >= 2

    # Independent reference: the order in which autograd really completes each parameter's gradient.
    fired = []
    handles = [p.register_post_accumulate_grad_hook(lambda p: fired.append(p)) for p in model.parameters()]
    loss.backward()
    for h in handles:
        h.remove()
    position = {id(p): pos for g in grouping for p, pos in zip(g.params, g.positions)}
    assert len(fired) == len(position)
    predicted = [position[id(p)] for p in fired]
    assert predicted == sorted(predicted), "a gradient completed before one the graph walk ranks earlier"
    group_of = {id(p): g.index for g in grouping for p in g.params}
    last_fired = {}
    for step, p in enumerate(fired):
        last_fired[group_of[id(p)]] = step
    assert sorted(last_fired, key=last_fired.get) == list(range(len(grouping)))  # completion order = index


def test_group_size_is_honoured_and_blocks_are_cut_from_the_input_side():
    net = nn.Sequential(*[m for _ in range(10) for m in (nn.Linear(4, 4), nn.ReLU())])
    grouping = build_groups(net, torch.randn(2, 4), group_size=3)
    assert grouping.stacks == (tuple(str(2 * i) for i in range(10)),)
    # Backward completes the output side first: the short remainder group is first.
    assert [g.layers for g in grouping] == [("18",), ("12", "14", "16"), ("6", "8", "10"), ("0", "2", "4")]
    assert [len(g.params) for g in grouping] == [2, 6, 6, 6]
    one = build_groups(net, torch.randn(2, 4), group_size=1)
    assert len(one) == 10 and all(g.kind == "blocks" for g in one)
    table = grouping.describe()
    assert table.splitlines()[0].split() == ["group", "kind", "layers", "tensors", "params", "bytes", "backward"]
    assert len(table.splitlines()) == 2 + len(grouping)


def test_outside_parameters_split_by_side_and_clip_towers_are_both_found(zoo):
    model, loss_fn = zoo["llama"]()
    grouping = build_groups(model, loss_fn=loss_fn, group_size=4)
    assert [g.kind for g in grouping] == ["outside", "blocks", "outside"]
    assert set(grouping.groups[0].names) == {"lm_head.weight", "model.norm.weight"}
    assert grouping.groups[-1].names == ("model.embed_tokens.weight",)

    clip, clip_loss = zoo["clip"]()
    grouping = build_groups(clip, loss_fn=clip_loss, group_size=2)
    assert sorted(s[0] for s in grouping.stacks) == ["transformer.resblocks.0", "visual.transformer.resblocks.0"]


def test_tied_embeddings_appear_once_in_the_input_side_group(zoo):
    model, loss_fn = zoo["gpt2_tied"]()
    assert model.lm_head.weight is model.transformer.wte.weight
    grouping = build_groups(model, loss_fn=loss_fn, group_size=2, strict=True)  # both owners outside the blocks
    _check_partition(model, grouping)
    holder = [g for g in grouping if any(p is model.lm_head.weight for p in g.params)]
    assert len(holder) == 1 and holder[0].index == len(grouping) - 1  # completes last: its last use is the input
    assert grouping.aliases == {"transformer.wte.weight": ("lm_head.weight",)}


def _shared_stack():
    net = nn.Sequential(*[nn.Linear(4, 4) for _ in range(6)])
    net[5].weight = net[0].weight  # shared by blocks 0 and 5, in different groups when group_size < 6
    return net


def test_parameter_shared_across_groups():
    net = _shared_stack()
    with pytest.raises(ValueError, match=r"strict=True: parameter '0.weight' is shared by \['0.weight', '5.weight'\]"):
        build_groups(net, torch.randn(2, 4), group_size=2, strict=True)
    grouping = build_groups(net, torch.randn(2, 4), group_size=2)
    _check_partition(net, grouping)
    holder = next(g for g in grouping if any(p is net[0].weight for p in g.params))
    assert holder.layers == ("0", "1") and holder.index == len(grouping) - 1
    build_groups(net, torch.randn(2, 4), group_size=6, strict=True)  # one group: nothing ambiguous


class _WithSpare(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.spare = nn.Linear(4, 4)  # never called

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_unused_parameters_form_a_last_group_with_a_warning():
    net = _WithSpare()
    with pytest.warns(UserWarning, match=r"not reached .*\['spare.weight', 'spare.bias'\]"):
        grouping = build_groups(net, torch.randn(2, 4), group_size=1)
    _check_partition(net, grouping)
    assert grouping.groups[-1].kind == "unused" and grouping.groups[-1].positions == (None, None)
    assert "never" in grouping.describe()


def test_a_model_without_repeated_container_is_one_group():
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.LayerNorm(8))
    with pytest.warns(UserWarning, match="no repeated container"):
        grouping = build_groups(net, loss_fn=lambda m: m(torch.randn(2, 4)).sum(), group_size=2)
    assert len(grouping) == 1 and grouping.groups[0].kind == "outside"


def test_build_groups_leaves_rng_and_buffers_untouched():
    net = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5)) for _ in range(3)])
    mean = net[0][1].running_mean.clone()
    x = torch.randn(8, 4) + 5
    state = torch.get_rng_state()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_groups(net, x, group_size=1)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(net[0][1].running_mean, mean)


@pytest.mark.parametrize("group_size", [0, -1, 1.5, True, "8"])
def test_bad_group_size(group_size):
    with pytest.raises(ValueError, match="group_size="):
        build_groups(nn.Linear(2, 2), torch.randn(1, 2), group_size=group_size)


def test_no_trainable_parameters_and_no_graph():
    frozen = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)).requires_grad_(False)
    with pytest.raises(ValueError, match="has no trainable parameters"):
        group_parameters(frozen, torch.ones(1, requires_grad=True))
    with pytest.raises(ValueError, match="has no tensor that requires grad"):
        backward_order(torch.ones(3))
    with pytest.raises(ValueError, match="example and loss_fn are both None"):
        build_groups(nn.Linear(2, 2))


def test_backward_order_of_a_chain_is_exact():
    a, b, c = (torch.randn(3, requires_grad=True) for _ in range(3))
    out = ((a * 2).sin() * b).sum() * c.sum()  # c's consumer is the newest node, a's the oldest
    assert [(t is x, pos) for (t, pos), x in zip(backward_order(out), (c, b, a))] == [(True, 0), (True, 1), (True, 2)]
