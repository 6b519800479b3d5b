"""macroarch: the post's "macro-architecture" built as PyTorch components, and every claim measured.

- ``claims``: the registry of the post's claims and the rules that grade a measurement;
- ``tracking``: ``start_run`` writes ``result.json`` and a W&B run (offline by default);
- ``runner`` / ``paper``: batch execution of the notebooks with papermill, and the report built from results;
- ``memory``: exact byte accounting, analytic and measured (real or fake tensors);
- ``models``: named model builders (full-size for fake tensors, tiny to train here; BERT masked-LM);
- ``analysis``: gradient norms through depth, variance estimators, the clipping probe, HC/mHC blocks;
- ``dgr``: DGR, the post's dynamic graph reorganisation (groups, in-backward updates, delay compensation);
- ``mvas``: MVAS, parameters and optimizer state stored in fp16/fp8/fp4 by importance, served just in time;
- ``optim``: CompensatedAdamW (fp32 master from 4 accumulation steps, the 2^5 / max_grad_norm scale, DC-ASGD,
  loss-spike guard) and the LR/warmup recipe;
- ``comm``: GradientBucketer (fixed-size gradient buckets over torch.distributed, windows, timeouts), the ZeRO-3
  communication model, torchrun-style launches;
- ``data``: the local byte-level text corpus and its batches.

Names are imported lazily, so ``import macroarch`` (and the CLI) does not pay for torch until it is used.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "CLAIMS": "macroarch.claims",
    "Claim": "macroarch.claims",
    "Target": "macroarch.claims",
    "Verdict": "macroarch.claims",
    "get_claim": "macroarch.claims",
    "ConfigError": "macroarch.config",
    "Run": "macroarch.tracking",
    "start_run": "macroarch.tracking",
    "read_offline_run": "macroarch.wandb_offline",
    "find_offline_runs": "macroarch.wandb_offline",
    "PRECISIONS": "macroarch.memory",
    "PrecisionPolicy": "macroarch.memory",
    "MasterWeightAdamW": "macroarch.memory",
    "activation_bytes": "macroarch.memory",
    "measure_training_step": "macroarch.memory",
    "parameter_count": "macroarch.memory",
    "training_state_bytes": "macroarch.memory",
    "measure_step": "macroarch.memory",
    "MODELS": "macroarch.models",
    "ModelSpec": "macroarch.models",
    "get_model_spec": "macroarch.models",
    "build_bert_mlm": "macroarch.models",
    "GradientNormRecorder": "macroarch.analysis",
    "ClippingProbe": "macroarch.analysis",
    "HCTransformerLM": "macroarch.analysis",
    "composite_gain": "macroarch.analysis",
    "minibatch_gradient_variance": "macroarch.analysis",
    "DGRWrapper": "macroarch.dgr",
    "GradientCompensator": "macroarch.dgr",
    "MVASAdamW": "macroarch.mvas",
    "MVASSchedule": "macroarch.mvas",
    "CompensatedAdamW": "macroarch.optim",
    "LossSpikeGuard": "macroarch.optim",
    "NormGradScaler": "macroarch.optim",
    "recipe_scheduler": "macroarch.optim",
    "GradientBucketer": "macroarch.comm",
    "CollectiveError": "macroarch.comm",
    "ddp_with_buckets": "macroarch.comm",
    "zero3_step": "macroarch.comm",
    "Cluster": "macroarch.comm",
    "launch": "macroarch.comm",
    "ensure_corpus": "macroarch.data",
    "load_corpus": "macroarch.data",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    try:
        module = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'macroarch' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
