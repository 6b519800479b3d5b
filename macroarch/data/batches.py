"""Batches from a 1-D stream of byte tokens: causal-LM windows, evaluation windows, BERT masked-LM.

- :func:`lm_batches`: random windows drawn from a seeded ``torch.Generator``, as nanoGPT's ``get_batch``.
  ``labels`` equal ``input_ids`` (Hugging Face convention: the model shifts them by one position).
- :func:`eval_batches`: fixed, non-overlapping windows spread evenly over the split, so a small
  ``max_batches`` still sees all of it rather than its first files.
- :func:`mlm_batches`: BERT's masked-LM recipe (Devlin et al., 2018, section 3.1) on bytes. The byte
  vocabulary is extended by four special ids (``PAD_ID`` ... ``MASK_ID``, so ``MLM_VOCAB_SIZE`` = 260);
  each row is ``[CLS] seq_len-2 bytes [SEP]``. Each byte position is selected with ``mask_prob``; a selected
  position becomes ``[MASK]`` with probability 0.8, a uniformly random byte with 0.1, and stays itself with
  0.1; ``labels`` hold the original byte there and -100 everywhere else. Deviation: a row with no selected
  position gets one (uniformly placed), so the loss of a small batch is never undefined; this raises the
  selection rate by at most ``(1 - mask_prob) ** (seq_len - 2) / (seq_len - 2)``.

All iterators validate their arguments when called (not at the first ``next``), and are reproducible: the
same ``seed`` gives the same batches.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from macroarch.data.text import BYTE_VOCAB_SIZE

PAD_ID = BYTE_VOCAB_SIZE
CLS_ID = BYTE_VOCAB_SIZE + 1
SEP_ID = BYTE_VOCAB_SIZE + 2
MASK_ID = BYTE_VOCAB_SIZE + 3
SPECIAL_IDS = {"pad": PAD_ID, "cls": CLS_ID, "sep": SEP_ID, "mask": MASK_ID}
MLM_VOCAB_SIZE = BYTE_VOCAB_SIZE + len(SPECIAL_IDS)
IGNORE_INDEX = -100  # what torch's cross_entropy (and so transformers) skips


def _positive_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
    return value


def _token_stream(tokens, needed: int, what: str) -> torch.Tensor:
    tokens = torch.as_tensor(tokens)
    if tokens.ndim != 1 or tokens.dtype.is_floating_point or tokens.dtype.is_complex:
        raise ValueError(f"tokens: expected a 1-D integer tensor, got {tuple(tokens.shape)} {tokens.dtype}")
    if tokens.numel() < needed:
        raise ValueError(f"seq_len: {what} needs {needed} tokens but the split has only {tokens.numel()}; "
                         f"use a smaller seq_len or a larger corpus")
    return tokens


def _check_steps(steps: int | None) -> int | None:
    return None if steps is None else _positive_int("steps", steps, minimum=0)


def _random_windows(tokens: torch.Tensor, batch_size: int, length: int, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, tokens.numel() - length + 1, (batch_size,), generator=generator)
    index = starts[:, None] + torch.arange(length)  # (B, T)
    return tokens[index].long()


def lm_batches(tokens, batch_size: int, seq_len: int, *, seed: int,
               steps: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(input_ids, labels)`` pairs of int64 ``(batch_size, seq_len)`` random windows; endless if ``steps`` is None."""
    _positive_int("batch_size", batch_size)
    _positive_int("seq_len", seq_len, minimum=2)
    tokens = _token_stream(tokens, seq_len, f"seq_len={seq_len}")
    steps = _check_steps(steps)

    def batches():
        generator = torch.Generator().manual_seed(seed)
        step = 0
        while steps is None or step < steps:
            input_ids = _random_windows(tokens, batch_size, seq_len, generator)
            yield input_ids, input_ids.clone()
            step += 1

    return batches()


def eval_batches(tokens, batch_size: int, seq_len: int,
                 max_batches: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic ``(input_ids, labels)`` windows: ``min(n // seq_len, max_batches * batch_size)`` non-overlapping
    windows evenly spaced over ``tokens``, in order. The last batch may hold fewer than ``batch_size`` rows."""
    _positive_int("batch_size", batch_size)
    _positive_int("seq_len", seq_len, minimum=2)
    tokens = _token_stream(tokens, seq_len, f"seq_len={seq_len}")
    if max_batches is not None:
        _positive_int("max_batches", max_batches)
    available = tokens.numel() // seq_len
    count = available if max_batches is None else min(available, max_batches * batch_size)
    starts = torch.arange(count) * available // count * seq_len  # window i of `count`, spread over `available`

    def batches():
        for first in range(0, count, batch_size):
            index = starts[first:first + batch_size, None] + torch.arange(seq_len)  # (b, T)
            input_ids = tokens[index].long()
            yield input_ids, input_ids.clone()

    return batches()


def _mask_bytes(windows: torch.Tensor, generator: torch.Generator, mask_prob: float, mask_token_prob: float,
                random_token_prob: float) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's corruption of byte windows ``(B, L)``: returns ``(input_ids, labels)``, both ``(B, L)`` int64."""
    B, L = windows.shape
    selected = torch.rand(B, L, generator=generator) < mask_prob
    fallback = torch.randint(0, L, (B,), generator=generator)  # drawn always, so the stream does not depend on data
    empty_rows = ~selected.any(dim=1)
    selected[empty_rows, fallback[empty_rows]] = True
    action = torch.rand(B, L, generator=generator)
    to_mask = selected & (action < mask_token_prob)
    to_random = selected & (action >= mask_token_prob) & (action < mask_token_prob + random_token_prob)
    random_bytes = torch.randint(0, BYTE_VOCAB_SIZE, (B, L), generator=generator)

    input_ids = windows.clone()
    input_ids[to_mask] = MASK_ID
    input_ids[to_random] = random_bytes[to_random]
    labels = torch.where(selected, windows, IGNORE_INDEX)
    return input_ids, labels


def mlm_batches(tokens, batch_size: int, seq_len: int, *, seed: int, mask_prob: float = 0.15,
                mask_token_prob: float = 0.8, random_token_prob: float = 0.1,
                steps: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """Masked-LM batches for ``transformers.BertForMaskedLM`` (``vocab_size=MLM_VOCAB_SIZE``, ``pad_token_id=PAD_ID``).

    Yields ``{"input_ids", "attention_mask", "labels"}``, int64 ``(batch_size, seq_len)``: rows are
    ``[CLS] bytes [SEP]`` from random windows, corrupted as the module docstring says. Rows are never
    padded, so ``attention_mask`` is all ones. Endless if ``steps`` is None.
    """
    _positive_int("batch_size", batch_size)
    _positive_int("seq_len", seq_len, minimum=3)  # [CLS], at least one byte, [SEP]
    tokens = _token_stream(tokens, seq_len - 2, f"seq_len={seq_len} (with [CLS] and [SEP])")
    steps = _check_steps(steps)
    if not 0.0 < mask_prob <= 1.0:
        raise ValueError(f"mask_prob: expected a probability in (0, 1], got {mask_prob!r}")
    for name, p in (("mask_token_prob", mask_token_prob), ("random_token_prob", random_token_prob)):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"{name}: expected a probability in [0, 1], got {p!r}")
    if mask_token_prob + random_token_prob > 1.0:
        raise ValueError(f"mask_token_prob + random_token_prob: expected at most 1, got "
                         f"{mask_token_prob} + {random_token_prob}")

    def batches():
        generator = torch.Generator().manual_seed(seed)
        cls = torch.full((batch_size, 1), CLS_ID)
        sep = torch.full((batch_size, 1), SEP_ID)
        ignore = torch.full((batch_size, 1), IGNORE_INDEX)
        step = 0
        while steps is None or step < steps:
            windows = _random_windows(tokens, batch_size, seq_len - 2, generator)
            ids, labels = _mask_bytes(windows, generator, mask_prob, mask_token_prob, random_token_prob)
            yield {"input_ids": torch.cat([cls, ids, sep], dim=1),
                   "attention_mask": torch.ones(batch_size, seq_len, dtype=torch.long),
                   "labels": torch.cat([ignore, labels, ignore], dim=1)}
            step += 1

    return batches()
