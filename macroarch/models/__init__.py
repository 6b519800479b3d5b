"""Building blocks: named model builders, the HC/mHC model, and layer discovery.

- ``registry`` / ``spec``: named transformers architectures, full-size for fake tensors, tiny to train here;
- ``bert``: BERT masked-LM builders (small to train, BERT-large's shape);
- ``hyperconnections``: residual, Hyper-Connection and mHC blocks, a small LM built from them, and the
  composite gain of their residual mixing (reference R1);
- ``layers``: ``find_repeated_layers``, the repeated blocks of any ``nn.Module``.

``MODELS`` maps a name to a ``ModelSpec``; ``spec.build(device="meta")`` (or a build inside
``FakeTensorMode``) gives the real Hugging Face model without allocating memory, ``spec.shape`` is what
``macroarch.measure.memory.analytic`` counts bytes from.
"""

from macroarch.models.bert import (
    BERT_LARGE_VOCAB,
    bert_large_config,
    bert_small_config,
    build_bert_mlm,
    count_parameters,
    mlm_loss,
)
from macroarch.models.hyperconnections import (
    RESIDUAL_KINDS,
    CompositeGain,
    HCLMConfig,
    HCTransformerLM,
    HyperConnection,
    LMOutput,
    ManifoldHyperConnection,
    ResidualConnection,
    StreamConnection,
    composite_gain,
    make_connection,
    mixing_matrices,
    sinkhorn_knopp,
)
from macroarch.layers import find_repeated_layers
from macroarch.models.registry import MODELS, get_model_spec
from macroarch.models.spec import ModelSpec, TransformerShape

__all__ = [
    "BERT_LARGE_VOCAB",
    "CompositeGain",
    "HCLMConfig",
    "HCTransformerLM",
    "HyperConnection",
    "LMOutput",
    "MODELS",
    "ManifoldHyperConnection",
    "ModelSpec",
    "RESIDUAL_KINDS",
    "ResidualConnection",
    "StreamConnection",
    "TransformerShape",
    "bert_large_config",
    "bert_small_config",
    "build_bert_mlm",
    "composite_gain",
    "count_parameters",
    "find_repeated_layers",
    "get_model_spec",
    "make_connection",
    "mixing_matrices",
    "mlm_loss",
    "sinkhorn_knopp",
]
