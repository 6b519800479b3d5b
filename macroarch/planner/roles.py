"""An MVAS plan made on a small model, as per-role rules for planning the full-size one.

The notebooks plan MVAS on a small model they train (the Fisher diagonal at initialisation, ``importance_plan``)
and size the full-size model with that precision mix, carried over by tensor role: what
``mvas.transfer_plan(plan, model, depth="uniform")`` does on a built model. ``plan`` takes the mix as
``policy={"mvas": {"precision_policy": rules}}`` instead, so that every depth it builds gets it:

- a tensor of a layer stack (a name with a ``.<i>.`` index) has the role of its name with the first index
  replaced by ``*`` (``model.layers.*.mlp.up_proj.weight``), and takes the format that holds most of that role's
  elements over the plan's layers (the same in every layer, as ``depth="uniform"``);
- any other tensor (embeddings, heads) takes the format of the tensor of the same name;
- a role or tensor the plan keeps in its own dtype gets no rule (``plan_from_rules`` keeps tensors no rule names),
  and ``min_numel`` and the norm and bias patterns keep a tensor whatever the rules say, as in ``transfer_plan``.

Rules are glob patterns, first match wins; a role's ``*`` matches dots too, so the most specific roles (most
name components) come first and ``blocks.*.attn.out.weight`` is not taken by ``blocks.*.out.weight``.
"""

from __future__ import annotations

import re
from typing import Any

_LAYER_INDEX = re.compile(r"\.(\d+)\.")  # the first layer index of a name, as mvas.transfer_plan reads it


def rules_from_plan(plan: Any) -> dict[str, str]:
    """``plan`` (an ``mvas.PrecisionPlan``) as ``{pattern: format}`` rules for ``MVASConfig.precision_policy``
    (module docstring)."""
    from macroarch.mvas import dtype_format

    roles: dict[str, dict[str | None, int]] = {}  # role -> format (None: kept) -> elements
    for t in plan.tensors:
        m = _LAYER_INDEX.search(t.name)
        role = t.name if m is None else t.name[:m.start()] + ".*." + t.name[m.end():]
        fmt = None if t.format == dtype_format(t.dtype).name else t.format
        roles.setdefault(role, {}).setdefault(fmt, 0)
        roles[role][fmt] += t.numel
    rules = {role: max(formats.items(), key=lambda kv: kv[1])[0] for role, formats in roles.items()}
    ordered = sorted((r for r, f in rules.items() if f is not None), key=lambda r: -r.count("."))
    return {r: rules[r] for r in ordered}


__all__ = ["rules_from_plan"]
