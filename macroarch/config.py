"""Typed configuration and strict YAML loading.

Configs are frozen dataclasses next to the code that uses them; this module holds what they share: the
error type for bad user input (the CLI turns it into a one-line message and exit status 2), a YAML loader
whose errors name the file, and a key check that names the bad key and lists the good ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """Bad user input: an unknown profile, claim id, notebook, key or value. The message names it."""


def load_yaml(path: Path) -> Any:
    """Parse a YAML file; a syntax error becomes a :class:`ConfigError` naming the file and line."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no such file: {path}")
    try:
        with path.open(encoding="utf-8") as f:
            return yaml.safe_load(f)
    except yaml.YAMLError as e:
        where = ""
        if (mark := getattr(e, "problem_mark", None)) is not None:
            where = f" line {mark.line + 1}"
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"malformed YAML in {path}{where}: {problem}") from None


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
