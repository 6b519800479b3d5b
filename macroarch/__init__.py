"""macroarch: the post's "macro-architecture" built as PyTorch components, and every claim measured.

Four layers, each a folder, each importing only from the layers below it:

- techniques, what a user puts into a training loop: ``dgr`` (dynamic graph reorganisation), ``mvas``
  (parameters and optimizer state stored in fp16/fp8/fp4 by importance, served just in time), ``optim``
  (CompensatedAdamW, MasterWeightAdamW, the gradient scale, the spike guard, the LR/warmup recipe), ``comm``
  (the GradientBucketer, torchrun-style launches), ``compose`` (the one function that stacks them on a model)
  and ``config`` (their typed configs, loaded from YAML);
- building blocks: ``models`` (named builders, the HC/mHC model, layer discovery) and ``data`` (the local
  corpus and its batches);
- measurement: ``measure`` (memory accounting, gradient analysis, the ZeRO-3 communication model and its
  calibration) and ``experiments`` (the one training loop and one harness per claim group, which the notebooks
  call);
- reproduction: ``repro`` (the claims registry, tracking to ``result.json`` and W&B, the papermill runner, the
  paper builder, the CLI).

``paths`` (where the checkout, outputs and W&B live) is a leaf every layer may use. Names are imported lazily,
so ``import macroarch`` (and the CLI) does not pay for torch until it is used.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from macroarch import _warnings

__version__ = "0.1.0"

# Progress bars are widgets in JupyterLab and text elsewhere (macroarch._progress); an environment without
# ipywidgets gets text, and tqdm's advice to install it is noise there.
warnings.filterwarnings("ignore", message="IProgress not found")
# torchao's deprecation records, logged through torch's pytree logger when transformers imports torchao (``_warnings``).
_warnings.install()

_EXPORTS = {
    "CLAIMS": "macroarch.repro.claims",
    "Claim": "macroarch.repro.claims",
    "Target": "macroarch.repro.claims",
    "Verdict": "macroarch.repro.claims",
    "get_claim": "macroarch.repro.claims",
    "ConfigError": "macroarch.config",
    "Run": "macroarch.repro.tracking",
    "start_run": "macroarch.repro.tracking",
    "read_offline_run": "macroarch.repro.wandb_offline",
    "find_offline_runs": "macroarch.repro.wandb_offline",
    "PRECISIONS": "macroarch.measure.memory",
    "PrecisionPolicy": "macroarch.measure.memory",
    "MasterWeightAdamW": "macroarch.optim",
    "activation_bytes": "macroarch.measure.memory",
    "measure_training_step": "macroarch.measure.memory",
    "parameter_count": "macroarch.measure.memory",
    "training_state_bytes": "macroarch.measure.memory",
    "measure_step": "macroarch.measure.memory",
    "MODELS": "macroarch.models",
    "ModelSpec": "macroarch.models",
    "get_model_spec": "macroarch.models",
    "build_bert_mlm": "macroarch.models",
    "GradientNormRecorder": "macroarch.measure.gradients",
    "ClippingProbe": "macroarch.measure.clipping",
    "HCTransformerLM": "macroarch.models",
    "composite_gain": "macroarch.models",
    "minibatch_gradient_variance": "macroarch.measure.gradients",
    "DGRWrapper": "macroarch.dgr",
    "GradientCompensator": "macroarch.dgr",
    "MVASAdamW": "macroarch.mvas",
    "plan": "macroarch.planner",
    "MVASSchedule": "macroarch.mvas",
    "CompensatedAdamW": "macroarch.optim",
    "LossSpikeGuard": "macroarch.optim",
    "NormGradScaler": "macroarch.optim",
    "recipe_scheduler": "macroarch.optim",
    "GradientBucketer": "macroarch.comm",
    "CollectiveError": "macroarch.comm",
    "ddp_with_buckets": "macroarch.comm",
    "zero3_step": "macroarch.measure.zero3",
    "Cluster": "macroarch.measure.zero3",
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
