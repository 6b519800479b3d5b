"""GradientBucketer vs DDP: micro-step time on gloo ranks, as ratios measured in the same run.

    python benchmarks/comm.py                                  # 8 x 512 GPT-2-style decoder (25M params), 2 ranks
    python benchmarks/comm.py --layers 12 --width 768 --rounds 5
    python benchmarks/comm.py --sizes 8 16 24 64 --threads 2

Ranks are launched as torchrun launches them (``macroarch.comm.launch``: gloo on loopback, one process per rank,
``--threads`` torch threads each) and train the same model from the same weights, each on its own batches. A
micro-step is forward, backward and gradient synchronisation; the set-ups (DDP with its defaults, 25 MiB
buckets and a 1 MiB first bucket; DDP with 8 MiB buckets; the bucketer at each ``--sizes``) take turns for
``--rounds`` rounds so that load from elsewhere hits them alike (``macroarch.measure.comm_bench.compare_bucketing``).
Reported: each set-up's micro-step time, collectives per step, bucket sizes, its largest gradient difference
from an explicit all-reduce average, and the ratios DDP time / bucketer time (target >= 1.0: at least parity).
"""

from __future__ import annotations

import argparse

from macroarch.measure.comm_bench import bucket_summary, compare_bucketing
from macroarch.measure.workload import Workload


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--sizes", type=float, nargs="+", default=[8.0, 25.0], help="bucketer sizes in MiB")
    parser.add_argument("--steps", type=int, default=6, help="timed micro-steps per set-up and round")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = parser.parse_args(argv)

    work = Workload(d_model=args.width, n_layers=args.layers, n_heads=args.heads, seq_len=args.seq_len,
                    batch_size=args.batch_size)
    setups = ([{"kind": "local"}, {"kind": "ddp", "bucket_mb": None}, {"kind": "ddp", "bucket_mb": 8}]
              + [{"kind": "bucketer", "bucket_mb": mb} for mb in args.sizes])
    rows = compare_bucketing(work, setups, steps=args.steps, warmup=args.warmup, rounds=args.rounds,
                             world_size=args.world_size, threads=args.threads)
    n_params = sum(p.numel() for p in work.model().parameters())
    print(f"{args.layers} x {args.width} GPT-2-style decoder, {n_params / 1e6:.1f}M params, {work.tokens} tokens per "
          f"rank, {args.world_size} gloo ranks x {args.threads} threads, {args.rounds} rounds x {args.steps} steps")
    print(bucket_summary(rows))
    t = {r["label"]: r["step_s"] for r in rows}
    for mb in args.sizes:
        mine = t[f"bucketer {mb:g} MiB"]
        print(f"bucketer {mb:g} MiB: DDP default / bucketer = {t['DDP 25 MiB (default)'] / mine:.3f}x, "
              f"DDP 8 MiB / bucketer = {t['DDP 8 MiB'] / mine:.3f}x (target >= 1.0)")
    print("per-round micro-step times (ms): " + "; ".join(
        f"{r['label']}: " + ", ".join(f"{x * 1e3:.0f}" for x in r["times"]) for r in rows))


if __name__ == "__main__":
    main()
