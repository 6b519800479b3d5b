"""CompensatedAdamW vs torch.optim.AdamW: optimizer-step time and optimizer-state bytes, as ratios in one run.

    python benchmarks/optim.py                          # 4 x 256 GPT-2-style decoder (3.3M params), 1 thread
    python benchmarks/optim.py --layers 8 --width 512 --threads 2

Each set-up gets its own copy of one model (same initial weights) and the same fixed gradients; only
``optimizer.step()`` is timed (the gradients are put back before every step), round-robin over the set-ups for
``--rounds`` rounds so that load from other processes hits them alike; the median is reported. State bytes are
the optimizer's tensors after the first step (moments, master copies, counters). Set-ups: torch AdamW (fp32 and
bf16), CompensatedAdamW with every option off (fp32 and bf16: should cost what AdamW costs), with the fp32 master
copy on bf16 weights, with the 2^5 / max_grad_norm scale (one norm per step), with lost-update counting, and
``macroarch.measure.memory.MasterWeightAdamW`` (the fp32-master baseline).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from macroarch.models import get_model_spec
from macroarch.optim import CompensatedAdamW, MasterWeightAdamW

SETUPS = {
    "torch AdamW fp32": (torch.float32, lambda ps: torch.optim.AdamW(ps, lr=1e-3)),
    "CompensatedAdamW fp32 (options off)": (torch.float32, lambda ps: CompensatedAdamW(ps, lr=1e-3)),
    "torch AdamW bf16": (torch.bfloat16, lambda ps: torch.optim.AdamW(ps, lr=1e-3)),
    "CompensatedAdamW bf16 (options off)": (torch.bfloat16, lambda ps: CompensatedAdamW(ps, lr=1e-3)),
    "CompensatedAdamW bf16 + fp32 master": (torch.bfloat16,
                                            lambda ps: CompensatedAdamW(ps, lr=1e-3, master_weights=True)),
    "MasterWeightAdamW bf16": (torch.bfloat16, lambda ps: MasterWeightAdamW(ps, lr=1e-3)),
    "CompensatedAdamW fp32 + norm scale": (torch.float32, lambda ps: CompensatedAdamW(ps, lr=1e-3, grad_scale="norm")),
    "CompensatedAdamW bf16 + master + lost-update count": (
        torch.bfloat16, lambda ps: CompensatedAdamW(ps, lr=1e-3, master_weights=True, count_lost_updates=True)),
}


def state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    base = get_model_spec("gpt3_tiny").scaled(n_layers=args.layers, d_model=args.width, n_heads=4, n_kv_heads=4,
                                              d_ff=4 * args.width, dropout=0.0).build()
    n_params = sum(p.numel() for p in base.parameters())
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    base(input_ids=ids, labels=ids).loss.backward()
    grads = [p.grad.detach().clone() for p in base.parameters()]

    runs = {}
    for name, (dtype, make) in SETUPS.items():
        model = copy.deepcopy(base).to(dtype)
        params = list(model.parameters())
        opt = make(params)
        if getattr(opt, "grad_scaler", None) is not None:
            opt.scale_loss(torch.ones(()))  # the gradients below count as scaled by the first scale
        runs[name] = (params, [g.to(dtype) for g in grads], opt, [])

    def step(params, grads, opt):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        start = time.perf_counter()
        opt.step()
        return time.perf_counter() - start

    for params, grads, opt, _ in runs.values():  # state in place, as in every step after the first
        step(params, grads, opt)
    for _ in range(args.rounds):
        for params, grads, opt, times in runs.values():
            times.append(step(params, grads, opt))

    reference = statistics.median(runs["torch AdamW fp32"][3])
    print(f"{args.layers} x {args.width} decoder: {n_params / 1e6:.2f}M parameters, {args.threads} thread(s), "
          f"median of {args.rounds} steps")
    print(f"{'set-up':<52}{'step ms':>9}{'x AdamW fp32':>14}{'state B/param':>15}")
    for name, (_, _, opt, times) in runs.items():
        median = statistics.median(times)
        print(f"{name:<52}{1e3 * median:>9.2f}{median / reference:>14.2f}{state_bytes(opt) / n_params:>15.2f}")


if __name__ == "__main__":
    main()
