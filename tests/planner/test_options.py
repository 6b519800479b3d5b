"""What the notebooks that size full models need from the planner (issue 45's last item), each checked against a
real-tensor step built here or against the planner's own default path:

- ``depths``: chosen depths, the full depth among them as a check, ``()`` for the whole model, bad ones refused;
- ``cache``: plans sharing a ``StepCache`` (one per budget, per size) measure no step twice, find the same sizes,
  and a search starts from the sizes measured before; a step on a model built for another batch size is a fresh
  step's bytes;
- ``max_size``, ``fake=False``, ``device``;
- checkpointing of the modules a model names (PointNet's T-Nets);
- the GPU-kernel correction scaled to the activations alive at each phase's peak, and ``measured`` beside it;
- video-classification configs, a model without an SDPA kernel;
- an MVAS plan made on a small model as per-role rules (``macroarch.planner.roles``).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from model_zoo import in_bf16
from torch import nn

from macroarch.measure.fit import measure_training
from macroarch.optim import MasterWeightAdamW
from macroarch.planner import PlanError, custom, plan
from macroarch.planner import run as planner_run
from macroarch.planner.run import StepCache

WIDTH, VOCAB, LAYERS = 64, 128, 6


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _Stack(nn.Module):
    """An MLP stack with a classifier: ``layers`` identical blocks."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.embed = nn.Linear(16, WIDTH)
        self.blocks = nn.ModuleList(_Block(WIDTH) for _ in range(layers))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _loss(runner, batch):
    return nn.functional.cross_entropy(runner(batch["x"]), batch["labels"])


def _model():
    return custom("stack", lambda layers, seq, frames: _Stack(layers or LAYERS),
                  lambda b, s, f: {"x": torch.randn(b, 16), "labels": torch.randint(0, VOCAB, (b,))}, _loss,
                  layers=LAYERS, default_seq=1)


def _real(batch: int, layers: int = LAYERS):
    """One real bf16 step with fp32 master weights and moments (the default recipe) of the stack."""
    def build():
        torch.manual_seed(0)
        model = in_bf16(lambda: _Stack(layers))
        data = {"x": torch.randn(batch, 16, dtype=torch.bfloat16), "labels": torch.randint(0, VOCAB, (batch,))}
        return model, model, MasterWeightAdamW(model.parameters()), data

    return measure_training(build, _loss, fake=False)


def _counting(monkeypatch) -> list:
    """Every step ``fake_step`` measures, as ``(combo, batch, units, built anew)``."""
    calls = []
    fake_step = planner_run.fake_step

    def counting(model, combo, setup, batch_size, seq, units, stacks=None):
        fresh = stacks is None or (combo, planner_run.setup_key(setup, combo), units, seq) not in stacks
        calls.append((combo, batch_size, units, fresh))
        return fake_step(model, combo, setup, batch_size, seq, units, stacks)

    monkeypatch.setattr(planner_run, "fake_step", counting)
    return calls


# ------------------------------------------------------------------------------------------------ depths
def test_chosen_depths_are_measured_and_checked_to_the_byte():
    real = _real(8)
    got = plan(_model(), 8, depths=(1, 2, 3, LAYERS)).combination("plain")
    assert got.depths == (1, 2, 3, LAYERS) and "checked to the byte at 3, 6" in got.how
    assert (got.bytes.peak, got.bytes.at_peak) == (real.peak_bytes, real.by_category)
    whole = plan(_model(), 8, depths=()).combination("plain")
    assert whole.depths == () and whole.how.endswith("measured at full depth")
    assert (whole.bytes.peak, whole.bytes.at_peak) == (real.peak_bytes, real.by_category)
    assert whole.bytes.phases == real.phases  # each phase's peak, as measured


@pytest.mark.parametrize("depths, message", [
    ((2,), "two or more increasing"), ((3, 2), "increasing"), ((2, 3, 7), "from 1 to its 6"), ((0, 1), "from 1"),
])
def test_bad_depths_are_refused(depths, message):
    with pytest.raises(PlanError, match=message):
        plan(_model(), 8, depths=depths)


def test_depths_of_a_fixed_depth_model_are_refused():
    from macroarch.planner.models import pointnet

    with pytest.raises(PlanError, match="its depth is fixed"):
        plan(pointnet(8), 2, 16, depths=(1, 2))
    assert plan(pointnet(8), 2, 16, depths=()).combination("plain").depths == ()


def test_the_whole_model_where_extrapolating_costs_more():
    """The planner's own depths: two shallow ones holding more units than the model are no saving."""
    from macroarch.planner.run import depth_plan

    setup = planner_run.Setup(None, None, 1, 1)
    assert depth_plan(_model(), frozenset(), setup).depths == (2, 3, 4)
    five = dataclasses.replace(_model(), full_units=5)
    assert depth_plan(five, frozenset(), setup).depths == (2, 3, 4)  # 2 + 3 units: as many as the model
    four = dataclasses.replace(_model(), full_units=4)
    assert depth_plan(four, frozenset(), setup).depths == ()


# ------------------------------------------------------------------------------------------------ the cache
def test_plans_sharing_a_cache_measure_each_step_once_and_agree(monkeypatch):
    """A plan per budget with one cache: every step measured once, the second search starting from the first's
    sizes (it measures none below them), the same largest batches as plans without a cache, and steps on a model
    built for another batch the bytes of fresh ones."""
    budgets = (_real(64).peak_bytes / 1e9, _real(200).peak_bytes / 1e9)
    alone = [plan(_model(), 8, budget_gb=b).combination("plain") for b in budgets]
    calls = _counting(monkeypatch)
    cache, model = StepCache(), _model()  # one model: a cache knows a model by its builder
    shared = [plan(model, 8, budget_gb=b, cache=cache).combination("plain") for b in budgets]
    assert [c.largest for c in shared] == [c.largest for c in alone] == [64, 200]
    keys = [(combo, batch, units) for combo, batch, units, _ in calls]
    assert len(keys) == len(set(keys)) == len(cache)  # no step measured twice
    first = {k[1] for k in keys[:len(keys) // 2]}
    assert min(batch for _, batch, _, _ in calls if batch not in first) > 64  # the second search: only above 64
    assert sum(fresh for *_, fresh in calls) == 3  # one model built per depth; every other batch on it
    assert shared[1].searched.keys() >= shared[0].searched.keys()  # the second search knows the first's sizes
    for batch in (17, 200):
        c = plan(model, batch, cache=cache).combination("plain")
        assert (c.bytes.peak, c.bytes.at_peak) == (_real(batch).peak_bytes, _real(batch).by_category)


def test_a_plain_step_beside_mvas_is_the_plain_step_alone(monkeypatch):
    cache, model = StepCache(), _model()
    plan(model, 8, cache=cache)
    calls = _counting(monkeypatch)
    plan(model, 8, cache=cache, combinations=["mvas"])
    assert {combo for combo, *_ in calls} == {frozenset({"mvas"})}  # the plain step came from the cache
    plan(dataclasses.replace(model, frames=None), 8, cache=cache, combinations=["mvas"])
    assert len(calls) == 3  # a copy of the model is the model: nothing measured again
    plan(_model(), 8, cache=cache)
    assert len(calls) == 6  # another model (another builder), measured anew


def test_the_search_stops_at_max_size():
    c = plan(_model(), 8, budget_gb=1e3, max_size=40).combination("plain")
    assert c.largest == 40 and c.largest_capped
    with pytest.raises(PlanError, match="max_size"):
        plan(_model(), 8, budget_gb=1, max_size=0)


# ------------------------------------------------------------------------------------------------ tensors, device
def test_real_tensors_give_the_fake_bytes():
    fake = plan(_model(), 8, combinations=["mvas", "checkpoint"])
    real = plan(_model(), 8, combinations=["mvas", "checkpoint"], fake=False)
    for name in ("plain", "mvas", "checkpoint"):
        a, b = fake.combination(name), real.combination(name)
        assert (a.bytes.peak, a.bytes.at_peak, a.bytes.categories) == (b.bytes.peak, b.bytes.at_peak,
                                                                        b.bytes.categories), name
        assert b.how.startswith("real tensors")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_cuda_kernels_need_a_gpu():
    with pytest.raises(PlanError, match="no GPU"):
        plan(_model(), 8, device="cuda")
    with pytest.raises(PlanError, match="'cpu' or 'cuda'"):
        plan(_model(), 8, device="tpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's kernels need a GPU (autograd's context)")
def test_cuda_kernels_on_a_gpu():
    c = plan("gpt3_tiny", 2, 32, attention="eager", device="cuda").combination("plain")
    assert c.error is None and "CUDA kernels" in c.how and c.bytes == c.measured  # nothing corrected


# ------------------------------------------------------------------------------------------------ checkpointing
def test_checkpointing_recomputes_the_modules_a_model_names():
    """PointNet: its blocks and both T-Nets (``pointnet().checkpoint_units``), against a real step that wraps the
    same modules in non-reentrant ``torch.utils.checkpoint``."""
    from macroarch.models.pointnet import PointNet
    from macroarch.planner.models import pointnet

    def build():
        torch.manual_seed(0)
        model = in_bf16(lambda: PointNet(num_classes=8))
        for m in [*model.layers, model.input_transform, model.feature_transform]:
            forward = m.forward
            m.forward = lambda *a, _f=forward, **k: torch.utils.checkpoint.checkpoint(_f, *a, use_reentrant=False, **k)
        data = {"points": torch.randn(4, 32, 3, dtype=torch.bfloat16), "labels": torch.randint(0, 8, (4,))}
        return model, model, MasterWeightAdamW(model.parameters()), data

    real = measure_training(build, lambda runner, b: runner(**b).loss, fake=False)
    got = plan(pointnet(8), 4, 32, combinations=["checkpoint"]).combination("checkpoint")
    assert (got.bytes.peak, got.bytes.at_peak) == (real.peak_bytes, real.by_category)
    blocks_only = plan(dataclasses.replace(pointnet(8), checkpoint_units=None), 4, 32,
                       combinations=["checkpoint"]).combination("checkpoint")
    assert got.bytes.categories["activations"] < blocks_only.bytes.categories["activations"]


# ------------------------------------------------------------------------------------------------ GPU kernels
def test_the_gpu_kernel_correction_follows_the_activations_alive():
    """The correction (CUDA's 1-byte dropout masks and fp32 LayerNorm statistics) adds its bytes in full at the
    activations' maximum and at each phase's peak in the share of the activations alive there: an update's peak,
    with the activations gone, keeps its measured bytes (it had all of them added before)."""
    from macroarch.measure.memory import activation_bytes
    from macroarch.models import get_model_spec

    c = plan("gpt3_tiny", 1, 32, attention="eager").combination("plain")
    m, b = c.measured, c.bytes
    shape = get_model_spec("gpt3_tiny").shape
    delta = (activation_bytes(shape, 1, 32, "bf16_mixed", device_type="cuda")["total"]
             - activation_bytes(shape, 1, 32, "bf16_mixed", device_type="cpu")["total"])
    assert delta != 0 and b.categories["activations"] == m.categories["activations"] + delta
    for name, phase in m.phases.items():
        share = phase.by_category.get("activations", 0) / m.categories["activations"]
        assert b.phases[name].peak_bytes == phase.peak_bytes + round(delta * share), name
    assert b.peak == max(p.peak_bytes for p in b.phases.values())
    assert m.phases["optimizer"].by_category.get("activations", 0) <= 4  # the loss, at most
    assert b.phases["optimizer"].peak_bytes == m.phases["optimizer"].peak_bytes


# ------------------------------------------------------------------------------------------------ model specs
def test_video_classification_configs_and_a_model_without_sdpa(tmp_path):
    """A TimeSformer config.json (no ``architectures``): the video-classification class, its own eager attention
    (it has no SDPA kernel), said in the notes; its bytes are a real step's."""
    from transformers import TimesformerConfig, TimesformerForVideoClassification

    config = {"model_type": "timesformer", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
              "intermediate_size": 64, "image_size": 32, "patch_size": 16, "num_frames": 4, "num_labels": 5}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    p = plan(str(path), 2, frames=4)
    assert p.model["attention"] == "eager" and any("no SDPA kernel" in n for n in p.notes)

    def build():
        torch.manual_seed(0)
        cfg = TimesformerConfig(**{k: v for k, v in config.items() if k != "model_type"})
        model = in_bf16(lambda: TimesformerForVideoClassification(cfg))
        data = {"pixel_values": torch.randn(2, 4, 3, 32, 32, dtype=torch.bfloat16),
                "labels": torch.randint(0, 5, (2,))}
        return model, model, MasterWeightAdamW(model.parameters()), data

    real = measure_training(build, lambda runner, b: runner(**b).loss, fake=False)
    c = p.combination("plain")
    assert (c.bytes.peak, c.bytes.at_peak) == (real.peak_bytes, real.by_category)


def test_videomae_on_meta_builds_its_position_table_as_a_shape():
    from transformers import VideoMAEConfig

    from macroarch.planner.models import from_transformers_config

    m = from_transformers_config("v", VideoMAEConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                     intermediate_size=64, image_size=32, patch_size=16,
                                                     num_frames=2048, num_labels=5))
    net = m.build(None, torch.bfloat16, None)  # 1024 tubelets x 4 patches: the Python loop would take seconds
    table = net.videomae.embeddings.position_embeddings
    assert table.device.type == "meta" and tuple(table.shape) == (1, 1024 * 4, 32) and table.dtype == torch.float32
    real = from_transformers_config("v", VideoMAEConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                        intermediate_size=64, image_size=32, patch_size=16,
                                                        num_frames=4, num_labels=5)).build(None, torch.float32,
                                                                                          None, device="cpu")
    assert real.videomae.embeddings.position_embeddings.abs().sum() > 0  # a real model keeps its real table


# ------------------------------------------------------------------------------------------------ MVAS by role
def test_a_small_models_plan_as_rules_gives_every_tensor_its_roles_format():
    """Rules from a plan made on a 2-block model, applied to a 6-block one, against ``mvas.transfer_plan(depth=
    "uniform")``: each role's most common format in every block, tensors the plan kept (and small ones) kept, and a
    role whose name ends another's (``blocks.*.up.weight``, ``blocks.*.inner.up.weight``) not taken by it."""
    from macroarch import compose, mvas
    from macroarch.config import MacroConfig, MVASConfig
    from macroarch.planner.roles import rules_from_plan

    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(128, 128)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.inner, self.norm = nn.Linear(128, 128), Inner(), nn.LayerNorm(128)

    class Net(nn.Module):
        def __init__(self, layers: int) -> None:
            super().__init__()
            self.embed = nn.Embedding(512, 128)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))

    small = Net(2)
    formats = {"blocks.0.up.weight": "fp8_e4m3", "blocks.1.up.weight": "fp8_e4m3", "embed.weight": "fp4_e2m1",
               "blocks.0.inner.up.weight": "fp16", "blocks.1.inner.up.weight": "bf16"}
    plan_small = mvas.plan_from_rules(small, list(formats.items()))
    rules = rules_from_plan(plan_small)
    assert list(rules)[0] == "blocks.*.inner.up.weight"  # the most specific first
    big = Net(6)
    expected = {t.name: (t.format, t.block_size) for t in mvas.transfer_plan(plan_small, big, depth="uniform").tensors}
    got = compose.precision_plan(big, MacroConfig(mvas=MVASConfig(precision_policy=rules)))
    assert {t.name: (t.format, t.block_size) for t in got.tensors} == expected
    assert expected["blocks.5.up.weight"][0] == "fp8_e4m3" and expected["blocks.5.inner.up.weight"][0] == "fp16"
    assert expected["embed.weight"][0] == "fp4_e2m1"


def test_affine_in_depth_names_the_phase_and_key_that_bend():
    from macroarch.measure.memory import measured

    assert measured.affine_in_depth({2: {"a": 10}, 4: {"a": 20}}, 80) == {"a": 400}
    with pytest.raises(ValueError, match="the x phase: a: bytes are not affine"):
        measured.affine_in_depth({2: {"a": 10}, 4: {"a": 20}, 5: {"a": 26}}, 80, "the x phase")
