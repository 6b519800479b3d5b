"""Hyper-Connections (HC) and manifold-constrained Hyper-Connections (mHC), and the composite gain of their mixing.

Reference point R1 (see CLAIMS.md). A layer with sublayer ``F`` (attention or MLP) keeps ``n`` residual streams
``x`` of width ``d`` and updates them as ``x' = H_res x + H_post^T F(H_pre x)`` (``H_pre``, ``H_post``: 1 x n,
``H_res``: n x n). Three kinds of connection wrap a sublayer:

- ``"residual"``: the standard pre-LN residual ``x + F(x)`` (n = 1, ``H_res`` = the 1 x 1 identity).
- ``"hc"``: Hyper-Connections (Zhu et al. 2024, arXiv 2409.19606, Algorithm 2), static and optionally dynamic:
  ``A = A_static + s_alpha * tanh(LayerNorm(x) W_alpha)`` (n x (n+1): column 0 is ``H_pre^T``, the rest is
  ``A_r``, and ``H_res = A_r^T``), ``beta = B_static + s_beta * tanh(LayerNorm(x) W_beta)`` (``H_post``).
  Paper init: ``A_r = I``, column 0 = one-hot at ``layer_index % n``, ``B = 1``, ``W = 0``, ``s = 0.01``.
- ``"mhc"``: mHC (Xie et al. 2025, arXiv 2512.24880, eqs. 7-9): the streams are flattened to ``n*d``, RMSNormed
  and projected by ``phi`` (n*d x (n^2 + 2n)) into logits ``alpha * (x' phi) + b``; ``H_pre = sigmoid``,
  ``H_post = 2 sigmoid``, ``H_res = Sinkhorn-Knopp`` (exp, then ``t_max`` = 20 rounds of column then row
  normalisation: ``M_t = T_r(T_c(M_{t-1}))``, so rows sum to 1 exactly and columns approximately).

Streams start as n copies of the embedding and are summed before the final norm (HC paper, section 2).
``composite_gain`` measures mHC's "Amax gain magnitude" of the product of the ``H_res`` across depth.

Choices the papers leave open, and deviations:
- mHC init (not stated in the paper): ``phi = 0`` (as HC zero-inits its dynamic weights), ``alpha = 0.01``
  (mHC table 5), ``b_post = 0`` (``H_post = 1``, HC's ``B = 1``), ``b_pre`` = logit of a soft one-hot at
  ``layer_index % n`` that sums to 1 (HC's one-hot read), ``b_res`` = 0 on the diagonal and -4 off it (near
  HC's ``A_r = I``: 0.95 on the diagonal, yet off-diagonal logits still get useful gradients).
  With these inits, HC and mHC keep all n streams equal to the residual model's stream; the logits still differ
  a little, because the final LayerNorm sees the sum ``n x``, which only its eps tells apart from ``x``.
- Layer index counts sublayers (attention and MLP are layers 2k and 2k+1), as in mHC's figure 3.
- HC's norm is a LayerNorm (as in its Algorithm 2); mHC's is an RMSNorm without weight (the paper folds the
  weight into ``phi``) with torch's default eps instead of 1e-20.
- Small GPT-2-style dense decoder (LayerNorm, learned positions, GELU) instead of the papers' MoE/MLA models;
  mHC's fused kernels and recomputation (systems work) are not reproduced.
- The mixing matrix of a dynamic connection is the token average of ``H_res`` over the last forward batch
  (mHC's figures 3, 7, 8 average over the tokens of a sequence); a static one reports its current value.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

RESIDUAL_KINDS = ("residual", "hc", "mhc")
_DYNAMIC_SCALE_INIT = 0.01  # HC's s_alpha, s_beta and mHC's gating factors alpha (mHC table 5)
_MHC_PRE_LEAK = 0.04  # total H_pre weight the initial soft one-hot gives to the streams a layer does not read
_MHC_RES_OFFDIAG_LOGIT = -4.0


def sinkhorn_knopp(logits: Tensor, iters: int = 20, eps: float = 1e-12) -> Tensor:
    """Doubly stochastic matrices from ``(..., n, n)`` logits: ``exp``, then ``iters`` column-then-row normalisations.

    Plain differentiable torch ops (backpropagates through every iteration). ``eps`` only guards a sum that
    underflowed to 0; the logits are shifted by their (detached) max first, which leaves the result unchanged.
    """
    if iters < 1:
        raise ValueError(f"iters={iters!r} must be >= 1")
    if logits.dim() < 2 or logits.shape[-1] != logits.shape[-2]:
        raise ValueError(f"logits must have shape (..., n, n), got {tuple(logits.shape)}")
    m = torch.exp(logits - logits.detach().amax(dim=(-2, -1), keepdim=True))
    for _ in range(iters):
        m = m / m.sum(dim=-2, keepdim=True).clamp_min(eps)  # T_c: columns sum to 1
        m = m / m.sum(dim=-1, keepdim=True).clamp_min(eps)  # T_r: rows sum to 1
    return m


def _mix(weights: Tensor, h: Tensor) -> Tensor:
    """``weights @ h`` for ``(..., m, n)`` weights and ``(..., n, d)`` streams, as a broadcast multiply-sum.

    Same result as the matmul, which on CPU is far slower for many tiny per-token matrices when the weights are a
    transposed view (``docs/benchmarks.md``, "Measurements moved out of docstrings").
    """
    return (weights.unsqueeze(-1) * h.unsqueeze(-3)).sum(dim=-2)


class StreamConnection(nn.Module):
    """Wraps one sublayer ``F: (B, T, d) -> (B, T, d)``; maps streams ``(B, T, n, d)`` to ``(B, T, n, d)``."""

    def __init__(self, sublayer: nn.Module, n_streams: int) -> None:
        super().__init__()
        self.sublayer = sublayer
        self.n_streams = n_streams
        self._last_h_res: Tensor | None = None

    def residual_matrix(self) -> Tensor:
        """The n x n residual mixing ``H_res`` (detached; token-averaged over the last forward if dynamic)."""
        raise NotImplementedError

    def _record(self, h_res: Tensor) -> None:
        self._last_h_res = h_res.detach().reshape(-1, self.n_streams, self.n_streams).mean(0)


class ResidualConnection(StreamConnection):
    """``x + F(x)`` on a single stream."""

    def __init__(self, sublayer: nn.Module) -> None:
        super().__init__(sublayer, 1)

    def forward(self, h: Tensor) -> Tensor:
        return h + self.sublayer(h.squeeze(-2)).unsqueeze(-2)

    def residual_matrix(self) -> Tensor:
        return torch.eye(1)


class HyperConnection(StreamConnection):
    """Unconstrained Hyper-Connections (HC paper, Algorithm 2), parameter names as there."""

    def __init__(self, sublayer: nn.Module, d_model: int, n_streams: int, layer_index: int, dynamic: bool = True):
        super().__init__(sublayer, n_streams)
        n = n_streams
        alpha = torch.zeros(n, n + 1)
        alpha[layer_index % n, 0] = 1.0  # layer k reads stream k mod n
        alpha[:, 1:] = torch.eye(n)
        self.static_alpha = nn.Parameter(alpha)  # (n, n+1): [H_pre^T | A_r], H_res = A_r^T
        self.static_beta = nn.Parameter(torch.ones(n))  # H_post
        self.dynamic = dynamic
        if dynamic:
            self.norm = nn.LayerNorm(d_model)
            self.dynamic_alpha_fn = nn.Parameter(torch.zeros(d_model, n + 1))
            self.dynamic_alpha_scale = nn.Parameter(torch.tensor(_DYNAMIC_SCALE_INIT))
            self.dynamic_beta_fn = nn.Parameter(torch.zeros(d_model))
            self.dynamic_beta_scale = nn.Parameter(torch.tensor(_DYNAMIC_SCALE_INIT))

    def forward(self, h: Tensor) -> Tensor:
        alpha, beta = self.static_alpha, self.static_beta
        if self.dynamic:
            normed = self.norm(h)  # (B, T, n, d); row i of alpha depends on stream i only
            alpha = alpha + self.dynamic_alpha_scale * torch.tanh(normed @ self.dynamic_alpha_fn)  # (B, T, n, n+1)
            beta = beta + self.dynamic_beta_scale * torch.tanh(normed @ self.dynamic_beta_fn)  # (B, T, n)
        mixed = _mix(alpha.transpose(-1, -2), h)  # (B, T, n+1, d): layer input, then H_res x
        out = mixed[..., 1:, :] + beta.unsqueeze(-1) * self.sublayer(mixed[..., 0, :]).unsqueeze(-2)
        if self.dynamic:
            self._record(alpha[..., 1:].transpose(-1, -2))
        return out

    def residual_matrix(self) -> Tensor:
        if self.dynamic and self._last_h_res is not None:
            return self._last_h_res
        return self.static_alpha[:, 1:].detach().T.clone()


class ManifoldHyperConnection(StreamConnection):
    """mHC (eqs. 7-9): sigmoid ``H_pre``, ``2 sigmoid`` ``H_post``, Sinkhorn-Knopp ``H_res``."""

    def __init__(
        self, sublayer: nn.Module, d_model: int, n_streams: int, layer_index: int, dynamic: bool = True,
        sinkhorn_iters: int = 20,
    ):
        super().__init__(sublayer, n_streams)
        if sinkhorn_iters < 1:
            raise ValueError(f"sinkhorn_iters={sinkhorn_iters!r} must be >= 1")
        n = n_streams
        pre = torch.full((n,), _MHC_PRE_LEAK / n)
        pre[layer_index % n] = 1.0 - _MHC_PRE_LEAK * (n - 1) / n
        self.b_pre = nn.Parameter(torch.logit(pre, eps=1e-6))  # sigmoid(b_pre) sums to 1 (n = 1: 1 - 1e-6)
        self.b_post = nn.Parameter(torch.zeros(n))  # H_post = 2 sigmoid(0) = 1
        self.b_res = nn.Parameter(torch.full((n, n), _MHC_RES_OFFDIAG_LOGIT).fill_diagonal_(0.0))
        self.sinkhorn_iters = sinkhorn_iters
        self.dynamic = dynamic
        if dynamic:
            self.phi = nn.Parameter(torch.zeros(n * d_model, n * n + 2 * n))
            self.alpha_pre = nn.Parameter(torch.tensor(_DYNAMIC_SCALE_INIT))
            self.alpha_post = nn.Parameter(torch.tensor(_DYNAMIC_SCALE_INIT))
            self.alpha_res = nn.Parameter(torch.tensor(_DYNAMIC_SCALE_INIT))

    def _logits(self, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if not self.dynamic:
            return self.b_pre, self.b_post, self.b_res
        n = self.n_streams
        flat = h.flatten(-2)  # (B, T, n*d): mHC projects from the whole widened stream
        proj = F.rms_norm(flat, (flat.shape[-1],)) @ self.phi  # (B, T, n^2 + 2n)
        pre, post, res = proj.split([n, n, n * n], dim=-1)
        res = self.alpha_res * res.unflatten(-1, (n, n)) + self.b_res
        return self.alpha_pre * pre + self.b_pre, self.alpha_post * post + self.b_post, res

    def forward(self, h: Tensor) -> Tensor:
        pre, post, res = self._logits(h)
        h_pre, h_post = torch.sigmoid(pre), 2.0 * torch.sigmoid(post)
        h_res = sinkhorn_knopp(res, self.sinkhorn_iters)  # (n, n) or (B, T, n, n)
        layer_in = _mix(h_pre.unsqueeze(-2), h).squeeze(-2)  # (B, T, d)
        out = _mix(h_res, h) + h_post.unsqueeze(-1) * self.sublayer(layer_in).unsqueeze(-2)
        if self.dynamic:
            self._record(h_res)
        return out

    def residual_matrix(self) -> Tensor:
        if self.dynamic and self._last_h_res is not None:
            return self._last_h_res
        with torch.no_grad():
            return sinkhorn_knopp(self.b_res, self.sinkhorn_iters)


def make_connection(
    kind: str, sublayer: nn.Module, *, d_model: int, n_streams: int, layer_index: int, dynamic: bool = True,
    sinkhorn_iters: int = 20,
) -> StreamConnection:
    """Wrap ``sublayer`` with the connection ``kind`` (one of ``RESIDUAL_KINDS``; ``n_streams`` unused for residual)."""
    if kind == "residual":
        return ResidualConnection(sublayer)
    if n_streams < 1:
        raise ValueError(f"n_streams={n_streams!r} must be >= 1")
    if kind == "hc":
        return HyperConnection(sublayer, d_model, n_streams, layer_index, dynamic)
    if kind == "mhc":
        return ManifoldHyperConnection(sublayer, d_model, n_streams, layer_index, dynamic, sinkhorn_iters)
    raise ValueError(f"kind={kind!r} is not a residual kind; use one of {RESIDUAL_KINDS}")


@dataclass(frozen=True)
class HCLMConfig:
    """Shape of an ``HCTransformerLM``.

    Attributes:
        vocab_size, d_model, n_layers, n_heads, max_seq_len: as in GPT-2; ``d_model % n_heads == 0``.
        d_ff: MLP inner size (``4 * d_model`` when None).
        residual: connection around every sublayer, one of ``RESIDUAL_KINDS``.
        n_streams: residual streams n for ``"hc"``/``"mhc"`` (``"residual"`` always has one).
        dynamic: add the input-dependent part of the HC/mHC mappings.
        sinkhorn_iters: Sinkhorn-Knopp iterations ``t_max`` for ``"mhc"``.
        dropout: on embeddings, attention probabilities and sublayer outputs.
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int | None = None
    max_seq_len: int = 128
    residual: str = "residual"
    n_streams: int = 4
    dynamic: bool = True
    sinkhorn_iters: int = 20
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len", "n_streams",
                     "sinkhorn_iters"):
            value = getattr(self, name)
            if not (name == "d_ff" and value is None) and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} must be a positive int")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be a multiple of n_heads={self.n_heads}")
        if self.residual not in RESIDUAL_KINDS:
            raise ValueError(f"residual={self.residual!r} is not a residual kind; use one of {RESIDUAL_KINDS}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout!r} must lie in [0, 1)")

    @property
    def streams(self) -> int:
        return 1 if self.residual == "residual" else self.n_streams


class _CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.n_heads, self.dropout = n_heads, dropout
        self.out_dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)  # (B, nh, T, hs)
                   for t in self.qkv(self.norm(x)).split(C, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.out_dropout(self.proj(y.transpose(1, 2).reshape(B, T, C)))


class _MLP(nn.Module):
    def __init__(self, d_model: int, d_ff: int, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, d_ff)
        self.proj = nn.Linear(d_ff, d_model)
        self.out_dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.out_dropout(self.proj(F.gelu(self.fc(self.norm(x)))))


class LMOutput(NamedTuple):
    logits: Tensor  # (B, T, vocab_size)
    loss: Tensor | None  # next-token cross entropy when labels were given


class HCTransformerLM(nn.Module):
    """Causal pre-LN decoder whose every attention and MLP sublayer is wrapped by the chosen connection.

    ``layers`` holds the 2 * n_layers connections in depth order (attention, MLP, attention, ...); their
    sublayers have the same parameter names for every kind, so a ``"residual"`` state dict loads into an
    ``"hc"``/``"mhc"`` model with ``strict=False``.
    """

    def __init__(
        self, vocab_size: int, d_model: int, n_layers: int, n_heads: int, d_ff: int | None = None,
        max_seq_len: int = 128, *, residual: str = "residual", n_streams: int = 4, dynamic: bool = True,
        sinkhorn_iters: int = 20, dropout: float = 0.0,
    ) -> None:
        super().__init__()
        cfg = HCLMConfig(vocab_size, d_model, n_layers, n_heads, d_ff, max_seq_len, residual, n_streams, dynamic,
                         sinkhorn_iters, dropout)
        self.config = cfg
        self.wte = nn.Embedding(vocab_size, d_model)
        self.wpe = nn.Embedding(max_seq_len, d_model)
        self.dropout = nn.Dropout(dropout)
        sublayers = []
        for _ in range(n_layers):
            sublayers += [_CausalSelfAttention(d_model, n_heads, dropout), _MLP(d_model, d_ff or 4 * d_model, dropout)]
        for module in [self.wte, self.wpe, *sublayers]:
            module.apply(lambda m: _init_gpt2_(m, n_layers))
        self.layers = nn.ModuleList(
            make_connection(residual, sub, d_model=d_model, n_streams=cfg.streams, layer_index=i, dynamic=dynamic,
                            sinkhorn_iters=sinkhorn_iters)
            for i, sub in enumerate(sublayers)
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        _init_gpt2_(self.head, n_layers)

    def streams(self, input_ids: Tensor) -> Tensor:
        """The residual streams after the last layer, ``(B, T, n, d)``, before they are summed."""
        T = input_ids.shape[1]
        if T > self.config.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len={self.config.max_seq_len}")
        x = self.dropout(self.wte(input_ids) + self.wpe(torch.arange(T, device=input_ids.device)))  # (B, T, d)
        h = x.unsqueeze(-2).expand(*x.shape[:-1], self.config.streams, x.shape[-1])  # n copies of the embedding
        for layer in self.layers:
            h = layer(h)
        return h

    def forward(self, input_ids: Tensor, labels: Tensor | None = None) -> LMOutput:
        logits = self.head(self.norm(self.streams(input_ids).sum(dim=-2)))
        loss = None
        if labels is not None:  # position t predicts token t+1, as in Hugging Face causal LMs
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        return LMOutput(logits, loss)


def _init_gpt2_(module: nn.Module, n_layers: int) -> None:
    """GPT-2 init: N(0, 0.02), zero biases, output projections of sublayers scaled by 1/sqrt(2 n_layers)."""
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
    if isinstance(module, _CausalSelfAttention | _MLP):
        nn.init.normal_(module.proj.weight, std=0.02 / math.sqrt(2 * n_layers))


def mixing_matrices(model: nn.Module) -> list[Tensor]:
    """``H_res`` of every connection in ``model``, in depth (forward) order."""
    mats = [m.residual_matrix() for m in model.modules() if isinstance(m, StreamConnection)]
    if not mats:
        raise ValueError(f"{type(model).__name__} contains no StreamConnection")
    return mats


@dataclass(frozen=True)
class CompositeGain:
    """Amax gain of ``P_l = H_res^(l) ... H_res^(1)`` for l = 1..L (mHC section 3.1).

    Attributes:
        forward: ``(L,)`` max absolute row sum of ``P_l`` (worst-case forward signal expansion).
        backward: ``(L,)`` max absolute column sum of ``P_l`` (worst-case gradient expansion).
    """

    forward: Tensor
    backward: Tensor

    @property
    def peak_forward(self) -> float:
        return float(self.forward.max())

    @property
    def peak_backward(self) -> float:
        return float(self.backward.max())

    @property
    def peak(self) -> float:
        """Largest forward or backward gain over depth."""
        return max(self.peak_forward, self.peak_backward)


def composite_gain(model_or_mixing_matrices: nn.Module | Sequence[Tensor]) -> CompositeGain:
    """Composite gain per depth, from a model (via ``mixing_matrices``) or n x n matrices in forward order."""
    if isinstance(model_or_mixing_matrices, nn.Module):
        mats = mixing_matrices(model_or_mixing_matrices)
    else:
        mats = list(model_or_mixing_matrices)
    if not mats:
        raise ValueError("composite_gain needs at least one mixing matrix")
    n = mats[0].shape[-1]
    product = torch.eye(n, dtype=torch.float64)
    forward, backward = [], []
    for depth, h_res in enumerate(mats):
        if h_res.shape != (n, n):
            raise ValueError(f"mixing matrix {depth} has shape {tuple(h_res.shape)}, expected ({n}, {n})")
        product = h_res.detach().to(torch.float64) @ product
        forward.append(product.abs().sum(dim=1).max())
        backward.append(product.abs().sum(dim=0).max())
    return CompositeGain(torch.stack(forward), torch.stack(backward))


__all__ = ["RESIDUAL_KINDS", "CompositeGain", "HCLMConfig", "HCTransformerLM", "HyperConnection", "LMOutput",
           "ManifoldHyperConnection", "ResidualConnection", "StreamConnection", "composite_gain", "make_connection",
           "mixing_matrices", "sinkhorn_knopp"]
