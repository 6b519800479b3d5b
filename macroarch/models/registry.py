"""Named model specs: the full-size models the post talks about, and tiny ones of the same families.

Full-size models (build them on ``device="meta"`` or under ``FakeTensorMode``):

- ``gpt3_175b``: GPT-3 175B (Brown et al. 2020, table 2.1): 96 layers, d_model 12288, 96 heads,
  context 2048, GPT-2 vocabulary (50257), tied embeddings, GELU MLP 4x, LayerNorm and linears with
  biases: 174,604,259,328 parameters. GPT-3 alternates dense and locally banded sparse attention
  layers; that pattern changes neither the parameters nor (in eager attention, which materialises the
  full score matrix either way) the activations, and is ignored here: every layer is dense. Dropout
  0.1, as in GPT-2 and Megatron's GPT-3 configs (the GPT-3 paper does not state it).
- ``llama_65b``: LLaMA-65B (Touvron et al. 2023, table 2): 80 layers, d_model 8192, 64 heads,
  SwiGLU 22016, vocabulary 32000, untied, RMSNorm, no biases, context 2048: 65,285,660,672 parameters.
- ``llama_7b``: LLaMA-7B (Touvron et al. 2023, table 2): 32 layers, d_model 4096, 32 heads, SwiGLU 11008,
  vocabulary 32000, untied, RMSNorm, no biases, context 2048: 6,738,415,616 parameters (the size users most often
  plan for: ``macroarch plan llama_7b``).
- ``llama_10b``: the ~10B Llama-style model claim C1 talks about; the post gives no config, so this
  is LLaMA-7B's width and MLP (4096, 32 heads, 11008) at 48 layers instead of 32:
  9,976,549,376 parameters.

Tiny models keep the family (and so the code path) and shrink every dimension so that a training
step takes milliseconds on a CPU: ``gpt3_tiny``, ``llama_65b_tiny`` and ``llama_10b_tiny``. The Llama
tiny models keep their parents' MLP ratio (22016 / 8192 = 11008 / 4096 = 2.6875).
"""

from __future__ import annotations

from macroarch.models.spec import ModelSpec, TransformerShape

_GPT3_VOCAB = 50257
_LLAMA_VOCAB = 32000

MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            "gpt3_175b",
            TransformerShape(
                family="gpt2", n_layers=96, d_model=12288, n_heads=96, n_kv_heads=96, d_ff=4 * 12288,
                vocab_size=_GPT3_VOCAB, max_seq_len=2048, tied_embeddings=True, dropout=0.1,
            ),
            "GPT-3 175B as a GPT-2-style transformers model; dense attention in every layer",
        ),
        ModelSpec(
            "llama_65b",
            TransformerShape(
                family="llama", n_layers=80, d_model=8192, n_heads=64, n_kv_heads=64, d_ff=22016,
                vocab_size=_LLAMA_VOCAB, max_seq_len=2048, tied_embeddings=False, norm_eps=1e-6,
            ),
            "LLaMA-65B",
        ),
        ModelSpec(
            "llama_7b",
            TransformerShape(
                family="llama", n_layers=32, d_model=4096, n_heads=32, n_kv_heads=32, d_ff=11008,
                vocab_size=_LLAMA_VOCAB, max_seq_len=2048, tied_embeddings=False, norm_eps=1e-6,
            ),
            "LLaMA-7B",
        ),
        ModelSpec(
            "llama_10b",
            TransformerShape(
                family="llama", n_layers=48, d_model=4096, n_heads=32, n_kv_heads=32, d_ff=11008,
                vocab_size=_LLAMA_VOCAB, max_seq_len=2048, tied_embeddings=False, norm_eps=1e-6,
            ),
            "a ~10B Llama (LLaMA-7B width, 48 layers) for claim C1",
        ),
        ModelSpec(
            "gpt3_tiny",
            TransformerShape(
                family="gpt2", n_layers=2, d_model=64, n_heads=4, n_kv_heads=4, d_ff=256,
                vocab_size=256, max_seq_len=128, tied_embeddings=True, dropout=0.1,
            ),
            "GPT-3's architecture at toy size",
        ),
        ModelSpec(
            "llama_65b_tiny",
            TransformerShape(
                family="llama", n_layers=2, d_model=64, n_heads=4, n_kv_heads=4, d_ff=172,
                vocab_size=256, max_seq_len=128, tied_embeddings=False, norm_eps=1e-6,
            ),
            "LLaMA-65B's architecture at toy size",
        ),
        ModelSpec(
            "llama_10b_tiny",
            TransformerShape(
                family="llama", n_layers=3, d_model=32, n_heads=2, n_kv_heads=2, d_ff=86,
                vocab_size=256, max_seq_len=128, tied_embeddings=False, norm_eps=1e-6,
            ),
            "the C1 ~10B Llama's architecture at toy size",
        ),
    )
}


def get_model_spec(name: str) -> ModelSpec:
    """The registered spec called ``name``; an unknown name raises ValueError listing the known ones."""
    if name not in MODELS:
        raise ValueError(f"model name={name!r} is not registered; known: {sorted(MODELS)}")
    return MODELS[name]
