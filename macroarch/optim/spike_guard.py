"""Loss-spike guard (post section 5.1): "when the loss fluctuates by more than 15%, trigger automatic scaling".

``LossSpikeGuard.observe(loss)`` compares each loss with the mean of the last ``window`` finite losses and
triggers when ``loss > (1 + threshold) * mean`` (or a non-finite loss). On a trigger it applies ``action``:

- ``"lower_lr"`` (default, our reading of "automatic scaling"): a learning-rate factor, multiplied by
  ``factor`` and then restored geometrically to 1 over ``recovery_steps`` calm observations. Optimizers that
  hold the guard (``CompensatedAdamW(spike_guard=guard)``) multiply every group's ``lr`` by ``lr_factor`` at
  their update, so LR schedulers, which overwrite ``lr``, do not undo it;
- ``"lower_scale"``: the gradient scale of every attached optimizer's ``NormGradScaler`` backs off once;
- ``"skip"``: attached optimizers skip the update that contains the spiking batch (weights untouched).

A non-finite loss always triggers, and an attached optimizer always skips the update that contains it
(``saw_nonfinite``), whatever the action: a NaN loss is no update to take at a lower learning rate.

Each trigger is logged (``logging`` warning on ``macroarch.optim``) and kept in ``triggers``.

Call ``observe`` once per forward pass, before ``backward``: under DGR the groups step inside backward and
must already know the decision. One guard may serve several optimizers (one per DGR group); each applies a
skip once, and the shared ``lr_factor`` and scalers are changed once per trigger.

Deviations from the post: it says "fluctuates"; a fall of 15% is progress (it is common early in training),
so by default only a rise triggers (``two_sided=True`` triggers on both). The reference is a window mean that
includes every finite loss, spikes too, so a lasting change of level stops triggering after about a window.
No trigger fires before ``min_history`` losses have been seen.
"""

from __future__ import annotations

import collections
import logging
import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

log = logging.getLogger("macroarch.optim")

ACTIONS = ("lower_lr", "lower_scale", "skip")


@dataclass(frozen=True)
class SpikeTrigger:
    """One trigger: the observation's index (0-based), its loss, the window mean, the relative change."""

    observation: int
    loss: float
    running_mean: float
    change: float
    action: str


class LossSpikeGuard:
    """Watches the loss against its running mean and acts past ``threshold`` (module docstring).

    Args:
        threshold: relative change that triggers, > 0 (the post's 15% is 0.15).
        window: number of recent finite losses in the running mean, >= 1.
        action: ``"lower_lr"``, ``"lower_scale"`` or ``"skip"``.
        factor: what ``"lower_lr"`` multiplies the LR factor by, in (0, 1).
        recovery_steps: calm observations over which the LR factor returns to 1, >= 1.
        min_lr_factor: floor of the LR factor, in (0, 1].
        min_history: losses seen before the first trigger can fire, >= 1; None is ``window``.
        two_sided: also trigger when the loss falls by more than ``threshold``.
    """

    def __init__(self, threshold: float = 0.15, window: int = 20, action: str = "lower_lr", *, factor: float = 0.5,
                 recovery_steps: int = 50, min_lr_factor: float = 0.01, min_history: int | None = None,
                 two_sided: bool = False) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not (
                math.isfinite(threshold) and threshold > 0):
            raise ValueError(f"threshold={threshold!r} must be a finite number > 0 (0.15 is the post's 15%)")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window={window!r} must be an int >= 1")
        if action not in ACTIONS:
            raise ValueError(f"action={action!r} must be one of {ACTIONS}")
        if not (isinstance(factor, int | float) and 0.0 < factor < 1.0):
            raise ValueError(f"factor={factor!r} must lie in (0, 1)")
        if isinstance(recovery_steps, bool) or not isinstance(recovery_steps, int) or recovery_steps < 1:
            raise ValueError(f"recovery_steps={recovery_steps!r} must be an int >= 1")
        if not (isinstance(min_lr_factor, int | float) and 0.0 < min_lr_factor <= 1.0):
            raise ValueError(f"min_lr_factor={min_lr_factor!r} must lie in (0, 1]")
        min_history = window if min_history is None else min_history
        if isinstance(min_history, bool) or not isinstance(min_history, int) or min_history < 1:
            raise ValueError(f"min_history={min_history!r} must be an int >= 1 or None")
        self.threshold, self.window, self.action = float(threshold), window, action
        self.factor, self.recovery_steps, self.min_lr_factor = float(factor), recovery_steps, float(min_lr_factor)
        self.min_history, self.two_sided = min_history, bool(two_sided)
        self._history: collections.deque[float] = collections.deque(maxlen=window)
        self._seen = 0  # finite losses seen, for min_history
        self.observations = 0
        self.lr_factor = 1.0
        self.triggers: list[SpikeTrigger] = []
        self._scalers: list[Any] = []  # NormGradScalers of attached optimizers, for "lower_scale"

    def __repr__(self) -> str:
        return (f"LossSpikeGuard(threshold={self.threshold}, window={self.window}, action={self.action!r}, "
                f"triggers={len(self.triggers)}, lr_factor={self.lr_factor:.4g})")

    @property
    def running_mean(self) -> float | None:
        return sum(self._history) / len(self._history) if self._history else None

    def attach_scaler(self, scaler: Any) -> None:
        """Called by optimizers built with this guard: the scaler ``"lower_scale"`` backs off (once each)."""
        if scaler is not None and all(s is not scaler for s in self._scalers):
            self._scalers.append(scaler)

    def observe(self, loss: float | torch.Tensor) -> SpikeTrigger | None:
        """Record one loss; return the trigger it caused, or None."""
        value = float(loss.detach().float().item() if isinstance(loss, torch.Tensor) else loss)
        index = self.observations
        self.observations += 1
        mean = self.running_mean
        finite = math.isfinite(value)
        trigger = None
        if not finite or (mean is not None and self._seen >= self.min_history and mean > 0):
            change = math.inf if not finite else value / mean - 1.0
            if not finite or change > self.threshold or (self.two_sided and change < -self.threshold):
                trigger = SpikeTrigger(index, value, math.nan if mean is None else mean, change, self.action)
        if finite:
            self._history.append(value)
            self._seen += 1
        if trigger is None:
            if self.lr_factor < 1.0:  # geometric recovery: 1 / factor over recovery_steps calm observations
                self.lr_factor = min(1.0, self.lr_factor * (1.0 / self.factor) ** (1.0 / self.recovery_steps))
            return None
        self.triggers.append(trigger)
        if self.action == "lower_lr":
            self.lr_factor = max(self.min_lr_factor, self.lr_factor * self.factor)
        elif self.action == "lower_scale":
            for scaler in self._scalers:
                scaler.backoff()
        log.warning("loss spike at observation %d: loss %.4g vs running mean %.4g (%+.1f%%) -> %s", index, value,
                    trigger.running_mean, 100 * change if finite else math.inf, self.action)
        return trigger

    def saw_nonfinite(self, after: int) -> bool:
        """Whether an observation with index >= ``after`` was a non-finite loss."""
        for trigger in reversed(self.triggers):
            if trigger.observation < after:
                return False
            if not math.isfinite(trigger.loss):
                return True
        return False

    def skips(self, after: int) -> bool:
        """Whether an observation with index >= ``after`` triggered a skip (an optimizer's pending update)."""
        for trigger in reversed(self.triggers):  # in observation order: stop at the first one before `after`
            if trigger.observation < after:
                return False
            if trigger.action == "skip":
                return True
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self._history), "seen": self._seen, "observations": self.observations,
                "lr_factor": self.lr_factor, "triggers": [asdict(t) for t in self.triggers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        missing = sorted({"history", "seen", "observations", "lr_factor", "triggers"} - set(state_dict))
        if missing:
            raise ValueError(f"LossSpikeGuard state_dict lacks {missing}; was it made by state_dict()?")
        self._history = collections.deque(state_dict["history"], maxlen=self.window)
        self._seen, self.observations = int(state_dict["seen"]), int(state_dict["observations"])
        self.lr_factor = float(state_dict["lr_factor"])
        self.triggers = [SpikeTrigger(**t) for t in state_dict["triggers"]]
