"""Peak gradient bytes measured by MemTracker: about one group in sync DGR, the whole model in plain training."""

import copy

import torch

from macroarch.dgr import DGRWrapper
from macroarch.measure.memory import measure_step
from macroarch.models import get_model_spec


def _max_gradient_bytes(model, optimizer, ids):
    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    step()  # a first step creates AdamW's state
    return measure_step(step, model, optimizer, ids).max_by_category["gradients"]


def test_sync_dgr_holds_about_one_group_of_gradients():
    torch.manual_seed(0)
    net = get_model_spec("llama_65b_tiny").scaled(n_layers=8).build()
    plain = copy.deepcopy(net)
    ids = torch.randint(0, 256, (2, 16))
    dgr = DGRWrapper(net, group_size=2, example_inputs={"input_ids": ids, "labels": ids})
    grouping = dgr.grouping
    model_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    largest_group = max(g.nbytes for g in grouping)
    largest_tensor = max(p.numel() * p.element_size() for p in net.parameters())
    assert len(grouping) == 6 and largest_group < model_bytes / 4

    dgr_bytes = _max_gradient_bytes(dgr, dgr.optimizer(torch.optim.AdamW, lr=1e-3), ids)
    plain_bytes = _max_gradient_bytes(plain, torch.optim.AdamW(plain.parameters(), lr=1e-3), ids)
    assert plain_bytes == model_bytes
    # A finished group's gradients go when the next gradient arrives: one group plus one tensor at most.
    assert largest_group <= dgr_bytes <= largest_group + largest_tensor
