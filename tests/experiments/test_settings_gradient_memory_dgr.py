"""Notebooks 01, 02 and 04's settings against their notebooks, as tests/experiments/test_settings.py checks the
others: each profile's resolved parameters build them, every parameter is a field (or a run-level key) with the
parameters cell's default, and an unknown key or a bad value is refused by name."""

import dataclasses

import pytest

from macroarch.config import ConfigError
from macroarch.experiments import dgr_variance, gradient_explosion, memory_wall
from macroarch.experiments.settings import RUN_KEYS
from macroarch.repro.notebook import notebook_parameters, resolve

HARNESSES = {
    "01_gradient_explosion": gradient_explosion.GradientExplosionSettings,
    "02_memory_wall": memory_wall.MemoryWallSettings,
    "04_dgr_variance": dgr_variance.DGRVarianceSettings,
}
MAY_BE_ZERO = {"seed", "measured_layers", "bert_large_steps"}
"""0 is meaningful: the first seed, "measure the whole model", "skip the probe"."""


def _frozen(value):
    return tuple(value) if isinstance(value, list) else value


@pytest.mark.parametrize("profile", ["ci", "cpu", "gpu"])
@pytest.mark.parametrize("stem", HARNESSES)
def test_every_profile_builds_the_settings(stem, profile):
    params = resolve(stem, {"profile": profile})
    settings = HARNESSES[stem].from_params(params)
    fields = {f.name for f in dataclasses.fields(settings)}
    assert set(params) - fields <= RUN_KEYS
    for name in fields:
        assert getattr(settings, name) == _frozen(params[name]), name


@pytest.mark.parametrize("stem", HARNESSES)
def test_fields_are_the_notebooks_parameters_with_its_defaults(stem):
    cell = notebook_parameters(stem)
    fields = {f.name: f for f in dataclasses.fields(HARNESSES[stem])}
    assert set(fields) <= set(cell), f"fields the parameters cell of {stem} lacks: {set(fields) - set(cell)}"
    for name, p in cell.items():
        assert name in fields or name in RUN_KEYS, f"{stem}: parameter {name!r} is neither a field nor run-level"
        if name in fields and fields[name].default is not dataclasses.MISSING and p.default not in (None, "auto"):
            assert fields[name].default == _frozen(p.default), name


@pytest.mark.parametrize("stem", HARNESSES)
def test_unknown_keys_and_bad_values_are_named(stem):
    cls = HARNESSES[stem]
    params = resolve(stem, {"profile": "ci"})
    with pytest.raises(ConfigError, match="'stepz'"):
        cls.from_params(dict(params, stepz=3))
    settings = cls.from_params(params)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.seed = 2
    numbers = [f.name for f in dataclasses.fields(cls) if f.type == "int" and getattr(settings, f.name) > 0
               and f.name not in MAY_BE_ZERO]
    assert numbers
    for name in numbers:  # every size must be positive
        with pytest.raises(ValueError, match=name):
            dataclasses.replace(settings, **{name: 0})


def test_what_each_claim_is_graded_on_cannot_be_configured_away():
    ge = gradient_explosion.GradientExplosionSettings.from_params(resolve("01_gradient_explosion", {"profile": "ci"}))
    with pytest.raises(ConfigError, match="c3_thresholds"):
        dataclasses.replace(ge, c3_thresholds=(0.5, 2.0))
    with pytest.raises(ConfigError, match="sigmas"):
        dataclasses.replace(ge, sigmas=(1.0,))
    dv = dgr_variance.DGRVarianceSettings.from_params(resolve("04_dgr_variance", {"profile": "ci"}))
    with pytest.raises(ConfigError, match="variance_batches"):
        dataclasses.replace(dv, variance_batches=1)
    with pytest.raises(ConfigError, match="measure_every"):
        dataclasses.replace(dv, measure_every=dv.steps + 1)
    mw = memory_wall.MemoryWallSettings.from_params(resolve("02_memory_wall", {"profile": "ci"}))
    with pytest.raises(ConfigError, match="precisions"):
        dataclasses.replace(mw, precisions=("bf16_mixed",))
