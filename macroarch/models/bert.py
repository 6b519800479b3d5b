"""BERT masked-LM builders from configs, without downloads (claim C3: clipping in BERT-large training).

The post's claim C3 is about BERT-large pre-training. BERT-large (Devlin et al. 2019, section 3) is
24 layers, hidden size 1024, 16 heads, MLP 4096, 512 positions, 2 token types, GELU, LayerNorm eps
1e-12, dropout 0.1; with the WordPiece vocabulary (30522) the masked-LM model (``BertForMaskedLM``: no
pooler, no next-sentence head, decoder tied to the word embeddings) has 335,174,458 parameters. The
paper's "340M" also counts the pooler and the next-sentence head. Build it on ``device="meta"`` to
count or inspect it; it is far too slow to train on a CPU.

``bert_small_config`` keeps every architectural choice and shrinks the widths, so that the same code
path trains here in milliseconds per step. Our corpus is byte-level (256 bytes plus PAD, CLS, SEP and
MASK: 260 ids), so the vocabulary size and the PAD id are arguments: BERT zeroes the PAD row of the
embedding at initialisation and the input side passes it no gradient (the tied decoder still does), so
the PAD id must be the corpus's, not BERT's 0.
"""

from __future__ import annotations

from typing import Any

import torch

BERT_LARGE_VOCAB = 30522
"""WordPiece vocabulary of the released English BERT models."""


def _bert_config(
    vocab_size: int,
    hidden: int,
    layers: int,
    heads: int,
    intermediate: int,
    max_len: int,
    dropout: float,
    pad_token_id: int,
) -> Any:
    for name, value in (("vocab_size", vocab_size), ("hidden", hidden), ("layers", layers), ("heads", heads),
                        ("intermediate", intermediate), ("max_len", max_len)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")
    if hidden % heads:
        raise ValueError(f"hidden={hidden} must be a multiple of heads={heads}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout={dropout!r} must lie in [0, 1)")
    if not 0 <= pad_token_id < vocab_size:
        raise ValueError(f"pad_token_id={pad_token_id!r} must be an id in [0, vocab_size={vocab_size})")
    from transformers import BertConfig

    return BertConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=intermediate,
        hidden_act="gelu",
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        max_position_embeddings=max_len,
        type_vocab_size=2,
        initializer_range=0.02,
        layer_norm_eps=1e-12,
        pad_token_id=pad_token_id,
        tie_word_embeddings=True,
        # An encoder trained with MLM never reads a KV cache.
        use_cache=False,
    )


def bert_large_config(
    vocab_size: int = BERT_LARGE_VOCAB, max_len: int = 512, dropout: float = 0.1, pad_token_id: int = 0
) -> Any:
    """The ``BertConfig`` of BERT-large: 24 layers, hidden 1024, 16 heads, MLP 4096, 512 positions."""
    return _bert_config(vocab_size, 1024, 24, 16, 4096, max_len, dropout, pad_token_id)


def bert_small_config(
    vocab_size: int,
    hidden: int = 128,
    layers: int = 4,
    heads: int = 4,
    intermediate: int | None = None,
    max_len: int = 128,
    dropout: float = 0.1,
    pad_token_id: int = 0,
) -> Any:
    """A BERT that trains on a CPU: BERT-large's architecture with every width shrunk.

    ``intermediate`` defaults to ``4 * hidden``, BERT's MLP ratio. Pass the corpus's ``pad_token_id``.
    """
    return _bert_config(
        vocab_size, hidden, layers, heads, 4 * hidden if intermediate is None else intermediate, max_len, dropout,
        pad_token_id,
    )


def build_bert_mlm(
    config: Any,
    attn_implementation: str = "eager",
    seed: int | None = None,
    device: torch.device | str | None = None,
) -> torch.nn.Module:
    """A randomly initialised ``BertForMaskedLM`` in train mode, built from ``config``.

    ``seed`` makes the initial weights reproducible without touching the global RNG (the draw happens
    inside ``torch.random.fork_rng``). ``device="meta"`` allocates nothing, for the full-size model.
    """
    from transformers import BertForMaskedLM

    config._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[], enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(seed)
        if device is None:
            model = BertForMaskedLM(config)
        else:
            with torch.device(device):
                model = BertForMaskedLM(config)
    return model.train()


def count_parameters(model: torch.nn.Module) -> int:
    """Number of parameter elements, each shared tensor once (BERT ties decoder and word embeddings)."""
    return sum(p.numel() for p in model.parameters())


def mlm_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The masked-LM loss of ``model`` on ``batch`` (``input_ids``, ``labels`` with -100 where unmasked,
    optionally ``attention_mask`` and ``token_type_ids``); the ``loss_fn`` the clipping probe expects."""
    return model(**batch).loss
