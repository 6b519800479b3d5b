"""Project-wide settings: where things live, which profiles exist, and strict YAML loading.

Configs are frozen dataclasses next to the code that uses them; this module holds what they share: the
error type for bad user input (the CLI turns it into a one-line message and exit status 2), a YAML loader
whose errors name the file, and a key check that names the bad key and lists the good ones.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

PROFILES = ("ci", "cpu", "gpu")


class ConfigError(ValueError):
    """Bad user input: an unknown profile, claim id, notebook, key or value. The message names it."""


def project_root() -> Path:
    """The checkout this package runs from (``MACROARCH_ROOT`` overrides), else the working directory."""
    if env := os.environ.get("MACROARCH_ROOT"):
        return Path(env).resolve()
    here = Path(__file__).resolve().parent.parent
    return here if (here / "pyproject.toml").is_file() else Path.cwd().resolve()


def out_root() -> Path:
    """Where executed notebooks and result files go (``MACROARCH_OUT`` overrides)."""
    if env := os.environ.get("MACROARCH_OUT"):
        return Path(env).resolve()
    return project_root() / "papermill_runs" / "out"


def wandb_root() -> Path:
    """The folder W&B writes its ``wandb/`` directory into (W&B's own ``WANDB_DIR`` overrides)."""
    if env := os.environ.get("WANDB_DIR"):
        return Path(env).resolve()
    return project_root()


def check_profile(profile: str) -> str:
    if profile not in PROFILES:
        raise ConfigError(f"unknown profile {profile!r}; expected one of {', '.join(PROFILES)}")
    return profile


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
