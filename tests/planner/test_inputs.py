"""The planner's inputs beyond text models: video clips (frames), point clouds (points), MVAS from a target
reduction, attention dropout, and the fake-tensor path's shortcuts (one decode per packed weight, public-API
``fake_module``). Each is checked against a real-tensor step built here, or against what the shortcut replaces.
"""

from __future__ import annotations

import json

import pytest
import torch
from model_zoo import in_bf16
from torch import nn

from macroarch.measure.fit import fake_module, measure_training
from macroarch.optim import MasterWeightAdamW
from macroarch.planner import PlanError, plan
from macroarch.planner.cli import run

NAMES = {"parameters": "weights", "gradients": "gradients", "master_weights": "master",
         "optimizer_state": "optimizer", "activations": "activations"}


def _real_plain(make_model, batch):
    """One real bf16 step with fp32 master weights and moments (the default recipe) of ``make_model()``."""
    def build():
        torch.manual_seed(0)
        model = in_bf16(make_model)
        return model, model, MasterWeightAdamW(model.parameters()), batch

    return measure_training(build, lambda runner, b: runner(**b).loss, fake=False)


def _assert_matches(c, real):
    assert c.error is None
    for tracked, category in NAMES.items():
        if category == "activations":
            assert c.bytes.categories[category] == pytest.approx(real.max_by_category[tracked], rel=0.02)
        else:
            assert c.bytes.categories[category] == real.max_by_category[tracked], category
    assert c.bytes.peak == pytest.approx(real.peak_bytes, rel=0.02)


# ------------------------------------------------------------------------------------------------ video
VIDEO = {"model_type": "videomae", "architectures": ["VideoMAEForVideoClassification"], "hidden_size": 32,
         "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64, "image_size": 32,
         "patch_size": 16, "num_frames": 4, "tubelet_size": 2, "num_labels": 5}


@pytest.fixture(scope="module")
def video_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("videomae") / "config.json"
    path.write_text(json.dumps(VIDEO))
    return path


def _real_video(frames: int, batch: int = 2):
    from transformers import VideoMAEConfig, VideoMAEForVideoClassification

    config = VideoMAEConfig(**{k: v for k, v in VIDEO.items() if k not in ("model_type", "architectures")},
                            attn_implementation="sdpa")
    config.num_frames = frames
    data = {"pixel_values": torch.randn(batch, frames, 3, 32, 32, dtype=torch.bfloat16),
            "labels": torch.randint(0, 5, (batch,))}
    return _real_plain(lambda: VideoMAEForVideoClassification(config), data)


def test_frames_set_the_clip_length(video_config):
    c = plan(str(video_config), 2, frames=8).combination("plain")
    _assert_matches(c, _real_video(8))
    assert plan(str(video_config), 2).workload["frames"] == VIDEO["num_frames"]  # the config's by default
    with pytest.raises(PlanError, match="multiple of 2"):
        plan(str(video_config), 2, frames=5)


def test_largest_clip_that_fits(video_config):
    budget = (_real_video(8).peak_bytes + _real_video(10).peak_bytes) // 2
    c = plan(str(video_config), 2, frames=4, budget_gb=budget / 1e9, search="frames").combination("plain")
    assert c.largest == 8  # searched on multiples of the tubelet: 10 frames is the next clip and it is over


# ------------------------------------------------------------------------------------------------ point clouds
def test_points_per_cloud():
    from macroarch.models.pointnet import PointNet

    c = plan("pointnet", 2, points=64).combination("plain")
    data = {"points": torch.randn(2, 64, 3, dtype=torch.bfloat16), "labels": torch.randint(0, 40, (2,))}
    _assert_matches(c, _real_plain(lambda: PointNet(num_classes=40), data))
    with pytest.raises(PlanError, match="needs 2 samples"):  # BatchNorm after the pooling
        plan("pointnet", 1, points=64)
    fit = plan("pointnet", 2, points=64, budget_gb=c.bytes.peak / 1e9, search="points").combination("plain")
    assert fit.fits and fit.largest == 64  # a budget of the peak at 64 points: one point more is over it


# ------------------------------------------------------------------------------------------------ MVAS target
LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
         "intermediate_size": 128, "num_hidden_layers": 5, "num_attention_heads": 4, "num_key_value_heads": 4,
         "max_position_embeddings": 64, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def llama_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama") / "config.json"
    path.write_text(json.dumps(LLAMA))
    return path


def test_mvas_from_a_target_reduction(llama_config, tmp_path):
    policy = tmp_path / "half.yaml"
    policy.write_text("mvas:\n  target_reduction: 0.5\n")
    p = plan(str(llama_config), 2, 16, techniques="mvas", policy=str(policy))
    plain, mvas = p.combination("plain"), p.combination("mvas")
    assert mvas.error is None
    assert mvas.bytes.categories["weights"] <= 0.5 * plain.bytes.categories["weights"]  # the target is met
    assert "extrapolated in depth" in mvas.how  # every block got the same formats
    assert any("target_reduction 0.5" in n for n in p.notes)

    impossible = tmp_path / "impossible.yaml"
    impossible.write_text("mvas:\n  target_reduction: 0.95\n")
    with pytest.raises(PlanError, match="target_reduction"):
        plan(str(llama_config), 2, 16, techniques="mvas", policy=str(impossible))
    assert run([str(llama_config), "--seq", "16", "--with", "mvas", "--policy", str(impossible)]) == 2


# ------------------------------------------------------------------------------------------------ attention dropout
BERT = {"model_type": "bert", "architectures": ["BertForMaskedLM"], "vocab_size": 128, "hidden_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128, "max_position_embeddings": 128,
        "attention_probs_dropout_prob": 0.1, "hidden_dropout_prob": 0.1}


def _real_bert(attention_dropout: float, batch: int, seq: int):
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(**{**{k: v for k, v in BERT.items() if k not in ("model_type", "architectures")},
                           "attention_probs_dropout_prob": attention_dropout}, attn_implementation="sdpa")
    ids = torch.randint(0, BERT["vocab_size"], (batch, seq))
    return _real_plain(lambda: BertForMaskedLM(config), {"input_ids": ids, "labels": ids})


def test_attention_dropout_is_counted_as_cudas_flash_kernel_holds_it(tmp_path):
    batch, seq = 2, 64
    path = tmp_path / "config.json"
    path.write_text(json.dumps(BERT))
    p = plan(str(path), batch, seq)
    assert any("attention dropout (attention_probs_dropout_prob=0.1)" in n and "math kernel" in n for n in p.notes)
    _assert_matches(p.combination("plain"), _real_bert(0.0, batch, seq))
    # the fallback the note names: with dropout, CPU SDPA keeps at least a score matrix per layer more
    scores = BERT["num_hidden_layers"] * batch * BERT["num_attention_heads"] * seq * seq * 2
    gap = _real_bert(0.1, batch, seq).max_by_category["activations"] - _real_bert(0.0, batch, seq).max_by_category[
        "activations"]
    assert gap >= scores


# ------------------------------------------------------------------------------------------------ fake shortcuts
def test_fake_decode_holds_the_bytes_of_the_chunked_one(monkeypatch):
    """Under fake tensors a packed weight is decoded with one chunk's temporaries, not chunk by chunk: the bytes
    held must be those of the real, chunked decode."""
    from macroarch.measure.memory import measure_step
    from macroarch.mvas.packed import packed_tensor
    from macroarch.mvas.packed.packed_tensor import CHUNK_NUMEL, pack

    numel = 2 * CHUNK_NUMEL + 4096  # three chunks, the last a short one

    def bytes_of_decode(fake: bool) -> tuple[int, int]:
        from macroarch._compat.fake import fake_tensor_mode

        calls = []
        original = packed_tensor.PackedTensor.dequantize_range
        monkeypatch.setattr(packed_tensor.PackedTensor, "dequantize_range",
                            lambda self, a, b: calls.append((a, b)) or original(self, a, b))
        holder = nn.Linear(1, 1)
        opt = torch.optim.SGD(holder.parameters(), lr=0.1)
        with fake_tensor_mode() if fake else torch.no_grad():
            packed = pack(torch.randn(numel), "fp8_e4m3", 32)
            peak = measure_step(lambda: packed.decoded(torch.bfloat16), holder, opt, packed.payload,
                                packed.scales).peak_bytes
        return peak, len(calls)

    real_peak, real_calls = bytes_of_decode(fake=False)
    fake_peak, fake_calls = bytes_of_decode(fake=True)
    assert real_calls == 3 and fake_calls == 1
    assert fake_peak == real_peak


def test_fake_module_keeps_buffers_and_their_persistence():
    class WithBuffers(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("kept", torch.zeros(3))
            self.register_buffer("scratch", torch.zeros(5), persistent=False)

    with torch.device("meta"):
        model = WithBuffers()
    keys = set(model.state_dict())
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with FakeTensorMode():
        model = fake_module(model)
    assert set(model.state_dict()) == keys and "scratch" not in keys
    assert isinstance(model.scratch, FakeTensor) and model.scratch.shape == (5,)
    assert isinstance(model.lin.weight, nn.Parameter) and isinstance(model.lin.weight, FakeTensor)


def test_a_gpt2_step_names_its_loss_so_transformers_does_not_warn(capfd):
    """GPT-2's class names no loss type; built from its config, transformers printed "`loss_type=None` was set in the
    config but it is unrecognized" on the first forward (a pink stderr box in notebook 02 under JupyterLab)."""
    import transformers

    from macroarch.planner.models import from_transformers_config

    transformers.logging.set_verbosity_warning()
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    model = from_transformers_config("gpt2_tiny", config)
    assert model.build(seq=8).loss_type == "ForCausalLM"
    plan(model, 1, 8, combinations=["plain"])
    assert "loss_type" not in capfd.readouterr().err
