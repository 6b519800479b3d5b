"""``GradientBucketer``: data-parallel gradient averaging in flat buckets of a fixed size (post section 4.2, C9).

The post's advice for 8xA100: pack gradients into buffers whose size is a multiple of 8 MB, and batch the
all-reduces into 200 ms windows. This is DDP's bucketing (Li et al. 2020, "PyTorch Distributed", VLDB) done
in Python over ``torch.distributed``, so that each part of the advice can be switched on and measured:

- **Layout.** The trainable parameters are laid out in one flat buffer per dtype, in the order their
  gradients arrive in backward (reverse registration order, as DDP's first guess; DGR's group order when
  the module is a ``DGRWrapper``), and the buffer is cut into buckets of exactly ``bucket_mb`` MiB (the
  last one, and with DGR the last one of each group, smaller). A parameter may straddle two buckets, so
  the sizes are exactly what was asked, unlike DDP, whose buckets hold whole parameters and close once
  they *exceed* the cap. Buckets are numbered by the order in which they fill.
- **Reduction.** A ``register_post_accumulate_grad_hook`` copies each gradient into its place in the
  buffer and points ``param.grad`` at that place (DDP's ``gradient_as_bucket_view``); when a bucket is full
  it is divided by the world size and an asynchronous ``all_reduce`` (SUM) is launched, strictly in bucket
  order, so every rank issues the same collectives in the same order. At the end of backward any bucket
  left (parameters that got no gradient here, sent as zeros, their ``.grad`` left as it was: as with DDP's
  default, every rank must use the same parameters) is launched. ``wait()`` blocks until all are done,
  each with ``timeout``, and returns True: ``param.grad`` then holds the average over ranks.
- **Accumulation.** ``with bucketer.no_sync(): loss.backward()`` accumulates locally, as with DDP.
- **Windows** (``window_ms``, the post's 200 ms batching). Gradients accumulate locally over the
  micro-steps of a window and are reduced once, on the window's last backward; ``wait()`` returns True
  only then (the optimizer steps once per window) and the gradients are the mean over ranks *and* over
  the window's micro-steps. A window is a whole number ``k`` of micro-steps, the same on every rank (a
  time-based decision taken rank by rank would desynchronise the collectives and hang): ``k = max(1,
  ceil(window_ms / t))``, where ``t`` is the ranks' mean micro-step time (backward end to backward end) in
  the previous window, carried by one extra 8-byte all-reduce per window. The first two windows are one
  micro-step each (the first has no earlier backward end to time from). So a window costs
  ``n_buckets + 1`` collectives instead of ``k * n_buckets``; the price is a ``k``-times larger effective
  batch and ``k``-times fewer optimizer steps, which the post does not mention.
- **DGR.** With a ``DGRWrapper`` whose optimizer does not exist yet, buckets follow the DGR groups and
  never straddle two; DGR updates a group inside backward as soon as its gradients are complete, so the
  bucketer (whose hooks run first) finishes that group's reductions inside the hook of the group's last
  gradient, and the rest at the end of backward: the usual DGR loop ``loss.backward(); opt.step()`` then
  trains on averaged gradients. Only the last bucket of each group loses its overlap with backward. DGR's
  ``accumulation_steps`` sets how many backward passes accumulate before one reduction.
- **Failures.** A collective that fails or does not finish within ``timeout`` (a peer that died, stalled
  or issued different collectives) raises :class:`CollectiveError` naming the bucket, the rank and the
  cause; the bucketer refuses to go on afterwards. Nothing waits forever.

World size 1 works and communicates nothing. Deviations from DDP: no bucket rebuild after the first
iteration (the order is fixed at construction), no ``find_unused_parameters``, dense gradients only, one
device per bucketer.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import time
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from macroarch._compat.autograd import at_backward_end, backward_pass_id
from macroarch.comm.layout import BUCKET_MULTIPLE_MB, MiB, check_bucket_mb, plan_buckets


class CollectiveError(RuntimeError):
    """A collective failed or ran past its timeout: a peer rank probably died, stalled or diverged."""


def _require_process_group(process_group: Any) -> Any:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("torch.distributed is not initialised: call torch.distributed.init_process_group('gloo' "
                           "or 'nccl') first (under torchrun it reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT "
                           "from the environment)")
    if process_group is None:
        return dist.group.WORLD
    if not isinstance(process_group, dist.ProcessGroup):
        raise ValueError(f"process_group={process_group!r} must be a torch.distributed.ProcessGroup or None")
    return process_group


def _seconds(timeout: Any) -> float:
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds > 0:
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds or a timedelta")
    return float(seconds)


def _on_grad(ref: weakref.ref, index: int) -> None:
    bucketer = ref()  # weak: hooks must not keep a discarded bucketer alive
    if bucketer is not None:
        bucketer._grad_ready(index)


class GradientBucketer:
    """Averages gradients across ranks in fixed-size flat buckets during backward (module docstring).

    Args:
        module_or_params: an ``nn.Module`` (a ``DGRWrapper`` included) or an iterable of parameters.
        process_group: the group to average over; None for the default group.
        bucket_mb: bucket size in MiB (2**20 bytes), > 0; a multiple of 8 by the post's rule (else a warning).
        window_ms: None (reduce after every backward), or the time window in ms over which micro-steps
            accumulate before one reduction (module docstring).
        timeout: seconds (or a timedelta) each collective may take before ``CollectiveError``.

    Usage::

        bucketer = GradientBucketer(model, bucket_mb=8)
        for batch in batches:
            loss_fn(model, batch).backward()   # buckets are all-reduced as they fill
            if bucketer.wait():                # True when the gradients are averaged
                opt.step()
                opt.zero_grad()
    """

    def __init__(self, module_or_params: nn.Module | Iterable[torch.Tensor], process_group: Any = None,
                 bucket_mb: float = BUCKET_MULTIPLE_MB, window_ms: float | None = None,
                 timeout: float | datetime.timedelta = 300.0) -> None:
        import torch.distributed as dist

        from macroarch.dgr import DGRWrapper

        self.bucket_mb = check_bucket_mb(bucket_mb)
        if window_ms is not None and (isinstance(window_ms, bool) or not isinstance(window_ms, int | float)
                                      or not math.isfinite(window_ms) or window_ms < 0):
            raise ValueError(f"window_ms={window_ms!r} must be None or a number of milliseconds >= 0")
        self.window_ms = window_ms
        self.timeout = _seconds(timeout)
        self.process_group = _require_process_group(process_group)
        self.rank = dist.get_rank(self.process_group)
        self.world_size = dist.get_world_size(self.process_group)

        breaks: set[int] = set()
        self._accumulation = 1
        self._group_of: list[int] | None = None
        if isinstance(module_or_params, DGRWrapper):
            wrapper = module_or_params
            if wrapper.grouping is None:
                raise ValueError("GradientBucketer: the DGRWrapper has no groups yet; pass example_inputs= to it, "
                                 "call build_groups(example), or run one forward first")
            if wrapper.has_optimizer:
                raise ValueError("GradientBucketer: the DGRWrapper's optimizer already exists, so its hooks would "
                                 "step each group before its gradients are averaged; create the bucketer first, "
                                 "then call wrapper.optimizer(...)")
            if window_ms is not None:
                raise ValueError("GradientBucketer: window_ms does not combine with DGR, which updates during "
                                 "backward; use the wrapper's accumulation_steps instead")
            named = [(name, p) for group in wrapper.grouping for name, p in zip(group.names, group.params)]
            self._group_of = [group.index for group in wrapper.grouping for _ in group.params]
            breaks = {i for i in range(1, len(named)) if self._group_of[i] != self._group_of[i - 1]}
            self._accumulation = wrapper.pipeline_config.accumulation_steps
        elif isinstance(module_or_params, nn.Module):
            # Reverse registration order: how gradients arrive in backward for most models (DDP's first guess).
            named = [(n, p) for n, p in reversed(list(module_or_params.named_parameters())) if p.requires_grad]
        else:
            unique = list({id(p): p for p in module_or_params}.values())
            if not all(isinstance(p, torch.Tensor) for p in unique):
                raise ValueError("module_or_params must be an nn.Module or an iterable of tensors")
            named = [(f"param{i}", p) for i, p in enumerate(unique) if p.requires_grad]
        if not named:
            raise ValueError("GradientBucketer: no trainable parameters (requires_grad=True) to average")
        devices = {p.device for _, p in named}
        if len(devices) > 1:
            raise ValueError(f"GradientBucketer: parameters span devices {sorted(map(str, devices))}; use one "
                             "bucketer per device")

        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.buckets, offsets, self._pieces = plan_buckets(self.params, int(self.bucket_mb * MiB), self.names, breaks)
        device = self.params[0].device
        self._flat = {dtype: torch.zeros(sum(p.numel() for p in self.params if p.dtype == dtype), dtype=dtype,
                                         device=device) for dtype in {p.dtype for p in self.params}}
        self._views = [self._flat[p.dtype][o:o + p.numel()].view_as(p) for p, o in zip(self.params, offsets)]
        self._group_buckets: dict[int, list[int]] = {}
        if self._group_of is not None:
            for i, pieces in enumerate(self._pieces):
                self._group_buckets.setdefault(self._group_of[i], []).extend(b for b, _ in pieces)

        # Statistics, read by notebooks and tests.
        self.collectives = 0  # all-reduces launched (buckets, plus one per window in window mode)
        self.reductions = 0  # backward passes whose gradients were reduced
        self.backward_passes = 0
        self.window_steps = 1  # micro-steps in the current window (window mode), else 1
        self.window_history: list[int] = []  # k of every window reduced so far
        self.micro_step_ms: float | None = None  # window mode: the ranks' mean micro-step time, last window

        # Per-backward state.
        self._task = -1
        self._reduce = False
        self._micro = 0  # backward passes since the last reduction
        self._pending: list[int] = []
        self._works: list[Any] = []
        self._next = 0  # next bucket to launch
        self._arrived: list[bool] = []
        self._group_left: dict[int, int] = {}
        self._outstanding = False  # a reducing backward whose collectives wait() has not yet waited for
        self._synced = False  # what wait() returns
        self._no_sync = False
        self._divisor = self.world_size
        self._failed: BaseException | None = None
        self._control: torch.Tensor | None = None  # window mode: the ranks' micro-step time, being averaged
        self._control_work: Any = None
        self._window_start: float | None = None  # end of the last window's last backward
        ref = weakref.ref(self)
        self._handles = [p.register_post_accumulate_grad_hook(lambda _p, i=i, ref=ref: _on_grad(ref, i))
                         for i, p in enumerate(self.params)]

    # ----------------------------------------------------------------------------------------- public API
    @property
    def bucket_bytes(self) -> list[int]:
        """Size of every bucket in bytes, in launch order."""
        return [b.nbytes for b in self.buckets]

    def wait(self) -> bool:
        """Wait for this step's reductions; True if the last backward averaged the gradients (then step)."""
        self._check_healthy()
        if self._outstanding:
            for index in range(len(self.buckets)):
                self._wait_bucket(index)
            if self._control_work is not None:
                self._wait_work(self._control_work, "the window's micro-step time", 8)
                mean_ms = float(self._control) * 1e3 / self.world_size
                if mean_ms > 0:  # 0: the first window, which had no backward end before it to time from
                    self.micro_step_ms = mean_ms
                    self.window_steps = max(1, math.ceil(self.window_ms / mean_ms))
                self._control_work = self._control = None
            self._outstanding = False
        return self._synced

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, without communication (as DDP's ``no_sync``)."""
        if self.window_ms is not None or self._group_of is not None:
            raise RuntimeError("no_sync() is for the default mode; window_ms and DGR decide by themselves when "
                               "to reduce")
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    def close(self) -> None:
        """Remove the hooks: backward no longer touches the buckets."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def describe(self) -> str:
        """One line per bucket: index, dtype, MiB, what it holds."""
        lines = [f"{len(self.buckets)} buckets of <= {self.bucket_mb:g} MiB on {self.world_size} ranks"]
        for b in self.buckets:
            held = ", ".join(b.names[:3]) + (f", ... ({len(b.names)} pieces)" if len(b.names) > 3 else "")
            lines.append(f"  {b.index:>4}  {str(b.dtype):<14} {b.nbytes / MiB:>9.3f} MiB  {held}")
        return "\n".join(lines)

    # ---------------------------------------------------------------------------------------- backward
    def _begin_backward(self) -> None:
        if self._outstanding:
            raise RuntimeError("GradientBucketer: a new backward started while the last one's reductions were not "
                               "waited for; call bucketer.wait() after every backward")
        steps = self.window_steps if self.window_ms is not None else self._accumulation
        self._reduce = not self._no_sync and self._micro + 1 >= steps
        self._synced = False
        if self._reduce:
            self._pending = [b.numel for b in self.buckets]
            self._works = [None] * len(self.buckets)
            self._next = 0
            self._arrived = [False] * len(self.params)
            if self._group_of is not None:
                self._group_left = {}
                for g in self._group_of:
                    self._group_left[g] = self._group_left.get(g, 0) + 1
            self._divisor = self.world_size * (self.window_steps if self.window_ms is not None else 1)
        at_backward_end(self._end_backward)

    def _grad_ready(self, index: int) -> None:
        self._check_healthy()
        task = backward_pass_id()
        if task != self._task:  # the first gradient of a new backward pass
            self._task = task
            self._begin_backward()
        if not self._reduce or self._arrived[index]:
            return
        self._arrived[index] = True
        self._take(index)
        self._launch_ready()
        if self._group_of is not None:
            group = self._group_of[index]
            self._group_left[group] -= 1
            if self._group_left[group] == 0:  # DGR's hook, next, steps this group: it must see the average
                for b in self._group_buckets[group]:
                    if self._works[b] is None:
                        raise RuntimeError(f"GradientBucketer: DGR group {group} completed before bucket {self._next} "
                                           "of an earlier group; the bucket order does not follow backward")
                    self._wait_bucket(b)

    def _take(self, index: int) -> None:
        """Move parameter ``index``'s gradient into its buffer slot and point ``.grad`` there."""
        p, view = self.params[index], self._views[index]
        if p.grad is None:
            view.zero_()
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
        if p.grad is not None:
            p.grad = view
        for b, count in self._pieces[index]:
            self._pending[b] -= count

    def _launch_ready(self) -> None:
        import torch.distributed as dist

        while self._next < len(self.buckets) and self._pending[self._next] == 0:
            b = self.buckets[self._next]
            buffer = self._flat[b.dtype][b.start:b.end]
            if self._divisor != 1:
                buffer.div_(self._divisor)
            if self.world_size > 1:
                self._works[b.index] = dist.all_reduce(buffer, group=self.process_group, async_op=True)
                self.collectives += 1
            else:
                self._works[b.index] = _DONE
            self._next += 1

    def _end_backward(self) -> None:
        import torch.distributed as dist

        self.backward_passes += 1
        if not self._reduce:
            self._micro += 1
            return
        for index, arrived in enumerate(self._arrived):
            if not arrived:  # no gradient in this backward: send what .grad holds (accumulated) or zeros
                self._arrived[index] = True
                self._take(index)
        self._launch_ready()
        if self.window_ms is not None:
            self.window_history.append(self.window_steps)
            # A micro-step is timed from one backward's end to the next: forward, backward, optimizer, data.
            now = time.perf_counter()
            micro_s = 0.0 if self._window_start is None else (now - self._window_start) / (self._micro + 1)
            self._window_start = now
            self._control = torch.tensor([micro_s], dtype=torch.float64, device=self.params[0].device)
            if self.world_size > 1:
                self._control_work = dist.all_reduce(self._control, group=self.process_group, async_op=True)
                self.collectives += 1
            else:
                self._control_work = _DONE
        self._micro = 0
        self.reductions += 1
        self._outstanding = self._synced = True
        if self._group_of is not None:  # DGR's step() follows backward at once
            self.wait()

    # ------------------------------------------------------------------------------------------ waiting
    def _wait_bucket(self, index: int) -> None:
        work = self._works[index]
        if work is not _DONE:
            self._wait_work(work, f"bucket {index}", self.buckets[index].nbytes)
            self._works[index] = _DONE

    def _wait_work(self, work: Any, what: str, nbytes: int) -> None:
        if work is _DONE:
            return
        start = time.perf_counter()
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except Exception as exc:
            self._failed = CollectiveError(
                f"GradientBucketer: the all-reduce of {what} ({nbytes / MiB:.3f} MiB) failed on rank {self.rank} of "
                f"{self.world_size} after {time.perf_counter() - start:.1f} s (timeout {self.timeout:g} s): "
                f"{type(exc).__name__}: {str(exc).strip()[:500]}. A peer rank has probably died, stalled or issued "
                "different collectives; this step's gradients are not averaged. Stop, destroy the process group "
                "and restart from the last checkpoint.")
            raise self._failed from exc

    def _check_healthy(self) -> None:
        if self._failed is not None:
            raise CollectiveError(f"GradientBucketer: an earlier collective failed, no more reductions: {self._failed}")


class _Done:
    """Marks a collective that is complete (or that world size 1 never needed)."""

    def __repr__(self) -> str:
        return "<done>"


_DONE = _Done()


def ddp_with_buckets(module: nn.Module, bucket_mb: float = BUCKET_MULTIPLE_MB, process_group: Any = None,
                     **ddp_kwargs: Any) -> torch.nn.parallel.DistributedDataParallel:
    """``DistributedDataParallel`` with ``bucket_mb``-MiB buckets, checked as ``GradientBucketer`` checks it.

    DDP's default is 25 MiB with a 1 MiB first bucket; an explicit ``bucket_cap_mb`` (this helper) makes the
    first bucket that size too. DDP closes a bucket once it exceeds the cap and never splits a parameter,
    so its buckets are not exactly ``bucket_mb``: ``ddp_bucket_bytes`` gives the sizes it chose.
    """
    from torch.nn.parallel import DistributedDataParallel

    cap = check_bucket_mb(bucket_mb)
    _require_process_group(process_group)
    return DistributedDataParallel(module, process_group=process_group, bucket_cap_mb=cap, **ddp_kwargs)


def ddp_bucket_bytes(ddp: torch.nn.parallel.DistributedDataParallel) -> list[int]:
    """The sizes in bytes of the buckets DDP uses now (after its first iteration rebuilt them), in bucket order.

    Read from the reducer's buckets (``macroarch._compat.distributed.ddp_bucket_buffers``, private): DDP's logging
    data reports the sizes at construction, not the rebuilt buckets.
    """
    from macroarch._compat.distributed import ddp_bucket_buffers

    return [b.numel() * b.element_size() for b in ddp_bucket_buffers(ddp)]
