"""What every harness's settings share: a frozen dataclass built from a notebook's resolved parameters.

Each harness module owns one frozen dataclass of its settings (a docstring per field, checks in
``__post_init__``), as torchtitan's components own their configs. A notebook builds it in the cell that resolves
its parameters::

    params = resolve_parameters("05_mvas_llama", globals())
    settings = ml.MVASLlamaSettings.from_params(params)

:meth:`Settings.from_params` takes the fields it names from that mapping (lists become tuples, so a settings
object cannot change under the run that reads it) and refuses a key it does not know, by name, except the
run-level keys (:data:`RUN_KEYS`) that a notebook reads itself and a harness may not need. A bad value raises
:class:`~macroarch.config.ConfigError` (a ``ValueError``) naming the field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

from macroarch.config import ConfigError
from macroarch.measure.machine import COMPUTE_DTYPES  # ``compute_dtype`` once ``auto`` is resolved

__all__ = ["COMPUTE_DTYPES", "RUN_KEYS", "Settings"]

RUN_KEYS = frozenset({"profile", "seed", "device", "threads", "corpus", "compute_dtype"})
"""Parameters about the run rather than the experiment (the profile, seeds, where and in how many threads it runs,
its corpus and compute dtype): a harness whose settings do not name one ignores it."""


S = TypeVar("S", bound="Settings")


@dataclasses.dataclass(frozen=True)
class Settings:
    """Base of the harnesses' settings: :meth:`from_params` and the checks their ``__post_init__`` use."""

    @classmethod
    def from_params(cls: type[S], params: Mapping[str, Any]) -> S:
        """The settings from a notebook's resolved parameters (``resolve_parameters``' mapping). Raises
        :class:`ConfigError` naming every key that is neither a field nor in :data:`RUN_KEYS`, and every field
        the mapping lacks that has no default."""
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(k for k in params if k not in fields and k not in RUN_KEYS)
        if unknown:
            raise ConfigError(f"{cls.__name__}: unknown parameter(s) {', '.join(map(repr, unknown))}; its settings "
                              f"are {', '.join(fields)} (run-level keys {', '.join(sorted(RUN_KEYS))} are ignored)")
        missing = [name for name, f in fields.items() if name not in params
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ConfigError(f"{cls.__name__}: missing parameter(s) {', '.join(map(repr, missing))}")
        return cls(**{k: _frozen(v) for k, v in params.items() if k in fields})

    # checks for __post_init__: each raises ConfigError naming the field
    def _fail(self, name: str, must: str) -> None:
        raise ConfigError(f"{type(self).__name__}.{name} must be {must}, got {getattr(self, name)!r}")

    def _positive(self, *names: str) -> None:
        """Each field is a number > 0 (not a bool)."""
        for name in names:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                self._fail(name, "a positive number")

    def _non_negative(self, *names: str) -> None:
        """Each field is a number >= 0 (not a bool)."""
        for name in names:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                self._fail(name, "a number >= 0")

    def _fraction(self, *names: str) -> None:
        """Each field is a number in [0, 1]."""
        for name in names:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
                self._fail(name, "a number in [0, 1]")

    def _one_of(self, name: str, choices: Iterable[Any]) -> None:
        choices = tuple(choices)
        if getattr(self, name) not in choices:
            self._fail(name, f"one of {', '.join(map(repr, choices))}")

    def _non_empty(self, *names: str) -> None:
        """Each field is a non-empty sequence."""
        for name in names:
            if not len(getattr(self, name)):
                self._fail(name, "a non-empty list")

    def _device(self, name: str = "device") -> None:
        v = getattr(self, name)
        if not isinstance(v, str) or not (v == "cpu" or v.startswith("cuda")):
            self._fail(name, "'cpu' or 'cuda[:i]'")


def _frozen(value: Any) -> Any:
    return tuple(_frozen(v) for v in value) if isinstance(value, list) else value
