"""Model specifications: the shape of a decoder-only transformer and how to build it with transformers.

A ``TransformerShape`` is the architecture as numbers (layers, widths, heads, vocabulary, ...); it is
what ``macroarch.measure.memory.analytic`` counts bytes from. A ``ModelSpec`` gives a shape a name and builds
the real Hugging Face model from it (``GPT2LMHeadModel`` or ``LlamaForCausalLM``) without downloading
anything: weights are initialised from the config, on any device, including ``"meta"`` and under
``torch._subclasses.fake_tensor.FakeTensorMode``, so full-size models cost no memory.

Two families are supported, each mapped onto one transformers class:

- ``"gpt2"``: learned absolute position embeddings, pre-LayerNorm with biases, a 4x GELU MLP, biases on
  every linear, tied input/output embeddings, dropout after embeddings, attention probabilities,
  attention output and MLP output (GPT-2/GPT-3). The GELU is transformers' ``gelu_pytorch_tanh``:
  the tanh approximation GPT-2 and GPT-3 use, computed by one fused op (``gelu_new`` is the same
  function spelled as eight elementwise ops, each saving its own tensor for backward, which would
  inflate activation memory in a way no real training stack does).
- ``"llama"``: rotary position embeddings, RMSNorm, SwiGLU MLP, no biases, untied embeddings, optional
  grouped-query attention (``n_kv_heads < n_heads``) and optional attention dropout only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

_FAMILIES = ("gpt2", "llama")


@dataclass(frozen=True)
class TransformerShape:
    """The architecture of a decoder-only transformer, as numbers.

    Attributes:
        family: ``"gpt2"`` or ``"llama"``; decides norms, biases, MLP and position embeddings.
        n_layers: number of transformer blocks.
        d_model: hidden size ``h``.
        n_heads: attention heads ``a``; ``d_model`` must be a multiple of it.
        n_kv_heads: key/value heads (grouped-query attention); equal to ``n_heads`` for plain MHA.
        d_ff: MLP inner size (``4 * d_model`` for GPT, the SwiGLU size for Llama).
        vocab_size: vocabulary size ``V``.
        max_seq_len: longest sequence; also the number of learned position embeddings for ``"gpt2"``.
        tied_embeddings: the output projection shares the input embedding matrix.
        dropout: dropout probability; for ``"gpt2"`` it applies to embeddings, attention
            probabilities, attention output and MLP output, for ``"llama"`` to attention only.
        norm_eps: epsilon of the LayerNorm / RMSNorm.
    """

    family: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    vocab_size: int
    max_seq_len: int
    tied_embeddings: bool
    dropout: float = 0.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.family not in _FAMILIES:
            raise ValueError(f"family={self.family!r} is not supported; use one of {_FAMILIES}")
        for name in ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab_size", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be a multiple of n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        if self.family == "gpt2" and self.n_kv_heads != self.n_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads}: the gpt2 family has no grouped-query attention")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout!r} must lie in [0, 1)")
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps={self.norm_eps!r} must be positive")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_dim(self) -> int:
        """Width of the key (and of the value) projection: ``n_kv_heads * head_dim``."""
        return self.n_kv_heads * self.head_dim


@dataclass(frozen=True)
class ModelSpec:
    """A named model: a shape, a sentence saying what it is, and how to build it.

    Attributes:
        name: registry key, e.g. ``"gpt3_175b"``.
        shape: the architecture.
        description: what the model is and where it deviates from the original.
    """

    name: str
    shape: TransformerShape
    description: str = ""

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"name={self.name!r} must be a non-empty string")
        if not isinstance(self.shape, TransformerShape):
            raise ValueError(f"shape={self.shape!r} must be a TransformerShape")

    @property
    def family(self) -> str:
        return self.shape.family

    def scaled(self, name: str | None = None, **changes: Any) -> ModelSpec:
        """The same model with some shape fields replaced, e.g. ``spec.scaled(n_layers=2)``.

        Used to measure a full-width model with fewer layers: every per-layer byte count is the same,
        so totals scale linearly in ``n_layers`` (see ``macroarch.measure.memory.analytic``).
        """
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(TransformerShape)})
        if unknown:
            raise ValueError(f"changes={unknown} are not TransformerShape fields")
        if not changes:
            return self if name is None else dataclasses.replace(self, name=name)
        suffix = "_".join(f"{k}{v}" for k, v in sorted(changes.items()))
        return ModelSpec(
            name=name or f"{self.name}[{suffix}]",
            shape=dataclasses.replace(self.shape, **changes),
            description=f"{self.description} (scaled: {suffix})",
        )

    def to_config(self, attn_implementation: str = "eager") -> Any:
        """The transformers config (``GPT2Config`` or ``LlamaConfig``) of this model."""
        s = self.shape
        if s.family == "gpt2":
            from transformers import GPT2Config

            config = GPT2Config(
                vocab_size=s.vocab_size,
                n_positions=s.max_seq_len,
                n_embd=s.d_model,
                n_layer=s.n_layers,
                n_head=s.n_heads,
                n_inner=s.d_ff,
                activation_function="gelu_pytorch_tanh",
                resid_pdrop=s.dropout,
                embd_pdrop=s.dropout,
                attn_pdrop=s.dropout,
                layer_norm_epsilon=s.norm_eps,
                tie_word_embeddings=s.tied_embeddings,
                # GPT-2's end-of-text token is the last id; keep it inside small vocabularies too.
                bos_token_id=s.vocab_size - 1,
                eos_token_id=s.vocab_size - 1,
                # Training never reads a KV cache; building one would keep every layer's K and V alive.
                use_cache=False,
            )
        else:
            from transformers import LlamaConfig

            config = LlamaConfig(
                vocab_size=s.vocab_size,
                hidden_size=s.d_model,
                intermediate_size=s.d_ff,
                num_hidden_layers=s.n_layers,
                num_attention_heads=s.n_heads,
                num_key_value_heads=s.n_kv_heads,
                max_position_embeddings=s.max_seq_len,
                rms_norm_eps=s.norm_eps,
                tie_word_embeddings=s.tied_embeddings,
                attention_dropout=s.dropout,
                use_cache=False,
            )
        config._attn_implementation = attn_implementation
        return config

    def build(
        self,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        attn_implementation: str = "eager",
    ) -> torch.nn.Module:
        """Build the causal-LM model from its config, randomly initialised, in train mode.

        ``device="meta"`` (or building inside ``FakeTensorMode``) allocates nothing, so the full-size
        models can be built on any machine. ``dtype`` is the parameter dtype (default float32); the
        model is created directly in it rather than cast afterwards, so no float32 copy ever exists.
        """
        from transformers import GPT2LMHeadModel, LlamaForCausalLM

        cls = GPT2LMHeadModel if self.family == "gpt2" else LlamaForCausalLM
        config = self.to_config(attn_implementation)
        previous = torch.get_default_dtype()
        if dtype is not None:
            torch.set_default_dtype(dtype)
        try:
            if device is None:
                model = cls(config)
            else:
                with torch.device(device):
                    model = cls(config)
        finally:
            torch.set_default_dtype(previous)
        if self.family == "gpt2":  # GPT-2's config names no loss type, and transformers warns at every forward
            model.loss_type = "ForCausalLM"
        return model.train()
