"""A notebook's parameters: read from its ``parameters`` cell, resolved against a profile, recorded whole.

The ``parameters`` cell is the single definition of what a notebook can be run with. Each line is one
annotated assignment with a comment that says what it means::

    profile: str = "cpu"        # ci | cpu | gpu: every parameter left None takes this profile's value
    steps: int = None           # training steps
    lr: float = 3e-3            # a value that is the same in every profile
    seeds: int = None           # paired seeds [2, 1000]

A number (or a list of numbers) may not be negative; a help text that ends in ``[low, high]`` (either side may be
left empty: ``[1, ]``) declares the range its values must lie in, so a size of 0, a step count of ``10**12`` or a
negative width is refused before any kernel starts, naming the parameter, instead of failing inside one or
running unbounded.

A profile gives values only to parameters whose default is ``None``: a profile value for a parameter with a
default of its own would never reach the run, and is refused by the runner (``macroarch.repro.profiles``).

``resolve_parameters(stem, globals())``, the first call after the cell, fills each parameter that is still
``None`` from ``papermill_runs/<profile>.yaml`` (so ``papermill ... -p profile ci`` runs at ci sizes), checks
every value against its annotation, resolves ``compute_dtype: auto`` to what this machine computes fast, writes
the effective values back into the namespace and returns them: that mapping is the run's config, passed whole
to ``start_run``, so W&B and ``result.json`` hold every parameter that ran and nothing retyped by hand.

The runner uses the same parser to check a profile's values before any kernel starts.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from macroarch.config import ConfigError
from macroarch.paths import check_profile, project_root

#: the annotations a parameter may carry, and the Python types its value may have
TYPES: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "float": (float, int),
    "bool": (bool,),
    "list": (list, tuple),
    "dict": (dict,),
}


_RANGE = re.compile(r"\[([^\[\],]*),([^\[\],]*)\]\s*$")


@dataclass(frozen=True)
class Parameter:
    """One line of a ``parameters`` cell: ``name: type = default  # help [low, high]``."""

    name: str
    type: str
    default: Any
    help: str
    low: float | None = 0  # numbers below are refused (None: no bound); a help text's ``[low, high]`` sets both
    high: float | None = None

    def check(self, value: Any, where: str) -> None:
        """Raise :class:`ConfigError` naming the parameter when ``value`` is not of its declared type, or a number
        of it (the value, or an element of a list) lies outside the parameter's range."""
        if value is None:
            return
        ok = TYPES[self.type]
        if isinstance(value, bool) and self.type in ("int", "float"):
            ok = ()  # True is an int to Python, never a size here
        if not isinstance(value, ok):
            raise ConfigError(f"{where}: parameter {self.name!r} must be {self.type}, got {value!r} "
                              f"({type(value).__name__})")
        numbers = value if isinstance(value, list | tuple) else [value]
        for x in numbers:
            if isinstance(x, bool) or not isinstance(x, int | float):
                continue
            if (self.low is not None and x < self.low) or (self.high is not None and x > self.high):
                raise ConfigError(f"{where}: parameter {self.name!r} must lie in {self.range_text()}, got {value!r}"
                                  + (f" ({self.help})" if self.help else ""))

    def range_text(self) -> str:
        def fmt(bound: float | None) -> str:
            return "" if bound is None else (f"{int(bound)}" if float(bound).is_integer() else f"{bound:g}")

        return f"[{fmt(self.low)}, {fmt(self.high)}]"


def _range(help_text: str, where: str, name: str) -> tuple[float | None, float | None]:
    """The ``[low, high]`` a help text ends with; ``(0, None)`` (no negative numbers) where it has none."""
    m = _RANGE.search(help_text)
    if m is None:
        return 0, None
    try:
        low, high = (float(g) if g.strip() else None for g in m.groups())
    except ValueError:
        raise ConfigError(f"{where}: parameter {name!r}: its range {m.group(0).strip()!r} is not [low, high] in "
                          f"numbers") from None
    if low is not None and high is not None and low > high:
        raise ConfigError(f"{where}: parameter {name!r}: its range {m.group(0).strip()!r} is empty")
    return low, high


def notebook_path(stem: str, root: Path | None = None) -> Path:
    return (root or project_root()) / "notebooks" / f"{stem}.ipynb"


def parameters_cell(path: Path) -> str:
    """The source of the notebook's cell tagged ``parameters``."""
    try:
        nb = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read notebook {path}: {e}") from None
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "code" and "parameters" in cell.get("metadata", {}).get("tags", []):
            src = cell["source"]
            return "".join(src) if isinstance(src, list) else src
    raise ConfigError(f"{path} has no cell tagged 'parameters'")


def is_annotated(source: str) -> bool:
    """Whether a parameters cell is in the annotated form (any ``name: type = ...`` line). Cells of untyped
    ``name = value`` lines (notebooks not converted yet) get a name check only from the runner."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return True  # let parse_parameters say what is wrong
    return any(isinstance(node, ast.AnnAssign) for node in tree.body)


def parse_parameters(source: str, where: str = "parameters cell") -> dict[str, Parameter]:
    """Every ``name: type = default  # help`` of a parameters cell, in order; anything else is an error."""
    lines = source.splitlines()
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        raise ConfigError(f"{where}: line {e.lineno}: {e.msg}") from None
    params: dict[str, Parameter] = {}
    for node in tree.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None):
            raise ConfigError(f"{where}: line {node.lineno} is not 'name: type = value  # help'")
        kind = ast.unparse(node.annotation)
        if kind not in TYPES:
            raise ConfigError(f"{where}: parameter {node.target.id!r} has type {kind!r}; use one of "
                              f"{', '.join(TYPES)}")
        try:
            default = ast.literal_eval(node.value)
        except ValueError:
            raise ConfigError(f"{where}: parameter {node.target.id!r}: default must be a literal") from None
        line = lines[node.lineno - 1]
        help_text = line.split("#", 1)[1].strip() if "#" in line[node.value.end_col_offset:] else ""
        low, high = _range(help_text, where, node.target.id)
        p = Parameter(node.target.id, kind, default, help_text, low, high)
        p.check(default, where)
        params[p.name] = p
    if "profile" not in params:
        raise ConfigError(f"{where}: no 'profile' parameter")
    return params


def notebook_parameters(stem: str, root: Path | None = None) -> dict[str, Parameter]:
    path = notebook_path(stem, root)
    return parse_parameters(parameters_cell(path), where=str(path.name))


def profile_values(stem: str, profile: str, root: Path | None = None) -> dict[str, Any]:
    """The parameters ``papermill_runs/<profile>.yaml`` gives notebook ``stem`` (empty if it lists none)."""
    from macroarch.repro.profiles import load_job  # validates the profile file

    job = load_job(profile, stem, root)
    return dict(job.parameters) if job is not None else {}


def resolve(stem: str, given: Mapping[str, Any], root: Path | None = None) -> dict[str, Any]:
    """The effective parameters of a run of notebook ``stem``: ``given`` (the cell's values, with whatever
    papermill injected), each ``None`` filled from the profile, types checked, ``compute_dtype: auto``
    resolved. Raises :class:`ConfigError` naming the parameter that is wrong or still missing."""
    spec = notebook_parameters(stem, root)
    profile = check_profile(given.get("profile", spec["profile"].default))
    from_profile = profile_values(stem, profile, root)
    where = f"{stem} ({profile} profile)"
    out: dict[str, Any] = {}
    for name, p in spec.items():
        value = given.get(name, p.default)
        if value is None:
            value = from_profile.get(name)
        if value is None:
            raise ConfigError(f"{where}: parameter {name!r} is None and papermill_runs/{profile}.yaml gives "
                              f"no value for it")
        p.check(value, where)
        out[name] = list(value) if isinstance(value, tuple) else value
    if out.get("compute_dtype") == "auto":
        from macroarch.measure.machine import auto_compute_dtype

        out["compute_dtype"] = auto_compute_dtype(out.get("device", "cpu"))
    return out


def resolve_parameters(stem: str, namespace: MutableMapping[str, Any]) -> dict[str, Any]:
    """Called by a notebook right after its parameters cell: ``params = resolve_parameters(stem, globals())``.
    Resolves (see :func:`resolve`), writes the effective values back into ``namespace`` and returns them."""
    spec = notebook_parameters(stem)
    params = resolve(stem, {name: namespace.get(name) for name in spec})
    namespace.update(params)
    return params
