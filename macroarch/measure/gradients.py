"""Gradient flow through depth: per-layer norms, controlled spectra, growth-rate fits, gradient variance.

Realises the measurement behind claim C2 (post section 2.1): backpropagated gradients grow
exponentially with depth when the weights' singular values exceed 1 and vanish when they are below 1.
For a stack of ``sigma * orthogonal`` layers this is exact: the gradient reaching a layer's output that
has ``k`` layers after it has norm ``sigma**k * ||gradient at the stack's output||``.

- ``GradientNormRecorder``: hooks on any ``nn.Module`` (transformers and timm models included) that record,
  per backward pass, the gradient norm flowing into each block's output and the norm of each block's
  parameter gradient. Blocks default to the children of the model's largest repeated container
  (``find_repeated_layers``).
- ``controlled_stack``: a deep ``nn.Sequential`` whose weights all have every singular value equal to sigma.
- ``layer_jacobian_singular_values`` / ``end_to_end_singular_values``: per-sample Jacobian spectra
  (``torch.func``), for nets small enough to hold a dense Jacobian.
- ``fit_growth_rate``: least-squares slope of log-norm against depth, with its standard error.
  Pass depth counted *from the output* (layers between a block and the loss) and the slope estimates
  ``log(sigma)``; counted from the input, it estimates ``-log(sigma)``.
- ``minibatch_gradient_variance`` and ``layer_norm_spread``: the variance across mini-batches and the
  spread across layers that claim C6 (section 3.1, DGR) compares between training schemes.

Deviation from the post: it speaks of "weight singular values" loosely; here every singular value of
every weight is set to exactly sigma, so that the predicted rate is a number and not a range.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from macroarch._compat.autograd import at_backward_end
from macroarch.layers import find_repeated_layers

_ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {"tanh": nn.Tanh, "relu": nn.ReLU, "gelu": nn.GELU}


def _resolve_layers(model: nn.Module, layers: Sequence[str] | None) -> list[tuple[str, nn.Module]]:
    if layers is None:
        found = find_repeated_layers(model)
        if not found:
            raise ValueError(
                f"layers: {type(model).__name__} has no nn.ModuleList/nn.Sequential of >= 2 parameterised blocks "
                "of one class to find automatically; pass layers=[module names], input side first"
            )
        return found
    if isinstance(layers, str):
        raise ValueError(f"layers must be a list of module names, got the string {layers!r}; pass [{layers!r}]")
    names = list(layers)
    if not names:
        raise ValueError("layers is empty; pass at least one module name, or None to find the blocks")
    if len(set(names)) != len(names):
        raise ValueError(f"layers names a module twice: {names}")
    resolved = []
    for name in names:
        try:
            resolved.append((name, model.get_submodule(name)))
        except AttributeError:
            raise ValueError(f"layers: {type(model).__name__} has no submodule {name!r}") from None
    return resolved


def _first_tensor(output: Any) -> torch.Tensor | None:
    """The hidden state of a block's output: the tensor itself, or the first tensor of a tuple/list/dict."""
    if isinstance(output, torch.Tensor):
        return output
    values = output.values() if isinstance(output, Mapping) else output if isinstance(output, list | tuple) else ()
    return next((v for v in values if isinstance(v, torch.Tensor)), None)


class GradientNormRecorder:
    """Records per-block gradient norms for every backward pass run inside its ``with`` block.

    ``output_grad_norms[t, i]`` is the norm of the gradient flowing into block ``i``'s output in backward
    pass ``t`` (the backpropagated signal); ``param_grad_norms[t, i]`` the norm of that pass's gradient of
    block ``i``'s trainable parameters (this pass alone, whatever ``.grad`` accumulates). Blocks are in
    the order of ``names``: input side first. A block that returns a tuple, list or dict is measured on
    its first tensor (the hidden state, for transformers and timm blocks); a block called several times
    in one pass, or a parameter shared by several blocks, adds its squared norms. A block that the pass
    does not reach reports 0. Norms are float64 on the CPU. Activation checkpointing is not supported:
    its recomputed forward would hook tensors that no gradient reaches. Run the forward pass inside the
``with`` block too: the output hooks are attached as the blocks run.

    Usage::

        with GradientNormRecorder(model) as rec:
            loss_fn(model, batch).backward()
        rec.names, rec.output_grad_norms  # [L], (passes, L)
    """

    def __init__(self, model: nn.Module, layers: Sequence[str] | None = None):
        resolved = _resolve_layers(model, layers)
        self.names = [name for name, _ in resolved]
        self._modules = [module for _, module in resolved]
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._records: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._lock = threading.Lock()  # autograd runs hooks on one thread per device
        self._reset_pass()

    def __enter__(self) -> GradientNormRecorder:
        if self._handles:
            raise RuntimeError("GradientNormRecorder is already recording; it cannot be entered twice")
        # Tensor hooks on the block outputs rather than register_full_backward_hook: the latter wraps the
        # block's inputs and outputs in a BackwardHookFunction, which breaks blocks whose outputs are then
        # modified in place, and it sees only positional tensor inputs (HF passes most as kwargs).
        for i, module in enumerate(self._modules):
            self._handles.append(module.register_forward_hook(partial(self._on_forward, i)))
        blocks_of: dict[int, tuple[torch.Tensor, list[int]]] = {}
        for i, module in enumerate(self._modules):
            for p in module.parameters():
                if p.requires_grad:
                    blocks_of.setdefault(id(p), (p, []))[1].append(i)
        for p, blocks in blocks_of.values():
            # A hook on a leaf sees the gradient of this pass, summed over its uses, before accumulation.
            self._handles.append(p.register_hook(partial(self._on_grad, self._param_sq, blocks)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._reset_pass()  # hooks left on already-computed outputs check _handles and stay silent

    @property
    def output_grad_norms(self) -> torch.Tensor:
        """(passes, L) float64: norm of the gradient flowing into each block's output."""
        return self._stack(0)

    @property
    def param_grad_norms(self) -> torch.Tensor:
        """(passes, L) float64: norm of each block's parameter gradient in that pass."""
        return self._stack(1)

    def clear(self) -> None:
        """Forget the recorded passes (hooks stay in place)."""
        self._records.clear()

    def _stack(self, which: int) -> torch.Tensor:
        if not self._records:
            return torch.zeros(0, len(self.names), dtype=torch.float64)
        return torch.stack([record[which] for record in self._records])

    def _reset_pass(self) -> None:
        self._output_sq: list[torch.Tensor | None] = [None] * len(self._modules)
        self._param_sq: list[torch.Tensor | None] = [None] * len(self._modules)
        self._finish_queued = False

    def _on_forward(self, i: int, module: nn.Module, args: Any, output: Any) -> None:
        hidden = _first_tensor(output)
        if hidden is not None and hidden.requires_grad:
            hidden.register_hook(partial(self._on_grad, self._output_sq, [i]))

    def _on_grad(self, sums: list[torch.Tensor | None], blocks: list[int], grad: torch.Tensor) -> None:
        if not self._handles:
            return
        # Squared norms add over blocks' pieces; float64 so that sigma**64-sized ranges keep their digits.
        sq = torch.linalg.vector_norm(grad.detach(), dtype=torch.float64).square()
        with self._lock:
            for i in blocks:
                sums[i] = sq if sums[i] is None else sums[i] + sq
            if not self._finish_queued:
                # Runs once the whole backward pass (or autograd.grad call) is done: one record per pass.
                at_backward_end(self._finish_pass)
                self._finish_queued = True

    def _finish_pass(self) -> None:
        def norms(sums: list[torch.Tensor | None]) -> torch.Tensor:
            return torch.stack([torch.zeros((), dtype=torch.float64) if s is None else s.cpu() for s in sums]).sqrt()

        with self._lock:
            self._records.append((norms(self._output_sq), norms(self._param_sq)))
            self._reset_pass()


# ---------------------------------------------------------------------------------- controlled spectra
def random_orthogonal(n: int, generator: torch.Generator | None = None, dtype: torch.dtype = torch.float64):
    """A Haar-random (n, n) orthogonal matrix: QR of a Gaussian, with R's diagonal signs folded into Q."""
    a = torch.randn(n, n, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    # Without the sign fix QR's convention (positive diag R) biases the distribution away from Haar.
    return (q * torch.sign(torch.diagonal(r))).to(dtype)


def controlled_stack(
    depth: int,
    width: int,
    sigma: float,
    kind: str = "linear",
    activation: str | Callable[[], nn.Module] = "tanh",
    *,
    generator: torch.Generator | int | None = None,
    dtype: torch.dtype = torch.float32,
) -> nn.Sequential:
    """``depth`` bias-free ``Linear(width, width)`` layers with weights ``sigma * (random orthogonal)``.

    ``kind="linear"``: the Linears alone, so every singular value of every layer, and of the Jacobian of
    any run of ``k`` consecutive layers, is exactly ``sigma`` (``sigma**k``). ``kind="mlp"``: ``activation``
    (a name in ``"tanh"``, ``"relu"``, ``"gelu"``, or a factory returning a module) between consecutive
    Linears, none after the last. ``generator``: a ``torch.Generator``, an int seed, or None for the global
    RNG. The weights are drawn in float64 and cast to ``dtype``.
    """
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"depth={depth!r} must be >= 1")
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"width={width!r} must be >= 1")
    if not (isinstance(sigma, int | float) and math.isfinite(sigma) and sigma > 0):
        raise ValueError(f"sigma={sigma!r} must be positive and finite")
    if kind not in ("linear", "mlp"):
        raise ValueError(f"kind={kind!r} must be 'linear' or 'mlp'")
    if kind == "mlp":
        if isinstance(activation, str):
            if activation not in _ACTIVATIONS:
                raise ValueError(f"activation={activation!r} must be one of {sorted(_ACTIVATIONS)} or a factory")
            activation = _ACTIVATIONS[activation]
        elif not callable(activation):
            raise ValueError(f"activation={activation!r} must be a name or a callable returning an nn.Module")
    if isinstance(generator, int):
        generator = torch.Generator().manual_seed(generator)

    layers: list[nn.Module] = []
    for i in range(depth):
        linear = nn.Linear(width, width, bias=False, dtype=dtype)
        with torch.no_grad():
            linear.weight.copy_(sigma * random_orthogonal(width, generator))
        if kind == "mlp" and i > 0:
            layers.append(activation())
        layers.append(linear)
    return nn.Sequential(*layers)


def _per_sample_jacobian(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """(B, out_numel, in_numel): Jacobian of ``fn`` at each sample of ``x``, each run as a batch of one."""
    if x.dim() < 2:
        raise ValueError(f"x must have a leading batch dimension, got shape {tuple(x.shape)}")
    jac = torch.func.vmap(torch.func.jacrev(lambda xi: fn(xi.unsqueeze(0)).squeeze(0)))(x)
    out_numel = jac[0].numel() // x[0].numel()
    return jac.reshape(x.shape[0], out_numel, x[0].numel())


def layer_jacobian_singular_values(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(B, min(out, in)) singular values, descending, of d module(x_b) / d x_b for each sample b of x."""
    return torch.linalg.svdvals(_per_sample_jacobian(module, x))


def end_to_end_singular_values(stack: nn.Module | Iterable[nn.Module], x: torch.Tensor) -> torch.Tensor:
    """(B, k) singular values of the Jacobian of a whole stack: a module, or a ModuleList/list run in order.

    For a deep stack these are the product of the layers' local stretchings; compare their logs divided by
    the depth with ``log(sigma)``.
    """
    if isinstance(stack, nn.Module) and not isinstance(stack, nn.ModuleList):
        return layer_jacobian_singular_values(stack, x)
    modules = list(stack)

    def compose(h: torch.Tensor) -> torch.Tensor:
        for module in modules:
            h = module(h)
        return h

    return torch.linalg.svdvals(_per_sample_jacobian(compose, x))


# ----------------------------------------------------------------------------------------- growth fit
@dataclass(frozen=True)
class GrowthFit:
    """Least-squares fit ``log(norm) = intercept + rate * depth``."""

    rate: float
    """Slope: growth of log-norm per layer; ``log(sigma)`` for a controlled stack with depth from the output."""
    rate_stderr: float
    """OLS standard error of the slope, ``sqrt(SSR / (n - 2) / sum((d - mean d)**2))``."""
    intercept: float
    """log-norm at depth 0."""
    r2: float
    """Coefficient of determination; nan when the log-norms are all equal (nothing to explain)."""
    n: int
    """Number of points fitted."""


def fit_growth_rate(depths: Sequence[float] | torch.Tensor, norms: Sequence[float] | torch.Tensor) -> GrowthFit:
    """Fit the exponential growth rate of ``norms`` with ``depths`` by ordinary least squares on log(norm).

    Every norm must be positive and finite: a zero or non-finite norm (an underflowed or overflowed
    gradient, a block the pass did not reach) raises ValueError naming it instead of being dropped
    silently; drop such depths yourself if that is what the experiment means.
    """
    d = torch.as_tensor(depths, dtype=torch.float64).flatten()
    y = torch.as_tensor(norms, dtype=torch.float64).flatten()
    if d.numel() != y.numel():
        raise ValueError(f"depths and norms differ in length: {d.numel()} vs {y.numel()}")
    n = d.numel()
    if n < 3:
        raise ValueError(f"norms: need at least 3 points for a slope and its standard error, got {n}")
    if not torch.isfinite(d).all():
        raise ValueError(f"depths must be finite, got {d.tolist()}")
    bad = torch.nonzero(~(torch.isfinite(y) & (y > 0))).flatten()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(f"norms[{i}]={y[i].item()!r} (depth {d[i].item():g}): log-growth needs positive finite "
                         f"norms ({bad.numel()} bad of {n}); drop those depths before fitting")
    log_y = y.log()
    dc, yc = d - d.mean(), log_y - log_y.mean()
    sxx = float(dc.square().sum())
    if sxx == 0:
        raise ValueError("depths are all equal; a slope needs at least two distinct depths")
    rate = float((dc * yc).sum()) / sxx
    ssr = float((yc - rate * dc).square().sum())
    sst = float(yc.square().sum())
    return GrowthFit(
        rate=rate,
        rate_stderr=math.sqrt(ssr / (n - 2) / sxx),
        intercept=float(log_y.mean()) - rate * float(d.mean()),
        r2=1.0 - ssr / sst if sst > 0 else math.nan,
        n=n,
    )


# ------------------------------------------------------------------------------------------- variance
@dataclass(frozen=True)
class GradientVariance:
    """Spread of mini-batch gradients at fixed weights (``minibatch_gradient_variance``)."""

    trace: float
    """Unbiased trace of the covariance: ``sum_k ||g_k - mean g||**2 / (K - 1)``."""
    mean_grad_sq_norm: float
    """``||mean_k g_k||**2``; it overestimates ``||E g||**2`` by ``trace / K``."""
    num_batches: int
    """K."""
    num_params: int
    """Length of the gradient vector; ``trace / num_params`` is the mean per-coordinate variance."""
    group_traces: dict[str, float]
    """Trace restricted to each group's parameters; over a partition of the parameters they sum to ``trace``."""


def minibatch_gradient_variance(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    batches: Iterable[Any],
    params: Iterable[torch.Tensor] | None = None,
    groups: Mapping[str, Iterable[torch.Tensor]] | None = None,
) -> GradientVariance:
    """Trace of the covariance of the gradients of ``loss_fn(model, batch)`` over ``batches``, weights fixed.

    ``params``: the parameters that make up the gradient vector (default: every one with requires_grad).
    ``groups``: optional named subsets of them (e.g. ``{n: m.parameters() for n, m in find_repeated_layers(model)}``)
    whose own traces are reported. Gradients come from ``torch.autograd.grad``, so ``.grad`` is never
    touched; buffers (BatchNorm running statistics) are restored afterwards, so the model is left exactly
    as found. It runs in the model's current mode: dropout in train mode adds its own noise to the variance.
    Memory is O(parameters), not O(K * parameters): means and squared deviations are updated per batch
    (Welford), in float64.
    """
    chosen = (p for p in model.parameters() if p.requires_grad) if params is None else params
    params = list({id(p): p for p in chosen}.values())  # a parameter listed twice is one coordinate block
    if not params:
        raise ValueError("params is empty: no trainable parameters to take gradients of")
    index = {id(p): i for i, p in enumerate(params)}
    group_index: dict[str, list[int]] = {}
    for name, members in (groups or {}).items():
        group_index[name] = []
        for p in members:
            if id(p) not in index:
                raise ValueError(f"groups[{name!r}] holds a parameter that is not in params")
            group_index[name].append(index[id(p)])

    saved_buffers = [(b, b.detach().clone()) for b in model.buffers()]
    mean = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    m2 = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    k = 0
    try:
        with torch.enable_grad():
            for batch in batches:
                loss = loss_fn(model, batch)
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise ValueError(f"loss_fn must return a scalar tensor, got {type(loss).__name__} "
                                     f"of shape {tuple(getattr(loss, 'shape', ()))}")
                grads = torch.autograd.grad(loss.reshape(()), params, allow_unused=True)
                k += 1
                for g, mu, s in zip(grads, mean, m2):
                    g = torch.zeros_like(mu) if g is None else g.detach().to(torch.float64)
                    delta = g - mu
                    mu.add_(delta / k)
                    s.add_(delta * (g - mu))  # Welford: delta before the mean update times delta after it
    finally:
        with torch.no_grad():
            for buffer, value in saved_buffers:
                buffer.copy_(value)
    if k < 2:
        raise ValueError(f"batches: need at least 2 mini-batches for a variance, got {k}")

    per_param = [float(s.sum()) / (k - 1) for s in m2]
    return GradientVariance(
        trace=sum(per_param),
        mean_grad_sq_norm=sum(float(mu.square().sum()) for mu in mean),
        num_batches=k,
        num_params=sum(p.numel() for p in params),
        group_traces={name: sum(per_param[i] for i in idx) for name, idx in group_index.items()},
    )


@dataclass(frozen=True)
class NormSpread:
    """Spread of per-layer gradient norms (``layer_norm_spread``); population statistics over the layers."""

    mean: float
    std: float
    cv: float
    """``std / mean``: scale-free, but dominated by the largest norms."""
    log_std: float
    """Std of log-norms: the measure of "variance across layers" to use (``log_std**2``). It does not
    change with the loss scale, and for exponential growth it is ``|rate| * std(depth)``, so it measures
    the growth itself rather than its last few layers."""
    n: int


def layer_norm_spread(per_layer_norms: Sequence[float] | torch.Tensor) -> NormSpread:
    """Mean, std, coefficient of variation and std of log of one pass's per-layer norms (1-D, all > 0).

    Standard deviations divide by n, not n - 1: the layers are the whole population, not a sample.
    """
    x = torch.as_tensor(per_layer_norms, dtype=torch.float64)
    if x.dim() != 1 or x.numel() < 2:
        raise ValueError(f"per_layer_norms must be 1-D with at least 2 layers, got shape {tuple(x.shape)}")
    bad = torch.nonzero(~(torch.isfinite(x) & (x > 0))).flatten()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(f"per_layer_norms[{i}]={x[i].item()!r}: norms must be positive and finite")
    mean, std = float(x.mean()), float(x.std(correction=0))
    return NormSpread(mean=mean, std=std, cv=std / mean, log_std=float(x.log().std(correction=0)), n=x.numel())


__all__ = [
    "GradientNormRecorder",
    "GradientVariance",
    "GrowthFit",
    "NormSpread",
    "controlled_stack",
    "end_to_end_singular_values",
    "find_repeated_layers",
    "fit_growth_rate",
    "layer_jacobian_singular_values",
    "layer_norm_spread",
    "minibatch_gradient_variance",
    "random_orthogonal",
]
