"""The harnesses' settings against their notebooks: each profile's resolved parameters build them, every parameter
of a notebook is a field (or a run-level key), the fields' defaults are the parameters cell's, and an unknown key
or a bad value is refused by name."""

import dataclasses

import pytest

from macroarch.config import ConfigError
from macroarch.experiments import (
    applications,
    clip,
    comm_bucketing,
    convergence_recipe,
    dgr_variance,
    gradient_explosion,
    hardware_speedups,
    memory_wall,
    mixed_precision,
    mvas_llama,
    zero3_communication,
)
from macroarch.experiments.settings import RUN_KEYS, Settings
from macroarch.repro.notebook import notebook_parameters, resolve

MAY_BE_ZERO = {"seed", "warmup", "warmup_steps", "measured_layers", "bert_large_steps"}
"""0 is meaningful: the first seed, no warmup, "measure the whole model", "skip the probe"."""

HARNESSES = {
    "01_gradient_explosion": gradient_explosion.GradientExplosionSettings,
    "02_memory_wall": memory_wall.MemoryWallSettings,
    "03_zero3_communication": zero3_communication.Zero3Settings,
    "04_dgr_variance": dgr_variance.DGRVarianceSettings,
    "05_mvas_llama": mvas_llama.MVASLlamaSettings,
    "06_mixed_precision": mixed_precision.MixedPrecisionSettings,
    "07_comm_bucketing": comm_bucketing.BucketingSettings,
    "08_convergence_recipe": convergence_recipe.RecipeSettings,
    "09_hardware_speedups": hardware_speedups.HardwareSettings,
    "10_applications": applications.ApplicationsSettings,
    "11_clip": clip.ClipSettings,
}


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
        settings.threads = 2
    numbers = [f.name for f in dataclasses.fields(cls) if f.type == "int" and getattr(settings, f.name) > 0
               and f.name not in MAY_BE_ZERO]
    for name in numbers:  # every size must be positive
        with pytest.raises(ValueError, match=name):
            dataclasses.replace(settings, **{name: 0})


def test_a_missing_parameter_is_named():
    @dataclasses.dataclass(frozen=True)
    class Two(Settings):
        steps: int
        lr: float = 1e-3

    assert Two.from_params({"steps": 2, "profile": "ci", "seed": 0}) == Two(steps=2)
    with pytest.raises(ConfigError, match="'steps'"):
        Two.from_params({"lr": 1e-2})
