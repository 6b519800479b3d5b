"""Train a tiny GPT-2 or Llama on several processes, launched as users launch training: with torchrun.

    torchrun --nproc-per-node 2 examples/train_distributed.py --strategy ddp
    torchrun --nproc-per-node 2 examples/train_distributed.py --strategy fsdp2 --dgr sync
    torchrun --nproc-per-node 2 examples/train_distributed.py --strategy fsdp2 --mvas

Every rank builds the same model from its config (one seed; nothing is downloaded) and trains on its own
batches (seed + rank): the local byte corpus (``--data corpus``, ``macroarch.data``, built from the Python
standard library's source if missing) or a synthetic token stream (``--data synthetic``: random "words" in
random order, learnable in a few dozen steps). Rank 0 prints the loss of every step, averaged over ranks.

- ``--strategy ddp``: ``DistributedDataParallel``; ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on
  every block, then the root.
- ``--dgr sync``: DGR's per-group updates during backward, each group stepping once its gradients are
  reduced (``macroarch.dgr.distributed``): the same weights as the plain step, groups updated earlier.
- ``--mvas``: packed fp8 weights (``macroarch.mvas``), all-gathered packed by FSDP2 and updated by
  ``MVASAdamW`` (fsdp2 only: ``macroarch.mvas.interop.fsdp``).

The optimizer is ``CompensatedAdamW`` (with its options off: AdamW), or ``MVASAdamW`` with ``--mvas``.
Backend: NCCL when CUDA is available (one GPU per rank, ``LOCAL_RANK``), else gloo on the CPU.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

MODELS = {"gpt2": "gpt3_tiny", "llama": "llama_65b_tiny"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategy", choices=["ddp", "fsdp2"], required=True, help="data-parallel engine")
    p.add_argument("--dgr", choices=["off", "sync"], default="off", help="DGR per-group updates during backward")
    p.add_argument("--mvas", action="store_true", help="packed fp8 weights (fsdp2 only)")
    p.add_argument("--model", choices=sorted(MODELS), default="gpt2", help="architecture, built from its config")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--d-model", type=int, default=64, help="hidden size")
    p.add_argument("--data", choices=["synthetic", "corpus"], default="synthetic", help="token source")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank and step")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate")
    p.add_argument("--group-size", type=int, default=1, help="DGR: blocks per group")
    p.add_argument("--seed", type=int, default=0, help="model seed (data: seed + rank)")
    p.add_argument("--timeout", type=float, default=60.0, help="process group timeout, seconds")
    args = p.parse_args(argv)
    if args.mvas and args.strategy != "fsdp2":
        p.error("--mvas needs --strategy fsdp2 (packed weights are all-gathered by FSDP2; DDP would broadcast and "
                "all-reduce them as dense tensors)")
    for name in ("layers", "d_model", "steps", "batch_size", "seq_len", "group_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def token_batches(args: argparse.Namespace, vocab_size: int, rank: int):
    from macroarch.data import ensure_corpus, lm_batches, load_corpus

    if args.data == "corpus":
        tokens = load_corpus(ensure_corpus()).train
    else:  # 64 random "words" of 3-6 tokens, in random order: within a word every next token is predictable
        g = torch.Generator().manual_seed(1234)
        words = [torch.randint(0, vocab_size, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g)
                 for _ in range(64)]
        tokens = torch.cat([words[i] for i in torch.randint(0, len(words), (20_000,), generator=g).tolist()])
    return lm_batches(tokens, args.batch_size, args.seq_len, seed=args.seed * 1000 + rank + 1, steps=args.steps)


def build(args: argparse.Namespace, device: torch.device, example: dict):
    """(what the loop calls, the optimizer) for the chosen strategy, DGR and MVAS."""
    from macroarch.dgr import DGRWrapper
    from macroarch.dgr.distributed import data_parallel, fully_shard_groups, shard_blocks
    from macroarch.models import find_repeated_layers, get_model_spec
    from macroarch.optim import CompensatedAdamW

    spec = get_model_spec(MODELS[args.model]).scaled(n_layers=args.layers, d_model=args.d_model, dropout=0.0,
                                                      max_seq_len=max(128, args.seq_len))
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = spec.build(device=device)
    optimizer_cls, kwargs = CompensatedAdamW, {"lr": args.lr, "weight_decay": 0.0}
    shard_one = None
    if args.mvas:
        from macroarch import mvas
        from macroarch.mvas.interop.fsdp import fully_shard as shard_one  # packed shards and all-gathers
        plan = mvas.plan_from_rules(model, [("*.h.*", "fp8_e4m3"), ("*.layers.*", "fp8_e4m3")], block_size=32)
        mvas.apply(model, plan)
        optimizer_cls, kwargs = mvas.MVASAdamW, {**kwargs, "seed": args.seed}
    blocks = [name for name, _ in find_repeated_layers(model)]

    def shard(module: torch.nn.Module) -> None:  # FSDP2's usual plan: every block, then the root
        shard_blocks(module, blocks, shard_one)

    if args.dgr == "sync":
        wrapper = DGRWrapper(model, group_size=args.group_size, example_inputs=example, atomic_steps=False)
        if args.strategy == "ddp":
            run = data_parallel(wrapper, optimizer_cls, **kwargs)
        else:
            run = fully_shard_groups(wrapper, optimizer_cls, shard=shard, **kwargs)
        return run.model, run.optimizer
    if args.strategy == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model,
                                                          device_ids=[device.index] if device.type == "cuda" else None)
    else:
        shard(model)
    return model, optimizer_cls(model.parameters(), **kwargs)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        raise SystemExit("launch with torchrun: torchrun --nproc-per-node 2 examples/train_distributed.py "
                         "--strategy ddp (it sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        vocab = 256  # the byte vocabulary of macroarch.data, and the tiny specs' vocabulary
        batches = [(ids.to(device), labels.to(device)) for ids, labels in token_batches(args, vocab, rank)]
        model, optimizer = build(args, device, {"input_ids": batches[0][0], "labels": batches[0][1]})
        if rank == 0:
            print(f"{world} ranks ({backend}), {args.strategy}, dgr {args.dgr}, mvas {args.mvas}: "
                  f"{args.model} {args.layers}x{args.d_model}, {args.batch_size}x{args.seq_len} tokens per rank",
                  flush=True)
        start = time.perf_counter()
        for step, (ids, labels) in enumerate(batches):
            loss = model(input_ids=ids, labels=labels).loss
            try:
                loss.backward()
                optimizer.step()
            except Exception as exc:
                if args.mvas and step == 0:  # FSDP2 support of packed weights is new: say where it broke
                    raise RuntimeError(f"--mvas: the first step failed in {type(optimizer).__name__} on FSDP2's "
                                       f"sharded (DTensor) weights: {type(exc).__name__}: {exc}") from exc
                raise
            optimizer.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            if rank == 0:
                print(f"step {step + 1:4d}/{args.steps}  loss {mean.item() / world:.4f}", flush=True)
        if rank == 0:
            print(f"done: {args.steps} steps in {time.perf_counter() - start:.1f} s", flush=True)
        # every rank past its last collective before any tears gloo down: a rank that destroys the group while its
        # peer's last all-reduce is still in flight can abort the peer ("terminate called without an active
        # exception", seen once in 2 full test runs on a 2-core EPYC)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
