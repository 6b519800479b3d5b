"""``MVASAdamW``: AdamW (Loshchilov and Hutter 2019) whose weights and moments are stored in low precision.

The Adam math is torch.optim.AdamW's, computed in fp32 one tensor at a time; what differs is storage:

- **Weights.** A parameter managed by an MVAS store (an ``MVASWeight``, ``macroarch.mvas.tensor``) is read
  dequantised from its packed storage and written back in its format with the weight's own ``write_range``
  (its public storage API): with **stochastic rounding** (the default), so an
  update smaller than the format's spacing still moves the weight in expectation (round-to-nearest would
  drop it: the "lost update" of low-precision training), or, with ``master_weights=True``, from an fp32
  master copy kept in the optimizer state and rounded to nearest. Other parameters are updated in place as
  AdamW does (fp32 math, cast back to the parameter's dtype).
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
(``macroarch.dgr.pipeline.all_finite``).

``state_dict()`` / ``load_state_dict()`` round-trip exactly: torch casts floating state to the parameter's
dtype on load, so the packed moments and the master copies are put back as they were saved, and the state
of the stochastic-rounding generators is saved too (a resumed run draws the same roundings).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from macroarch.dgr.pipeline import all_finite
from macroarch.mvas import formats
from macroarch.mvas.formats import PackedTensor, get_format, pack, write_range
from macroarch.mvas.tensor import MVASWeight
from macroarch.optim._state import restore_saved_state

_EXACT_KEYS = ("exp_avg", "exp_avg_scales", "exp_avg_sq", "exp_avg_sq_scales", "master")


def _min_subnormal(fmt_name: str) -> float:
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

    supports_mvas_weights = True  # it writes managed weights through their storage API (macroarch.mvas.tensor)

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, state_format: str = "fp8_e4m3",
                 state_block_size: int = 128, master_weights: bool = False, rounding: str = "stochastic",
                 min_state_numel: int = 4096, seed: int | None = None) -> None:
        if not lr >= 0.0:
            raise ValueError(f"lr={lr} must be >= 0")
        if not all(0.0 <= b < 1.0 for b in betas) or len(betas) != 2:
            raise ValueError(f"betas={betas} must be two values in [0, 1)")
        if not eps >= 0.0:
            raise ValueError(f"eps={eps} must be >= 0")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay={weight_decay} must be >= 0")
        state_format = get_format(state_format).name  # raises on an unknown name, listing the known ones
        if not isinstance(state_block_size, int) or state_block_size < 1:
            raise ValueError(f"state_block_size={state_block_size!r} must be a positive int")
        if rounding not in ("stochastic", "nearest"):
            raise ValueError(f"rounding={rounding!r} must be 'stochastic' or 'nearest'")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.state_format = state_format
        self.state_block_size = state_block_size
        self.master_weights = master_weights
        self.rounding = rounding
        self.min_state_numel = min_state_numel
        self.seed = int(torch.randint(0, 2**62, ())) if seed is None else int(seed)
        self._generators: dict[torch.device, torch.Generator] = {}
        self.skipped_nonfinite = 0  # steps skipped for an inf/NaN gradient or loss
        self.step_was_skipped = False  # whether the last step() skipped (LR schedulers may hold back)

    # ------------------------------------------------------------------------------------------- storage
    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            g = torch.Generator(device=device)
            g.manual_seed(self.seed + len(self._generators))
            self._generators[device] = g
        return self._generators[device]

    def _quantised(self, p: torch.Tensor) -> bool:
        return (self.state_format != "fp32" and p.numel() >= self.min_state_numel
                and (not get_format(self.state_format).block_scaled or p.numel() % self.state_block_size == 0))

    @staticmethod
    def _packed_state(state: dict) -> bool:
        return state["exp_avg"].dtype != torch.float32

    def _load(self, state: dict, key: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``start:stop`` of a moment as float32: a view of dense state (updated in place), or decoded."""
        value = state[key]
        if not self._packed_state(state):
            return value.view(-1)[start:stop]
        fmt = get_format(self.state_format)
        block = self.state_block_size if fmt.block_scaled else None
        scales = state.get(key + "_scales")
        packed = PackedTensor(fmt.name, (state["numel"],), torch.float32, block, value, scales)
        dense = packed.dequantize_range(start, stop)
        if key == "exp_avg_sq" and scales is not None:  # sqrt(v) that underflowed reads back as its block's floor
            floor = scales[start // block:stop // block] * _min_subnormal(fmt.name)
            dense = torch.maximum(dense.view(floor.numel(), -1), floor[:, None]).view(-1)
        return dense

    def _store(self, state: dict, key: str, start: int, stop: int, value: torch.Tensor) -> None:
        packed = pack(value, self.state_format, self.state_block_size)
        write_range(state[key], state.get(key + "_scales"), packed, start, stop)

    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
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
        """Elements updated at a time: whole blocks of the moments and of the packed weight, about CHUNK_NUMEL."""
        unit = self.state_block_size if self._packed_state(state) else 1
        if isinstance(p, MVASWeight):
            if p.write_unit == p.numel():
                return p.numel()  # one scale for the whole tensor: it cannot be re-packed in pieces
            unit = math.lcm(unit, p.write_unit)
        return max(unit, formats.CHUNK_NUMEL // unit * unit)

    # ------------------------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        self.step_was_skipped = (loss is not None and not all_finite([torch.as_tensor(loss).detach()])) or (
            not all_finite(grads))
        if self.step_was_skipped:
            self.skipped_nonfinite += 1
            return loss
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("MVASAdamW does not support sparse gradients")
                state = self.state[p] if self.state[p] else self._init_state(p)
                state["step"] += 1
                t = float(state["step"])
                bias1, bias2 = 1.0 - beta1 ** t, math.sqrt(1.0 - beta2 ** t)
                managed = isinstance(p, MVASWeight)
                rounding = "nearest" if "master" in state else self.rounding
                generator = self._generator(p.device) if managed and rounding == "stochastic" else None
                packed_state = self._packed_state(state)
                grad, flat_p = p.grad.reshape(-1), p.view(-1) if not managed else None
                chunk, n = self._chunk(p, state), p.numel()
                # large tensors are updated a chunk at a time: the float32 temporaries of the update (about ten
                # of them) stay bounded instead of growing with the tensor
                for start in range(0, n, chunk):
                    stop = min(start + chunk, n)
                    g = grad[start:stop].float()
                    m = self._load(state, "exp_avg", start, stop)
                    v = self._load(state, "exp_avg_sq", start, stop)
                    if packed_state:
                        v.square_()  # stored as sqrt(v)
                    m.lerp_(g, 1.0 - beta1)
                    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
                    denom = (v.sqrt() / bias2).add_(eps)
                    if managed:
                        w = (state["master"].view(-1)[start:stop] if "master" in state
                             else p.dequantize_range(start, stop))
                    else:
                        w = flat_p[start:stop] if p.dtype == torch.float32 else flat_p[start:stop].float()
                    w.mul_(1.0 - lr * wd).addcdiv_(m, denom, value=-lr / bias1)
                    if managed:
                        p.write_range(start, stop, w, rounding, generator)
                    elif p.dtype != torch.float32:
                        flat_p[start:stop] = w
                    if packed_state:
                        self._store(state, "exp_avg", start, stop, m)
                        self._store(state, "exp_avg_sq", start, stop, v.sqrt_())
        return loss

    # ------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["mvas_generators"] = {str(d): g.get_state() for d, g in self._generators.items()}
        sd["mvas_seed"] = self.seed
        sd["mvas_skipped_nonfinite"] = self.skipped_nonfinite
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        generators = state_dict.pop("mvas_generators", {})
        seed = state_dict.pop("mvas_seed", self.seed)
        self.skipped_nonfinite = int(state_dict.pop("mvas_skipped_nonfinite", 0))
        super().load_state_dict(state_dict)
        restore_saved_state(self, state_dict, _EXACT_KEYS)  # torch cast them to each parameter's dtype
        self.seed = seed
        self._generators = {}
        for device, rng in generators.items():
            g = torch.Generator(device=device)
            g.set_state(rng)
            self._generators[torch.device(device)] = g

    def state_bytes(self) -> int:
        """Bytes of the moments (payloads and scales) held now, masters excluded."""
        return sum(v.numel() * v.element_size() for s in self.state.values() for k, v in s.items()
                   if k.startswith("exp_avg") and torch.is_tensor(v))

