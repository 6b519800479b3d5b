"""LossSpikeGuard: triggers past threshold x running mean, and its actions."""

import logging
import math

import pytest

from macroarch.optim import LossSpikeGuard


def test_triggers_on_a_rise_past_the_threshold_only():
    guard = LossSpikeGuard(threshold=0.15, window=4)
    for loss in (2.0, 2.0, 2.0, 2.0):
        assert guard.observe(loss) is None
    assert guard.observe(2.2) is None  # +10%
    mean = (2.0 * 3 + 2.2) / 4
    trigger = guard.observe(mean * 1.16)  # +16% over the running mean
    assert trigger is not None and trigger.observation == 5 and trigger.running_mean == pytest.approx(mean)
    assert trigger.change == pytest.approx(0.16)
    assert guard.observe(1.0) is None  # a fall is progress
    assert len(guard.triggers) == 1


def test_two_sided_triggers_on_a_fall_too():
    guard = LossSpikeGuard(threshold=0.15, window=2, two_sided=True)
    guard.observe(2.0)
    guard.observe(2.0)
    assert guard.observe(1.6) is not None


def test_no_trigger_before_min_history_but_non_finite_always():
    guard = LossSpikeGuard(threshold=0.15, window=10, min_history=3)
    guard.observe(1.0)
    assert guard.observe(5.0) is None
    assert guard.observe(math.nan) is not None
    assert guard.running_mean == 3.0  # the NaN is not in the mean


def test_lower_lr_halves_then_recovers_over_recovery_steps(caplog):
    guard = LossSpikeGuard(threshold=0.15, window=1, factor=0.5, recovery_steps=4)
    with caplog.at_level(logging.WARNING, logger="macroarch.optim"):
        for loss in (1.0, 1.0, 2.0):
            guard.observe(loss)
    assert guard.lr_factor == 0.5 and "loss spike at observation 2" in caplog.text
    for _ in range(3):
        guard.observe(2.0)
    assert 0.5 < guard.lr_factor < 1.0
    guard.observe(2.0)
    assert guard.lr_factor == pytest.approx(1.0)


def test_skips_reports_skip_triggers_after_an_index():
    guard = LossSpikeGuard(threshold=0.15, window=1, action="skip")
    for loss in (1.0, 2.0, 2.0):
        guard.observe(loss)
    assert guard.skips(after=1) and not guard.skips(after=2)


def test_state_dict_round_trip():
    guard = LossSpikeGuard(window=3)
    for loss in (1.0, 1.0, 1.0, 3.0, 1.0):
        guard.observe(loss)
    twin = LossSpikeGuard(window=3)
    twin.load_state_dict(guard.state_dict())
    assert twin.triggers == guard.triggers and twin.lr_factor == guard.lr_factor
    assert twin.observe(5.0) == guard.observe(5.0)


@pytest.mark.parametrize("kwargs, name", [
    ({"threshold": 0.0}, "threshold"), ({"threshold": -0.15}, "threshold"), ({"window": 0}, "window"),
    ({"action": "explode"}, "action"), ({"factor": 1.0}, "factor"), ({"recovery_steps": 0}, "recovery_steps"),
    ({"min_lr_factor": 0.0}, "min_lr_factor"), ({"min_history": 0}, "min_history"),
])
def test_bad_settings_are_named(kwargs, name):
    with pytest.raises(ValueError, match=name):
        LossSpikeGuard(**kwargs)
