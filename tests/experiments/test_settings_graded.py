"""Notebooks 01, 02 and 04's settings refuse values that would take away what their claims are graded on (the
checks every harness shares are in tests/experiments/test_settings.py)."""

import dataclasses

import pytest

from macroarch.config import ConfigError
from macroarch.experiments import dgr_variance, gradient_explosion, memory_wall
from macroarch.repro.notebook import resolve


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
