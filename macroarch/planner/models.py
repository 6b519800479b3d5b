"""What ``plan`` measures: a model spec resolved to a builder on ``"meta"``, its batch and its loss.

A spec is, in the order tried:

1. ``module:fn`` (a Python callable, imported): ``fn()`` returns either a model that takes ``input_ids`` and
   ``labels`` and returns an output with ``.loss`` (a transformers LM), or ``(model, make_batch, loss)`` with
   ``make_batch(batch, seq) -> dict of tensors`` and ``loss(model, batch) -> scalar``. It is called on the
   ``"meta"`` device in the training dtype, once per measurement; its depth cannot be changed, so it is measured
   at full depth.
2. a path: a transformers ``config.json``, or a directory holding one. The model class is the config's
   ``architectures[0]``, else the causal-LM (then masked-LM) class of its ``model_type``; built with
   ``_from_config`` (random weights: nothing is downloaded, ``HF_HUB_OFFLINE=1`` is set before transformers is
   imported).
3. a name from the project's builders (``macroarch.models.MODELS``, and ``bert_large``): their transformers
   configs, as 2; ``pointnet``: the project's PointNet classifier (``seq`` counts points per cloud).
4. an open_clip architecture shipped with open_clip (``ViT-L-14``, also written ``ViT-L/14``): ``open_clip``'s
   ``CLIP`` from the config, ``pretrained=None``; one step of its contrastive loss (``open_clip.ClipLoss``).
5. a timm model name (``vit_base_patch16_224``): ``timm.create_model(pretrained=False)``; one step of
   cross-entropy on its logits.

Depth. A model is built at ``units`` depth units: each of its repeated stacks (``find_repeated_layers``; a CLIP's
two towers) holds ``units * unit[i]`` blocks, where ``unit`` is the stacks' full depths divided by their greatest
common divisor (ViT-L/14: 24 image and 12 text blocks, so a unit is 2 + 1 and the full model is 12 units). Only
transformers configs (``num_hidden_layers``), timm models taking ``depth=`` and open_clip ViTs with integer
``layers`` can be built shallower; anything else is measured at full depth (``full_units is None``).

``seq`` is the sequence length of text models (token ids, labels the ids themselves), the image side of vision
models (default: the model's own) and the points per cloud of point-cloud models. A video model (a transformers
config with ``num_frames``: VideoMAE, TimeSformer, ViViT) also has ``frames``, the clip length (default: the
config's).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a config is built, never fetched

Batch = dict[str, torch.Tensor]


class PlanError(ValueError):
    """Bad input to ``plan``: the message names what was wrong (the CLI prints it on one line, exit status 2)."""


@dataclass
class Model:
    """A resolved model spec (module docstring).

    Attributes:
        name: the spec as given.
        kind: ``"transformers"``, ``"builder"``, ``"open_clip"``, ``"timm"``, ``"callable"`` or ``"custom"``.
        unit: blocks per repeated stack in one depth unit (empty when the depth is fixed).
        full_units: depth units of the full model (None: the depth is fixed, measure at full depth).
        seq_name: what ``seq`` counts (``"tokens"``, ``"image side"`` or ``"points"``).
        default_seq: the model's own ``seq`` (None: it must be given).
        attention: the attention implementation measured (transformers: ``"sdpa"`` or ``"eager"``).
        family: the transformers ``model_type`` (or the library's name).
        shape: the project's ``TransformerShape`` of the model where it has one (Llama and GPT-2 families), for the
            analytic fallback and the GPU-kernel correction.
        frames: a video model's clip length (None: not a video model); ``dataclasses.replace(model, frames=n)``
            is the same model on clips of ``n`` frames.
        frames_multiple: what a clip length must be a multiple of (VideoMAE's and ViViT's tubelets span 2).
        seq_multiple: what the largest-``seq`` search steps by (a folding trunk's crops: 32 residues).
        min_batch: the smallest batch a training step takes (2 where BatchNorm follows a pooling).
        notes: what was changed from the spec to count the bytes a GPU run holds, and why.
        checkpoint_units: the modules the ``checkpoint`` technique recomputes, given the built model (None: the
            library's switch, else the repeated blocks; PointNet's: its blocks and both T-Nets).
    """

    name: str
    kind: str
    unit: tuple[int, ...]
    full_units: int | None
    seq_name: str
    default_seq: int | None
    attention: str
    family: str
    _build: Callable[[tuple[int, ...] | None, int | None, int | None], nn.Module] = field(repr=False)
    _batch: Callable[[int, int, int | None], Batch] = field(repr=False)
    _loss: Callable[[Any, Batch], torch.Tensor] = field(repr=False)
    shape: Any = None
    frames: int | None = None
    frames_multiple: int = 1
    seq_multiple: int = 1
    min_batch: int = 1
    notes: tuple[str, ...] = ()
    checkpoint_units: Callable[[nn.Module], list[nn.Module]] | None = field(default=None, repr=False)

    @property
    def scalable(self) -> bool:
        return self.full_units is not None

    @property
    def builder(self) -> Callable[..., nn.Module]:
        """What builds the model: shared by the copies ``dataclasses.replace`` makes (other ``frames``), so a
        step's cache knows them for one model (``macroarch.planner.run.StepCache``)."""
        return self._build

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(self.full_units * u for u in self.unit) if self.scalable else ()

    def build(self, units: int | None = None, dtype: torch.dtype = torch.float32, seq: int | None = None,
              device: str = "meta") -> nn.Module:
        """The model on ``device`` (``"meta"``: no memory) at ``units`` depth units (None: full depth), parameters in
        ``dtype``, for inputs of ``seq`` (a vision model's image side; None: its own) and, for a video model, clips
        of ``frames`` frames."""
        if units is not None and not self.scalable:
            raise ValueError(f"{self.name}: its depth is fixed; build it with units=None")
        layers = None if units is None or units == self.full_units else tuple(units * u for u in self.unit)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                return self._build(layers, seq, self.frames).train()
        finally:
            torch.set_default_dtype(previous)

    def batch(self, batch_size: int, seq: int | None, dtype: torch.dtype) -> Batch:
        """A batch of the right shapes and dtypes (values do not matter to a fake-tensor step)."""
        seq = self.default_seq if seq is None else seq
        if seq is None:
            raise PlanError(f"{self.name}: give --seq (the number of {self.seq_name})")
        out = self._batch(batch_size, seq, self.frames)
        return {k: v.to(dtype) if v.is_floating_point() else v for k, v in out.items()}

    def loss(self, runner: Any, batch: Batch) -> torch.Tensor:
        return self._loss(runner, batch)


def _units(layers: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    g = functools.reduce(math.gcd, layers)
    return tuple(n // g for n in layers), g


# ------------------------------------------------------------------------------------------- transformers
def _config_from_file(path: Path) -> Any:
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise PlanError(f"{path}: no config.json there")
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanError(f"{file}: not a JSON transformers config ({e})") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise PlanError(f"{file}: not a transformers config (no \"model_type\" key)")
    from transformers import AutoConfig

    try:
        return AutoConfig.for_model(**data)
    except (ValueError, KeyError, TypeError) as e:
        raise PlanError(f"{file}: transformers cannot read this config: {e}") from None


def _transformers_class(config: Any) -> type:
    import transformers

    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    for auto in ("AutoModelForCausalLM", "AutoModelForMaskedLM", "AutoModelForImageClassification",
                 "AutoModelForVideoClassification"):
        mapping = getattr(transformers, auto)._model_mapping
        if type(config) in mapping:
            return mapping[type(config)]
    raise PlanError(f"model_type {config.model_type!r}: no causal-LM, masked-LM, image- or video-classification class "
                    f"in transformers {transformers.__version__}; give \"architectures\" in the config")


def _loss_type(cls: type) -> str | None:
    """The loss transformers' ``loss_function`` should use for ``cls``, read from the auto class that maps to it
    (``GPT2LMHeadModel`` names none, and transformers then warns "`loss_type=None` was set in the config but it is
    unrecognized" at every forward: ``ModelSpec.build`` sets it likewise)."""
    import transformers

    for auto, loss in (("AutoModelForCausalLM", "ForCausalLM"), ("AutoModelForMaskedLM", "ForMaskedLM"),
                       ("AutoModelForImageClassification", "ForImageClassification"),
                       ("AutoModelForVideoClassification", "ForVideoClassification")):
        if cls in getattr(transformers, auto)._model_mapping.values():
            return loss
    return None


def _shape_of(config: Any) -> Any:
    """The project's ``TransformerShape`` for Llama and GPT-2 configs (None for other families)."""
    from macroarch.models.spec import TransformerShape

    try:
        if config.model_type == "llama":
            return TransformerShape(
                family="llama", n_layers=config.num_hidden_layers, d_model=config.hidden_size,
                n_heads=config.num_attention_heads, n_kv_heads=config.num_key_value_heads,
                d_ff=config.intermediate_size, vocab_size=config.vocab_size,
                max_seq_len=config.max_position_embeddings, tied_embeddings=config.tie_word_embeddings,
                norm_eps=config.rms_norm_eps, dropout=config.attention_dropout)
        if config.model_type == "gpt2":
            return TransformerShape(
                family="gpt2", n_layers=config.n_layer, d_model=config.n_embd, n_heads=config.n_head,
                n_kv_heads=config.n_head, d_ff=config.n_inner or 4 * config.n_embd, vocab_size=config.vocab_size,
                max_seq_len=config.n_positions, tied_embeddings=config.tie_word_embeddings,
                norm_eps=config.layer_norm_epsilon, dropout=config.resid_pdrop)
    except (AttributeError, ValueError):
        return None
    return None


ATTENTION_DROPOUT_KEYS = ("attention_probs_dropout_prob", "attention_dropout", "attn_pdrop")
"""transformers config keys of the dropout on attention probabilities (BERT and ViT, Llama and CLIP, GPT-2)."""


def _no_attention_dropout(config: Any) -> str | None:
    """Set ``config``'s attention dropout to 0 (in place) and say why, if it had any.

    On a CPU, SDPA falls back to its math kernel when attention dropout is above 0 (PyTorch's CPU flash kernel
    takes none), which saves the score matrix, the probabilities and the dropout's result per layer; CUDA's flash
    and memory-efficient kernels take the dropout inside (a seed and an offset saved, no score matrix). With the
    dropout at 0 the CPU kernel is the flash one, which saves what CUDA's does: the output and an fp32
    log-sum-exp per query row."""
    found = {k: getattr(config, k) for k in ATTENTION_DROPOUT_KEYS
             if isinstance(getattr(config, k, None), int | float) and getattr(config, k) > 0}
    if not found:
        return None
    for k in found:
        setattr(config, k, 0.0)
    given = ", ".join(f"{k}={v:g}" for k, v in found.items())
    return (f"attention dropout ({given}) counted as CUDA's SDPA holds it: with dropout, CPU SDPA falls back to its "
            f"math kernel, which keeps the score matrix, the probabilities and the dropped probabilities per layer; "
            f"CUDA's flash kernels apply the dropout inside and keep the output and an fp32 log-sum-exp per row, as "
            f"the CPU flash kernel does without dropout, so the step is built with attention dropout 0 (the other "
            f"dropouts stay)")


def from_transformers_config(name: str, config: Any, kind: str = "transformers", attention: str = "sdpa") -> Model:
    """A transformers config as a ``Model`` (module docstring, 2). A config with ``num_frames`` whose model takes
    ``pixel_values`` is a video model (clips of ``(frames, channels, side, side)``); with SDPA, attention dropout is
    set to 0 (``_no_attention_dropout`` says why); a model without an SDPA kernel (TimeSformer) runs its own,
    eager, attention, and the plan says so."""
    import copy

    cls = _transformers_class(config)
    config = copy.deepcopy(config)
    config.use_cache = False  # training never reads a KV cache; building one keeps every layer's K and V
    notes: tuple[str | None, ...] = ()
    if attention == "sdpa" and not getattr(cls, "_supports_sdpa", False):
        attention = "eager"
        notes += (f"{cls.__name__} has no SDPA kernel in transformers: its own (eager) attention is counted, which "
                  f"keeps each layer's score matrices",)
    notes += (_no_attention_dropout(config),) if attention == "sdpa" else ()
    params = inspect.signature(cls.forward).parameters
    vision = "pixel_values" in params and "input_ids" not in params
    video = vision and isinstance(getattr(config, "num_frames", None), int)
    n_layers = getattr(config, "num_hidden_layers", None)
    loss_type = _loss_type(cls)
    classify = cls.__name__.endswith(("ForSequenceClassification", "ForImageClassification",
                                      "ForVideoClassification"))

    def build(layers: tuple[int, ...] | None, seq: int | None, frames: int | None) -> nn.Module:
        c = copy.deepcopy(config)
        if layers is not None:
            c.num_hidden_layers = layers[0]
        if vision and seq is not None:
            c.image_size = seq
        if video and frames is not None:
            c.num_frames = frames
        c._attn_implementation = attention
        with _table_shapes_only(c):
            model = cls(c)
        if getattr(model, "loss_type", "") is None:
            model.loss_type = loss_type
        return model

    def make_batch(b: int, s: int, frames: int | None) -> Batch:
        if vision:
            image = (getattr(config, "num_channels", 3), s, s)
            pixels = torch.randn(b, frames, *image) if video else torch.randn(b, *image)
            return {"pixel_values": pixels, "labels": torch.randint(0, config.num_labels, (b,))}
        ids = torch.randint(0, config.vocab_size, (b, s))
        labels = torch.randint(0, config.num_labels, (b,)) if classify else ids
        return {"input_ids": ids, "labels": labels}

    if not isinstance(n_layers, int) or n_layers < 1:
        unit, full = (), None
    else:
        unit, full = (1,), n_layers
    default_seq = getattr(config, "image_size", None) if vision else None
    return Model(name=name, kind=kind, unit=unit, full_units=full, seq_name="image side" if vision else "tokens",
                 default_seq=default_seq, attention=attention, family=config.model_type, _build=build,
                 _batch=make_batch, _loss=lambda runner, batch: runner(**batch).loss, shape=_shape_of(config),
                 frames=config.num_frames if video else None, frames_multiple=_tubelet(config) if video else 1,
                 notes=tuple(n for n in notes if n))


def _table_shapes_only(config: Any) -> contextlib.AbstractContextManager:
    """On ``"meta"``, VideoMAE's sinusoidal position table as zeros of its shape and dtype.

    VideoMAE fills that fixed table in a Python loop over every position and channel (a minute at 1000 frames),
    on the CPU whatever the device, and keeps it as a plain tensor attribute; a fake step reads only its shape
    (``fake_module`` replaces it with an empty tensor of that shape), so on ``"meta"`` the loop is skipped.
    Elsewhere (a real model) nothing is changed."""
    if config.model_type != "videomae" or torch.get_default_device().type != "meta":
        return contextlib.nullcontext()
    from unittest import mock

    from transformers.models.videomae import modeling_videomae

    return mock.patch.object(modeling_videomae, "get_sinusoid_encoding_table",
                             lambda n, dim: torch.zeros(1, n, dim, dtype=torch.float32, device="meta"))


def _tubelet(config: Any) -> int:
    """Frames per tubelet of a video config (VideoMAE: ``tubelet_size=2``, ViViT: ``[2, 16, 16]``; else 1)."""
    t = getattr(config, "tubelet_size", 1)
    return int(t[0] if isinstance(t, list | tuple) else t)


# ------------------------------------------------------------------------------------------- open_clip, timm
def _open_clip_config(name: str) -> dict | None:
    try:
        import open_clip
    except ImportError:
        return None
    cfg = open_clip.get_model_config(name.replace("/", "-"))
    return cfg if cfg is not None and "vision_cfg" in cfg and "text_cfg" in cfg else None


def from_open_clip(name: str, cfg: Mapping[str, Any]) -> Model:
    """An open_clip architecture as a ``Model`` (module docstring, 4)."""
    import copy

    import open_clip

    cfg = {k: v for k, v in cfg.items() if k in ("embed_dim", "vision_cfg", "text_cfg", "quick_gelu")}
    vision_layers, text_layers = cfg["vision_cfg"].get("layers"), cfg["text_cfg"].get("layers", 12)
    scalable = isinstance(vision_layers, int) and isinstance(text_layers, int)
    unit, g = _units((vision_layers, text_layers)) if scalable else ((), None)
    context = cfg["text_cfg"].get("context_length", 77)
    vocab = cfg["text_cfg"].get("vocab_size", 49408)

    def build(layers: tuple[int, ...] | None, image: int | None, frames: int | None) -> nn.Module:
        c = copy.deepcopy(cfg)
        if layers is not None:
            c["vision_cfg"]["layers"], c["text_cfg"]["layers"] = layers
        if image is not None:
            c["vision_cfg"]["image_size"] = image
        return open_clip.model.CLIP(**c)

    def make_batch(b: int, s: int, frames: int | None) -> Batch:
        return {"image": torch.randn(b, 3, s, s), "text": torch.randint(0, vocab, (b, context))}

    def loss(runner: Any, batch: Batch) -> torch.Tensor:
        image_features, text_features, scale = runner(batch["image"], batch["text"])[:3]
        return open_clip.ClipLoss()(image_features, text_features, scale)

    return Model(name=name, kind="open_clip", unit=unit, full_units=g, seq_name="image side",
                 default_seq=cfg["vision_cfg"].get("image_size", 224), attention="open_clip's own",
                 family="open_clip CLIP", _build=build, _batch=make_batch, _loss=loss)


def from_timm(name: str, **model_kwargs: Any) -> Model:
    """A timm model as a ``Model`` (module docstring, 5); ``model_kwargs`` go to ``timm.create_model``."""
    import timm

    with torch.device("meta"):
        probe = timm.create_model(name, pretrained=False, **model_kwargs)
    default_seq = int(probe.pretrained_cfg.get("input_size", (3, 224, 224))[-1])
    num_classes = max(int(getattr(probe, "num_classes", 1000) or 1000), 1)
    depth = len(getattr(probe, "blocks", ()))
    try:  # ViT-style models take depth=; others are measured whole
        with torch.device("meta"):
            scalable = depth > 1 and len(timm.create_model(name, pretrained=False, **{**model_kwargs, "depth": 1}
                                                           ).blocks) == 1
    except (TypeError, AttributeError):
        scalable = False

    def build(layers: tuple[int, ...] | None, seq: int | None, frames: int | None) -> nn.Module:
        kwargs = dict(model_kwargs) if layers is None else {**model_kwargs, "depth": layers[0]}
        if seq is not None and seq != default_seq:
            kwargs["img_size"] = seq
        return timm.create_model(name, pretrained=False, **kwargs)

    def make_batch(b: int, s: int, frames: int | None) -> Batch:
        return {"x": torch.randn(b, 3, s, s), "labels": torch.randint(0, num_classes, (b,))}

    def loss(runner: Any, batch: Batch) -> torch.Tensor:
        return F.cross_entropy(runner(batch["x"]), batch["labels"])

    return Model(name=name, kind="timm", unit=(1,) if scalable else (), full_units=depth if scalable else None,
                 seq_name="image side", default_seq=default_seq, attention="timm's own (F.scaled_dot_product_attention"
                 " where fused_attn)", family="timm", _build=build, _batch=make_batch, _loss=loss)


# ------------------------------------------------------------------------------------------- module:fn
def from_callable(spec: str) -> Model:
    """``module:fn`` as a ``Model`` (module docstring, 1)."""
    module_name, _, fn_name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise PlanError(f"{spec}: cannot import {fn_name!r} from {module_name!r} ({e})") from None
    if not callable(fn):
        raise PlanError(f"{spec}: {fn_name!r} is not callable")
    made: dict[str, Any] = {}

    def build(layers: tuple[int, ...] | None, seq: int | None, frames: int | None) -> nn.Module:
        out = fn()
        if isinstance(out, tuple):
            if len(out) != 3 or not isinstance(out[0], nn.Module):
                raise PlanError(f"{spec}: must return a model or (model, make_batch, loss); got a tuple of {len(out)}")
            made.update(batch=out[1], loss=out[2])
            return out[0]
        if not isinstance(out, nn.Module):
            raise PlanError(f"{spec}: returned {type(out).__name__}, not an nn.Module")
        made["vocab"] = out.get_input_embeddings().num_embeddings if hasattr(out, "get_input_embeddings") else None
        return out

    def make_batch(b: int, s: int, frames: int | None) -> Batch:
        if "batch" in made:
            return dict(made["batch"](b, s))
        if made.get("vocab") is None:
            raise PlanError(f"{spec}: the model has no input embeddings; return (model, make_batch, loss)")
        ids = torch.randint(0, made["vocab"], (b, s))
        return {"input_ids": ids, "labels": ids}

    def loss(runner: Any, batch: Batch) -> torch.Tensor:
        return made["loss"](runner, batch) if "loss" in made else runner(**batch).loss

    return Model(name=spec, kind="callable", unit=(), full_units=None, seq_name="tokens", default_seq=None,
                 attention="the model's own", family="callable", _build=build, _batch=make_batch, _loss=loss)


# ------------------------------------------------------------------------------------------- any model
def custom(name: str, build: Callable[[int | None, int | None, int | None], nn.Module],
           make_batch: Callable[[int, int, int | None], Batch], loss: Callable[[Any, Batch], torch.Tensor], *,
           layers: int | None = None, seq_name: str = "tokens", default_seq: int | None = None,
           frames: int | None = None, frames_multiple: int = 1, seq_multiple: int = 1, min_batch: int = 1,
           family: str = "custom", attention: str = "the model's own",
           checkpoint: Callable[[nn.Module], list[nn.Module]] | None = None) -> Model:
    """A ``Model`` from three functions, for models no spec names (a harness's own architecture).

    Args:
        build: ``build(layers, seq, frames) -> nn.Module``: the model with ``layers`` repeated blocks (None: its
            full depth), for inputs of ``seq`` and, for a video model, ``frames``; called on ``"meta"`` in the
            parameter dtype (``Model.build``).
        make_batch: ``make_batch(batch, seq, frames) -> dict of tensors``.
        loss: ``loss(runner, batch) -> scalar``; ``runner`` is the model or what a technique wraps it in.
        layers: the full depth, if ``build`` can build it shallower (then it is measured at a few depths and
            extrapolated); None measures the whole model.
        seq_name, default_seq, frames, frames_multiple, seq_multiple, min_batch, family, attention: as
            ``Model``'s (``seq_name`` names what ``seq`` counts: ``"tokens"``, ``"residues"``...).
        checkpoint: the modules ``checkpoint`` recomputes, given the built model (``Model.checkpoint_units``;
            None: the repeated blocks).
    """
    def by_layers(stack: tuple[int, ...] | None, seq: int | None, clip: int | None) -> nn.Module:
        return build(None if stack is None else stack[0], seq, clip)

    return Model(name=name, kind="custom", unit=(1,) if layers else (), full_units=layers, seq_name=seq_name,
                 default_seq=default_seq, attention=attention, family=family, _build=by_layers, _batch=make_batch,
                 _loss=loss, frames=frames, frames_multiple=frames_multiple, seq_multiple=seq_multiple,
                 min_batch=min_batch, checkpoint_units=checkpoint)


# ------------------------------------------------------------------------------------------- point clouds
def pointnet(num_classes: int = 40) -> Model:
    """PointNet classification (``macroarch.models.pointnet``, ModelNet40's 40 classes): ``seq`` is the points per
    cloud (default 1024), one cross-entropy step on ``(batch, points, 3)`` clouds. Its BatchNorm after the max-pool
    needs two clouds per step, so the batch starts at 2; its depth is fixed. ``checkpoint`` recomputes its shared-MLP
    blocks and both T-Nets (the input and the feature transform, each a small PointNet of its own)."""
    from macroarch.layers import find_repeated_layers
    from macroarch.models.pointnet import PointNet

    def units(net: nn.Module) -> list[nn.Module]:
        return [b for _, b in find_repeated_layers(net)] + [net.input_transform, net.feature_transform]

    def build(layers: tuple[int, ...] | None, seq: int | None, frames: int | None) -> nn.Module:
        return PointNet(num_classes=num_classes)

    def make_batch(b: int, s: int, frames: int | None) -> Batch:
        return {"points": torch.randn(b, s, 3), "labels": torch.randint(0, num_classes, (b,))}

    return Model(name="pointnet", kind="builder", unit=(), full_units=None, seq_name="points", default_seq=1024,
                 attention="none (a shared MLP and max-pooling)", family="pointnet", _build=build, _batch=make_batch,
                 _loss=lambda runner, batch: runner(**batch).loss, min_batch=2, checkpoint_units=units)


# ------------------------------------------------------------------------------------------- resolution
def _builder_config(name: str) -> Any | None:
    from macroarch.models import MODELS, bert_large_config

    if name in MODELS:
        return MODELS[name].to_config()
    if name == "bert_large":
        return bert_large_config()
    return None


def _is_timm(name: str) -> bool:
    try:
        import timm
    except ImportError:
        return False
    return timm.is_model(name)


def resolve(spec: str, attention: str = "sdpa") -> Model:
    """The ``Model`` named by ``spec`` (module docstring for the order); ``PlanError`` naming it if none is."""
    if not isinstance(spec, str) or not spec:
        raise PlanError(f"model={spec!r} must be a non-empty string")
    path = Path(spec)
    if path.exists():
        return from_transformers_config(spec, _config_from_file(path), attention=attention)
    if (spec.endswith(".json") or "/" in spec) and ":" not in spec and _open_clip_config(spec) is None:
        raise PlanError(f"{spec}: no such file or directory")
    if ":" in spec:
        return from_callable(spec)
    if spec == "pointnet":
        return pointnet()
    config = _builder_config(spec)
    if config is not None:
        return from_transformers_config(spec, config, kind="builder", attention=attention)
    clip = _open_clip_config(spec)
    if clip is not None:
        return from_open_clip(spec, clip)
    if _is_timm(spec):
        return from_timm(spec)
    raise PlanError(f"unknown model {spec!r}: not a config.json or a directory with one, a project builder "
                    f"(macroarch.models.MODELS, bert_large, pointnet), an open_clip architecture, a timm model or "
                    f"module:fn")


__all__ = ["ATTENTION_DROPOUT_KEYS", "Model", "PlanError", "custom", "from_callable", "from_open_clip", "from_timm",
           "from_transformers_config", "pointnet", "resolve"]
