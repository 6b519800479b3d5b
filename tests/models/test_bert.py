"""BERT masked-LM builders: a small BERT trains, BERT-large has BERT-large's shape and parameter count."""

import math

import pytest
import torch

from macroarch.models.bert import (
    bert_large_config,
    bert_small_config,
    build_bert_mlm,
    count_parameters,
    mlm_loss,
)

BYTE_VOCAB = 260  # 256 bytes + PAD, CLS, SEP, MASK
PAD = 256


def _mlm_batch(vocab_size, batch=4, seq=32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 256, (batch, seq), generator=generator)
    masked = torch.rand(batch, seq, generator=generator) < 0.15
    masked[:, 0] = True  # at least one target per row
    labels = torch.where(masked, input_ids, torch.full_like(input_ids, -100))
    return {"input_ids": input_ids.masked_fill(masked, vocab_size - 1), "labels": labels}


def test_small_bert_gives_a_finite_mlm_loss_near_log_vocab_at_init():
    model = build_bert_mlm(bert_small_config(BYTE_VOCAB, pad_token_id=PAD), seed=0)
    loss = mlm_loss(model, _mlm_batch(BYTE_VOCAB))
    assert torch.isfinite(loss)
    # weights drawn with std 0.02 give near-zero logits: cross-entropy of a uniform guess over the vocabulary
    assert loss.item() == pytest.approx(math.log(BYTE_VOCAB), abs=0.3)
    assert model.bert.embeddings.word_embeddings.weight[PAD].abs().sum() == 0  # the corpus's PAD row starts at 0


def test_small_config_shrinks_widths_and_keeps_bert_ratios():
    config = bert_small_config(BYTE_VOCAB, hidden=64, layers=2, heads=2, max_len=64, pad_token_id=PAD)
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (2, 64, 2)
    assert config.intermediate_size == 4 * 64 and config.max_position_embeddings == 64
    assert config.vocab_size == BYTE_VOCAB and config.pad_token_id == PAD


def test_bert_large_on_meta_has_the_parameter_count_of_its_shapes():
    config = bert_large_config()
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
            config.intermediate_size, config.max_position_embeddings) == (24, 1024, 16, 4096, 512)
    model = build_bert_mlm(config, device="meta")
    assert all(p.device.type == "meta" for p in model.parameters())
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight

    V, P, T, h, f, L = 30522, 512, 2, 1024, 4096, 24
    embeddings = V * h + P * h + T * h + 2 * h  # word, position, token type, LayerNorm
    layer = (
        4 * (h * h + h)  # query, key, value, attention output (weights and biases)
        + 2 * h  # attention LayerNorm
        + (h * f + f) + (f * h + h)  # MLP in and out
        + 2 * h  # output LayerNorm
    )
    head = (h * h + h) + 2 * h + V  # transform dense, LayerNorm, decoder bias (decoder weight is tied)
    expected = embeddings + L * layer + head
    assert count_parameters(model) == expected
    assert 334e6 < expected < 336e6


def test_seed_gives_the_same_weights_and_leaves_the_global_rng_alone():
    config = bert_small_config(BYTE_VOCAB, hidden=32, layers=1, heads=2, pad_token_id=PAD)
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a, b = build_bert_mlm(config, seed=7), build_bert_mlm(config, seed=7)
    assert torch.equal(torch.random.get_rng_state(), before)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    c = build_bert_mlm(config, seed=8)
    assert not torch.equal(a.bert.encoder.layer[0].intermediate.dense.weight,
                           c.bert.encoder.layer[0].intermediate.dense.weight)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(hidden=100, heads=3), "hidden"),
        (dict(layers=0), "layers"),
        (dict(pad_token_id=BYTE_VOCAB), "pad_token_id"),
        (dict(dropout=1.0), "dropout"),
    ],
)
def test_bad_small_config_names_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        bert_small_config(BYTE_VOCAB, **kwargs)
