"""Per-group updates scheduled during backward (post section 3.1, DGR's interleaved group updates).

``DGROptimizer`` puts a ``Tensor.register_post_accumulate_grad_hook`` on every parameter of a ``Grouping``
(``macroarch.dgr.grouping``). When the last gradient of a group has been accumulated, the group is updated
right away, while backward carries on with the layers below:

- ``mode="sync"``: the group's optimizer steps at once and its gradients are released (set to None), so
  peak gradient memory is about the largest group plus the tensor in flight, not the whole model. The
  result equals ordinary training exactly: a group completes only after every node that reads its
  parameters has run, so updating it in place cannot change what backward computes below it. The total
  peak falls only where gradients are part of it: when activations dominate, it is at the end of forward.
- ``mode="interleaved"``: group g's gradient is applied ``delays[g]`` optimizer steps later, as a pipeline
  whose groups run asynchronously would apply it (default: g's index in backward order, so the output side
  is fresh and the input side most stale, as in PipeDream). Each gradient is queued with a copy of the
  group's weights at the time it was computed (``w_then``); when it comes due, the ``GradientCompensator``
  (DC-ASGD, ``macroarch.optim.compensation``) corrects it with ``w_now - w_then``, or it is applied as it is
  when no compensator is given. Memory: group g holds ``delays[g]`` gradients and weight copies, i.e.
  ``2 * delays[g]`` times its parameter bytes; with the default delays and G equal groups that is about
  ``G - 1`` times the model. For the first ``delays[g]`` steps group g applies nothing (pipeline fill).
  ``delays[g] == 0`` is the sync update. **Delays count optimizer steps, not gradients**: every update
  (every ``step()``, after ``accumulation_steps`` backward passes) advances every group's queue by one, so a
  gradient computed at update t is applied at update ``t + delays[g]`` exactly, also for a group that gets
  gradients only on some steps (a step without one queues nothing to apply, and applies what is due).

Optimizer structure: one instance of the user's optimizer class per group (so a group steps alone, with any
``torch.optim.Optimizer``), all sharing this object's ``state`` dict, and whose single param group *is*
``self.param_groups[g]``: LR schedulers see torch's own param groups, one per DGR group, and
``param_groups[g]["max_grad_norm"]`` is the group's clipping norm. ``state_dict()`` has torch's layout and
``load_state_dict()`` takes it, but both go through each per-group optimizer's own ``state_dict`` /
``load_state_dict`` (whatever its class): torch's generic loader would cast ``MVASAdamW``'s fp8 moments and
``CompensatedAdamW``'s fp32 masters to the parameter dtype and drop what those optimizers keep beside the state
(the stochastic-rounding seed, loss scale, counters). So a run stopped after step k and resumed from
``state_dict()`` continues bitwise as the uninterrupted one, with the moments in their stored format.

Gradient accumulation (``accumulation_steps=k``): only the k-th backward since the last ``step()`` updates;
before it, gradients accumulate in ``.grad`` as usual and ``step()``/``zero_grad()`` do nothing, so a plain
``loss.backward(); opt.step(); opt.zero_grad()`` loop accumulates unchanged. A backward after the k-th
without a ``step()`` raises. ``step()`` updates whatever backward did not (groups that were not complete:
unused or partly used parameters, or gradients set by hand) and returns the closure's loss.

Clipping: global-norm clipping needs every gradient before the first update, which is exactly what updating
during backward gives up; so clipping is per group (``clip_mode="per_group"``): each group's gradient, as
backward produced it (in interleaved mode before it is queued), is clipped with ``clip_grad_norm_`` to its
group's ``max_grad_norm``.

Failure safety. Non-finite values: a group's gradients are checked before it steps (one float32 sum per
tensor); an inf or NaN gradient anywhere, or a non-finite loss (``observe_loss(loss)`` before backward, or a
``step(closure)``), skips the whole step: the group and every group after it update nothing, and with
``atomic_steps=True`` the groups updated earlier in the same step are rolled back, so weights (packed or
not), optimizer state, step counters, delay queues and compensator state are bitwise as before the step.
The skip is counted in ``skipped_nonfinite`` (saved in ``state_dict``), and per-group optimizers that keep
per-update bookkeeping are told (``skip_update(nonfinite=...)``: ``CompensatedAdamW`` backs its loss scale off
once, for the group whose gradient overflowed). Exceptions: if a group's step
raises, with ``atomic_steps=True`` the whole step is rolled back the same way, ``.grad`` keeps the gradient
the failing group held (clipped, if clipping is on), and a RuntimeError naming the group is raised from the
original error (out of ``loss.backward()`` when it happened there).
Cost of ``atomic_steps=True``: before a group steps its parameters, optimizer state, queue and compensator
state are copied, and the copies of every group updated in a step live until the step ends (``step()``): about
three times the model's parameter bytes at the end of backward for fp32 AdamW, a third of that for
``MVASAdamW``'s packed weights and fp8 moments, and copy time for the whole model every step.
``atomic_steps=False`` keeps no copies: a non-finite gradient then skips its group and the ones after it,
earlier groups keep their update, and an exception may leave the failing group partly updated.

Reporting: ``grad_norm()`` is the norm of the whole gradient of the current step (before clipping), from the
norms of the groups already updated (measured as they stepped, when clipping or ``track_grad_norm`` is on) and
of the gradients still held; HF Trainer integration logs it (``macroarch.integrations``). An optimizer that
scales the loss (``CompensatedAdamW(grad_scale=...)``) has its gradients unscaled (its ``unscale_()``) before
they are clipped or measured, so ``max_grad_norm`` applies to the true gradient.

Sources: updating inside backward with post-accumulate-grad hooks is the technique of PyTorch's tutorial
"How to save memory by fusing the optimizer step into the backward pass"; the per-stage staleness is that
of PipeDream (Narayanan et al. 2019, SOSP); the compensation is DC-ASGD (Zheng et al. 2017, ICML).

Deviations from the post: it describes asynchronous updates on GPU streams; here updates run on the
backward thread, in order, and "interleaved" is the staleness such a pipeline would have, simulated
exactly. Backward is assumed to run on one thread (CPU, or one GPU); hooks registered on the same tensors
after DGR's still see the gradient: a group's gradients are released when the next gradient arrives or
backward ends.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import math
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from macroarch._compat.autograd import at_backward_end, backward_pass_id, is_view
from macroarch._compat.subclass import torch_function_disabled
from macroarch.dgr.grouping import Grouping
from macroarch.optim.compensation import GradientCompensator
from macroarch.optim.functional import all_finite, finite_checked, local

MODES = ("sync", "interleaved")
CLIP_MODES = ("per_group",)


@dataclass(frozen=True)
class PipelineConfig:
    """How DGR schedules group updates.

    Attributes:
        mode: ``"sync"`` (update each group as soon as its gradient is complete) or ``"interleaved"``
            (apply it ``delays[g]`` steps later, compensated).
        delays: interleaved only: one int for every group, one per group, or None for the group's index in
            backward order.
        accumulation_steps: backward passes per update (gradient accumulation), >= 1.
        max_grad_norm: per-group clipping norm: None (no clipping), one number for every group, or one per
            group (None entries skip that group).
        clip_mode: only ``"per_group"``; global-norm clipping cannot be done before backward ends.
        atomic_steps: copy a group's parameters and optimizer state before it steps and restore them if the
            step raises.
    """

    mode: str = "sync"
    delays: int | tuple[int, ...] | None = None
    accumulation_steps: int = 1
    max_grad_norm: float | tuple[float | None, ...] | None = None
    clip_mode: str = "per_group"
    atomic_steps: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} is not a DGR mode; use one of {MODES}")
        if self.delays is not None:
            if self.mode != "interleaved":
                raise ValueError(f"delays={self.delays!r} only applies to mode='interleaved' (mode={self.mode!r})")
            many = not isinstance(self.delays, int)
            delays = tuple(self.delays) if many else (self.delays,)
            if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in delays):
                raise ValueError(f"delays={self.delays!r} must be an int >= 0 or a sequence of them")
            object.__setattr__(self, "delays", delays if many else self.delays)
        k = self.accumulation_steps
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"accumulation_steps={k!r} must be a positive int")
        if self.max_grad_norm is not None:
            many = isinstance(self.max_grad_norm, Sequence)
            norms = tuple(self.max_grad_norm) if many else (self.max_grad_norm,)
            if any(n is not None and (isinstance(n, bool) or not isinstance(n, int | float) or not
                                      (math.isfinite(n) and n > 0)) for n in norms):
                raise ValueError(f"max_grad_norm={self.max_grad_norm!r} must be a positive number, None, or a "
                                 "sequence of them (one per group)")
            object.__setattr__(self, "max_grad_norm", norms if many else self.max_grad_norm)
        if self.clip_mode != "per_group":
            raise ValueError(f"clip_mode={self.clip_mode!r} is not supported; use one of {CLIP_MODES}: DGR updates "
                             "groups during backward, before the global gradient norm is known")
        if not isinstance(self.atomic_steps, bool):
            raise ValueError(f"atomic_steps={self.atomic_steps!r} must be True or False")

    def per_group(self, name: str, n_groups: int) -> tuple[Any, ...]:
        """``delays`` or ``max_grad_norm`` expanded to one value per group (checked against ``n_groups``)."""
        value = getattr(self, name)
        if name == "delays" and value is None:
            return tuple(range(n_groups)) if self.mode == "interleaved" else (0,) * n_groups
        if not isinstance(value, tuple):
            return (value,) * n_groups
        if len(value) != n_groups:
            raise ValueError(f"{name} has {len(value)} entries but the grouping has {n_groups} groups")
        return value


def _on_grad_ready(ref: weakref.ref, param: torch.Tensor) -> None:
    optimizer = ref()  # a weak reference: hooks must not keep a discarded optimizer alive, nor call it
    if optimizer is not None:
        optimizer._grad_ready(param)


def _remove(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


class DGROptimizer(torch.optim.Optimizer):
    """Updates each DGR group during backward (module docstring); a ``torch.optim.Optimizer``.

    Args:
        grouping: the groups (``build_groups`` / ``group_parameters``).
        optimizer_cls: an optimizer class or factory, called once per group as
            ``optimizer_cls([{"params": group_params}], **optimizer_kwargs)``; must return a
            ``torch.optim.Optimizer`` with one param group.
        config: the schedule; default ``PipelineConfig()`` (sync).
        compensator: interleaved only: corrects delayed gradients; None applies them as they are.
        **optimizer_kwargs: passed to ``optimizer_cls`` (``lr=...``).
    """

    # Managed (packed) weights are written only by the per-group optimizers, each checked when it is built.
    supports_mvas_weights = True

    def __init__(self, grouping: Grouping, optimizer_cls: Callable[..., torch.optim.Optimizer],
                 config: PipelineConfig | None = None, compensator: GradientCompensator | None = None,
                 **optimizer_kwargs: Any) -> None:
        config = PipelineConfig() if config is None else config
        if not isinstance(grouping, Grouping):
            raise ValueError(f"grouping={grouping!r} must be a Grouping (from build_groups or group_parameters)")
        if compensator is not None and config.mode != "interleaved":
            raise ValueError(f"compensator={compensator!r} only applies to mode='interleaved' (mode={config.mode!r})")
        if not callable(optimizer_cls):
            raise ValueError(f"optimizer_cls={optimizer_cls!r} must be an optimizer class or factory")
        name = getattr(optimizer_cls, "__name__", repr(optimizer_cls))
        norms = config.per_group("max_grad_norm", len(grouping))
        self._delays = config.per_group("delays", len(grouping))
        self._inner: list[torch.optim.Optimizer] = []
        for group in grouping:
            try:
                inner = optimizer_cls([{"params": list(group.params)}], **optimizer_kwargs)
            except Exception as exc:
                raise ValueError(f"optimizer_cls {name} failed to build the optimizer of DGR group {group.index} "
                                 f"({group.label}): {type(exc).__name__}: {exc}") from exc
            if not isinstance(inner, torch.optim.Optimizer) or len(inner.param_groups) != 1:
                raise ValueError(f"optimizer_cls {name} must return a torch.optim.Optimizer with one param group, "
                                 f"got {type(inner).__name__} for DGR group {group.index}")
            _check_packed_weights(inner, group)
            inner.param_groups[0]["max_grad_norm"] = norms[group.index]
            self._inner.append(inner)
        self._building = True
        super().__init__([inner.param_groups[0] for inner in self._inner],
                         {**self._inner[0].defaults, "max_grad_norm": None})
        self._building = False
        self._relink()
        self.grouping, self.config, self.compensator = grouping, config, compensator
        self._group_of = {p: group.index for group in grouping for p in group.params}
        self._pending: list[collections.deque] = [collections.deque() for _ in grouping]  # (grads, w_then)
        self._micro = 0  # backward passes completed since the last update
        self._done: set[int] = set()  # groups updated in the current update
        self._arrived: list[set[torch.Tensor]] = [set() for _ in grouping]
        self._release: list[torch.Tensor] = []  # parameters whose gradients are freed at the next arrival
        self._task = -1  # the graph task (backward pass) the hooks last saw
        self._suspended = False
        self._poisoned = False  # this step saw a non-finite gradient or loss: nothing more is updated
        self._rollback: list[tuple[int, tuple[Any, ...]]] = []  # (group, copies) updated in this step
        self._norm_sq = 0.0  # squared gradient norms of the groups updated in this step
        self.track_grad_norm = False  # measure each group's gradient norm as it steps (grad_norm())
        self.skipped_nonfinite = 0
        self.step_was_skipped = False  # whether the last step() skipped the update (LR schedulers may hold back)
        ref = weakref.ref(self)
        hook = functools.partial(_on_grad_ready, ref)  # no Python frame of its own, on every parameter's gradient
        self._handles = [p.register_post_accumulate_grad_hook(hook) for p in self._group_of]
        self._finalizer = weakref.finalize(self, _remove, self._handles)

    # ------------------------------------------------------------------------------- torch.optim API
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not self._building:
            raise NotImplementedError("DGROptimizer's param groups are the DGR groups; rebuild the grouping and "
                                      "the optimizer to train more parameters")
        super().add_param_group(param_group)

    def _relink(self) -> None:
        """Point each per-group optimizer at its param group here and at the shared state."""
        for inner, group in zip(self._inner, self.param_groups):
            inner.param_groups = [group]
            inner.state = self.state

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update the groups backward left (all of them if no hooked backward ran); no-op while accumulating."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.step_was_skipped = False
        if 0 < self._micro < self.config.accumulation_steps:
            return loss
        if loss is not None:
            self.observe_loss(loss)
        self._free_released()
        for index in range(len(self._inner)):
            if index not in self._done:
                self._update(index)
        self._end_step()
        return loss

    def _end_step(self) -> None:
        self.step_was_skipped = self._poisoned
        self._free_released()
        self._done.clear()
        self._micro = 0
        self._poisoned = False
        self._rollback.clear()
        self._norm_sq = 0.0

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients, except between the backward passes of one accumulation."""
        if 0 < self._micro < self.config.accumulation_steps:
            return
        self._free_released()
        with torch_function_disabled():  # ``.grad`` of a managed weight needs no torch function
            super().zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """torch's layout (one param group per DGR group, parameters numbered in group order) assembled from each
        per-group optimizer's own ``state_dict()``, plus ``"dgr"``: the delay queues, the compensator, the step
        counters, and under ``"inner"`` what each per-group optimizer adds beside its state and param group
        (``MVASAdamW``'s seed, ``CompensatedAdamW``'s counters, scaler and guard)."""
        state_dict = super().state_dict()  # torch's hooks; its state and groups are replaced by the inner ones
        state, groups, inner_extras = {}, [], []
        first = 0
        for index in range(len(self._inner)):
            with self._alone(index) as inner:
                own = inner.state_dict()
            (group,) = own["param_groups"]
            renumber = {local: first + k for k, local in enumerate(group["params"])}
            groups.append({**group, "params": [renumber[i] for i in group["params"]]})
            state.update({renumber[i]: value for i, value in own["state"].items()})
            inner_extras.append({k: v for k, v in own.items() if k not in ("state", "param_groups")})
            first += len(group["params"])
        state_dict["state"], state_dict["param_groups"] = state, groups
        state_dict["dgr"] = {
            "delays": list(self._delays),
            "micro_step": self._micro,
            "done": sorted(self._done),
            "pending": [[None if e is None else {"grads": e[0], "w_then": e[1]} for e in queue]
                        for queue in self._pending],
            "compensator": None if self.compensator is None else self.compensator.state_dict(),
            "skipped_nonfinite": self.skipped_nonfinite,
            "inner": inner_extras,
        }
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict()``: each group's slice goes through its per-group optimizer's own
        ``load_state_dict`` (which keeps packed moments and master copies in their stored dtype; torch's loader
        would cast them to the parameter dtype), then DGR's queues and counters. All or nothing: the layout is
        checked first, and if a per-group load raises, every per-group optimizer is put back as it was and the
        error is re-raised naming the group. A state dict without ``"dgr"`` (torch's layout alone) loads the
        per-group state and keeps DGR's queues and counters."""
        state_dict = dict(state_dict)
        dgr = state_dict.pop("dgr", None)
        slices = self._check_loadable(state_dict, dgr)
        previous = []
        for index in range(len(self._inner)):
            with self._alone(index) as inner:
                previous.append(inner.state_dict())
        state: collections.defaultdict = collections.defaultdict(dict)
        groups: list[dict[str, Any]] = []
        loaded = 0
        try:
            for index, own in enumerate(slices):
                with self._alone(index) as inner:
                    inner.load_state_dict(own)
                    loaded += 1
                    state.update(inner.state)
                    groups.append(inner.param_groups[0])
        except Exception as exc:
            for index in range(loaded + 1):
                with self._alone(index) as inner:
                    inner.load_state_dict(previous[index])
            group = self.grouping.groups[loaded]
            raise ValueError(f"DGR group {loaded} ({group.label}): {type(self._inner[loaded]).__name__}."
                             f"load_state_dict raised {type(exc).__name__}: {exc}; nothing was loaded") from exc
        self.state, self.param_groups = state, groups
        self._relink()
        if dgr is None:
            return
        self._micro, self._done = int(dgr["micro_step"]), set(dgr["done"])
        self.skipped_nonfinite = int(dgr.get("skipped_nonfinite", 0))
        for index, (queue, saved) in enumerate(zip(self._pending, dgr["pending"])):
            params = self.grouping.groups[index].params
            queue.clear()
            for entry in saved:
                if entry is None:  # a step on which the group had no gradient
                    queue.append(None)
                    continue
                queue.append(([None if g is None else g.detach().to(p.device, copy=True)
                               for g, p in zip(entry["grads"], params)],
                              [w.detach().to(p.device, copy=True) for w, p in zip(entry["w_then"], params)]))
        if self.compensator is not None:
            self.compensator.load_state_dict(dgr["compensator"])

    def _check_loadable(self, state_dict: dict[str, Any], dgr: dict[str, Any] | None) -> list[dict[str, Any]]:
        """Check ``state_dict``'s layout against this optimizer before anything is loaded; returns each group's
        slice in the per-group optimizer's own layout (its parameters numbered from 0)."""
        saved_groups = state_dict.get("param_groups")
        if not isinstance(saved_groups, list) or not isinstance(state_dict.get("state"), dict):
            raise ValueError("state_dict has no 'state' and 'param_groups': pass what DGROptimizer.state_dict() "
                             "returned")
        if len(saved_groups) != len(self._inner):
            raise ValueError(f"state_dict has {len(saved_groups)} param groups; this DGR optimizer has "
                             f"{len(self._inner)} groups: build it with the same grouping (model, group_size)")
        for index, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"state_dict's param group {index} has {len(saved['params'])} parameters; DGR group "
                                 f"{index} ({self.grouping.groups[index].label}) has {len(group['params'])}: build the "
                                 "optimizer with the same grouping")
        extras: list[dict[str, Any]] = [{} for _ in self._inner]
        if dgr is not None:
            if list(dgr["delays"]) != list(self._delays) or len(dgr["pending"]) != len(self._pending):
                raise ValueError(f"state_dict was saved with delays {dgr['delays']}; this optimizer has "
                                 f"{list(self._delays)}: build it with the same grouping and delays")
            if (dgr["compensator"] is None) != (self.compensator is None):
                raise ValueError("state_dict and this optimizer disagree on having a compensator")
            extras = dgr.get("inner", extras)  # saved before per-group delegation: torch's layout alone
            if len(extras) != len(self._inner):
                raise ValueError(f"state_dict's 'dgr.inner' has {len(extras)} entries for {len(self._inner)} groups")
        slices = []
        for saved, extra in zip(saved_groups, extras):
            ids = saved["params"]
            own_state = {k: state_dict["state"][i] for k, i in enumerate(ids) if i in state_dict["state"]}
            slices.append({**extra, "state": own_state, "param_groups": [{**saved, "params": list(range(len(ids)))}]})
        return slices

    def init_state(self, params: Any = None) -> None:
        """Create the zero state of every parameter that has none, without stepping (the per-group optimizers'
        ``init_state``, e.g. for ``macroarch.mvas.interop.dcp.load``); raises if a per-group optimizer has none."""
        wanted = None if params is None else {id(p) for p in params}
        for index, inner in enumerate(self._inner):
            init = getattr(inner, "init_state", None)
            if init is None:
                raise ValueError(f"DGR group {index}: {type(inner).__name__} has no init_state(); take one step first")
            own = [p for p in self.param_groups[index]["params"] if wanted is None or id(p) in wanted]
            if own:
                init(own)

    @contextlib.contextmanager
    def _alone(self, index: int) -> Iterator[torch.optim.Optimizer]:
        """Per-group optimizer ``index`` with a state dict of its own parameters only, as torch's ``state_dict`` /
        ``load_state_dict`` need; relinked to the shared state after."""
        inner = self._inner[index]
        inner.state = collections.defaultdict(
            dict, {p: self.state[p] for p in self.param_groups[index]["params"] if p in self.state})
        try:
            yield inner
        finally:
            self._relink()

    # ------------------------------------------------------------------------------------ DGR API
    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Backward passes inside only accumulate gradients (for measurements: nothing is updated)."""
        previous, self._suspended = self._suspended, True
        try:
            yield
        finally:
            self._suspended = previous

    def close(self) -> None:
        """Remove the hooks; the optimizer then steps only through ``step()``."""
        _remove(self._handles)

    def observe_loss(self, loss: float | torch.Tensor) -> bool:
        """Tell the optimizer the loss of the coming (or just finished) backward; a non-finite one skips the
        whole step (module docstring). Returns whether it was finite."""
        finite = math.isfinite(float(loss.detach().float().sum() if torch.is_tensor(loss) else loss))
        if not finite:
            self._poison()
        return finite

    @torch.no_grad()
    def grad_norm(self) -> float:
        """The 2-norm of the current step's whole gradient before clipping: groups already updated (measured as
        they stepped, with clipping or ``track_grad_norm``) and gradients still held; NaN after a skip."""
        if self._poisoned:
            return math.nan
        held = [p.grad for index, group in enumerate(self.grouping.groups) if index not in self._done
                for p in group.params if p.grad is not None]
        rest = float(torch.nn.utils.get_total_norm(held)) ** 2 if held else 0.0
        return math.sqrt(self._norm_sq + rest)

    # ---------------------------------------------------------------------------------- scheduling
    def _grad_ready(self, param: torch.Tensor) -> None:
        if self._suspended:
            return
        task = backward_pass_id()
        if task != self._task:  # the first gradient of a new backward pass
            self._task = task
            if self._micro >= self.config.accumulation_steps:
                raise RuntimeError(
                    f"DGR: backward pass {self._micro + 1} since the last update with accumulation_steps="
                    f"{self.config.accumulation_steps}; call opt.step() (and opt.zero_grad()) after every "
                    f"{self.config.accumulation_steps}th backward, or use opt.suspended() for extra passes; under "
                    f"accelerate's accumulate() or Trainer's gradient_accumulation_steps=k, build "
                    f"DGRWrapper(..., accumulation_steps=k) (MacroTrainer does)"
                )
            self._arrived = [set() for _ in self._inner]
            self._done.clear()  # left over only if an earlier backward was aborted before step()
            at_backward_end(self._backward_done)
        self._free_released()
        if self._micro + 1 < self.config.accumulation_steps:
            return
        index = self._group_of[param]
        arrived = self._arrived[index]
        arrived.add(param)
        if len(arrived) == len(self.param_groups[index]["params"]) and index not in self._done:
            with torch.no_grad():
                self._update(index)

    def _backward_done(self) -> None:
        self._micro += 1
        self._free_released()

    def _free_released(self) -> None:
        if self._release:
            with torch_function_disabled():  # ``.grad = None`` needs no subclass's torch function
                for p in self._release:
                    p.grad = None
            self._release.clear()

    def _update(self, index: int) -> None:
        """Check, clip, (delay and compensate,) and step group ``index``; all-or-nothing per step when
        ``atomic_steps`` (module docstring)."""
        group = self.grouping.groups[index]
        params, inner = group.params, self._inner[index]
        with torch_function_disabled():  # reading ``.grad`` needs no subclass's torch function
            fresh = [p.grad for p in params]
        delay, queue = self._delays[index], self._pending[index]
        if self._poisoned:
            _skip(inner, nonfinite=False)
            self._finish(index, params)
            return
        if all(g is None for g in fresh) and not delay:
            return
        if not all_finite(fresh, over=params):  # every rank's shards: under FSDP2 all ranks skip or all step
            self._poison()
            _skip(inner, nonfinite=True)
            self._finish(index, params)
            return
        max_norm = self.param_groups[index]["max_grad_norm"]
        checked = fresh  # finite: the inner optimizer need not sum them again (finite_checked)
        if any(g is not None for g in fresh) and (max_norm is not None or self.track_grad_norm):
            unscale = getattr(inner, "unscale_", None)
            if unscale is not None:
                unscale()  # the true gradient is clipped and measured, not the loss-scaled one
                checked = []  # a division by the loss scale: the inner optimizer checks what it reads
            present = [p for p in params if p.grad is not None]
            if max_norm is not None:
                self._norm_sq += float(torch.nn.utils.clip_grad_norm_(present, max_norm)) ** 2
            elif self.track_grad_norm:
                self._norm_sq += float(torch.nn.utils.get_total_norm([p.grad for p in present])) ** 2
            fresh = [p.grad for p in params]
        # The weights this gradient was computed at: the group has not moved since this step's forward.
        entry = ([_owned(g) for g in fresh], [p.detach().clone() for p in params]) \
            if delay and any(g is not None for g in fresh) else None
        saved = self._snapshot(index) if self.config.atomic_steps else None
        if delay and len(queue) < delay:  # pipeline fill: nothing is due yet
            queue.append(entry)
        else:
            due = queue.popleft() if delay else None
            if delay:
                queue.append(entry)
            try:
                if not delay or due is not None:
                    if delay:
                        stale, w_then = due
                        grads = stale if self.compensator is None else self.compensator(group.names, stale, params,
                                                                                        w_then)
                        for p, g in zip(params, grads):
                            p.grad = g
                    with finite_checked(checked):  # a delayed step reads other tensors, which are checked then
                        inner.step()
            except Exception as exc:
                if saved is not None:
                    self._rollback.append((index, saved))
                    self._roll_back()
                for p, g in zip(params, fresh):
                    p.grad = g
                outcome = ("the whole step was rolled back (parameters, optimizer state, queues)" if saved is not None
                           else "atomic_steps=False, so its parameters may be partly updated")
                raise RuntimeError(f"DGR group {index} ({group.label}): {type(inner).__name__}.step() raised "
                                   f"{type(exc).__name__}: {exc}; {outcome}") from exc
        if saved is not None:
            self._rollback.append((index, saved))
        self._finish(index, params)

    def _poison(self) -> None:
        """A non-finite gradient or loss in this step: undo what it updated, skip what is left."""
        if not self._poisoned:
            self.skipped_nonfinite += 1
        self._poisoned = True
        self._roll_back()

    def _roll_back(self) -> None:
        for index, saved in reversed(self._rollback):
            self._restore(index, saved)
        self._rollback.clear()
        self._norm_sq = 0.0

    def _finish(self, index: int, params: Sequence[torch.Tensor]) -> None:
        self._done.add(index)
        self._release.extend(params)  # freed at the next arrival, after later hooks on these tensors ran

    def _snapshot(self, index: int) -> tuple[Any, ...]:
        group = self.grouping.groups[index]
        state = {p: {k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                     for k, v in self.state[p].items()} for p in group.params if p in self.state}
        options = {k: v for k, v in self.param_groups[index].items() if k != "params"}
        meansquare = None if self.compensator is None else {n: self.compensator.meansquare.get(n) for n in group.names}
        return [p.detach().clone() for p in group.params], state, options, meansquare, list(self._pending[index])

    def _restore(self, index: int, saved: tuple[Any, ...]) -> None:
        values, state, options, meansquare, queue = saved
        self._pending[index].clear()
        self._pending[index].extend(queue)
        params = self.grouping.groups[index].params
        with torch.no_grad():
            for p, value in zip(params, values):
                p.copy_(value)
        for p in params:
            if p in state:
                self.state[p] = state[p]
            else:
                self.state.pop(p, None)
        self.param_groups[index].update(options)
        for name, value in (meansquare or {}).items():
            if value is None:
                self.compensator.meansquare.pop(name, None)
            else:
                self.compensator.meansquare[name] = value


def _owned(grad: torch.Tensor | None) -> torch.Tensor | None:
    """A gradient to queue for a later step: itself, or a copy where it is a view into another tensor's memory
    (DDP with ``gradient_as_bucket_view=True`` makes ``.grad`` a view into its bucket, which the next backward pass
    overwrites: the queued gradient would silently become the next step's)."""
    return grad.clone() if grad is not None and is_view(local(grad)) else grad  # a DTensor: its shard's


def _skip(inner: torch.optim.Optimizer, nonfinite: bool) -> None:
    """Let a per-group optimizer with bookkeeping per update (``CompensatedAdamW.skip_update``: loss scale, guard,
    accumulation) know that DGR skips its update in this step."""
    skip_update = getattr(inner, "skip_update", None)
    if skip_update is not None:
        skip_update(nonfinite=nonfinite)


def _check_packed_weights(inner: torch.optim.Optimizer, group: Any) -> None:
    """A per-group optimizer that cannot write packed (MVAS) weights is refused when it is built, before any
    backward could step it."""
    from macroarch import mvas

    if getattr(inner, "supports_mvas_weights", False):
        return
    for p in group.params:
        if isinstance(p, mvas.MVASWeight):
            raise TypeError(f"DGR group {group.index} ({group.label}): {type(inner).__name__} cannot update "
                            "MVAS-managed (packed) weights; use wrapper.optimizer(macroarch.mvas.MVASAdamW, ...)")
