"""Precision policies as MVAS rules (post section 3.2, claim C15): the post's CLIP policy by tower, and
``{part: format | [shallow, deep]}`` for any model, as the ``[(pattern, format), ...]`` rules of
``macroarch.mvas.plan.policy.plan_from_rules``.

**The post's CLIP policy** ``{text: fp16, image: [fp8, fp16]}`` (``configs/clip_post.yaml``, claim C15):
a list cuts the tower's repeated blocks (``find_repeated_layers``, input side first) into as many
consecutive runs as it has entries, the first runs one block longer when they do not divide evenly; so
``[fp8, fp16]`` puts the shallow half in fp8 and the deep half in fp16. The tower's other parameters (patch
embedding, class/positional embeddings, ln_pre/ln_post, projection) take the list's last entry. The
towers of an open_clip ``CLIP`` are ``visual`` and the text modules (``transformer``, ``token_embedding``,
``positional_embedding``, ``ln_final``, ``text_projection``); a ``CustomTextCLIP``'s text tower is ``text``.
``fp8`` means e4m3 and ``fp4`` e2m1. ``logit_scale`` belongs to neither tower.

``policy_rules`` generalises it: a part is a CLIP tower or a glob over parameter names, and a ``[shallow, deep]``
pair splits the part's repeated blocks at ``shallow_fraction`` (its docstring).
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from macroarch.mvas.codecs.formats import get_format
from macroarch.mvas.plan.policy import PrecisionPlan, Rule, matches, plan_from_rules

__all__ = ["CLIP_TOWERS", "EMBEDDING_PATTERNS", "clip_plan", "clip_rules", "parse_precision_policy", "policy_rules",
           "read_precision_policy", "split_rules"]

CLIP_TOWERS = ("text", "image")
_CLIP_TEXT_MODULES = ("transformer", "token_embedding", "positional_embedding", "ln_final", "text_projection")


def split_rules(blocks: Sequence[str], formats: Sequence[str]) -> list[Rule]:
    """Rules giving consecutive runs of ``blocks`` (input side first) the ``formats`` in order."""
    if not formats:
        raise ValueError("formats is empty: give at least one format per run of blocks")
    if len(blocks) < len(formats):
        raise ValueError(f"{len(blocks)} blocks cannot be cut into {len(formats)} runs ({list(formats)})")
    runs = torch.tensor_split(torch.arange(len(blocks)), len(formats))
    return [(blocks[int(i)], fmt) for run, fmt in zip(runs, formats) for i in run]


def parse_precision_policy(policy: Mapping[str, object]) -> dict[str, tuple[str, ...]]:
    """``{text: fp16, image: [fp8, fp16]}`` -> ``{"text": ("fp16",), "image": ("fp8_e4m3", "fp16")}``."""
    if not isinstance(policy, Mapping):
        raise ValueError(f"precision_policy must be a mapping of tower -> format(s); got {type(policy).__name__}")
    unknown = [k for k in policy if k not in CLIP_TOWERS]
    if unknown:
        raise ValueError(f"precision_policy: unknown key(s) {unknown}; allowed: {', '.join(CLIP_TOWERS)}")
    out = {}
    for tower, value in policy.items():
        names = [value] if isinstance(value, str) else value
        if not isinstance(names, list | tuple) or not names or not all(isinstance(n, str) for n in names):
            raise ValueError(f"precision_policy.{tower}: expected a format or a non-empty list; got {value!r}")
        try:
            out[tower] = tuple(get_format(n).name for n in names)
        except ValueError as e:
            raise ValueError(f"precision_policy.{tower}: {e}") from None
    return out


def read_precision_policy(path: str | Path) -> dict[str, tuple[str, ...]]:
    """``optim.precision_policy`` of a YAML config such as ``configs/clip_post.yaml``, parsed."""
    from macroarch.config import load_yaml

    policy = ((load_yaml(Path(path)) or {}).get("optim") or {}).get("precision_policy")
    if policy is None:
        raise ValueError(f"{path} has no optim.precision_policy")
    return parse_precision_policy(policy)


def _clip_towers(model: nn.Module) -> dict[str, tuple[list[str], nn.Module]]:
    """tower -> (the prefixes of its parameters, the module holding its repeated blocks)."""
    if not isinstance(getattr(model, "visual", None), nn.Module):
        raise ValueError(f"{type(model).__name__} has no .visual tower: expected an open_clip CLIP/CustomTextCLIP")
    if isinstance(getattr(model, "text", None), nn.Module):
        text = (["text"], model.text)
    else:
        text = ([n for n in _CLIP_TEXT_MODULES if hasattr(model, n)], model.transformer)
    return {"image": (["visual"], model.visual), "text": text}


def clip_rules(model: nn.Module, policy: Mapping[str, object], image_blocks: Sequence[str] | None = None,
               text_blocks: Sequence[str] | None = None) -> list[Rule]:
    """Rules for an open_clip model from the post's ``precision_policy`` (blocks found unless given)."""
    from macroarch.layers import find_repeated_layers

    parsed = parse_precision_policy(policy)
    towers = _clip_towers(model)
    given = {"image": image_blocks, "text": text_blocks}
    rules: list[Rule] = []
    for tower, formats in parsed.items():
        prefixes, root = towers[tower]
        if len(formats) > 1:
            blocks = given[tower]
            if blocks is None:
                root_name = next(n for n, m in model.named_modules() if m is root)
                blocks = [f"{root_name}.{n}" for n, _ in find_repeated_layers(root)]
            rules += split_rules(list(blocks), formats)
        rules += [(prefix, formats[-1]) for prefix in prefixes]
    return rules


#: the input embeddings of a part (open_clip's conv1 / class and positional embeddings, timm's patch_embed /
#: cls_token / pos_embed, transformers' embed_tokens / wpe / wte / patch_embeddings)
EMBEDDING_PATTERNS = ("*embed*", "*conv1*", "*cls_token*", "*wte*", "*wpe*")


def policy_rules(model: nn.Module, policy: Mapping[str, object], *, shallow_fraction: float = 0.5,
                 embedding_is_shallow: bool = True,
                 embedding_patterns: Sequence[str] = EMBEDDING_PATTERNS) -> list[Rule]:
    """Rules for any model from a precision policy ``{part: format | [shallow, deep]}``.

    A part is a CLIP tower (``text``, ``image``; for open_clip models) or a glob over parameter names
    (``model.layers.*``). One format covers the whole part. A ``[shallow, deep]`` pair splits the part's
    repeated blocks (``find_repeated_layers``, input side first): the first ``ceil(shallow_fraction * n)``
    blocks take the shallow format, the rest the deep one; the part's input embeddings outside its blocks
    (``embedding_patterns``: a ViT's patch embedding, class token and position embedding, a text tower's token
    and position embeddings) are shallow when ``embedding_is_shallow``, and everything else outside the blocks
    (final norm, output projection) is deep. Norms, biases and small tensors still
    keep their dtype (``plan_from_rules``). Raises ``ValueError`` naming the part when it matches nothing or
    has too few blocks for a pair.
    """
    from macroarch.layers import find_repeated_layers

    if not 0.0 < shallow_fraction < 1.0:
        raise ValueError(f"shallow_fraction={shallow_fraction} must be in (0, 1)")
    names = [n for n, _ in model.named_parameters()]
    is_clip = isinstance(getattr(model, "visual", None), nn.Module)
    rules: list[Rule] = []
    for part, value in policy.items():
        formats = [value] if isinstance(value, str) else list(value)
        if not formats or len(formats) > 2:
            raise ValueError(f"precision_policy.{part}: {value!r} must be one format or a [shallow, deep] pair")
        formats = [get_format(f).name for f in formats]
        if is_clip and part in CLIP_TOWERS:
            prefixes, root = _clip_towers(model)[part]
            root_name = next(n for n, m in model.named_modules() if m is root)
            blocks = [f"{root_name}.{n}" if root_name else n for n, _ in find_repeated_layers(root)]
        else:
            prefixes = [part]
            blocks = [n for n, _ in find_repeated_layers(model) if matches(n, part)]
        members = [n for n in names if any(matches(n, pre) for pre in prefixes)]
        if not members:
            raise ValueError(f"precision_policy.{part}: matches no parameter of {type(model).__name__}")
        if len(formats) == 2:
            if len(blocks) < 2:
                raise ValueError(f"precision_policy.{part}: a [shallow, deep] pair needs at least 2 repeated "
                                 f"blocks in the part; found {len(blocks)}")
            n_shallow = min(len(blocks) - 1, max(1, math.ceil(shallow_fraction * len(blocks) - 1e-9)))
            rules += [(b, formats[0] if i < n_shallow else formats[1]) for i, b in enumerate(blocks)]
            if embedding_is_shallow:
                rules += [(n, formats[0]) for n in members
                          if not any(matches(n, b) for b in blocks)
                          and any(fnmatch.fnmatchcase(n, pat) for pat in embedding_patterns)]
        rules += [(pre, formats[-1]) for pre in prefixes]
    return rules


def clip_plan(model: nn.Module, policy: Mapping[str, object], **kwargs) -> PrecisionPlan:
    """``plan_from_rules(model, clip_rules(model, policy), **kwargs)``."""
    return plan_from_rules(model, clip_rules(model, policy), **kwargs)
