"""A profile: ``papermill_runs/<profile>.yaml``, the notebooks it runs, their per-profile values and budgets.

::

    description: what this profile is for
    budget: 10m                           # optional: the time budget of a notebook without its own
    notebooks:
      - notebook: 02_memory_wall          # notebooks/02_memory_wall.ipynb
        parameters: {measured_layers: 2}  # each a parameter of its `parameters` cell, of the declared type
        timeout: 600                      # optional: seconds per cell
        budget: 6m                        # optional: how long the notebook should take here (90s, 6m, 1h)
        exclusive: true                   # optional: runs alone on all the cores (several processes, timing)

Everything is checked before any kernel starts: a bad profile, notebook (one in ``notebooks/``, named by file
name), claim id, parameter name, a key given twice, a value of the wrong type or outside its range (against the
annotation and ``[low, high]`` in the notebook's ``parameters`` cell), a value for a parameter whose default is
not ``None`` (the run would never see it), a ``None`` parameter the profile leaves without a value, or a
budget or timeout that is not more than 0 s and at most a day raises :class:`ConfigError` naming it.
Notebooks whose parameters cell is not annotated yet (``name = value`` lines) get a name check only, and their
values through papermill.

What a notebook needs of the machine, for the runner's schedule (:mod:`macroarch.repro.runner`): the cores of its
resolved ``threads`` parameter (1 without one), or all of them alone where the profile marks it ``exclusive``
(notebooks of several processes, such as gloo ranks, and measurements a neighbour on another core would bias).

A run with a seed offset (``NotebookJob.seed_offset``, ``macroarch reproduce --seed-offset K``) adds ``K`` to the
notebook's ``seed`` parameter; the offset seed is passed through papermill and is part of the effective
parameters, so what ran is what is recorded and a run with another offset is another run.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from macroarch.config import ConfigError, check_keys, load_yaml
from macroarch.paths import check_profile, project_root
from macroarch.repro import notebook as nbparams
from macroarch.repro.claims import CLAIMS, parse_claim_ids

_PROFILE_KEYS = ("description", "notebooks", "budget")
_STEM = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_ENTRY_KEYS = ("notebook", "parameters", "timeout", "budget", "exclusive")


@dataclass(frozen=True)
class NotebookJob:
    """One notebook of a profile, validated."""

    stem: str
    path: Path
    claims: tuple[str, ...]
    parameters: dict[str, Any]  # what the profile file gives (for old-form notebooks: what papermill injects)
    timeout: int | None = None
    budget: float | None = None  # seconds
    annotated: bool = True  # the parameters cell is `name: type = default  # help` (resolves its own sizes)
    exclusive: bool = False  # runs alone, on all the cores the runner has
    seed_offset: int = 0  # added to the notebook's `seed` parameter (see has_seed)

    def with_seed_offset(self, offset: int) -> NotebookJob:
        return replace(self, seed_offset=offset)

    def papermill_parameters(self, profile: str, root: Path | None = None) -> dict[str, Any]:
        """What papermill injects: ``profile`` (an annotated notebook resolves the rest itself), and the offset
        ``seed`` in a run with a seed offset."""
        if not self.annotated:
            return {**self._given(profile), "profile": profile}
        if self.seed_offset and self.has_seed(profile, root):
            return {"profile": profile, "seed": self.effective_parameters(profile, root)["seed"]}
        return {"profile": profile}

    def effective_parameters(self, profile: str, root: Path | None = None) -> dict[str, Any]:
        """The parameters a run of this notebook would have now (what its result.json config records)."""
        if not self.annotated:
            return {**self._given(profile), "profile": profile}
        params = nbparams.resolve(self.stem, {"profile": profile}, root)
        if self.seed_offset and "seed" in params:
            params = nbparams.resolve(self.stem, {"profile": profile, "seed": params["seed"] + self.seed_offset}, root)
        return params

    def has_seed(self, profile: str, root: Path | None = None) -> bool:
        """Whether a seed offset reaches this notebook: its parameters cell declares ``seed`` (a notebook not
        converted to annotated parameters: its profile entry gives one)."""
        if not self.annotated:
            return "seed" in self.parameters
        return "seed" in nbparams.notebook_parameters(self.stem, root)

    def threads(self, profile: str, root: Path | None = None) -> int:
        """The cores this notebook computes on: its resolved ``threads`` parameter, 1 where it has none."""
        value = self.effective_parameters(profile, root).get("threads")
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1

    def _given(self, profile: str) -> dict[str, Any]:
        if self.seed_offset and isinstance(self.parameters.get("seed"), int):
            return {**self.parameters, "seed": self.parameters["seed"] + self.seed_offset}
        return dict(self.parameters)


def profile_file(profile: str, root: Path | None = None) -> Path:
    return (root or project_root()) / "papermill_runs" / f"{profile}.yaml"


_DURATION = re.compile(r"^(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")


#: the longest budget or cell timeout a profile may give: a day (a longer one is a typo, not a plan)
MAX_SECONDS = 24 * 3600


def parse_duration(value: Any, where: str) -> float:
    """``90``, ``"90s"``, ``"6m"``, ``"1h30m"`` -> seconds; more than zero and at most :data:`MAX_SECONDS`."""
    seconds = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION.match(value.strip())) and any(m.groups()):
        h, mi, s = (int(g or 0) for g in m.groups())
        seconds = float(h * 3600 + mi * 60 + s)
    if seconds is None or not 0 < seconds <= MAX_SECONDS:
        raise ConfigError(f"{where}: budget must be a duration of more than 0 s and at most 24h, as seconds or "
                          f"like 90s, 6m, 1h30m; got {value!r}")
    return seconds


def format_duration(seconds: float) -> str:
    """``252`` -> ``4m12s``; ``360`` -> ``6m``; ``42.3`` -> ``42s``."""
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    if h:
        return f"{h}h{m:02d}m"
    if m:
        return f"{m}m{s:02d}s" if s else f"{m}m"
    return f"{s}s"


def load_profile(profile: str, root: Path | None = None) -> list[NotebookJob]:
    """Read and validate ``papermill_runs/<profile>.yaml`` against the notebooks and the registry."""
    root = root or project_root()
    path, default_budget, entries = _entries(profile, root)
    return [_job(profile, root, path, i, entry, default_budget) for i, entry in entries]


def load_job(profile: str, stem: str, root: Path | None = None) -> NotebookJob | None:
    """Notebook ``stem``'s entry of the profile, validated (``None`` if the profile does not list it). Only that
    entry's parameters are checked: a notebook run by hand does not depend on the others being right."""
    root = root or project_root()
    path, default_budget, entries = _entries(profile, root)
    for i, entry in entries:
        if str(entry["notebook"]).removesuffix(".ipynb") == stem:
            return _job(profile, root, path, i, entry, default_budget)
    return None


def _entries(profile: str, root: Path) -> tuple[Path, float | None, list[tuple[int, dict]]]:
    check_profile(profile)
    path = profile_file(profile, root)
    try:
        data = load_yaml(path)
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}") from None
    check_keys(data or {}, _PROFILE_KEYS, str(path), required=("notebooks",))
    entries = data["notebooks"]
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{path}: 'notebooks' must be a non-empty list")
    default_budget = parse_duration(data["budget"], f"{path}: budget") if data.get("budget") is not None else None
    seen = set()
    for i, entry in enumerate(entries):
        where = f"{path}: notebooks[{i}]"
        check_keys(entry, _ENTRY_KEYS, where, required=("notebook",))
        stem = str(entry["notebook"]).removesuffix(".ipynb")
        if not isinstance(entry["notebook"], str) or not _STEM.fullmatch(stem):
            raise ConfigError(f"{where}: notebook {entry['notebook']!r} must name a notebook in notebooks/ by its "
                              f"file name, such as 02_memory_wall (no folder, no '..')")
        if not (root / "notebooks" / f"{stem}.ipynb").is_file():
            raise ConfigError(f"{where}: unknown notebook {stem!r} (no notebooks/{stem}.ipynb)")
        if stem in seen:
            raise ConfigError(f"{where}: notebook {stem!r} is listed twice")
        seen.add(stem)
    return path, default_budget, list(enumerate(entries))


def _job(profile: str, root: Path, path: Path, i: int, entry: dict, default_budget: float | None) -> NotebookJob:
    stem = str(entry["notebook"]).removesuffix(".ipynb")
    nb = root / "notebooks" / f"{stem}.ipynb"
    where = f"{path.name}: {stem}"
    params = entry.get("parameters") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{where}: 'parameters' must be a mapping, got {type(params).__name__}")
    if "profile" in params:
        raise ConfigError(f"{where}: 'profile' is set by the runner, not by the profile file")
    annotated = _check_parameters(nb, profile, params, where)
    timeout = entry.get("timeout")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int)
                                or not 0 < timeout <= MAX_SECONDS):
        raise ConfigError(f"{where}: timeout must be a whole number of seconds from 1 to {MAX_SECONDS} (a day), "
                          f"got {timeout!r}")
    budget = parse_duration(entry["budget"], where) if entry.get("budget") is not None else default_budget
    exclusive = entry.get("exclusive", False)
    if not isinstance(exclusive, bool):
        raise ConfigError(f"{where}: exclusive must be true or false, got {exclusive!r}")
    claims = tuple(c.id for c in CLAIMS.values() if c.notebook == stem)
    return NotebookJob(stem=stem, path=nb, claims=claims, parameters=params, timeout=timeout, budget=budget,
                       annotated=annotated, exclusive=exclusive)


def _check_parameters(nb: Path, profile: str, params: dict[str, Any], where: str) -> bool:
    """Check a profile's values against the notebook's parameters cell; returns whether it is annotated."""
    source = nbparams.parameters_cell(nb)
    if not nbparams.is_annotated(source):  # an old-form cell: names only
        import papermill

        declared = papermill.inspect_notebook(str(nb))
        if "profile" not in declared:
            raise ConfigError(f"{nb.name}: its parameters cell must define 'profile'")
        _check_names(params, declared, where)
        return False
    spec = nbparams.parse_parameters(source, where=nb.name)
    _check_names(params, spec, where)
    for name, value in params.items():
        if spec[name].default is not None:
            raise ConfigError(f"{where}: parameter {name!r} has the default {spec[name].default!r} in "
                              f"notebooks/{nb.name}, so the profile's {value!r} would never reach the run (a profile "
                              f"fills only parameters left None); make its default None in the notebook's "
                              f"parameters cell and give its value in every profile that runs it")
        spec[name].check(value, where)
    missing = [n for n, p in spec.items() if p.default is None and params.get(n) is None]
    if missing:
        raise ConfigError(f"{where}: parameter {missing[0]!r} is None in the notebook and {profile}.yaml gives "
                          f"no value for it")
    return True


def _check_names(params: dict[str, Any], declared: Any, where: str) -> None:
    unknown = [k for k in params if k not in declared]
    if unknown:
        raise ConfigError(f"{where}: unknown parameter {unknown[0]!r}; the notebook's parameters are: "
                          f"{', '.join(declared)}")


def select(jobs: Sequence[NotebookJob], only: str | None) -> list[NotebookJob]:
    """Keep the notebooks that measure any claim of ``only`` (``"C4,C7"``); all when ``only`` is None. An empty
    ``only`` (``--only ''``, a variable that expanded to nothing) is refused rather than read as everything."""
    if only is None:
        return list(jobs)
    if not str(only).strip(" ,"):
        raise ConfigError("--only is empty: give claim ids such as C4,C7, or leave --only out to run every notebook")
    wanted = set(parse_claim_ids(only))
    picked = [j for j in jobs if wanted & set(j.claims)]
    missing = wanted - {c for j in picked for c in j.claims}
    if missing:
        raise ConfigError(f"claim(s) {', '.join(sorted(missing))} have no notebook in this profile")
    return picked


__all__ = ["NotebookJob", "profile_file", "load_profile", "load_job", "select", "parse_duration", "format_duration"]
