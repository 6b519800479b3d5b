"""compose.apply: the techniques stacked in order, against independent references."""

import copy
from pathlib import Path

import pytest
import torch
from model_zoo import ZOO

from macroarch import compose, mvas
from macroarch.config import ConfigError, load_config
from macroarch.dgr import DGROptimizer, DGRWrapper
from macroarch.mvas import MVASAdamW

ROOT = Path(__file__).resolve().parent.parent

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


def _state(model):
    """Every tensor of the model as it is registered: (type, bytes), parameters by identity too."""
    return ({k: (type(v).__name__, v.dtype, v.detach().clone()) for k, v in model.state_dict(keep_vars=True).items()},
            [id(p) for p in model.parameters()],
            [None if p.grad is None else p.grad.clone() for p in model.parameters()])


def _assert_unchanged(model, before):
    tensors, ids, grads = _state(model)
    assert ids == before[1]  # the user's own parameter objects, where they were registered
    assert tensors.keys() == before[0].keys()
    for k, (kind, dtype, value) in tensors.items():
        assert (kind, dtype) == before[0][k][:2], k
        assert torch.equal(value.reshape(-1).view(torch.uint8), before[0][k][2].reshape(-1).view(torch.uint8)), k
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(grads, before[2]))
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())


class _BatchNormNet(torch.nn.Module):
    """Repeated blocks with BatchNorm, whose running statistics a forward pass in training mode changes."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64))
                                          for _ in range(3))
        self.head = torch.nn.Linear(64, 4)

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def test_a_step_that_fails_after_mvas_leaves_the_model_bitwise_as_it_was():
    """MVAS packs the weights, then DGR's forward pass (through the packed model: BatchNorm's statistics move)
    raises: the model gets its own parameters, buffers and gradients back, and a retry applies cleanly."""
    torch.manual_seed(0)
    model = _BatchNormNet()
    batch = torch.randn(8, 64)
    torch.nn.functional.mse_loss(model(batch), torch.zeros(8, 4)).backward()  # gradients the user already had
    config = {"mvas": {"target_reduction": 0.5, "min_numel": 0}, "dgr": {"group_size": 1}}
    before = _state(model)
    calls = []

    def broken(m, b):
        calls.append(any(isinstance(p, mvas.MVASWeight) for p in m.parameters()))
        m(b).sum().backward()
        raise OSError("the data loader broke")

    with pytest.raises(RuntimeError, match=r"DGRWrapper.*OSError: the data loader broke.*restored"):
        compose.apply(model, config, example_inputs=batch, loss_fn=broken)
    assert calls == [True]  # it failed after MVAS had packed the model
    _assert_unchanged(model, before)

    stack = compose.apply(model, config, example_inputs=batch,
                          loss_fn=lambda m, b: torch.nn.functional.mse_loss(m(b), torch.zeros(8, 4)))
    assert stack.store.entries and isinstance(stack.optimizer, DGROptimizer)


def test_the_loops_loss_fn_without_example_inputs_is_refused_before_anything_is_applied():
    """The README's loop calls loss_fn(model, batch): the same function given to apply without example_inputs is
    refused, naming how to pass the batch, and the model is untouched; with example_inputs it trains."""
    model, loss = ZOO["clip"]()
    batch = 0  # the zoo's loss closes over its own batch; this loop's loss_fn takes (model, batch)

    def loss_fn(m, b):
        return loss(m)

    before = _state(model)
    with pytest.raises(ConfigError, match=r"example_inputs=batch"):
        compose.apply(model, POST, loss_fn=loss_fn)
    _assert_unchanged(model, before)
    stack = compose.apply(model, POST, example_inputs=batch, loss_fn=loss_fn, seed=0)
    loss_fn(stack.model, batch).backward()
    stack.optimizer.step()


def test_a_nan_lr_is_refused_before_the_model_is_packed(tmp_path):
    model, loss = ZOO["clip"]()
    path = tmp_path / "post.yaml"
    path.write_text((ROOT / "configs" / "clip_post.yaml").read_text() + "  lr: .nan\n")
    before = _state(model)
    with pytest.raises(ConfigError, match="optim.lr"):
        compose.apply(model, str(path), loss_fn=loss)
    _assert_unchanged(model, before)
