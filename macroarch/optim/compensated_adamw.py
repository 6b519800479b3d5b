"""``CompensatedAdamW``: AdamW with the post's mixed-precision rules (section 4.1) and training guards (5.1).

With every option off this *is* ``torch.optim.AdamW`` (Loshchilov & Hutter 2019), bitwise: the update is
``macroarch.optim.functional.adamw_step_`` (the one AdamW of this project, op for op torch's single-tensor path)
on the parameters and moments as they are, one tensor at a time. The options:

- ``accumulation_steps=k``: call ``step()`` after every backward (every micro-batch); the first ``k - 1``
  calls move ``.grad`` into an accumulation buffer (and set ``.grad`` to None), the ``k``-th updates with
  the *mean* of the ``k`` micro-batch gradients, so the loss need not be divided by ``k`` (DeepSpeed's
  convention of stepping the engine every micro-batch). LR schedulers should be stepped when ``updated`` is
  True, i.e. once per update.
- ``master_weights``: an fp32 master copy for 16-bit (bf16/fp16) parameters, as in Micikevicius et al. 2018
  ("Mixed Precision Training") and Megatron-LM's ``main_grad``: the weight, both moments *and* the gradient
  accumulation buffer are fp32, the update is applied to the master and rounded into the 16-bit parameter.
  Without it everything stays in the parameter's dtype, which is what ``torch.optim.AdamW`` on a
  ``model.bfloat16()`` does (the accumulation buffer is then 16-bit, like autograd's own ``.grad``).
  ``"auto"`` applies the post's rule: a master copy when ``accumulation_steps >= 4``. fp32 parameters are
  their own master and never get a copy. ``MasterWeightAdamW`` (``macroarch.optim.master_adamw``) is this
  optimizer with ``master_weights=True`` and its state created up front.
- ``grad_scale``: ``"norm"`` (or a ``NormGradScaler`` to share, e.g. across DGR groups) is the post's
  ``2^5 / max_grad_norm`` used as a loss scale (``macroarch.optim.scale``): ``opt.scale_loss(loss).backward()``,
  and ``step()`` divides the scale back out (or ``unscale_()`` does it earlier, before gradients are clipped,
  as ``torch.amp.GradScaler.unscale_``). A non-finite gradient also backs the scale off.
- ``delay_compensation``: a ``macroarch.dgr.GradientCompensator`` (DC-ASGD, Zheng et al. 2017) for gradients
  that are applied after the weights have moved: ``opt.snapshot_weights()`` records the weights a gradient is
  computed at (call it before that forward pass); each update takes the oldest snapshot as ``w_then`` and
  corrects the gradient with ``w_now - w_then`` before Adam sees it. No snapshot: the gradient is fresh.
- ``spike_guard``: a ``LossSpikeGuard`` (``macroarch.optim.spike_guard``): its LR factor multiplies every
  group's ``lr`` at the update, a ``"skip"`` trigger skips the update, ``"lower_scale"`` backs off the scale.

**Atomic updates.** An update is all or nothing: an inf or NaN in any gradient of it (any micro-batch), a
non-finite loss returned by the closure, or a non-finite loss seen by the spike guard (whatever its action)
skips it: no parameter, master, moment or step counter changes; the gradients of the window are dropped and
the skip is counted in ``stats["skipped_nonfinite"]`` (saved in ``state_dict``).

``count_lost_updates=True`` counts, at every update, the elements with a due update (nonzero first moment)
whose stored weight (the master if there is one, else the parameter) did not change: updates that round to
zero. ``stats`` holds the counts.

**DTensor parameters** (FSDP2): each update runs on the local shard (``to_local()``) with local state. The
update's decision is the same on every rank (``macroarch.optim.functional.agree``: one ``all_reduce`` of a few
numbers over the parameters' mesh per update): an inf/NaN in any rank's gradient shard, a non-finite closure loss
on any rank, or a guard's skip on any rank skips the update on all of them, and the gradient norm of
``grad_scale`` is the norm of the whole gradient across the shards, so every rank's scale moves alike. What is
not agreed: the spike guard judges the losses it is given (its ``lr_factor``, ``"lower_scale"`` backoff and
trigger log follow them); under data parallelism give it the loss averaged over the ranks (``all_reduce``), or
the ranks' learning rates can differ; ``count_lost_updates`` counts this rank's elements. Plain parameters under
DDP need nothing (their gradients are already reduced, the same on every rank).

**Zero state without a step**: ``init_state()`` creates the state (step 0, zero moments, the fp32 master copy)
of every parameter that has none, e.g. for a checkpoint loader to load into (``macroarch.mvas.interop.dcp``).

Under DGR (``DGRWrapper.optimizer``) each group runs its own instance, and the DGR optimizer's ``state_dict`` /
``load_state_dict`` go through this class's, so masters stay fp32 and the counters, scaler and guard are saved.

Deviations: no amsgrad, no fused kernel, no capturable/differentiable modes.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from macroarch.optim.compensation import GradientCompensator
from macroarch.optim.functional import adamw_step_, agree, check_hyperparameters, local, locally_finite, owned_params
from macroarch.optim.saved_state import check_saved_state, restore_saved_state
from macroarch.optim.scale import NormGradScaler, NormScaleConfig
from macroarch.optim.spike_guard import LossSpikeGuard

LOW_PRECISION = (torch.float16, torch.bfloat16)
MASTER_DTYPE = torch.float32
AUTO_MASTER_MIN_ACCUMULATION = 4
"""The post's rule: keep an fp32 master copy from this many accumulation steps on."""

_FLOAT_STATE = ("master", "exp_avg", "exp_avg_sq", "grad_accum")


def global_grad_norm(grads: Iterable[torch.Tensor]) -> float:
    """The 2-norm of all ``grads`` together, computed in fp32 per tensor; inf/NaN if any element is. These tensors
    only: for the shards of DTensor gradients, ``macroarch.optim.functional.agree`` sums over the ranks."""
    total = 0.0
    for g in grads:
        total += float(torch.linalg.vector_norm(g, dtype=torch.float32)) ** 2
    return math.sqrt(total)


class CompensatedAdamW(torch.optim.Optimizer):
    """AdamW with master weights, gradient accumulation, the 2^5 / max_grad_norm scale, DC-ASGD and a
    loss-spike guard (module docstring).

    Args:
        params: parameters or parameter groups, as for ``torch.optim.AdamW``.
        lr, betas, eps, weight_decay: as for ``torch.optim.AdamW`` (and the same defaults).
        master_weights: ``"auto"`` (fp32 master for 16-bit parameters when ``accumulation_steps >= 4``),
            True (always, for 16-bit parameters) or False (never).
        accumulation_steps: ``step()`` calls (micro-batches) per update, >= 1.
        grad_scale: None, ``"norm"``, a ``NormScaleConfig`` or a (shared) ``NormGradScaler``.
        delay_compensation: None or a ``GradientCompensator``.
        spike_guard: None or a (shared) ``LossSpikeGuard``.
        count_lost_updates: count updates that round to zero into ``stats`` (a copy of each weight per update).
        master_dtype: dtype of the master copies, and of the moments and accumulation buffers of parameters
            that have one (a floating dtype wider than the parameters).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        master_weights: bool | str = "auto",
        accumulation_steps: int = 1,
        grad_scale: None | str | NormScaleConfig | NormGradScaler = None,
        delay_compensation: GradientCompensator | None = None,
        spike_guard: LossSpikeGuard | None = None,
        count_lost_updates: bool = False,
        master_dtype: torch.dtype = MASTER_DTYPE,
    ) -> None:
        lr, betas, eps, weight_decay = check_hyperparameters(lr, betas, eps, weight_decay)
        if not isinstance(master_dtype, torch.dtype) or not master_dtype.is_floating_point:
            raise ValueError(f"master_dtype={master_dtype!r} must be a floating-point torch.dtype")
        if master_weights not in ("auto", True, False):
            raise ValueError(f"master_weights={master_weights!r} must be 'auto', True or False")
        if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
            raise ValueError(f"accumulation_steps={accumulation_steps!r} must be an int >= 1")
        if grad_scale == "norm":
            grad_scale = NormGradScaler()
        elif isinstance(grad_scale, NormScaleConfig):
            grad_scale = NormGradScaler(grad_scale)
        elif grad_scale is not None and not isinstance(grad_scale, NormGradScaler):
            raise ValueError(f"grad_scale={grad_scale!r} must be None, 'norm', a NormScaleConfig or a NormGradScaler")
        if delay_compensation is not None and not isinstance(delay_compensation, GradientCompensator):
            raise ValueError(f"delay_compensation={delay_compensation!r} must be a GradientCompensator or None")
        if spike_guard is not None and not isinstance(spike_guard, LossSpikeGuard):
            raise ValueError(f"spike_guard={spike_guard!r} must be a LossSpikeGuard or None")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        for index, group in enumerate(self.param_groups):  # per-group overrides are checked like the defaults
            check_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"],
                                  f"param_groups[{index}]")
        self.master_rule = master_weights  # (not ``master_weights``: MasterWeightAdamW's method has that name)
        self.master_dtype = master_dtype
        self.accumulation_steps = accumulation_steps
        self.grad_scaler: NormGradScaler | None = grad_scale
        self.compensator = delay_compensation
        self.spike_guard = spike_guard
        self.count_lost_updates = bool(count_lost_updates)
        if spike_guard is not None:
            spike_guard.attach_scaler(grad_scale)
        self._micro = 0  # step() calls since the last update
        self._unscaled = False  # unscale_() has divided this update's gradients by the loss scale already
        self._bad_loss = False  # a closure returned a non-finite loss in this update's window
        self._guard_seen = 0 if spike_guard is None else spike_guard.observations
        self._snapshots: collections.deque[dict[int, torch.Tensor]] = collections.deque()
        self.updated = False  # whether the last step() updated (for LR schedulers under accumulation)
        self.step_was_skipped = False  # whether the last step() was an update that was skipped
        self.stats = {"updates": 0, "skipped_nonfinite": 0, "skipped_spike": 0, "due_elements": 0,
                      "lost_elements": 0, "stalled_elements": 0}

    # ------------------------------------------------------------------------------------ public API
    def uses_master(self, p: torch.Tensor) -> bool:
        """Whether ``p`` gets an fp32 master copy under this optimizer's ``master_weights`` rule."""
        if p.dtype not in LOW_PRECISION or self.master_rule is False:
            return False
        return self.master_rule is True or self.accumulation_steps >= AUTO_MASTER_MIN_ACCUMULATION

    def master_weight(self, p: torch.Tensor) -> torch.Tensor | None:
        """``p``'s fp32 master copy, or None (no copy, or not created yet: copies appear at the first update)."""
        return self.state.get(p, {}).get("master")

    @torch.no_grad()
    def init_state(self, params: Iterable[torch.Tensor] | None = None) -> None:
        """Create the zero state of every parameter (or of ``params``, parameters of this optimizer) that has none
        yet, without stepping: step 0, zero moments (local to a DTensor's shard), and the master copy where
        ``uses_master``, taken from the weight now. What the first update would create; state already there is
        kept. For loaders that fill existing tensors (``torch.distributed.checkpoint``,
        ``macroarch.mvas.interop.dcp``)."""
        params = owned_params(self, params)
        for p in params:
            self._init_state(p)

    @property
    def skipped_nonfinite(self) -> int:
        """Updates skipped for an inf or NaN (``stats["skipped_nonfinite"]``)."""
        return self.stats["skipped_nonfinite"]

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the gradient scale (unchanged without ``grad_scale``); call ``.backward()`` on it."""
        return loss if self.grad_scaler is None else self.grad_scaler.scale(loss)

    @torch.no_grad()
    def unscale_(self) -> None:
        """Divide this update's gradients (``.grad`` and the accumulation buffers) by the loss scale now, e.g.
        before clipping them; ``step()`` then does not divide again. A no-op without ``grad_scale`` or when
        already done for this update."""
        if self.grad_scaler is None or self._unscaled:
            return
        scale = self.grad_scaler.applied_scale
        for p in self._params():
            if p.grad is not None:
                p.grad.div_(scale)
            buffer = self.state.get(p, {}).get("grad_accum")
            if buffer is not None:
                buffer.div_(scale)
        self._unscaled = True

    def skip_update(self, nonfinite: bool = False) -> None:
        """Drop the pending update (gradient buffers, loss-scale flag, weight snapshot, guard observations) without
        touching any weight or moment, as a skipped update does. For a caller that skips the step for the whole
        model (DGR, on a non-finite gradient in another group); ``nonfinite``: these gradients overflowed (counted,
        and the loss scale backs off)."""
        for p in self._params():
            self.state.get(p, {}).pop("grad_accum", None)
        self._micro, self._unscaled, self._bad_loss, self.updated = 0, False, False, False
        self.step_was_skipped = True
        if self.spike_guard is not None:
            self._guard_seen = self.spike_guard.observations
        if self._snapshots:
            self._snapshots.popleft()
        if nonfinite:
            self.stats["skipped_nonfinite"] += 1
            if self.grad_scaler is not None:
                self.grad_scaler.update(math.inf)

    def snapshot_weights(self) -> None:
        """Record the current weights as ``w_then`` of a gradient about to be computed (delay compensation)."""
        if self.compensator is None:
            raise ValueError("snapshot_weights: delay_compensation is None, so no update would use the snapshot")
        self._snapshots.append({i: self._stored(p).detach().clone() for i, p in enumerate(self._params())})

    @property
    def lost_update_fraction(self) -> float:
        """Lost / due elements over all counted updates (``count_lost_updates=True``); NaN before any."""
        due = self.stats["due_elements"]
        return self.stats["lost_elements"] / due if due else math.nan

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One micro-step: accumulate, or (every ``accumulation_steps``-th call) update. Returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            if not locally_finite([torch.as_tensor(loss).detach()]):
                self._bad_loss = True
        self._micro += 1
        self.updated = self.step_was_skipped = False
        if self._micro < self.accumulation_steps:
            for p in self._params():
                if p.grad is not None:
                    self._accumulate(p)
                    p.grad = None
            return loss
        self._micro = 0
        self._update()
        return loss

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state (fp32 masters and moments kept fp32) plus ``"compensated"``: counters,
        pending weight snapshots, and the scaler's, guard's and compensator's state."""
        state = super().state_dict()
        state["compensated"] = {
            "micro_step": self._micro,
            "guard_seen": self._guard_seen,
            "snapshots": [dict(s) for s in self._snapshots],
            "stats": dict(self.stats),
            "grad_scaler": None if self.grad_scaler is None else self.grad_scaler.state_dict(),
            "spike_guard": None if self.spike_guard is None else self.spike_guard.state_dict(),
            "compensator": None if self.compensator is None else self.compensator.state_dict(),
        }
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        extra = state_dict.pop("compensated", None)
        if extra is not None:
            for name in ("grad_scaler", "spike_guard", "compensator"):
                if (extra[name] is None) != (getattr(self, name) is None):
                    raise ValueError(f"state_dict and this optimizer disagree on having a {name}; build the "
                                     f"optimizer with the same options as the one that was saved")
        check_saved_state(self, state_dict, _FLOAT_STATE)  # another model's state: refused before anything changes
        super().load_state_dict(state_dict)
        # torch casts loaded floating state to each parameter's dtype: that would round fp32 masters, moments and
        # accumulation buffers of 16-bit parameters. Put the saved values back, in their saved dtype.
        restore_saved_state(self, state_dict, _FLOAT_STATE)
        params = self._params()
        if extra is None:
            return
        self._micro, self._guard_seen = int(extra["micro_step"]), int(extra["guard_seen"])
        self._snapshots = collections.deque({int(i): w.detach().to(params[int(i)].device, copy=True)
                                             for i, w in s.items()} for s in extra["snapshots"])
        self.stats.update(extra["stats"])
        if self.grad_scaler is not None:
            self.grad_scaler.load_state_dict(extra["grad_scaler"])
        if self.spike_guard is not None:
            self.spike_guard.load_state_dict(extra["spike_guard"])
        if self.compensator is not None:
            self.compensator.load_state_dict(extra["compensator"])

    # ------------------------------------------------------------------------------------- internals
    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _stored(self, p: torch.Tensor) -> torch.Tensor:
        """The weight the update lands in: the master copy if there is one, else the parameter."""
        state = self.state.get(p, {})
        return state["master"] if "master" in state else p

    def _accumulate(self, p: torch.Tensor) -> None:
        """Add ``p.grad`` to the accumulation buffer: fp32 with a master copy, else ``p``'s dtype (as autograd)."""
        state = self.state[p]
        buffer, grad = state.get("grad_accum"), local(p.grad)
        if buffer is None:
            dtype = self.master_dtype if self.uses_master(p) else p.dtype
            state["grad_accum"] = grad.detach().to(dtype, copy=True)
        else:
            buffer.add_(grad)

    def _take_grad(self, p: torch.Tensor) -> torch.Tensor | None:
        """The summed, still scaled gradient of this update (the buffer plus the last micro-batch), or None."""
        buffer = self.state[p].pop("grad_accum", None) if p in self.state else None
        if buffer is None:
            return local(p.grad)
        if p.grad is not None:
            buffer.add_(local(p.grad))
        return buffer

    def _init_state(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if "step" not in state:
            master = self.uses_master(p)
            weight = local(p)
            dtype = self.master_dtype if master else p.dtype
            state["step"] = torch.tensor(0.0, dtype=torch.float32)  # torch.optim.AdamW's (non-capturable) counter
            state["exp_avg"] = torch.zeros_like(weight, dtype=dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(weight, dtype=dtype, memory_format=torch.preserve_format)
            if master:
                state["master"] = weight.detach().to(self.master_dtype, copy=True)
        return state

    def _update(self) -> None:
        params = self._params()
        grads = {i: g for i, p in enumerate(params) if (g := self._take_grad(p)) is not None}
        scale = 1.0 if self.grad_scaler is None or self._unscaled else self.grad_scaler.applied_scale
        divisor = self.accumulation_steps * scale
        skip, nonfinite, self._unscaled = False, self._bad_loss, False
        self._bad_loss = False
        if self.spike_guard is not None:
            skip = self.spike_guard.skips(after=self._guard_seen)
            nonfinite |= self.spike_guard.saw_nonfinite(after=self._guard_seen)
            self._guard_seen = self.spike_guard.observations
        if self.grad_scaler is None and grads:
            nonfinite |= not locally_finite(list(grads.values()))
        # the same decision on every rank of DTensor parameters (one collective per update; nothing without them)
        pairs = [(grads[i], params[i]) for i in grads] if self.grad_scaler is not None else []
        (nonfinite, skip), norm = agree([nonfinite, skip], params, pairs)
        if skip:
            self.stats["skipped_spike"] += 1
        if self.grad_scaler is not None:
            norm /= divisor
            self.grad_scaler.update(norm)
            nonfinite |= not math.isfinite(norm)
        if nonfinite:
            self.stats["skipped_nonfinite"] += 1
        w_then = self._snapshots.popleft() if self._snapshots else None
        self.step_was_skipped = skip or nonfinite
        if skip or nonfinite or not grads:
            return
        lr_factor = 1.0 if self.spike_guard is None else self.spike_guard.lr_factor
        first = 0
        for group in self.param_groups:
            self._step_group(group, first, grads, divisor, w_then, lr_factor)
            first += len(group["params"])
        self.stats["updates"] += 1
        self.updated = True

    def _step_group(self, group: dict[str, Any], first: int, grads: dict[int, torch.Tensor], divisor: float,
                    w_then: dict[int, torch.Tensor] | None, lr_factor: float) -> None:
        """AdamW on one param group, one tensor at a time (the fp32 copy of a 16-bit gradient is a transient of
        one tensor); ``grads`` are keyed by flat parameter index (``first`` is the group's)."""
        beta1, beta2 = group["betas"]
        lr = group["lr"] * lr_factor if lr_factor != 1.0 else group["lr"]
        for i, p in enumerate(group["params"], start=first):
            if i not in grads:
                continue
            state = self._init_state(p)
            weight = local(p)
            target = state.get("master", weight)
            g = grads[i]
            if divisor != 1.0 or g.dtype != target.dtype:
                g = (g.to(self.master_dtype) / divisor).to(target.dtype)  # mean over micro-batches, unscaled
            if w_then is not None:
                g = self.compensator.compensate(f"{i}", g, target, w_then[i])
            if self.count_lost_updates:
                before, weight_before = target.clone(), weight.clone() if target is not weight else None
            state["step"] += 1
            adamw_step_(target, g, state["exp_avg"], state["exp_avg_sq"], step=state["step"].item(), lr=lr,
                        beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"])
            if target is not weight:
                weight.copy_(target)  # round the updated master copy into the 16-bit weight
            if self.count_lost_updates:
                due = state["exp_avg"] != 0  # an update was due: the first moment is nonzero
                self.stats["due_elements"] += int(due.sum())
                self.stats["lost_elements"] += int((due & (target == before)).sum())
                unchanged = weight == (weight_before if weight_before is not None else before)
                self.stats["stalled_elements"] += int((due & unchanged).sum())
