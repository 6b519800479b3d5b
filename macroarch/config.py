"""Typed configuration of the techniques, and strict YAML loading.

One frozen dataclass per component (``MVASConfig``, ``DGRConfig``, ``OptimConfig``), a docstring per field,
checks in ``__post_init__``; ``MacroConfig`` holds them and is what ``macroarch.compose.apply`` stacks on a
model. ``load_config`` reads YAML onto it key by key, including the post's own block (section 6)::

    optim:
      macro_architecture: true
      group_size: 6
      precision_policy: {text: fp16, image: [fp8, fp16]}

Every error is a :class:`ConfigError` that names the bad key or value (the CLI turns it into one line and exit
status 2). The shared helpers (``load_yaml`` naming the file and line, ``check_keys`` naming the bad key and
listing the good ones) serve the other YAML files of the project too.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import math
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """Bad user input: an unknown profile, claim id, notebook, key or value. The message names it."""


def load_yaml(path: Path) -> Any:
    """Parse a YAML file; a syntax error, or a key given twice in one mapping (which YAML would silently resolve to
    the last value), becomes a :class:`ConfigError` naming the file and line."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no such file: {path}")
    try:
        with path.open(encoding="utf-8") as f:
            return yaml.load(f, Loader=_strict_loader())  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as e:
        where = ""
        if (mark := getattr(e, "problem_mark", None)) is not None:
            where = f" line {mark.line + 1}"
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"malformed YAML in {path}{where}: {problem}") from None


_STRICT_LOADER: type | None = None


def _strict_loader() -> type:
    """yaml's SafeLoader, refusing a mapping that gives one key twice."""
    global _STRICT_LOADER
    if _STRICT_LOADER is None:
        import yaml

        class StrictLoader(yaml.SafeLoader):
            def construct_mapping(self, node, deep=False):
                seen: dict[Any, Any] = {}
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":  # ``<<: *anchor``: its keys may be overridden
                        continue
                    key = self.construct_object(key_node, deep=deep)
                    if key in seen:
                        raise yaml.constructor.ConstructorError(
                            None, None, f"key {key!r} is given twice (first on line {seen[key] + 1})",
                            key_node.start_mark)
                    seen[key] = key_node.start_mark.line
                return super().construct_mapping(node, deep=deep)

        StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, StrictLoader.construct_mapping)
        _STRICT_LOADER = StrictLoader
    return _STRICT_LOADER


def check_keys(mapping: Mapping[str, Any], allowed: Iterable[str], where: str,
               required: Iterable[str] = ()) -> None:
    """Reject keys outside ``allowed`` and missing ``required`` ones, naming them and where they are."""
    if not isinstance(mapping, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(mapping).__name__}")
    allowed = tuple(allowed)
    unknown = [k for k in mapping if k not in allowed]
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}; allowed keys: {', '.join(allowed)}")
    missing = [k for k in required if k not in mapping]
    if missing:
        raise ConfigError(f"{where}: missing key {missing[0]!r}")


# ------------------------------------------------------------------------------------------ typed loading
def _check_value(value: Any, hint: Any, where: str) -> Any:
    """``value`` checked against a field's type hint (the few forms our configs use); returns it normalised
    (lists become tuples, ints become floats where a float is asked for)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _check_value(value, arg, where)
            except ConfigError as e:
                errors.append(e)
        raise errors[-1]
    if origin in (tuple, collections.abc.Sequence):
        if isinstance(value, str) or not isinstance(value, list | tuple):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        item = args[0] if args else Any
        return tuple(_check_value(v, item, f"{where}[{i}]") for i, v in enumerate(value))
    if origin in (dict, collections.abc.Mapping):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        key_hint, value_hint = args or (Any, Any)
        return {_check_value(k, key_hint, where): _check_value(v, value_hint, f"{where}.{k}")
                for k, v in value.items()}
    if hint is Any:
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        if not math.isfinite(value):  # YAML's .nan / .inf: no setting here means anything with them
            raise ConfigError(f"{where}: expected a finite number, got {value!r}")
        return float(value)
    if hint is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if isinstance(hint, type) and not isinstance(value, hint):
        raise ConfigError(f"{where}: expected {hint.__name__}, got {value!r}")
    return value


def from_mapping(cls: type[T], mapping: Mapping[str, Any] | None, where: str) -> T:
    """Build the frozen dataclass ``cls`` from a YAML mapping: every key must be a field (the error names the
    key, where it is, and the allowed keys), every value must fit the field's type; nested dataclass fields
    are built the same way. The dataclass's own ``__post_init__`` checks the values' meaning."""
    mapping = {} if mapping is None else mapping
    names = [f.name for f in dataclasses.fields(cls)]
    check_keys(mapping, names, where or "the config")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in mapping.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = from_mapping(hint, value, f"{where}.{name}" if where else name)
        else:
            kwargs[name] = _check_value(value, hint, f"{where}.{name}" if where else name)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where or 'the config'}: {e}") from None


# ------------------------------------------------------------------------------------------ the configs
def _fail(where: str, message: str) -> None:
    raise ConfigError(f"{where}: {message}")


def _check_format(name: str, where: str) -> None:
    from macroarch.mvas.codecs.formats import get_format  # torch: imported when a config is checked, not by the CLI

    try:
        get_format(name)
    except ValueError as e:
        _fail(where, str(e))


def _check_policy(policy: Mapping[str, Any] | None, where: str) -> None:
    for key, value in (policy or {}).items():
        if not isinstance(value, str) and len(value) != 2:
            _fail(f"{where}.{key}", f"{list(value)} must be one format or a [shallow, deep] pair of formats")
        for name in (value,) if isinstance(value, str) else value:
            _check_format(name, f"{where}.{key}")


@dataclass(frozen=True)
class MVASConfig:
    """MVAS (post section 3.2): which weights are stored packed, in which format, and how they are updated.

    Either ``precision_policy`` (explicit rules) or ``target_reduction`` (a byte budget) switches MVAS on.
    """

    precision_policy: Mapping[str, str | tuple[str, ...]] | None = None
    """Format per part of the model. Keys are a CLIP model's towers (``text``, ``image``) or glob patterns of
    parameter names (``model.layers.*``); a value is one format (``fp16``, ``fp8``, ``fp4``...) or a list that
    ``[shallow, deep]`` pair that splits the part's repeated blocks, input side first (``[fp8, fp16]``:
    shallow blocks fp8, deep ones fp16; see ``shallow_fraction``)."""
    shallow_fraction: float = 0.5
    """With a ``[shallow, deep]`` pair: the share of the part's blocks (input side first) that is shallow."""
    embedding_is_shallow: bool = True
    """With a pair: the part's parameters before its first block (a ViT's patch embedding, class token and
    position embedding) take the first (shallow) format; otherwise the last."""
    target_reduction: float | None = None
    """Instead of rules: save this fraction of the packable weights' bytes, formats chosen by a knapsack over
    sensitivity per byte saved (``mvas.plan_for_budget``)."""
    block_size: int = 32
    """Elements per fp32 scale of the scaled formats (fp8, fp4)."""
    min_numel: int = 4096
    """Tensors with fewer elements (and norms, biases) stay in their own dtype."""
    state_format: str = "fp8_e4m3"
    """Storage of MVASAdamW's moments (block-quantised)."""
    master_weights: bool = False
    """Keep an fp32 master copy of packed weights (else stochastic rounding writes them back)."""
    replan_every: int | None = None
    """Re-plan the formats every K optimizer steps from the running Fisher importance (``MVASSchedule``);
    None: the plan stays."""

    def __post_init__(self) -> None:
        if self.precision_policy is not None and self.target_reduction is not None:
            _fail("mvas", "give precision_policy or target_reduction, not both")
        _check_policy(self.precision_policy, "mvas.precision_policy")
        if not 0.0 < self.shallow_fraction < 1.0:
            _fail("mvas.shallow_fraction", f"{self.shallow_fraction} must be in (0, 1)")
        if self.target_reduction is not None and not 0.0 <= self.target_reduction < 1.0:
            _fail("mvas.target_reduction", f"{self.target_reduction} must be in [0, 1)")
        if self.block_size < 1:
            _fail("mvas.block_size", f"{self.block_size} must be >= 1")
        if self.min_numel < 0:
            _fail("mvas.min_numel", f"{self.min_numel} must be >= 0")
        _check_format(self.state_format, "mvas.state_format")
        if self.replan_every is not None and self.replan_every < 1:
            _fail("mvas.replan_every", f"{self.replan_every} must be >= 1 (or null: never)")

    @property
    def enabled(self) -> bool:
        return self.precision_policy is not None or self.target_reduction is not None


@dataclass(frozen=True)
class DGRConfig:
    """DGR (post section 3.1): per-group optimizer steps during backward."""

    group_size: int | None = None
    """Consecutive blocks of the model's repeated container per group; None: DGR off."""
    mode: str = "sync"
    """``sync`` (step each group as soon as its gradients are complete) or ``interleaved`` (apply them later,
    delay-compensated)."""
    accumulation_steps: int = 1
    """Backward passes per update."""
    max_grad_norm: float | None = None
    """Per-group gradient clipping norm; None: no clipping."""
    atomic_steps: bool = False
    """Keep each updated group's pre-step copy until the step ends, so that a non-finite gradient found later in
    backward rolls the whole step back (``DGRWrapper``'s default). It costs up to about three times the
    parameter bytes at the end of backward, which is what DGR exists to save, so the post's DGR (and this
    config) keeps no copies: a non-finite gradient then skips its group and the ones after it."""

    def __post_init__(self) -> None:
        if self.group_size is not None and self.group_size < 1:
            _fail("dgr.group_size", f"{self.group_size} must be >= 1 (or null: DGR off)")
        if self.mode not in ("sync", "interleaved"):
            _fail("dgr.mode", f"{self.mode!r} is not a DGR mode; use sync or interleaved")
        if self.accumulation_steps < 1:
            _fail("dgr.accumulation_steps", f"{self.accumulation_steps} must be >= 1")
        if self.max_grad_norm is not None and not (math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0):
            _fail("dgr.max_grad_norm", f"{self.max_grad_norm} must be > 0 (or null)")

    @property
    def enabled(self) -> bool:
        return self.group_size is not None


@dataclass(frozen=True)
class OptimConfig:
    """The optimizer, and the post's own switches as it writes them under ``optim:`` (section 6)."""

    macro_architecture: bool = False
    """The post's master switch: with false, ``group_size`` and ``precision_policy`` are ignored and nothing
    but the optimizer is applied."""
    group_size: int | None = None
    """The post's shorthand for ``dgr.group_size``."""
    precision_policy: Mapping[str, str | tuple[str, ...]] | None = None
    """The post's shorthand for ``mvas.precision_policy``."""
    lr: float = 1e-3
    """Learning rate."""
    betas: tuple[float, ...] = (0.9, 0.999)
    """Adam's beta1, beta2."""
    eps: float = 1e-8
    """Adam's epsilon."""
    weight_decay: float = 0.01
    """Decoupled weight decay."""

    def __post_init__(self) -> None:
        if self.group_size is not None and self.group_size < 1:
            _fail("optim.group_size", f"{self.group_size} must be >= 1")
        _check_policy(self.precision_policy, "optim.precision_policy")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            _fail("optim.betas", f"{list(self.betas)} must be two values in [0, 1)")
        for name in ("lr", "eps", "weight_decay"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):  # NaN compares false: checked as not finite
                _fail(f"optim.{name}", f"{value} must be a finite number >= 0")


@dataclass(frozen=True)
class MacroConfig:
    """Everything ``macroarch.compose.apply`` stacks on a model. YAML maps onto it key by key::

        optim:                       # the post's block (configs/clip_post.yaml), as written
          macro_architecture: true
          group_size: 6
          precision_policy: {text: fp16, image: [fp8, fp16]}
        mvas: {block_size: 32}       # finer settings of each component, all optional
        dgr: {mode: sync}
    """

    optim: OptimConfig = field(default_factory=OptimConfig)
    """The optimizer and the post's shorthand switches."""
    mvas: MVASConfig = field(default_factory=MVASConfig)
    """MVAS settings."""
    dgr: DGRConfig = field(default_factory=DGRConfig)
    """DGR settings."""

    def __post_init__(self) -> None:
        o = self.optim
        if not o.macro_architecture:
            return
        # The post's shorthand fills the component configs; a conflicting explicit value is an error.
        if o.group_size is not None:
            if self.dgr.group_size not in (None, o.group_size):
                _fail("optim.group_size", f"{o.group_size} conflicts with dgr.group_size {self.dgr.group_size}")
            object.__setattr__(self, "dgr", dataclasses.replace(self.dgr, group_size=o.group_size))
        if o.precision_policy is not None:
            if self.mvas.precision_policy not in (None, o.precision_policy):
                _fail("optim.precision_policy", "conflicts with mvas.precision_policy; give one of them")
            object.__setattr__(self, "mvas", dataclasses.replace(self.mvas, precision_policy=o.precision_policy))

    @property
    def uses_mvas(self) -> bool:
        return self.mvas.enabled and (self.optim.macro_architecture or self.optim.precision_policy is None)

    @property
    def uses_dgr(self) -> bool:
        return self.dgr.enabled and (self.optim.macro_architecture or self.optim.group_size is None)


def load_config(source: str | Path | Mapping[str, Any]) -> MacroConfig:
    """A :class:`MacroConfig` from a YAML file or an already parsed mapping; any bad key or value is a
    :class:`ConfigError` that names it (``optim.precision_policy.image: unknown format 'fp9'``)."""
    if isinstance(source, Mapping):
        data, where = source, "config"
    elif isinstance(source, str | Path):
        data, where = load_yaml(Path(source)), str(source)
    else:
        raise ConfigError(f"config: expected a mapping or a YAML file, got {type(source).__name__}")
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping at the top, got {type(data).__name__}")
    try:
        return from_mapping(MacroConfig, data, "")
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}" if where != "config" else str(e)) from None
