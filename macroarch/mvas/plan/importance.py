"""Parameter importance for MVAS (post section 3.2, "parameter importance evaluation based on an approximate
diagonal of the Hessian"): Hutchinson's Hessian diagonal, the Fisher diagonal, and HAWQ-style sensitivity.

Hutchinson's estimator (Hutchinson 1989, "A stochastic estimator of the trace of the influence matrix") turned
into a diagonal estimator by Bekas, Kokiopoulou and Saad 2007 ("An estimator for the diagonal of a matrix"):
for Rademacher probes z (entries +-1 with probability 1/2), E[z * (H z)] = diag(H), because
z_i (Hz)_i = H_ii + sum_{j != i} H_ij z_i z_j and the cross terms have mean zero. One probe has variance
Var[z_i (Hz)_i] = sum_{j != i} H_ij^2 per element, so a single probe is very noisy: estimates are averaged
over ``n_probes`` probes per batch and over batches (or steps). Hz is a Hessian-vector product by double
backward, ``autograd.grad(grad, params, grad_outputs=z)``, which costs about two backward passes and keeps
the graph of the first backward alive (roughly 2-3x the memory of a plain backward).

The sum over j runs over *every* parameter the probe touches, so with one probe over the whole model the
diagonal of a small tensor drowns in the off-diagonal mass of all the others. ``per_tensor=True`` probes
one tensor at a time (z zero elsewhere), which estimates the same diagonal with only that tensor's own
off-diagonal terms in the variance, at one double backward per tensor per probe instead of one per probe
(probe counts and costs on the tiny Llama: ``docs/benchmarks.md``, "Measurements moved out of docstrings").

The Fisher diagonal is the cheap default: an EMA of squared gradients, read from ``.grad`` after the
training step's own backward, so it costs one multiply-add per element. It is the *empirical* Fisher
(gradients of the loss on the observed labels, not on labels sampled from the model) of the mini-batch
gradient, so it also includes the squared mean gradient and shrinks with the batch size; it approximates
the Hessian only near a minimum of a log-likelihood loss. Use it to rank tensors, not as a curvature.

Sensitivity follows HAWQ (Dong et al. 2019, "HAWQ: Hessian AWare Quantization") and HAWQ-V2 (Dong et al.
2020, which ranks layers by the average Hessian trace): quantising w to q(w) raises the loss by about
0.5 * dw^T H dw (the gradient term is dropped, as at a minimum); keeping only the diagonal gives
sum_i h_ii * (q(w)_i - w_i)^2 / 2 per tensor. Off-diagonal terms (within and across tensors) are ignored.

Deviations: HAWQ uses the top eigenvalue or the trace per layer; we keep the whole diagonal so that per-
element weighting and per-block summaries come for free. The Hutchinson diagonal of a non-convex loss, and
any noisy estimate, can be negative; nothing here clamps it (the allocation policy decides). Nothing here
writes ``.grad`` or the weights; the model's train/eval mode is the caller's (dropout makes the Hessian that
of one dropout sample per batch, shared by all its probes). An operation without a double backward raises
(we add the fix to the message), but a custom autograd.Function whose backward is marked
``once_differentiable`` drops its second-order terms silently (torch only errors if one differentiates
with respect to its outputs, never the case for parameters): only the case where *no* gradient depends on
the parameters can be detected, and it warns.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

LossFn = Callable[[nn.Module, Any], torch.Tensor]
"""``loss_fn(model, batch) -> scalar loss``."""


def rademacher_like(t: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """A tensor of t's shape, dtype and device with independent entries +-1, each with probability 1/2."""
    device = generator.device if generator is not None else t.device
    signs = torch.randint(0, 2, t.shape, generator=generator, device=device, dtype=t.dtype)
    return (signs * 2 - 1).to(t.device)


def hessian_diagonal_probe(
    grads: Sequence[torch.Tensor], params: Sequence[torch.Tensor], probe: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """One Hutchinson sample ``z * (H z)`` per parameter, H the Hessian of the loss whose ``grads`` (taken
    with ``create_graph=True``) are given; ``probe`` is z, one tensor per parameter. The graph is retained."""
    # A gradient that does not require grad is constant: the loss is at most linear in everything it
    # touches, so its block of H z is zero and it can be left out of the double backward.
    live = [i for i, g in enumerate(grads) if g.requires_grad]
    hz: list[torch.Tensor | None] = [None] * len(params)
    if live:
        try:
            hz = list(torch.autograd.grad(
                [grads[i] for i in live], params, grad_outputs=[probe[i] for i in live],
                retain_graph=True, allow_unused=True,
            ))
        except (RuntimeError, NotImplementedError) as err:
            raise RuntimeError(
                "Hessian-vector product failed: an operation in the model has no double backward "
                f"({err}). For transformers models on CPU build them with attn_implementation=\"eager\" "
                "(SDPA attention is not twice differentiable there), or use FisherDiagonal instead."
            ) from err
    return [z * h if h is not None else torch.zeros_like(z) for z, h in zip(probe, hz)]


def _trainable(model: nn.Module, params: Iterable[str] | None) -> dict[str, nn.Parameter]:
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if not named:
        raise ValueError("model has no trainable parameters (none with requires_grad=True)")
    if params is None:
        return named
    names = list(params)
    unknown = [n for n in names if n not in named]
    if unknown:
        raise ValueError(f"params names {unknown} are not trainable parameters of the model")
    if not names:
        raise ValueError("params is empty: name at least one parameter, or pass None for all")
    return {n: named[n] for n in names}


def _check_probes(n_probes: int) -> None:
    if not isinstance(n_probes, int) or n_probes < 1:
        raise ValueError(f"n_probes={n_probes!r} must be an integer >= 1")


def _accum_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # 16-bit estimates are averaged in float32


def _hutchinson_batch(
    params: Mapping[str, nn.Parameter],
    loss: torch.Tensor,
    n_probes: int,
    generator: torch.Generator | None,
    per_tensor: bool,
) -> dict[str, torch.Tensor]:
    """The mean of ``n_probes`` samples z * Hz for one loss, per parameter name."""
    tensors = list(params.values())
    grads = torch.autograd.grad(loss, tensors, create_graph=True, allow_unused=True)
    grads = [g if g is not None else torch.zeros_like(p) for g, p in zip(grads, tensors)]
    if not any(g.requires_grad for g in grads):
        warnings.warn(
            "no gradient depends on the parameters, so the Hessian diagonal comes out zero: either the loss is "
            "linear in them or a backward in the model is not differentiable (e.g. a custom autograd.Function "
            "marked once_differentiable, whose second-order terms are dropped silently)",
            stacklevel=3,
        )
    sums = [torch.zeros_like(p, dtype=_accum_dtype(p.dtype)) for p in tensors]
    for _ in range(n_probes):
        probe = [rademacher_like(p.detach(), generator) for p in tensors]
        if per_tensor:  # block-diagonal probing: z_T (H_TT z_T) per tensor T
            samples = [hessian_diagonal_probe([g], [p], [z])[0] for g, p, z in zip(grads, tensors, probe)]
        else:
            samples = hessian_diagonal_probe(grads, tensors, probe)
        for s, sample in zip(sums, samples):
            s += sample.detach()
    return {n: s / n_probes for n, s in zip(params, sums)}


class _RunningDiagonal:
    """Per-name running mean (``beta=None``) or bias-corrected EMA of elementwise tensors."""

    def __init__(self, beta: float | None) -> None:
        if beta is not None and not 0.0 <= beta < 1.0:
            raise ValueError(f"beta={beta!r} must be in [0, 1), or None for a plain mean")
        self.beta = beta
        self._values: dict[str, torch.Tensor] = {}
        self._counts: dict[str, int] = {}

    def _add(self, name: str, value: torch.Tensor) -> None:
        count = self._counts.get(name, 0) + 1
        old = self._values.get(name)
        if old is None:
            old = torch.zeros_like(value)
        if self.beta is None:
            self._values[name] = old + (value - old) / count
        else:
            self._values[name] = self.beta * old + (1.0 - self.beta) * value
        self._counts[name] = count

    @property
    def steps(self) -> int:
        """Updates seen so far (the most any tensor has had)."""
        return max(self._counts.values(), default=0)

    def diagonal(self) -> dict[str, torch.Tensor]:
        """The current estimate per name. An EMA is divided by ``1 - beta**count``, as in Adam, so that it
        is not biased towards its zero start; a mean needs no correction."""
        if self.beta is None:
            return {n: v.clone() for n, v in self._values.items()}
        return {n: v / (1.0 - self.beta ** self._counts[n]) for n, v in self._values.items()}

    def state_dict(self) -> dict[str, Any]:
        return {"beta": self.beta, "values": dict(self._values), "counts": dict(self._counts)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.beta = state["beta"]
        self._values = dict(state["values"])
        self._counts = dict(state["counts"])


def hutchinson_diagonal(
    model: nn.Module,
    loss_fn: LossFn,
    batches: Iterable[Any],
    n_probes: int = 16,
    *,
    params: Iterable[str] | None = None,
    generator: torch.Generator | None = None,
    per_tensor: bool = False,
) -> dict[str, torch.Tensor]:
    """Hutchinson's estimate of the Hessian diagonal of ``loss_fn(model, batch)``, per parameter name.

    Each batch gets one forward and first backward, then ``n_probes`` Hessian-vector products with fresh
    Rademacher probes; the result is the mean over all batches x probes (each batch weighted equally).
    ``params`` names the parameters to estimate (default: every one with requires_grad); the Hessian is
    still that of the whole loss, the others are just held fixed. ``per_tensor`` probes one tensor at a time
(lower variance, one double backward per tensor; see the module docstring). Tensors come back in the parameter's
    dtype, or float32 for 16-bit parameters. Raises ValueError for ``n_probes < 1``, no batches or a model
    without trainable parameters, and RuntimeError naming the fix when the model is not twice differentiable.
    """
    _check_probes(n_probes)
    chosen = _trainable(model, params)
    running = _RunningDiagonal(beta=None)
    for batch in batches:
        for name, value in _hutchinson_batch(chosen, loss_fn(model, batch), n_probes, generator, per_tensor).items():
            running._add(name, value)
    if running.steps == 0:
        raise ValueError("batches is empty: give at least one batch to estimate the Hessian on")
    return running.diagonal()


class HutchinsonEstimator(_RunningDiagonal):
    """Hutchinson's Hessian diagonal accumulated across training steps: call ``update(batch)`` every K steps.

    ``beta=None`` (default) keeps the plain mean of all updates, right while the weights barely move;
    ``beta`` in [0, 1) keeps a bias-corrected EMA that forgets old weights (beta=0.9 averages about the last
    ten updates). ``per_tensor`` as in :func:`hutchinson_diagonal`. Each update costs one forward, one
    backward with ``create_graph`` and ``n_probes`` double backwards (times the number of tensors with
    ``per_tensor``), and leaves ``.grad`` and the weights untouched, so it may run between a training step's
    ``backward()`` and ``step()`` or anywhere else.
    """

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        n_probes: int = 16,
        beta: float | None = None,
        *,
        params: Iterable[str] | None = None,
        generator: torch.Generator | None = None,
        per_tensor: bool = False,
    ) -> None:
        _check_probes(n_probes)
        super().__init__(beta)
        self.model, self.loss_fn, self.n_probes, self.generator = model, loss_fn, n_probes, generator
        self.per_tensor = per_tensor
        self.params = _trainable(model, params)

    def update(self, batch: Any) -> dict[str, torch.Tensor]:
        """Add this batch's estimate (mean over ``n_probes`` probes); returns the running diagonal."""
        loss = self.loss_fn(self.model, batch)
        estimate = _hutchinson_batch(self.params, loss, self.n_probes, self.generator, self.per_tensor)
        for name, value in estimate.items():
            self._add(name, value)
        return self.diagonal()


class FisherDiagonal(_RunningDiagonal):
    """The empirical Fisher diagonal: an EMA of squared gradients, read from ``.grad``.

    Call ``update(model)`` after each ``loss.backward()`` (before ``zero_grad``); parameters whose ``.grad``
    is None are skipped. With gradient accumulation ``.grad`` holds the accumulated gradient, so this is
    the Fisher of that gradient, not the mean of per-micro-batch squares. ``diagonal()`` divides the EMA by
    ``1 - beta**t`` (t this tensor's updates), as Adam does; ``beta=None`` keeps a plain mean instead.
    """

    def __init__(self, beta: float | None = 0.99) -> None:
        super().__init__(beta)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        seen = False
        for name, p in model.named_parameters():
            if p.requires_grad and p.grad is not None:
                g = p.grad.detach().to(_accum_dtype(p.grad.dtype))
                self._add(name, g * g)
                seen = True
        if not seen:
            raise ValueError("model has no parameter with a .grad: call update(model) after loss.backward()")


def fisher_diagonal(
    model: nn.Module, loss_fn: LossFn, batches: Iterable[Any], *, params: Iterable[str] | None = None
) -> dict[str, torch.Tensor]:
    """The empirical Fisher diagonal, the mean over batches of the squared batch gradient, per name.

    Gradients come from ``autograd.grad``, so ``.grad`` is left as it was. Parameters the loss does not
    reach get zeros.
    """
    chosen = _trainable(model, params)
    running = _RunningDiagonal(beta=None)
    tensors = list(chosen.values())
    for batch in batches:
        grads = torch.autograd.grad(loss_fn(model, batch), tensors, allow_unused=True)
        for (name, p), g in zip(chosen.items(), grads):
            g = torch.zeros_like(p) if g is None else g.detach()
            g = g.to(_accum_dtype(g.dtype))
            running._add(name, g * g)
    if running.steps == 0:
        raise ValueError("batches is empty: give at least one batch to estimate the Fisher on")
    return running.diagonal()


def tensor_importance(diag: Mapping[str, torch.Tensor], reduction: str = "mean") -> dict[str, float]:
    """One number per tensor: the ``"mean"`` of its diagonal (HAWQ-V2's average trace) or the ``"sum"``."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction={reduction!r} must be 'mean' or 'sum'")
    return {n: float(d.double().mean() if reduction == "mean" else d.double().sum()) for n, d in diag.items()}


def block_importance(diag: Mapping[str, torch.Tensor], block_size: int = 128) -> dict[str, torch.Tensor]:
    """Mean of the diagonal over consecutive blocks of ``block_size`` elements of each flattened tensor
    (row-major, so blocks run along the last dimension as block scales do); the last block may be shorter.
    Returns a 1-D tensor of ``ceil(numel / block_size)`` means per name."""
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size={block_size!r} must be an integer >= 1")
    out = {}
    for name, d in diag.items():
        flat = d.detach().reshape(-1)
        n_blocks = -(-flat.numel() // block_size)
        padded = torch.zeros(n_blocks * block_size, dtype=flat.dtype, device=flat.device)
        padded[: flat.numel()] = flat
        counts = torch.full((n_blocks,), float(block_size), dtype=flat.dtype, device=flat.device)
        counts[-1] = flat.numel() - (n_blocks - 1) * block_size
        out[name] = padded.view(n_blocks, block_size).sum(dim=1) / counts
    return out


@torch.no_grad()
def sensitivity(
    importance_diag: Mapping[str, torch.Tensor],
    weights: Mapping[str, torch.Tensor],
    quantize: Callable[[torch.Tensor, str], torch.Tensor],
    formats: Sequence[str],
) -> dict[str, dict[str, float]]:
    """HAWQ-style loss increase of quantising each tensor to each format: sum_i h_ii (q(w)_i - w_i)^2 / 2.

    ``quantize(w, fmt)`` returns the dequantised (round-to-nearest) tensor, same shape as ``w``; it gets a
    detached view of the weights and must not modify it. Sums are taken in float64. Names in
    ``importance_diag`` must all be in ``weights``, with the same shape; extra weights are ignored.
    """
    if not formats:
        raise ValueError("formats is empty: give at least one format name")
    out: dict[str, dict[str, float]] = {}
    for name, h in importance_diag.items():
        if name not in weights:
            raise ValueError(f"weights has no tensor {name!r}, which importance_diag names")
        w = weights[name].detach()
        if w.shape != h.shape:
            raise ValueError(f"weights[{name!r}] has shape {tuple(w.shape)}, importance {tuple(h.shape)}")
        h64, w64 = h.detach().double(), w.double()
        out[name] = {}
        for fmt in formats:
            q = quantize(w, fmt)
            if q.shape != w.shape:
                raise ValueError(f"quantize(w, {fmt!r}) returned shape {tuple(q.shape)} for {tuple(w.shape)}")
            err = q.double() - w64
            out[name][fmt] = 0.5 * float((h64 * err * err).sum())
    return out
