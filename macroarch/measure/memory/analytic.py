"""Exact analytic memory accounting for training a decoder-only transformer (claims C1, C4, C7).

Three things are counted, all as Python ints (bytes):

1. **Parameters**, exactly as the transformers model holds them (tied embeddings once):
   ``parameter_count(shape) == sum(p.numel() for p in model.parameters())``.
2. **Training state** under a ``PrecisionPolicy``: parameters, gradients, Adam's two moments and an
   optional master copy. The post's section 2.2 counts GPT-3 175B as 350 GB fp16 parameters +
   350 GB fp16 gradients + 700 GB Adam m, v = 1.4 TB (preset ``"post"``, 8 B/param, no master copy).
   The standard mixed-precision accounting (Rajbhandari et al. 2020, ZeRO, section 3.1) is 16 B/param:
   16-bit weights and gradients, fp32 master weights, fp32 m and v (preset ``"bf16_mixed"``).
3. **Activations**: the bytes alive at the end of one forward pass (everything autograd saved for
   backward, plus the logits and loss the forward returns), for ``GPT2LMHeadModel`` and
   ``LlamaForCausalLM`` with eager attention, labels passed so the model computes its loss.

The activation count is not a textbook formula: it lists every storage the Hugging Face
implementation saves (found with ``torch.autograd.graph.saved_tensors_hooks`` and confirmed with
``MemTracker``; see ``macroarch.measure.memory.measured``). With ``b`` batch, ``s`` sequence, ``h`` width,
``a`` heads, ``f`` MLP width, ``A`` bytes per activation element, a GPT layer with dropout on a GPU
saves ``8*A*bsh + 2*A*bsf + 2*bsh`` (two 1-byte dropout masks) ``+ (2*A + 1)*a*s*s*b`` plus the
LayerNorm statistics (``16*bs``). For ``A = 2``, ``f = 4h`` that is exactly Korthikanti et al. 2022
(Reducing Activation Recomputation, eq. 2): ``sbh*(34 + 5*a*s/h)``, the statistics excepted.
Where the two differ:

- Llama layers: RMSNorm upcasts its input to fp32 and saves that copy (``4*bsh`` per norm, not
  ``2*bsh``), the softmax is taken in fp32 and then cast back (``4 + 2`` bytes per score, not ``2 + 1 + 2``),
  the SwiGLU MLP saves four ``b*s*f`` tensors, and there is no dropout.
  Net effect at b = 1, s = 2048 in bf16: Llama-65B 190.4 GB against Korthikanti's 153.0 GB.
- Outside the layers (Korthikanti leave them out): the final norm, the lm_head input, the logits and
  their fp32 log-softmax (``(A + 4)*b*s*V``: for GPT-3 at b = 1, s = 2048, 0.6 GB of 276.2 GB),
  position ids, RoPE tables, the targets and the loss.
- ``device_type="cpu"``: PyTorch's CPU dropout saves its mask in the activation dtype rather than as
  1-byte bools, and CPU LayerNorm keeps its mean/rstd in the activation dtype rather than fp32. For
  GPT-3 that is 319.7 GB instead of 276.2 GB; Llama (no dropout, RMSNorm) is the same on both.

The activation count matches ``MemTracker`` to within ``ACTIVATION_TOLERANCE`` (relative), a margin
for whatever small allocation a future transformers release adds; on the pinned versions the two
agree to the byte on CPU. See ``tests/memory/test_measured.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from macroarch.models.spec import ModelSpec, TransformerShape

ACTIVATION_TOLERANCE = 0.02
"""Largest relative gap allowed between ``activation_bytes`` and a measured forward pass."""

_DEVICE_TYPES = ("cuda", "cpu")


@dataclass(frozen=True)
class PrecisionPolicy:
    """Which dtype each part of the training state is held in.

    Attributes:
        name: preset name.
        param_dtype: dtype of the model's parameters (the weights the forward pass reads).
        grad_dtype: dtype of the gradients (PyTorch keeps them in the parameter dtype).
        optimizer_state_dtype: dtype of each of Adam's moments m and v.
        master_dtype: dtype of a separate master copy of the weights, or None for none.
        activation_dtype: dtype of the activations (equal to ``param_dtype``: no autocast).
        description: where the accounting comes from.
    """

    name: str
    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    optimizer_state_dtype: torch.dtype
    master_dtype: torch.dtype | None
    activation_dtype: torch.dtype
    description: str = ""

    def __post_init__(self) -> None:
        for field in ("param_dtype", "grad_dtype", "optimizer_state_dtype", "activation_dtype"):
            value = getattr(self, field)
            if not isinstance(value, torch.dtype) or not value.is_floating_point:
                raise ValueError(f"{field}={value!r} must be a floating-point torch.dtype")
        if self.master_dtype is not None and (
            not isinstance(self.master_dtype, torch.dtype) or not self.master_dtype.is_floating_point
        ):
            raise ValueError(f"master_dtype={self.master_dtype!r} must be None or a floating-point torch.dtype")

    @property
    def param_bytes(self) -> int:
        return self.param_dtype.itemsize

    @property
    def grad_bytes(self) -> int:
        return self.grad_dtype.itemsize

    @property
    def optimizer_bytes(self) -> int:
        """Bytes per parameter of Adam's state: the two moments m and v."""
        return 2 * self.optimizer_state_dtype.itemsize

    @property
    def master_bytes(self) -> int:
        return 0 if self.master_dtype is None else self.master_dtype.itemsize

    @property
    def activation_bytes(self) -> int:
        return self.activation_dtype.itemsize

    @property
    def bytes_per_param(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.master_bytes


PRECISIONS: dict[str, PrecisionPolicy] = {
    p.name: p
    for p in (
        PrecisionPolicy(
            "fp32", torch.float32, torch.float32, torch.float32, None, torch.float32,
            "everything in fp32: 4 + 4 + 8 = 16 B/param",
        ),
        PrecisionPolicy(
            "fp16", torch.float16, torch.float16, torch.float16, None, torch.float16,
            "pure fp16 Adam, no master copy: 2 + 2 + 4 = 8 B/param",
        ),
        PrecisionPolicy(
            "post", torch.float16, torch.float16, torch.float16, None, torch.float16,
            "the post's section 2.2: fp16 params 2 + fp16 grads 2 + Adam m, v 4 = 8 B/param (1.4 TB for GPT-3)",
        ),
        PrecisionPolicy(
            "bf16_mixed", torch.bfloat16, torch.bfloat16, torch.float32, torch.float32, torch.bfloat16,
            "mixed precision (ZeRO, section 3.1): bf16 weights 2 + grads 2 + fp32 master 4 + fp32 m, v 8 = 16 B/param",
        ),
        PrecisionPolicy(
            "mixed", torch.float16, torch.float16, torch.float32, torch.float32, torch.float16,
            "mixed precision as the ZeRO paper counts it, fp16 weights: 2 + 2 + 4 + 8 = 16 B/param",
        ),
    )
}


def get_precision(precision: str | PrecisionPolicy) -> PrecisionPolicy:
    """The policy itself, or the preset of that name; an unknown name raises ValueError."""
    if isinstance(precision, PrecisionPolicy):
        return precision
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not a known policy; known: {sorted(PRECISIONS)}")
    return PRECISIONS[precision]


def _as_shape(model: ModelSpec | TransformerShape) -> TransformerShape:
    if isinstance(model, ModelSpec):
        return model.shape
    if isinstance(model, TransformerShape):
        return model
    raise ValueError(f"model={model!r} must be a ModelSpec or a TransformerShape")


def parameter_count(model: ModelSpec | TransformerShape) -> int:
    """Exact number of parameters of the built transformers model, tied weights counted once."""
    s = _as_shape(model)
    h, f, v = s.d_model, s.d_ff, s.vocab_size
    if s.family == "gpt2":
        # ln_1, ln_2 (weight + bias); c_attn (h x 3h + 3h); attn c_proj (h x h + h); c_fc; mlp c_proj.
        per_layer = 2 * 2 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)
        embeddings = v * h + s.max_seq_len * h  # token + learned position embeddings
        final_norm = 2 * h
    else:
        # q, o: h x h; k, v: h x kv_dim (grouped-query attention); gate, up, down: 3 h f; two RMSNorms.
        per_layer = 2 * h * h + 2 * h * s.kv_dim + 3 * h * f + 2 * h
        embeddings = v * h
        final_norm = h
    head = 0 if s.tied_embeddings else v * h
    return embeddings + s.n_layers * per_layer + final_norm + head


def training_state_bytes(
    model: ModelSpec | TransformerShape | int, precision: str | PrecisionPolicy
) -> dict[str, int]:
    """Bytes of parameters, gradients, optimizer state (Adam m, v) and master weights, and their total.

    ``model`` is a spec, a shape or a parameter count. Adam's per-tensor step counters (4 bytes per
    parameter tensor in torch.optim) are not counted: no accounting in the post or ZeRO counts them.
    """
    if isinstance(model, bool) or not isinstance(model, int):
        n = parameter_count(model)
    elif model < 0:
        raise ValueError(f"model={model} parameters must not be negative")
    else:
        n = model
    p = get_precision(precision)
    state = {
        "parameters": n * p.param_bytes,
        "gradients": n * p.grad_bytes,
        "optimizer_state": n * p.optimizer_bytes,
        "master_weights": n * p.master_bytes,
    }
    state["total"] = sum(state.values())
    return state


@dataclass(frozen=True)
class ActivationTerm:
    """One storage alive at the end of the forward pass, ``count`` times (once per layer, or once).

    Attributes:
        name: what it is, e.g. ``"attn.softmax"``.
        where: ``"layer"``, ``"embedding"`` or ``"head"`` (final norm, logits, loss).
        nbytes: bytes of one such storage.
        count: how many there are.
    """

    name: str
    where: str
    nbytes: int
    count: int = 1

    @property
    def total(self) -> int:
        return self.nbytes * self.count


def _activation_dtype(precision: str | PrecisionPolicy | torch.dtype) -> torch.dtype:
    if isinstance(precision, torch.dtype):
        if not precision.is_floating_point:
            raise ValueError(f"precision={precision} must be a floating-point dtype")
        return precision
    return get_precision(precision).activation_dtype


def activation_terms(
    model: ModelSpec | TransformerShape,
    batch_size: int,
    seq_len: int,
    precision: str | PrecisionPolicy | torch.dtype = "bf16_mixed",
    device_type: str = "cuda",
) -> list[ActivationTerm]:
    """Every storage alive after one training forward pass (eager attention, loss computed inside).

    ``device_type`` picks the kernels whose saved tensors are counted: ``"cuda"`` (1-byte dropout
    masks, fp32 LayerNorm statistics) or ``"cpu"`` (both in the activation dtype).
    """
    s = _as_shape(model)
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")
    if seq_len > s.max_seq_len:
        raise ValueError(f"seq_len={seq_len} exceeds the model's max_seq_len={s.max_seq_len}")
    if device_type not in _DEVICE_TYPES:
        raise ValueError(f"device_type={device_type!r} must be one of {_DEVICE_TYPES}")
    act = _activation_dtype(precision).itemsize
    on_gpu = device_type == "cuda"
    mask = 1 if on_gpu else act  # bool mask from native_dropout on GPU; a dtype-valued noise tensor on CPU
    dropout = s.dropout > 0
    b, h, f, a, v = batch_size, s.d_model, s.d_ff, s.n_heads, s.vocab_size
    bs, bsh, bsf, scores = b * seq_len, b * seq_len * h, b * seq_len * f, b * a * seq_len * seq_len
    L = s.n_layers

    def layer(name: str, nbytes: int) -> ActivationTerm:
        return ActivationTerm(name, "layer", nbytes, L)

    terms: list[ActivationTerm] = []
    if s.family == "gpt2":
        stat = 4 if on_gpu else act  # LayerNorm mean and rstd
        for ln in ("ln_1", "ln_2"):
            terms += [layer(f"{ln}.input", act * bsh), layer(f"{ln}.mean", stat * bs), layer(f"{ln}.rstd", stat * bs)]
        terms += [
            layer("attn.c_attn.input", act * bsh),
            # matmul flattens (b, a, s, d) to (b*a, s, d): for b > 1 that copies q, k and v out of the
            # fused qkv output; for b = 1 they stay views of it. Same bytes either way.
            layer("attn.query", act * bsh),
            layer("attn.key", act * bsh),
            layer("attn.value", act * bsh),
            layer("attn.softmax", act * scores),
            layer("attn.c_proj.input", act * bsh),
            layer("mlp.c_fc.input", act * bsh),
            layer("mlp.gelu.input", act * bsf),
            layer("mlp.c_proj.input", act * bsf),
        ]
        if dropout:
            terms += [
                layer("attn.dropout.mask", mask * scores),
                layer("attn.dropout.output", act * scores),
                layer("attn.resid_dropout.mask", mask * bsh),
                layer("mlp.dropout.mask", mask * bsh),
                ActivationTerm("embedding.dropout.mask", "embedding", mask * bsh),
            ]
        terms += [
            ActivationTerm("position_ids", "embedding", 8 * seq_len),
            ActivationTerm("ln_f.input", "head", act * bsh),
            ActivationTerm("ln_f.mean", "head", stat * bs),
            ActivationTerm("ln_f.rstd", "head", stat * bs),
        ]
    else:
        for norm in ("input_layernorm", "post_attention_layernorm"):
            terms += [
                # RMSNorm computes in fp32: it saves the fp32 copy of its input (the input itself in fp32).
                layer(f"{norm}.input_fp32", 4 * bsh),
                layer(f"{norm}.rsqrt", 4 * bs),
                layer(f"{norm}.normed", act * bsh),
            ]
        terms += [
            layer("attn.qkv.input", act * bsh),
            layer("attn.query_rope", act * bsh),
            # With grouped-query attention the saved key and value are repeat_kv's full-width copies.
            layer("attn.key", act * bsh),
            layer("attn.value", act * bsh),
            layer("attn.softmax_fp32", 4 * scores),
            layer("attn.o_proj.input", act * bsh),
            layer("mlp.input", act * bsh),
            layer("mlp.gate", act * bsf),
            layer("mlp.silu", act * bsf),
            layer("mlp.up", act * bsf),
            layer("mlp.down.input", act * bsf),
        ]
        if dropout:
            terms += [layer("attn.dropout.mask", mask * scores), layer("attn.dropout.output", act * scores)]
        elif act != 4:
            terms.append(layer("attn.probs_cast", act * scores))  # softmax(...).to(bf16) is a new tensor
        terms += [
            ActivationTerm("rope.cos", "embedding", act * seq_len * s.head_dim),
            ActivationTerm("rope.sin", "embedding", act * seq_len * s.head_dim),
            ActivationTerm("norm.input_fp32", "head", 4 * bsh),
            ActivationTerm("norm.rsqrt", "head", 4 * bs),
            ActivationTerm("norm.normed", "head", act * bsh),
        ]
    terms += [
        ActivationTerm("lm_head.input", "head", act * bsh),
        ActivationTerm("logits", "head", act * bs * v),  # returned by the forward, so still alive
        ActivationTerm("log_softmax_fp32", "head", 4 * bs * v),  # the loss upcasts logits to fp32
        # The loss pads the labels by one and slices off the first: for b = 1 the slice is already
        # contiguous, so the saved targets keep the padded (s + 1)-long storage alive.
        ActivationTerm("loss.targets", "head", 8 * (bs if b > 1 else seq_len + 1)),
        ActivationTerm("loss.total_weight", "head", 4),
        ActivationTerm("loss", "head", 4),
    ]
    return terms


def activation_bytes(
    model: ModelSpec | TransformerShape,
    batch_size: int,
    seq_len: int,
    precision: str | PrecisionPolicy | torch.dtype = "bf16_mixed",
    device_type: str = "cuda",
) -> dict[str, int]:
    """Activation bytes after one forward pass: ``per_layer``, ``layers``, ``embedding``, ``head``, ``total``.

    See ``activation_terms`` for the storages counted and the module docstring for how they compare
    with Korthikanti et al.'s formula.
    """
    terms = activation_terms(model, batch_size, seq_len, precision, device_type)
    out = {where: sum(t.total for t in terms if t.where == where) for where in ("layer", "embedding", "head")}
    return {
        "per_layer": sum(t.nbytes for t in terms if t.where == "layer"),
        "layers": out["layer"],
        "embedding": out["embedding"],
        "head": out["head"],
        "total": sum(out.values()),
    }


def loss_temporary_bytes(model: ModelSpec | TransformerShape, batch_size: int, seq_len: int) -> int:
    """Bytes the causal-LM loss holds while it runs beyond what it keeps for backward: the fp32 copy of the logits
    it takes the log-softmax of (``4*b*s*V``) and, for ``b > 1``, the labels padded by one before they are sliced
    (``8*b*(s + 1)``; for ``b = 1`` the slice keeps that storage, counted in ``activation_terms``). So the largest
    the activations get in one step, the loss computing, is ``activation_bytes(...)["total"]`` plus these."""
    s = _as_shape(model)
    padded = 8 * batch_size * (seq_len + 1) if batch_size > 1 else 0
    return 4 * batch_size * seq_len * s.vocab_size + padded


def korthikanti_activation_bytes(model: ModelSpec | TransformerShape, batch_size: int, seq_len: int) -> int:
    """Korthikanti et al. 2022, eq. 2, all layers: ``L * s*b*h*(34 + 5*a*s/h)`` bytes (16-bit, GPT layer).

    A reference for cross-checking ``activation_bytes``, not a measurement of any implementation.
    """
    s = _as_shape(model)
    b = batch_size
    return s.n_layers * (34 * seq_len * b * s.d_model + 5 * s.n_heads * seq_len * seq_len * b)


_UNITS = {
    "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
}


def format_bytes(nbytes: int, unit: str = "GB", digits: int = 1) -> str:
    """``nbytes`` in ``unit``: decimal (GB = 1e9, as the post counts) or binary (GiB = 2**30)."""
    if unit not in _UNITS:
        raise ValueError(f"unit={unit!r} is not one of {list(_UNITS)}")
    return f"{nbytes / _UNITS[unit]:,.{digits}f} {unit}"
