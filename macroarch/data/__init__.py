"""Datasets the notebooks use, built locally by ``data_scripts/`` (nothing is downloaded).

``text``: a byte-level corpus (by default the Python standard library's source), its build, its verified
loader. ``batches``: causal-LM, evaluation and BERT masked-LM batches from a split's byte tokens. ``shapes``:
rendered scenes of coloured shapes with captions (held-out attribute combinations), for a small CLIP.
"""

from macroarch.data.batches import (
    CLS_ID,
    IGNORE_INDEX,
    MASK_ID,
    MLM_VOCAB_SIZE,
    PAD_ID,
    SEP_ID,
    SPECIAL_IDS,
    eval_batches,
    lm_batches,
    mlm_batches,
)
from macroarch.data.shapes import (
    ShapesData,
    ShapesError,
    ShapesSpec,
    ShapesSplit,
    build_shapes,
    ensure_shapes,
    load_shapes,
    shuffled_batches,
)
from macroarch.data.text import (
    BYTE_VOCAB_SIZE,
    DEFAULT_MAX_BYTES,
    FILE_SEPARATOR,
    CorpusError,
    CorpusSpec,
    TextCorpus,
    build_corpus,
    data_root,
    decode,
    encode,
    ensure_corpus,
    load_corpus,
    text_root,
)

__all__ = [
    "BYTE_VOCAB_SIZE",
    "CLS_ID",
    "DEFAULT_MAX_BYTES",
    "FILE_SEPARATOR",
    "IGNORE_INDEX",
    "MASK_ID",
    "MLM_VOCAB_SIZE",
    "PAD_ID",
    "SEP_ID",
    "SPECIAL_IDS",
    "ShapesData",
    "ShapesError",
    "ShapesSpec",
    "ShapesSplit",
    "CorpusError",
    "CorpusSpec",
    "TextCorpus",
    "build_corpus",
    "build_shapes",
    "data_root",
    "decode",
    "encode",
    "ensure_corpus",
    "ensure_shapes",
    "eval_batches",
    "lm_batches",
    "load_corpus",
    "load_shapes",
    "mlm_batches",
    "shuffled_batches",
    "text_root",
]
