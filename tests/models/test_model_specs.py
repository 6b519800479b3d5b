"""Model specs build the transformers model their shape describes, at any size, without memory."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from macroarch.models import MODELS, ModelSpec, TransformerShape, get_model_spec

FULL_SIZE = ("gpt3_175b", "llama_65b", "llama_7b", "llama_10b")
TINY = ("gpt3_tiny", "llama_65b_tiny", "llama_10b_tiny")


def test_registry_holds_the_full_size_and_tiny_models():
    assert set(FULL_SIZE) | set(TINY) <= set(MODELS)
    for name, spec in MODELS.items():
        assert spec.name == name


def test_unknown_model_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="gpt4") as info:
        get_model_spec("gpt4")
    for name in FULL_SIZE:
        assert name in str(info.value)


@pytest.mark.parametrize("name", FULL_SIZE)
def test_full_size_config_matches_the_paper(name):
    s = get_model_spec(name).shape
    expected = {
        "gpt3_175b": dict(family="gpt2", n_layers=96, d_model=12288, n_heads=96, d_ff=49152, vocab_size=50257,
                          max_seq_len=2048, tied_embeddings=True),
        "llama_65b": dict(family="llama", n_layers=80, d_model=8192, n_heads=64, d_ff=22016, vocab_size=32000,
                          max_seq_len=2048, tied_embeddings=False),
        "llama_7b": dict(family="llama", n_layers=32, d_model=4096, n_heads=32, d_ff=11008, vocab_size=32000,
                         max_seq_len=2048, tied_embeddings=False),
        "llama_10b": dict(family="llama", n_layers=48, d_model=4096, n_heads=32, d_ff=11008, vocab_size=32000,
                          max_seq_len=2048, tied_embeddings=False),
    }[name]
    assert {k: getattr(s, k) for k in expected} == expected


def test_gpt3_config_is_gpt2_style():
    config = get_model_spec("gpt3_175b").to_config()
    assert (config.n_layer, config.n_embd, config.n_head, config.n_positions) == (96, 12288, 96, 2048)
    assert config.tie_word_embeddings and config.use_cache is False
    assert config._attn_implementation == "eager"


def test_full_size_model_builds_on_meta_without_memory():
    model = get_model_spec("llama_65b").build(device="meta", dtype=torch.bfloat16)
    params = list(model.parameters())
    assert all(p.device.type == "meta" and p.dtype == torch.bfloat16 for p in params)
    assert type(model).__name__ == "LlamaForCausalLM" and model.training


def test_full_size_model_builds_under_fake_tensors():
    with FakeTensorMode():
        model = get_model_spec("gpt3_175b").build(dtype=torch.bfloat16)
    assert type(model).__name__ == "GPT2LMHeadModel"
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    assert len(model.transformer.h) == 96


@pytest.mark.parametrize("name", TINY)
def test_tiny_model_trains_a_step(name):
    torch.manual_seed(0)
    spec = get_model_spec(name)
    model = spec.build()
    ids = torch.randint(0, spec.shape.vocab_size, (2, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_scaled_replaces_shape_fields_and_keeps_the_rest():
    spec = get_model_spec("gpt3_175b")
    two = spec.scaled(n_layers=2)
    assert two.shape.n_layers == 2 and two.shape.d_model == spec.shape.d_model
    assert two.name != spec.name
    with pytest.raises(ValueError, match="n_layer"):
        spec.scaled(n_layer=2)


@pytest.mark.parametrize(
    "changes, bad",
    [
        (dict(family="bert"), "family"),
        (dict(n_layers=0), "n_layers"),
        (dict(d_model=65), "d_model"),
        (dict(n_kv_heads=3), "n_heads"),
        (dict(dropout=1.0), "dropout"),
    ],
)
def test_shape_rejects_bad_values_by_name(changes, bad):
    base = dict(family="llama", n_layers=2, d_model=64, n_heads=4, n_kv_heads=4, d_ff=128, vocab_size=64,
                max_seq_len=32, tied_embeddings=False)
    with pytest.raises(ValueError, match=bad):
        TransformerShape(**{**base, **changes})


def test_gpt2_family_has_no_grouped_query_attention():
    with pytest.raises(ValueError, match="n_kv_heads"):
        TransformerShape("gpt2", 1, 64, 4, 2, 256, 64, 32, True)


def test_spec_rejects_a_non_shape():
    with pytest.raises(ValueError, match="shape"):
        ModelSpec("x", shape=dict(n_layers=2))
