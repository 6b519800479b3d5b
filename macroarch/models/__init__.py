"""Named model builders: full-size transformers models for fake tensors, tiny ones to train here.

``MODELS`` maps a name to a ``ModelSpec``; ``spec.build(device="meta")`` (or a build inside
``FakeTensorMode``) gives the real Hugging Face model without allocating memory, ``spec.shape`` is what
``macroarch.memory.analytic`` counts bytes from.
"""

from macroarch.models.bert import (
    BERT_LARGE_VOCAB,
    bert_large_config,
    bert_small_config,
    build_bert_mlm,
    count_parameters,
    mlm_loss,
)
from macroarch.models.registry import MODELS, get_model_spec
from macroarch.models.spec import ModelSpec, TransformerShape

__all__ = [
    "BERT_LARGE_VOCAB",
    "MODELS",
    "ModelSpec",
    "TransformerShape",
    "bert_large_config",
    "bert_small_config",
    "build_bert_mlm",
    "count_parameters",
    "get_model_spec",
    "mlm_loss",
]
