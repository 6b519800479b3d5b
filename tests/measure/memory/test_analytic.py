"""Analytic accounting: parameter counts against the built models, the post's arithmetic, the formulas."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from macroarch.measure.memory import (
    PRECISIONS,
    PrecisionPolicy,
    activation_bytes,
    activation_terms,
    format_bytes,
    get_precision,
    korthikanti_activation_bytes,
    parameter_count,
    training_state_bytes,
)
from macroarch.models import MODELS, get_model_spec


@pytest.mark.parametrize("name", sorted(MODELS))
def test_parameter_count_equals_the_built_model(name):
    spec = get_model_spec(name)
    model = spec.build(device="meta")
    # Tied weights are one Parameter object, which parameters() yields once.
    assert parameter_count(spec) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("base", ["gpt3_tiny", "llama_65b_tiny"])
def test_parameter_count_with_and_without_tying_and_gqa(base, tied):
    changes = dict(tied_embeddings=tied)
    if base.startswith("llama"):
        changes["n_kv_heads"] = 2  # grouped-query attention
    spec = get_model_spec(base).scaled(**changes)
    assert parameter_count(spec) == sum(p.numel() for p in spec.build(device="meta").parameters())


def test_gpt3_under_the_posts_accounting_is_1_4_tb():
    n = parameter_count(get_model_spec("gpt3_175b"))
    state = training_state_bytes(get_model_spec("gpt3_175b"), "post")
    # The post: 350 GB fp16 parameters + 350 GB gradients + 700 GB Adam m, v = 1.4 TB.
    assert state == {
        "parameters": 2 * n, "gradients": 2 * n, "optimizer_state": 4 * n, "master_weights": 0, "total": 8 * n,
    }
    assert format_bytes(state["parameters"], "GB", 0) == "349 GB"
    assert format_bytes(state["optimizer_state"], "GB", 0) == "698 GB"
    assert format_bytes(state["total"], "TB", 1) == "1.4 TB"


def test_mixed_precision_is_16_bytes_per_parameter():
    n = 1_000
    assert training_state_bytes(n, "bf16_mixed") == {
        "parameters": 2 * n, "gradients": 2 * n, "optimizer_state": 8 * n, "master_weights": 4 * n, "total": 16 * n,
    }
    assert training_state_bytes(n, "mixed")["total"] == 16 * n
    assert training_state_bytes(n, "fp32") == {
        "parameters": 4 * n, "gradients": 4 * n, "optimizer_state": 8 * n, "master_weights": 0, "total": 16 * n,
    }
    assert training_state_bytes(n, "fp16")["total"] == 8 * n


def test_unknown_precision_names_itself_and_the_known_ones():
    with pytest.raises(ValueError, match="fp8_magic") as info:
        get_precision("fp8_magic")
    for name in PRECISIONS:
        assert name in str(info.value)


def test_precision_policy_checks_its_dtypes():
    with pytest.raises(ValueError, match="param_dtype"):
        PrecisionPolicy("bad", torch.int8, torch.float16, torch.float16, None, torch.float16)
    with pytest.raises(ValueError, match="master_dtype"):
        PrecisionPolicy("bad", torch.float16, torch.float16, torch.float16, "fp32", torch.float16)


def test_gpt_layer_on_gpu_is_korthikanti_plus_layernorm_statistics():
    # Korthikanti et al. count 34*sbh + 5*a*s^2*b bytes per 16-bit GPT layer with dropout; the HF
    # model additionally keeps each LayerNorm's fp32 mean and rstd (2 norms x 2 x 4 bytes x b*s).
    spec = get_model_spec("gpt3_175b")
    b, s = 2, 1024
    h, a, L = spec.shape.d_model, spec.shape.n_heads, spec.shape.n_layers
    per_layer = activation_bytes(spec, b, s, "bf16_mixed", device_type="cuda")["per_layer"]
    assert per_layer == 34 * s * b * h + 5 * a * s * s * b + 16 * b * s
    assert L * (per_layer - 16 * b * s) == korthikanti_activation_bytes(spec, b, s)


def test_cpu_kernels_keep_dropout_masks_and_statistics_in_the_activation_dtype():
    spec = get_model_spec("gpt3_175b")
    b, s = 1, 2048
    h, a = spec.shape.d_model, spec.shape.n_heads
    gpu = activation_bytes(spec, b, s, "bf16_mixed", device_type="cuda")["per_layer"]
    cpu = activation_bytes(spec, b, s, "bf16_mixed", device_type="cpu")["per_layer"]
    # Three masks go from 1 byte to 2 (attention probabilities, two b*s*h), statistics from 4 to 2.
    assert cpu - gpu == a * s * s * b + 2 * b * s * h - 8 * b * s


def test_llama_without_dropout_has_no_masks_and_fp32_softmax():
    spec = get_model_spec("llama_65b")
    names = {t.name for t in activation_terms(spec, 1, 128, "bf16_mixed")}
    assert "attn.softmax_fp32" in names and "attn.probs_cast" in names
    assert not any("dropout" in n for n in names)
    names_fp32 = {t.name for t in activation_terms(spec, 1, 128, "fp32")}
    assert "attn.probs_cast" not in names_fp32  # .to(float32) of an fp32 tensor is the tensor itself


def test_activations_are_linear_in_layers_and_batch():
    spec = get_model_spec("llama_10b")
    one = activation_bytes(spec.scaled(n_layers=1), 2, 256)
    full = activation_bytes(spec, 2, 256)
    assert full["total"] - one["total"] == (spec.shape.n_layers - 1) * one["per_layer"]
    assert activation_bytes(spec, 4, 256)["per_layer"] == 2 * full["per_layer"]


def test_activation_arguments_are_checked():
    spec = get_model_spec("gpt3_tiny")
    with pytest.raises(ValueError, match="seq_len"):
        activation_bytes(spec, 1, spec.shape.max_seq_len + 1)
    with pytest.raises(ValueError, match="batch_size"):
        activation_bytes(spec, 0, 8)
    with pytest.raises(ValueError, match="device_type"):
        activation_bytes(spec, 1, 8, device_type="tpu")


def test_format_bytes_decimal_and_binary():
    assert format_bytes(1_400_000_000_000, "TB") == "1.4 TB"
    assert format_bytes(3 * 2**30, "GiB", 2) == "3.00 GiB"
    with pytest.raises(ValueError, match="unit"):
        format_bytes(1, "gigabytes")


def _saved_bytes_fake_cuda(spec, b, s, dtype):
    """Bytes of the distinct storages autograd saves in a fake CUDA forward, plus logits and loss."""
    with FakeTensorMode():
        model = spec.build(device="cuda", dtype=dtype)
        ids = torch.randint(0, spec.shape.vocab_size, (b, s), device="cuda")
        excluded = {t.untyped_storage()._cdata for t in [ids, *model.parameters()]}
        alive = {}  # storage -> bytes; the graph keeps every saved storage alive, so keys stay unique

        def pack(t):
            alive[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(input_ids=ids, labels=ids)
        for t in (out.logits, out.loss):
            alive[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
    return sum(n for key, n in alive.items() if key not in excluded)


@pytest.mark.parametrize(
    "name, changes, precision",
    [
        ("gpt3_tiny", {}, "bf16_mixed"),
        ("gpt3_tiny", {}, "fp32"),
        ("llama_65b_tiny", {}, "bf16_mixed"),
        ("llama_65b_tiny", {"n_kv_heads": 2, "dropout": 0.1}, "bf16_mixed"),
    ],
)
def test_cuda_activation_terms_match_what_autograd_saves(name, changes, precision):
    # A fake CUDA forward needs no GPU and runs the CUDA kernels' saving rules (1-byte dropout masks,
    # fp32 LayerNorm statistics), so it checks device_type="cuda" where no GPU is available.
    spec = get_model_spec(name).scaled(**changes) if changes else get_model_spec(name)
    dtype = PRECISIONS[precision].activation_dtype
    for b, s in ((2, 24), (1, 17)):
        expected = activation_bytes(spec, b, s, precision, device_type="cuda")["total"]
        assert _saved_bytes_fake_cuda(spec, b, s, dtype) == expected
