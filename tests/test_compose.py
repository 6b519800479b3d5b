"""compose.apply: the techniques stacked in order, against independent references."""

import copy

import pytest
import torch
from model_zoo import ZOO

from macroarch import compose
from macroarch.config import ConfigError, load_config
from macroarch.dgr import DGRWrapper
from macroarch.mvas import MVASAdamW

POST = {"optim": {"macro_architecture": True, "group_size": 6,
                  "precision_policy": {"text": "fp16", "image": ["fp8", "fp16"]}}}


def _formats(plan):
    return {t.name: t.format for t in plan.tensors}


def test_post_policy_on_open_clip_splits_the_image_tower_at_half_depth():
    model, _ = ZOO["clip"]()  # 3 visual blocks, 2 text blocks
    formats = _formats(compose.precision_plan(model, load_config({**POST, "mvas": {"min_numel": 0}})))
    n_blocks = len(model.visual.transformer.resblocks)
    n_shallow = -(-n_blocks // 2)  # ceil(0.5 * n), input side first
    for i in range(n_blocks):
        for tail in ("attn.in_proj_weight", "attn.out_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"):
            expected = "fp8_e4m3" if i < n_shallow else "fp16"
            assert formats[f"visual.transformer.resblocks.{i}.{tail}"] == expected, (i, tail)
        assert formats[f"visual.transformer.resblocks.{i}.ln_1.weight"] == "fp32"  # norms keep their dtype
    assert formats["visual.conv1.weight"] == "fp8_e4m3"  # the patch embedding is shallow
    assert formats["visual.proj"] == "fp16"  # the output projection is deep
    assert formats["transformer.resblocks.0.mlp.c_fc.weight"] == "fp16"  # the text tower
    assert formats["token_embedding.weight"] == "fp16"


def test_post_config_trains_an_open_clip_model():
    model, loss = ZOO["clip"]()
    stack = compose.apply(model, POST, loss_fn=loss, seed=0)
    assert isinstance(stack.model, DGRWrapper) and stack.model.group_size == 6
    assert stack.store is not None and stack.store.entries
    losses = []
    for _ in range(8):
        value = loss(stack.model)
        value.backward()
        stack.optimizer.step()
        stack.optimizer.zero_grad()
        stack.after_step()
        losses.append(value.item())
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("bad", [
    {"optim": {"macro_architecture": True, "precision_policy": {"image": ["fp8", "fp16", "fp4"]}}},
    {"optim": {"macro_architecture": True, "precision_policy": {"image": "fp9"}}},
    {"optim": {"macro_architecture": True, "group_size": 0}},
    {"optim": {"macro_architecture": True, "precison_policy": {}}},
    {"optim": {"macro_architecture": True, "precision_policy": {"decoder": "fp8"}}},  # matches no parameter
])
def test_a_bad_config_leaves_the_model_untouched(bad):
    model, loss = ZOO["clip"]()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ConfigError):
        compose.apply(model, bad, loss_fn=loss)
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(type(p) is torch.nn.Parameter and p.stride() == p.contiguous().stride() for p in model.parameters())
    loss(model).backward()  # still an ordinary model


def test_dgr_without_an_example_is_refused():
    model, _ = ZOO["llama"]()
    with pytest.raises(ConfigError, match="example_inputs"):
        compose.apply(model, {"dgr": {"group_size": 2}})


def test_dgr_sync_alone_equals_torch_adamw():
    """With only DGR (sync) and CompensatedAdamW's options off, training equals torch.optim.AdamW."""
    model, loss = ZOO["llama"]()
    reference = copy.deepcopy(model)
    stack = compose.apply(model, {"dgr": {"group_size": 2}, "optim": {"lr": 1e-2}}, loss_fn=loss)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    for _ in range(3):
        loss(stack.model).backward()
        stack.optimizer.step()
        stack.optimizer.zero_grad()
        loss(reference).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_budget_config_meets_its_reduction():
    model, loss = ZOO["llama"]()
    dense = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
    stack = compose.apply(model, {"mvas": {"target_reduction": 0.5, "min_numel": 0}}, seed=0)
    assert isinstance(stack.optimizer, MVASAdamW) and stack.model is model
    assert stack.store.plan.bytes() <= 0.5 * sum(dense.values()) + 1
    value = loss(model)
    value.backward()
    stack.optimizer.step()
