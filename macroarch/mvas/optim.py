"""``MVASAdamW``: AdamW (Loshchilov and Hutter 2019) whose weights and moments are stored in low precision.

The Adam math is ``macroarch.optim.functional.adamw_update_``, the one every optimizer here runs, in fp32 one
tensor at a time; this optimizer only chooses storage (each stored tensor is a ``PackedTensor``: a format, a
payload and block scales), and ``macroarch.mvas._kernels.adamw_step`` does the whole step of a tensor in one
fused kernel (decode m, sqrt(v) and the weight, update, encode, write back), compiled by ``torch.compile``
unless ``compile=False`` or ``MACROARCH_COMPILE=0`` (the eager path, the reference of the tests):

- **Weights.** A parameter managed by an MVAS store (an ``MVASWeight``, ``macroarch.mvas.packed.weight``) is read
  dequantised from its packed storage and written back in its format (then ``mark_written``): with
  **stochastic rounding** (the default), so an update smaller than the format's spacing still moves the weight
  in expectation (round-to-nearest would drop it: the "lost update" of low-precision training), or, with
  ``master_weights=True``, from an fp32 master copy kept in the optimizer state and rounded to nearest. Other
  parameters are updated in place as AdamW does (fp32 math, cast back to the parameter's dtype). The noise of
  stochastic rounding is a counter-based hash of (seed, parameter index, step, element): reproducible from
  the seed, the same compiled and eager, and resumed exactly from a state dict.
- **Moments.** ``m`` and ``v`` of tensors with at least ``min_state_numel`` elements (4096, torchao's
  threshold) that ``state_block_size`` divides are block-quantised in ``state_format`` (fp8 e4m3, blocks of
  128 by default: 1.03 bytes per element each): ``m`` directly, ``v`` as ``sqrt(v)``, which halves its
  dynamic range in log scale (the approach of 8-bit and 4-bit optimizer states, Dettmers et al. 2022, Li et
  al. 2023, store ``v`` with a dedicated map; ours is the format's own grid). A ``sqrt(v)`` that underflows
  to zero would turn ``m / sqrt(v)`` into ``m / eps``; it reads back as the smallest value its block can
  represent instead (the zero-point problem of Li et al. 2023). Both are rounded to nearest. Smaller tensors
  keep fp32 moments. ``state_format="fp32"`` keeps every moment dense.

**Atomic steps.** Before anything is written, every gradient (and the closure's loss, if given) is checked: one
inf or NaN anywhere skips the whole step (weights, packed or not, moments and step counters untouched) and
counts it in ``skipped_nonfinite`` (saved in ``state_dict``). The check is one sum per gradient
(``macroarch.optim.functional.all_finite``).

**DTensor parameters** (FSDP2): the step updates each parameter's local shard (``to_local()``) and keeps its
state local. The skip is decided for all ranks at once: each rank's verdict on its gradient shards and its loss
is combined over the parameters' mesh (one ``all_reduce`` of two numbers per step), so an inf in one rank's
shard skips the step on every rank, and the ranks' weights and step counters stay in step.

**Zero state without a step**: ``init_state()`` creates the state (step 0, zero moments, packed where they will
be, the fp32 master where ``master_weights``) of every parameter that has none, e.g. for a checkpoint loader.

``state_dict()`` / ``load_state_dict()`` round-trip exactly: torch casts floating state to the parameter's
dtype on load, so the packed moments and the master copies are put back as they were saved. A load is all or
nothing: every saved tensor is checked against its parameter first (shapes, element counts, the moments' format,
finite scales, payload codes), so another model's state or a corrupt one is refused before anything changes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from macroarch._compat.subclass import torch_function_disabled
from macroarch.mvas import _kernels
from macroarch.mvas.codecs.formats import get_format, is_fake
from macroarch.mvas.codecs.noise import stream_key
from macroarch.mvas.packed.packed_tensor import bad_scales, nonfinite_codes
from macroarch.mvas.packed.weight import MVASWeight
from macroarch.optim.functional import adamw_scalars, all_finite, check_hyperparameters, local, owned_params
from macroarch.optim.saved_state import check_saved_state, restore_saved_state

STEP_CHUNK_NUMEL = 1 << 20
"""Elements one step kernel call updates at most. The compiled step keeps a few float32 temporaries of the chunk's
size between its loops (the new moments and weight, before their block scales are known): chunks of 2^20 elements
(4 MB each) keep them in the caches, larger ones do not; a call's fixed Python cost stays small beside a chunk."""
_EXACT_KEYS = ("exp_avg", "exp_avg_scales", "exp_avg_sq", "exp_avg_sq_scales", "master")


def _not_traced(method: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compiler.disable(method)``, made on the first call: ``torch.compiler.disable`` imports dynamo (most of
    ``torch.compile``'s modules), which a decorator applied at class definition would import with
    ``macroarch.mvas`` itself, compiled or not (torch's own optimizers defer it the same way)."""
    disabled: Callable[..., Any] | None = None

    @functools.wraps(method)
    def step(*args: Any, **kwargs: Any) -> Any:
        nonlocal disabled
        if disabled is None:
            disabled = torch.compiler.disable(method)
        return disabled(*args, **kwargs)

    return step


def min_subnormal(fmt_name: str) -> float:
    """The smallest positive value of a scaled format at scale 1 (its smallest subnormal)."""
    fmt = get_format(fmt_name)
    bias = 2 ** (fmt.exponent_bits - 1) - 1
    return 2.0 ** (1 - bias - fmt.mantissa_bits)


class MVASAdamW(torch.optim.Optimizer):
    """AdamW over MVAS-managed (and ordinary) parameters; see the module docstring.

    Args:
        params, lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        state_format: storage of ``m`` and ``sqrt(v)``: a block-scaled format (``"fp8_e4m3"``, ``"fp8_e5m2"``,
            ``"fp4_e2m1"``), ``"bf16"``/``"fp16"``, or ``"fp32"`` for dense moments.
        state_block_size: elements per scale of the moments.
        master_weights: keep an fp32 master of every managed parameter and write the weights from it.
        rounding: how managed weights are written without a master, ``"stochastic"`` or ``"nearest"``.
        min_state_numel: tensors smaller than this keep fp32 moments.
        seed: seed of the stochastic-rounding generator (default: drawn from torch's global generator).
    """

    supports_mvas_weights = True  # it writes managed weights through their storage API (macroarch.mvas.packed.weight)

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, state_format: str = "fp8_e4m3",
                 state_block_size: int = 128, master_weights: bool = False, rounding: str = "stochastic",
                 min_state_numel: int = 4096, seed: int | None = None, compile: bool | None = None) -> None:
        lr, betas, eps, weight_decay = check_hyperparameters(lr, betas, eps, weight_decay)
        state_format = get_format(state_format).name  # raises on an unknown name, listing the known ones
        if not isinstance(state_block_size, int) or state_block_size < 1:
            raise ValueError(f"state_block_size={state_block_size!r} must be a positive int")
        if rounding not in ("stochastic", "nearest"):
            raise ValueError(f"rounding={rounding!r} must be 'stochastic' or 'nearest'")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        for index, group in enumerate(self.param_groups):  # per-group overrides are checked like the defaults
            check_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"],
                                  f"param_groups[{index}]")
        self.state_format = state_format
        self.state_block_size = state_block_size
        self.master_weights = master_weights
        self.rounding = rounding
        self.min_state_numel = min_state_numel
        self.seed = int(torch.randint(0, 2**62, ())) if seed is None else int(seed)
        self.compile = compile  # None: MACROARCH_COMPILE decides (macroarch.mvas._kernels)
        self._plans: dict[torch.Tensor, tuple] = {}  # parameter -> (storage token, spec, chunks): ``_plan``
        self.skipped_nonfinite = 0  # steps skipped for an inf/NaN gradient or loss
        self.step_was_skipped = False  # whether the last step() skipped (LR schedulers may hold back)

    # ------------------------------------------------------------------------------------------- storage
    def _quantised(self, p: torch.Tensor) -> bool:
        return (self.state_format != "fp32" and p.numel() >= self.min_state_numel
                and (not get_format(self.state_format).block_scaled or p.numel() % self.state_block_size == 0))

    @staticmethod
    def _packed_state(state: dict) -> bool:
        return state["exp_avg"].dtype != torch.float32

    @torch.no_grad()
    def init_state(self, params: Iterable[torch.Tensor] | None = None) -> None:
        """Create the zero state of every parameter (or of ``params``, parameters of this optimizer) that has none
        yet, without stepping: step 0 and zero moments (packed or dense as the first step would make them, shaped
        after a DTensor's local shard), and the fp32 master copy of a managed weight with ``master_weights``,
        decoded from the weight now. State already there is kept. For loaders that fill existing tensors
        (``torch.distributed.checkpoint``, ``macroarch.mvas.interop.dcp``)."""
        params = owned_params(self, params)
        for p in params:
            if not self.state.get(p):
                self._init_state(p, local(p))

    def _init_state(self, p: torch.Tensor, weight: torch.Tensor) -> dict:
        """``p``'s state, shaped after ``weight`` (``p`` itself, or its local shard)."""
        state, p = self.state[p], weight
        state["step"] = torch.tensor(0.0)
        if self._quantised(p):
            fmt = get_format(self.state_format)
            n = p.numel()
            state["numel"] = n
            for key in ("exp_avg", "exp_avg_sq"):  # zero codes and zero scales read back as zeros
                state[key] = torch.zeros((n + 1) // 2 if fmt.name == "fp4_e2m1" else n, dtype=fmt.storage_dtype,
                                         device=p.device)
                if fmt.block_scaled:
                    state[key + "_scales"] = torch.zeros(n // self.state_block_size, device=p.device)
        else:
            state["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            state["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        if isinstance(p, MVASWeight) and self.master_weights:
            state["master"] = p.dequantize(torch.float32)
        return state

    def _chunk(self, p: torch.Tensor, state: dict) -> int:
        """Elements updated at a time: whole blocks of the moments and of the packed weight, about STEP_CHUNK_NUMEL."""
        unit = self.state_block_size if self._packed_state(state) else 1
        if isinstance(p, MVASWeight):
            if p.write_unit == p.numel():
                return p.numel()  # one scale for the whole tensor: it cannot be re-packed in pieces
            unit = math.lcm(unit, p.write_unit)
        return max(unit, STEP_CHUNK_NUMEL // unit * unit)

    def _spec(self, p: torch.Tensor, state: dict) -> _kernels.StepSpec:
        """How ``p`` (a local tensor) and its moments are stored: the static part of its kernel."""
        packed_state = self._packed_state(state)
        state_fmt = get_format(self.state_format) if packed_state else get_format("fp32")
        state_block = self.state_block_size if state_fmt.block_scaled else None
        if isinstance(p, MVASWeight):
            weight_fmt = get_format(p.format)
            weight_format, weight_block = weight_fmt.name, p.block_size if weight_fmt.block_scaled else None
        else:
            weight_format, weight_block = "dense", None
        return _kernels.StepSpec(weight_format, weight_block, self.rounding == "stochastic" and "master" not in state,
                                "master" in state, state_fmt.name, state_block,
                                min_subnormal(state_fmt.name) if state_block is not None else 0.0)

    @_not_traced  # traced by the user's torch.compile it fails (views of packed state); runs as it is
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for group in self.param_groups for p in group["params"]]
        # MVASWeight's torch function override has nothing to do for p.grad, numel() and version bumps, each a
        # Python call: off for the bookkeeping, not for dispatch
        with torch_function_disabled():
            checked = [p.grad for p in params] + [None if loss is None else torch.as_tensor(loss).detach()]
            self.step_was_skipped = not all_finite(checked, over=params)  # on every rank of DTensor parameters alike
            if self.step_was_skipped:
                self.skipped_nonfinite += 1
                return loss
            index = -1
            for group in self.param_groups:
                lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
                for p in group["params"]:
                    index += 1
                    if p.grad is None:
                        continue
                    if p.grad.is_sparse:
                        raise RuntimeError("MVASAdamW does not support sparse gradients")
                    self._step_tensor(p, index, lr, beta1, beta2, eps, wd)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``torch.optim.Optimizer.zero_grad`` without ``MVASWeight``'s torch function on each ``.grad`` read and write
        (a Python call each)."""
        with torch_function_disabled():
            super().zero_grad(set_to_none)

    def _step_tensor(self, p: torch.Tensor, index: int, lr: float, beta1: float, beta2: float, eps: float,
                     wd: float) -> None:
        """One parameter's update, a chunk of about ``STEP_CHUNK_NUMEL`` elements per kernel call: the float32
        temporaries of the update stay bounded instead of growing with the tensor."""
        weight, grad = local(p), local(p.grad).reshape(-1)
        state = self.state[p] if self.state[p] else self._init_state(p, weight)
        state["step"] += 1
        step = float(state["step"])
        scalars = adamw_scalars(step, lr, beta1, beta2, eps, wd)
        spec, chunks = self._plan(p, weight, state)
        key = stream_key(self.seed, index, weight.numel(), int(step))
        for start, stop, w, master, exp_avg, exp_avg_sq in chunks:
            _kernels.adamw_step(grad[start:stop], w, master, exp_avg, exp_avg_sq, torch.tensor([key, start]),
                               scalars, spec, compile=self.compile)
        if isinstance(weight, MVASWeight):
            weight.mark_written()

    def _plan(self, p: torch.Tensor, weight: torch.Tensor, state: dict) -> tuple[_kernels.StepSpec, list[tuple]]:
        """``p``'s storage spec and its chunks ``(start, stop, weight, master, exp_avg, exp_avg_sq)`` (views of the
        stored tensors), kept from step to step while the storage they view is the same (a re-plan that re-packs
        the weight, a loaded state dict and a DTensor's new shard make new ones): building them is most of the
        Python time of a step of a small tensor."""
        managed = isinstance(weight, MVASWeight)
        stored = weight.payload if managed else weight
        token = None
        if not is_fake(stored):  # fake tensors (memory measurements) have no data pointer: planned every step
            token = _token(weight, state)
            cached = self._plans.get(p)
            if cached is not None and cached[0] == token:
                return cached[1], cached[2]
        spec = _kernels.canonical_spec(self._spec(weight, state))
        master = state["master"].view(-1) if "master" in state else None
        flat = None if managed else weight.view(-1)
        n, chunk = weight.numel(), self._chunk(weight, state)
        chunks = []
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            if managed:
                w = _slice(weight.payload, weight.scales, spec.weight_format, spec.weight_block, start, stop)
            else:
                w = (flat[start:stop], None)
            moments = [_slice(state[key_], state.get(key_ + "_scales"), spec.state_format, spec.state_block, start,
                              stop) for key_ in ("exp_avg", "exp_avg_sq")]
            chunks.append((start, stop, w, None if master is None else master[start:stop], *moments))
        if token is not None:
            self._plans[p] = (token, spec, chunks)
        return spec, chunks

    # ------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["mvas_seed"] = self.seed
        sd["mvas_skipped_nonfinite"] = self.skipped_nonfinite
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict()`` exactly (packed moments and masters as saved). All or nothing: every parameter's
        saved state is checked against the parameter first (``check_loadable``), and a state dict of another
        model, another ``state_format`` or with corrupt moments is refused (ValueError naming the parameter) before
        anything changes."""
        state_dict = dict(state_dict)
        state_dict.pop("mvas_generators", None)  # written by versions that drew noise from torch generators
        seed = state_dict.pop("mvas_seed", self.seed)
        skipped = int(state_dict.pop("mvas_skipped_nonfinite", 0))
        self.check_loadable(state_dict)
        super().load_state_dict(state_dict)
        restore_saved_state(self, state_dict, _EXACT_KEYS)  # torch cast them to each parameter's dtype
        self.seed, self.skipped_nonfinite = seed, skipped

    def check_loadable(self, state_dict: dict[str, Any]) -> None:
        """Raise ValueError unless ``state_dict`` (torch's layout) fits this optimizer's parameters: dense moments and
        masters shaped as the parameter (a DTensor's local shard), packed moments of its element count in this
        optimizer's ``state_format`` (payload dtype and size, ``numel // state_block_size`` float32 scales) with
        finite non-negative scales and no code that decodes to NaN or infinity. Reads only."""
        check_saved_state(self, state_dict, ("master",), self._check_moments)

    def _check_moments(self, index: int, p: torch.Tensor, saved: dict[str, Any]) -> list[str]:
        """Problems of one parameter's saved moments (``check_loadable``)."""
        n, problems = local(p).numel(), []
        fmt = get_format(self.state_format)
        for key in ("exp_avg", "exp_avg_sq"):
            value = saved.get(key)
            if not torch.is_tensor(value):
                continue
            if value.dtype == torch.float32:  # dense
                if tuple(value.shape) not in {tuple(p.shape), tuple(local(p).shape)}:
                    problems.append(f"{key} {tuple(value.shape)}, the parameter {tuple(local(p).shape)}")
                continue
            if value.dtype != fmt.storage_dtype or fmt.name == "fp32":
                problems.append(f"{key} is stored as {value.dtype}, this optimizer's state_format {fmt.name} stores "
                                f"{fmt.storage_dtype} (build it with the state_format it was saved with)")
                continue
            numel = saved.get("numel", n)
            payload = (n + 1) // 2 if fmt.name == "fp4_e2m1" else n
            if numel != n or value.dim() != 1 or value.numel() != payload:
                problems.append(f"{key} {tuple(value.shape)} for {numel} elements, the parameter "
                                f"{tuple(local(p).shape)} has {n} ({fmt.name} stores {payload} codes)")
                continue
            bad = nonfinite_codes(value)
            if bad:
                problems.append(f"{bad} codes of {key} decode to NaN or infinity (corrupt)")
            if fmt.block_scaled:
                scales = saved.get(key + "_scales")
                want = n // self.state_block_size
                if not torch.is_tensor(scales) or scales.dtype != torch.float32 or scales.numel() != want:
                    got = "none" if not torch.is_tensor(scales) else f"{scales.dtype} x {scales.numel()}"
                    problems.append(f"{key}_scales: {got}, blocks of {self.state_block_size} need float32 x {want}")
                elif bad_scales(scales):
                    problems.append(f"{bad_scales(scales)} of {key}_scales are NaN, infinite or negative (corrupt)")
        return problems

    def state_bytes(self) -> int:
        """Bytes of the moments (payloads and scales) held now, masters excluded."""
        return sum(v.numel() * v.element_size() for s in self.state.values() for k, v in s.items()
                   if k.startswith("exp_avg") and torch.is_tensor(v))



def _token(weight: torch.Tensor, state: dict) -> tuple:
    """What a plan of ``weight``'s step depends on: where its storage and its state live, and their formats (a re-pack,
    a loaded state dict, a DTensor's new shard change it)."""
    managed = isinstance(weight, MVASWeight)
    stored = weight.payload if managed else weight
    master = state.get("master")
    return (stored.data_ptr(), stored.dtype, weight.numel(), weight.format if managed else None,
            weight.block_size if managed else None, state["exp_avg"].data_ptr(), state["exp_avg_sq"].data_ptr(),
            None if master is None else master.data_ptr())


def _slice(payload: torch.Tensor, scales: torch.Tensor | None, fmt: str, block: int | None, start: int,
           stop: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Elements ``start:stop`` of a flat stored tensor: views of its payload (fp4: two per byte; dense: the
    tensor itself) and of its scales (whole blocks; all of them for one scale per tensor)."""
    payload = payload.view(-1)
    if fmt == "fp4_e2m1":
        payload = payload[start // 2:(stop + 1) // 2]
    else:
        payload = payload[start:stop]
    if scales is not None and block is not None:
        scales = scales[start // block:stop // block]
    return payload, scales
