"""DGR-sync vs plain training: step time and peak memory (gradients and total), in the same run, as ratios.

    python benchmarks/dgr.py                                   # 256-layer GPT-2-style LM, width 64, batch 8 x 128
    python benchmarks/dgr.py --model hc --layers 64 --group-size 8
    python benchmarks/dgr.py --model llama_65b_tiny --layers 32 --no-atomic

Two copies of one model (same initial weights) train with torch.optim.AdamW: one plainly, one through
``DGRWrapper`` in sync mode. Timed steps alternate between them (plain, DGR, plain, ...) so that load from
other processes on a shared machine hits both alike; the median step is reported. Memory comes from one
further step of each under MemTracker (``macroarch.measure.memory.measured``'s categories), with AdamW's state
already in place. The two copies must end with equal weights: sync DGR is exact.

Models: ``hc`` is ``HCTransformerLM`` with plain residual connections (its repeated container holds
attention and MLP sublayers separately, so one "layer" of ``--group-size`` is half a transformer layer);
the registry names (``gpt3_tiny``, ``llama_65b_tiny``, ...) are scaled to ``--layers`` and ``--width``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from macroarch.dgr import DGRWrapper
from macroarch.measure.memory import format_bytes, measure_step
from macroarch.models import MODELS, get_model_spec


def build(name: str, layers: int, width: int, heads: int, seq_len: int) -> torch.nn.Module:
    if name == "hc":
        from macroarch.models.hyperconnections import HCTransformerLM

        return HCTransformerLM(256, width, layers, heads, max_seq_len=seq_len, residual="residual")
    spec = get_model_spec(name)
    return spec.scaled(n_layers=layers, d_model=width, n_heads=heads, n_kv_heads=heads, d_ff=4 * width,
                       dropout=0.0, max_seq_len=max(seq_len, spec.shape.max_seq_len)).build()


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def paired_ratio_quartiles(plain: list[float], dgr: list[float]) -> tuple[float, float, float]:
    """Quartiles (lower, median, upper) of ``plain[i] / dgr[i]``: each DGR step against the plain step timed just
    before it. Load from other processes drifts more slowly than a step, so the paired ratios cancel most of it,
    and their spread says how far the ratio of medians can be trusted."""
    if len(plain) != len(dgr) or not plain:
        raise ValueError(f"paired_ratio_quartiles: {len(plain)} plain and {len(dgr)} DGR times; need equal, >= 1")
    pairs = sorted(p / d for p, d in zip(plain, dgr))
    if len(pairs) == 1:
        return pairs[0], pairs[0], pairs[0]
    low, mid, high = statistics.quantiles(pairs, n=4, method="inclusive")
    return low, mid, high


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt3_tiny", choices=["hc", *sorted(n for n in MODELS if "tiny" in n)])
    parser.add_argument("--layers", type=int, default=256)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5, help="timed steps of each, alternating")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps of each first")
    parser.add_argument("--no-atomic", action="store_true", help="DGR without snapshot-and-restore of each group")
    parser.add_argument("--no-memory", action="store_true", help="skip the MemTracker steps")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    plain = build(args.model, args.layers, args.width, args.heads, args.seq_len).train()
    net = copy.deepcopy(plain)
    ids = torch.randint(0, 256, (args.batch_size, args.seq_len))
    dgr = DGRWrapper(net, group_size=args.group_size, atomic_steps=not args.no_atomic,
                     example_inputs={"input_ids": ids, "labels": ids})
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    opt_dgr = dgr.optimizer(torch.optim.AdamW, lr=1e-4)
    n_params = sum(p.numel() for p in plain.parameters())
    largest = format_bytes(max(g.nbytes for g in dgr.grouping), "MB", 2)
    print(f"{args.model}: {args.layers} layers, width {args.width}, {n_params / 1e6:.2f}M parameters, batch "
          f"{args.batch_size} x {args.seq_len}, {torch.get_num_threads()} threads; DGR group_size "
          f"{args.group_size}: {len(dgr.grouping)} groups, largest {largest}"
          f"{', atomic steps' if not args.no_atomic else ''}")

    times: dict[str, list[float]] = {"plain": [], "dgr": []}
    for i in range(args.warmup + args.steps):
        batch = torch.randint(0, 256, (args.batch_size, args.seq_len))
        for name, model, opt in (("plain", plain, opt_plain), ("dgr", dgr, opt_dgr)):
            start = time.perf_counter()
            train_step(model, opt, batch)
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)
    diff = max((a - b).abs().max().item() for a, b in zip(plain.parameters(), net.parameters()))
    t_plain, t_dgr = statistics.median(times["plain"]), statistics.median(times["dgr"])
    ratio = t_plain / t_dgr
    quartiles = paired_ratio_quartiles(times["plain"], times["dgr"])
    equal = "bitwise equal" if diff == 0 else f"differ, max |difference| {diff:.2e}"
    print(f"step time (median of {args.steps}): plain {t_plain:.3f} s, DGR-sync {t_dgr:.3f} s; "
          f"speed ratio plain/DGR {ratio:.3f}x (target >= 0.95x: {'met' if ratio >= 0.95 else 'NOT met'}); "
          f"weights {equal} (sync DGR must be exact)")
    print(f"  paired ratios plain/DGR (each DGR step against the plain step before it): median {quartiles[1]:.3f}x, "
          f"quartiles {quartiles[0]:.3f}x-{quartiles[2]:.3f}x; step-to-step spread of plain alone "
          f"{min(times['plain']):.3f}-{max(times['plain']):.3f} s")
    print(f"  all steps plain: {', '.join(f'{t:.3f}' for t in times['plain'])}")
    print(f"  all steps DGR:   {', '.join(f'{t:.3f}' for t in times['dgr'])}")
    if args.no_memory:
        return
    batch = torch.randint(0, 256, (args.batch_size, args.seq_len))
    mem_plain = measure_step(lambda: train_step(plain, opt_plain, batch), plain, opt_plain, batch)
    mem_dgr = measure_step(lambda: train_step(dgr, opt_dgr, batch), dgr, opt_dgr, batch)
    rows = [("gradients (max)", mem_plain.max_by_category["gradients"], mem_dgr.max_by_category["gradients"]),
            ("total (peak)", mem_plain.peak_bytes, mem_dgr.peak_bytes)]
    for category in ("parameters", "optimizer_state", "activations", "temporaries", "gradients"):
        rows.append((f"  {category} at peak", mem_plain.by_category[category], mem_dgr.by_category[category]))
    print(f"{'memory':<28}{'plain':>14}{'DGR-sync':>14}{'plain/DGR':>12}")
    for label, a, b in rows:
        ratio = f"{a / b:.2f}x" if b else "-"
        print(f"{label:<28}{format_bytes(a, 'MB', 2):>14}{format_bytes(b, 'MB', 2):>14}{ratio:>12}")
    print(f"gradient memory cut {rows[0][1] / rows[0][2]:.1f}x with {len(dgr.grouping)} groups")


if __name__ == "__main__":
    main()
