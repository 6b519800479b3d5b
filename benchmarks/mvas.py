"""MVAS against low-bit optimizers: bytes per parameter of the training state, step time at several tokens per step
and eval loss, in one run.

    python benchmarks/mvas.py                      # Llama-style LM, 4 layers, width 256; 100 steps of 1024 tokens,
                                                   # then step time at 4096 and 16384 tokens per step
    python benchmarks/mvas.py --tokens 1024 --steps 20 --layers 2 --width 128     # a quick run
    python benchmarks/mvas.py --only "AdamW fp32,MVAS + DGR" --json out.json

Every variant trains a copy of the same initial model on the same batches of the byte corpus:

==============================  =================================================================================
AdamW fp32                      torch.optim.AdamW (foreach), fp32 weights: the fair speed reference on a CPU
                                that emulates bf16 (AVX2 only), where every bf16 variant computes slowly
AdamW bf16 + fp32 master        bf16 weights and gradients, fp32 master and moments, stepped by torch's foreach
                                AdamW on the masters (``ForeachMasterAdamW`` here; what a mixed-precision trainer
                                runs): the reference for eval loss, and for speed where bf16 is native
AdamW bf16 + fp32 master (per   the same state with ``MasterWeightAdamW`` (torch's single-tensor AdamW, one
tensor)                         parameter at a time); only with ``--only``
torchao AdamW8bit / AdamW4bit   torchao.optim, fp32 weights, block-quantised moments (compiled step)
bitsandbytes AdamW8bit          bnb.optim.AdamW8bit, fp32 weights, blockwise dynamic 8-bit moments
MVAS                            bf16 compute, ``compose.apply`` with a budget plan (fp16/fp8/fp4 by sensitivity,
                                ``--weight-bytes`` per managed element): ``mvas.apply``, ``MVASAdamW`` (fp8 moments,
                                stochastic rounding)
MVAS + DGR                      the same inside ``DGRWrapper`` (sync): each group's gradients are freed once it steps
MVAS + DGR (eager)              the same with ``MACROARCH_COMPILE=0`` (``macroarch.mvas._kernels``' eager path);
                                only with ``--only`` or ``--eager-too``
==============================  =================================================================================

**Timing.** Steps go round-robin over the variants (one step of each in turn), so load from other processes hits
all alike. Training runs ``--steps`` steps at the first ``--tokens`` count (sequences of ``--seq-len`` bytes); its
first ``--warmup`` steps are not timed and its first step is reported apart ("first step s": allocation, and
compilation where a variant compiles: torchao's step, MVAS's kernels). Each further ``--tokens`` count adds
``--size-warmup`` untimed and ``--timed-steps`` timed steps of each variant on batches of that many tokens; the
median step is reported at every count, with its ratio to both references. ``torch._dynamo`` graphs compiled
during the timed steps are counted: a recompile there would be timed, and the run says so. Where the time goes: each
timed training step at the first ``--tokens`` count is split into forward, backward and optimizer step (with
``zero_grad``), and the median of each phase is reported per variant (DGR's groups step inside backward).

**torchao on CPU.** Its ``AdamW8bit``/``AdamW4bit`` compile ``single_param_adam`` with ``dynamic=False`` under
``disable_cache_limit``: one graph per distinct parameter shape and state kind (torch 2.14 / torchao 0.18,
``TORCH_LOGS=recompiles``: "tensor 'p' size mismatch" for the first call of each shape, then none: the step
counter and the learning rate are tensors, so no recompilation per step). The cost is all in the first step:
on a cold Inductor cache about 15-50 s per shape on one loaded core (C++ compilation), seconds on a warm cache
(``OptimState4bit`` has no ``_stable_hash_for_caching``, so torchao 4-bit misses the AOT cache and pays more).
Hence the warm-up: each variant's first step is kept out of the median and reported.

Bytes per parameter are the maxima over one more steady-state step under MemTracker of weights, gradients,
optimizer state and master copies (``macroarch.measure.memory.measured`` categories), divided by the parameter
count; where MemTracker cannot follow the step (torchao's compiled step) the bytes of the tensors held are
counted. Eval loss and next-token accuracy are on held-out windows, after the training steps at the first
tokens count. The issue's targets for MVAS + DGR: at most 4 bytes per parameter, eval loss within 1% of the
bf16 + master reference and at least 0.9x its speed at 1024 tokens per step; the summary says where it lands
against both references and which one is fair on this CPU (native bf16 or not).
"""

from __future__ import annotations

import argparse
import copy
import time
import warnings
from collections.abc import Iterable

import torch
from _common import (
    BF16_REFERENCE,
    FP32_REFERENCE,
    compile_switch,
    dynamo_graphs,
    fair_reference,
    format_size,
    format_table,
    kernel_stats,
    kernels,
    machine_lines,
    machine_record,
    parse_sizes,
    write_json,
)
from torch.optim.adam import adam

from macroarch import compose
from macroarch.config import DGRConfig, MacroConfig, OptimConfig
from macroarch.data import ensure_corpus, eval_batches, lm_batches, load_corpus
from macroarch.dgr import DGRWrapper
from macroarch.experiments.loop import PHASES, evaluate_lm, lm_step, train_round_robin
from macroarch.measure.memory import STATE_CATEGORIES, measure_step
from macroarch.models import get_model_spec
from macroarch.mvas import packable, plan_for_budget
from macroarch.optim import MasterWeightAdamW

REFERENCE = BF16_REFERENCE
EAGER = "MVAS + DGR (eager)"
PER_TENSOR = "AdamW bf16 + fp32 master (per tensor)"
VARIANTS = ("AdamW fp32", "AdamW bf16 + fp32 master", "torchao AdamW8bit", "torchao AdamW4bit",
            "bitsandbytes AdamW8bit", "MVAS", "MVAS + DGR", EAGER, PER_TENSOR)
DEFAULT_VARIANTS = VARIANTS[:7]
TARGETS = dict(bytes_per_param=4.0, eval_loss_gap=0.01, speed=0.9)


class ForeachMasterAdamW(torch.optim.Optimizer):
    """AdamW on fp32 master copies of 16-bit parameters with torch's foreach kernels: cast the gradients to fp32,
    ``torch.optim.adam.adam(..., foreach=True, decoupled_weight_decay=True)`` on the masters, copy the masters
    back into the parameters. The state is ``MasterWeightAdamW``'s (``master``, ``exp_avg``, ``exp_avg_sq``,
    ``step``), so the memory measurement files it the same way."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p] = dict(master=p.detach().float(), exp_avg=torch.zeros_like(p, dtype=torch.float32),
                                     exp_avg_sq=torch.zeros_like(p, dtype=torch.float32), step=torch.tensor(0.0))

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201 (torch's signature)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            states = [self.state[p] for p in params]
            masters = [s["master"] for s in states]
            adam(masters, [p.grad.float() for p in params], [s["exp_avg"] for s in states],
                 [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states], foreach=True,
                 decoupled_weight_decay=True, amsgrad=False, beta1=group["betas"][0], beta2=group["betas"][1],
                 lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
            torch._foreach_copy_(params, masters)
        return None


def mvas_plan(model: torch.nn.Module, weight_bytes: float):
    """Budget plan: the managed-size tensors at ``weight_bytes`` per element on average, by squared-error proxy."""
    named = dict(model.named_parameters())
    eligible, kept = packable(named)
    return plan_for_budget(named, target_bytes=int(weight_bytes * sum(p.numel() for p in eligible.values())) + kept,
                           formats=("fp16", "fp8_e4m3", "fp4_e2m1"), block_size=32)


def counted_state(model: torch.nn.Module, opt: torch.optim.Optimizer, step) -> dict[str, int]:
    """Bytes of the weights, gradients (after a backward) and optimizer state actually held, by storage."""
    from torch.distributed._tools.common_utils import get_untyped_storages

    def nbytes(tensors) -> int:
        seen = {}
        for t in tensors:
            for s in get_untyped_storages(t):
                seen[s.data_ptr()] = s.nbytes()
        return sum(seen.values())

    step()
    model(input_ids=torch.zeros(1, 2, dtype=torch.long), labels=torch.zeros(1, 2, dtype=torch.long)).loss.backward()
    params = list(model.parameters())
    counted = dict(parameters=nbytes(params), gradients=nbytes(p.grad for p in params if p.grad is not None),
                   optimizer_state=nbytes(v for s in opt.state.values() for k, v in s.items()
                                          if torch.is_tensor(v) and k not in ("step", "master")),
                   master_weights=nbytes(s["master"] for s in opt.state.values() if "master" in s))
    opt.zero_grad(set_to_none=True)
    return counted


def make(variant: str, initial: torch.nn.Module, args: argparse.Namespace, example: dict):
    """``(model to call, optimizer)`` for one variant, from a copy of ``initial``."""
    model = copy.deepcopy(initial)
    lr, wd = args.lr, 0.0
    if variant == "AdamW fp32":
        return model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd, foreach=True)
    if variant == "AdamW bf16 + fp32 master":
        model = model.to(torch.bfloat16)
        return model, ForeachMasterAdamW(model.parameters(), lr=lr, weight_decay=wd)
    if variant == PER_TENSOR:
        model = model.to(torch.bfloat16)
        return model, MasterWeightAdamW(model.parameters(), lr=lr, weight_decay=wd)
    if variant.startswith("torchao"):
        import torchao.optim

        cls = torchao.optim.AdamW8bit if variant.endswith("8bit") else torchao.optim.AdamW4bit
        return model, cls(model.parameters(), lr=lr, weight_decay=wd)
    if variant == "bitsandbytes AdamW8bit":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import bitsandbytes as bnb
        return model, bnb.optim.AdamW8bit(model.parameters(), lr=lr, weight_decay=wd)
    if variant.startswith("MVAS"):
        model = model.to(torch.bfloat16)  # computes in bf16, as the AdamW baseline does
        dgr = "DGR" in variant  # DGR: sync, one group per layer
        config = MacroConfig(optim=OptimConfig(lr=lr, weight_decay=wd), dgr=DGRConfig(group_size=1 if dgr else None))
        stack = compose.apply(model, config, plan=mvas_plan(model, args.weight_bytes),
                              example_inputs=example if dgr else None, seed=args.seed)
        return stack.model, stack.optimizer
    raise ValueError(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")


def speed_rows(variants: Iterable[str], step_s: dict[int, dict[str, float]]) -> list[list]:
    """One row per variant: at every tokens count, the median step in ms and its speed relative to both
    references (reference time / its time: above 1 is faster); ``None`` where a reference was not run."""
    rows = []
    for v in variants:
        row: list = [v]
        for tokens in step_s:
            t = step_s[tokens].get(v)
            row.append(None if t is None else f"{1e3 * t:.0f}")
            for ref in (REFERENCE, FP32_REFERENCE):
                base = step_s[tokens].get(ref)
                row.append(None if base is None or t is None else f"{base / t:.2f}x")
        rows.append(row)
    return rows


def speed_headers(tokens: Iterable[int]) -> list[str]:
    headers = ["variant"]
    for n in tokens:
        headers += [f"{format_size(n)} tok ms", "x bf16+m", "x fp32"]
    return headers


def target_checks(result: dict, ref: dict, step_s: dict[int, dict[str, float]], tokens: int,
                  fair: str) -> list[tuple[str, bool]]:
    """The issue's targets for MVAS + DGR, as ``(what, met)``: bytes per parameter, eval loss against the bf16 +
    master reference, and speed at ``tokens`` against the bf16 + master reference and against ``fair``."""
    most = TARGETS["bytes_per_param"]
    checks = [(f"<= {most:g} bytes/param", result["bytes_per_param"] <= most),
              (f"eval loss within {TARGETS['eval_loss_gap']:.0%}",
               result["eval_loss"] <= (1 + TARGETS["eval_loss_gap"]) * ref["eval_loss"])]
    mine = step_s[tokens]["MVAS + DGR"]
    for name in dict.fromkeys((REFERENCE, fair)):
        if name in step_s[tokens]:
            ratio = step_s[tokens][name] / mine
            checks.append((f">= {TARGETS['speed']}x {name} at {tokens} tokens ({ratio:.2f}x)",
                           ratio >= TARGETS["speed"]))
    return checks


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--tokens", default="1024,4096,16384",
                        help="tokens per step, multiples of --seq-len; training (eval loss) at the first")
    parser.add_argument("--steps", type=int, default=100, help="training steps at the first --tokens")
    parser.add_argument("--warmup", type=int, default=5, help="of --steps, untimed")
    parser.add_argument("--timed-steps", type=int, default=3, help="timed steps at each further --tokens")
    parser.add_argument("--size-warmup", type=int, default=1, help="untimed steps at each further --tokens")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--weight-bytes", type=float, default=0.9, help="MVAS: bytes per managed weight element")
    parser.add_argument("--eval-batches", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", default=None, help="comma-separated variant names")
    parser.add_argument("--eager-too", action="store_true", help=f"add {EAGER!r} to the default variants")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    try:
        args.tokens = parse_sizes(args.tokens, name="--tokens", multiple_of=args.seq_len)
    except ValueError as e:
        parser.error(str(e))
    if args.warmup < 1 or args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must exceed --warmup {args.warmup} (>= 1: the first step compiles)")
    if args.timed_steps < 1 or args.size_warmup < 0:
        parser.error(f"--timed-steps {args.timed_steps} must be >= 1 and --size-warmup {args.size_warmup} >= 0")
    default = DEFAULT_VARIANTS + ((EAGER,) if args.eager_too else ())
    args.variants = default if args.only is None else tuple(dict.fromkeys(v.strip() for v in args.only.split(",")))
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    wall = time.perf_counter()
    torch.set_num_threads(args.threads)
    variants = args.variants
    info = machine_record()  # what the JSON says it ran on (emulation included)
    fair = fair_reference(info)
    for line in machine_lines(info):
        print(line)
    print(f"fair speed reference here: {fair} ({'bf16 is native' if info['native_bf16'] else 'bf16 is emulated'})")

    text = load_corpus(ensure_corpus("stdlib"))
    spec = get_model_spec("llama_65b_tiny").scaled(n_layers=args.layers, d_model=args.width, n_heads=args.heads,
                                                    n_kv_heads=args.heads, d_ff=int(8 * args.width / 3) // 32 * 32,
                                                    max_seq_len=args.seq_len)
    torch.manual_seed(args.seed)
    initial = spec.build()
    n_params = sum(p.numel() for p in initial.parameters())
    first = args.tokens[0]
    batch = first // args.seq_len
    train = list(lm_batches(text.train, batch, args.seq_len, seed=args.seed, steps=args.steps))
    held_out = list(eval_batches(text.val, batch, args.seq_len, max_batches=args.eval_batches))
    example = dict(input_ids=train[0][0], labels=train[0][1])
    print(f"{args.layers}-layer Llama-style LM, width {args.width}: {n_params / 1e6:.2f}M parameters; {args.steps} "
          f"steps of {batch}x{args.seq_len} tokens, then step time at {', '.join(map(str, args.tokens[1:])) or '-'} "
          f"tokens per step; {torch.get_num_threads()} thread(s)")

    eager_ids = set()
    runs = {}
    for v in variants:
        with compile_switch(False if v == EAGER else None):
            runs[v] = make(v, initial, args, example)
        if v == EAGER:
            eager_ids.add(id(runs[v][0]))

    phases: dict[int, list[tuple[float, float, float]]] = {id(model): [] for model, _ in runs.values()}

    def step(model, opt, batch):  # the eager variant's steps run with the MVAS kernels switched off
        with compile_switch(False if id(model) in eager_ids else None):
            return lm_step(model, opt, batch, phases[id(model)])

    # warm-up (first step: allocation, compilation), then the timed training steps
    kernels_before = kernel_stats()
    logs = train_round_robin(runs, train[:args.warmup], step=step, desc=None)
    first_step = {v: logs[v].seconds[0] for v in variants}
    kernels_warm = kernel_stats()
    graphs = dynamo_graphs()
    for record in phases.values():
        record.clear()  # the phases of the timed steps only
    rest = train_round_robin(runs, train[args.warmup:], step=step, desc=f"training at {first} tokens per step",
                             mininterval=10)
    phase_s = {v: phase_medians(phases[id(runs[v][0])]) for v in variants}
    step_s = {first: {v: statistics_median(rest[v].seconds) for v in variants}}
    losses = {v: logs[v].losses + rest[v].losses for v in variants}

    results = {}
    for v in variants:
        model, opt = runs[v]
        inner = model.module if isinstance(model, DGRWrapper) else model

        def one_step(model=model, opt=opt, v=v):
            step(model, opt, train[0])

        try:
            with compile_switch(False if v == EAGER else None):
                mem = measure_step(one_step, inner, opt, *train[0])
            state, how = {k: mem.max_by_category[k] for k in STATE_CATEGORIES}, "tracked"
        except Exception as e:  # noqa: BLE001 (MemTracker cannot follow torchao's compiled step)
            print(f"  {v}: MemTracker failed ({type(e).__name__}); bytes counted from the tensors held instead")
            state, how = counted_state(inner, opt, one_step), "counted"
        with compile_switch(False if v == EAGER else None):
            ev = evaluate_lm(inner, held_out)
        results[v] = dict(first_step_s=first_step[v], eval_loss=ev.loss, eval_accuracy=ev.accuracy,
                          phases_ms={p: 1e3 * t for p, t in zip(PHASES, phase_s[v])},
                          final_train_loss=losses[v][-1], bytes_per_param=sum(state.values()) / n_params,
                          state_bytes=state, bytes_from=how)

    for tokens in args.tokens[1:]:
        b = tokens // args.seq_len
        batches = list(lm_batches(text.train, b, args.seq_len, seed=args.seed + tokens,
                                  steps=args.size_warmup + args.timed_steps))
        start = time.perf_counter()
        logs = train_round_robin(runs, batches, step=step, desc=f"{tokens} tokens per step", mininterval=10)
        step_s[tokens] = {v: statistics_median(logs[v].seconds[args.size_warmup:]) for v in variants}
        print(f"  {tokens} tokens per step: {time.perf_counter() - start:.0f} s for "
              f"{args.size_warmup + args.timed_steps} steps of each variant", flush=True)
    recompiled = dynamo_graphs() - graphs
    kernels_after = kernel_stats()
    for v in variants:
        results[v]["step_s"] = {str(t): step_s[t][v] for t in args.tokens}

    ref = results.get(REFERENCE)
    print()
    rows = []
    for v, r in results.items():
        gap = f"{r['eval_loss'] / ref['eval_loss'] - 1:+.2%}" if ref else None
        rows.append([v, f"{r['bytes_per_param']:.2f}", *(f"{r['state_bytes'][k] / n_params:.2f}"
                                                          for k in STATE_CATEGORIES),
                     f"{r['eval_loss']:.4f}", gap, f"{r['eval_accuracy']:.3f}", f"{r['first_step_s']:.1f}"])
    print(format_table(["variant", "bytes/param", "weights", "grads", "optim", "master", "eval loss",
                        "vs bf16+m", "acc", "first step s"], rows))
    counted = [v for v, r in results.items() if r["bytes_from"] != "tracked"]
    print("bytes per parameter: weights + gradients + optimizer state + masters"
          + (f" (counted from the tensors held, not tracked, for {', '.join(counted)})" if counted else "")
          + f"; eval loss after {args.steps} steps at {first} tokens per step, relative to {REFERENCE}; first step s: "
            "the first step of each (compilation included), left out of the timings")
    print()
    print(format_table(speed_headers(args.tokens), speed_rows(variants, step_s)))
    print(f"median step; x bf16+m / x fp32: {REFERENCE} / {FP32_REFERENCE} step time over the variant's (above 1 "
          f"is faster). Medians of {args.steps - args.warmup} steps at {first} tokens, of {args.timed_steps} at the "
          f"others. Fair reference on this CPU: {fair}.")
    print()
    print(format_table(["variant", *(f"{p} ms" for p in PHASES), "sum ms"], phase_rows(variants, phase_s)))
    print(f"where the time goes at {first} tokens per step: the median of each phase over the same steps (their sum "
          "need not be the median step); DGR's groups step inside backward; optimizer step includes zero_grad")
    print(f"torch.compile graphs compiled during the timed steps: {recompiled}"
          + (" (recompiles were timed: run with TORCH_LOGS=recompiles to see why)" if recompiled else ""))
    if kernels is not None:
        delta = {k: kernels_after[k] - kernels_before.get(k, 0) for k in kernels_after}
        warm = kernels_warm.get("compile_seconds", 0.0) - kernels_before.get("compile_seconds", 0.0)
        print(f"MVAS kernels: {delta['compiles']:.0f} compiled ({warm:.1f} s compiling in the warm-up steps), "
              f"{delta['compiled_calls']:.0f} compiled and {delta['eager_calls']:.0f} eager calls")
    if ref and "MVAS + DGR" in results:
        checks = target_checks(results["MVAS + DGR"], ref, step_s, first, fair)
        print("\nMVAS + DGR targets: " + "; ".join(f"{name}: {'met' if ok else 'NOT met'}" for name, ok in checks))
        mine = {t: step_s[t]["MVAS + DGR"] for t in args.tokens}
        print("MVAS + DGR speed at every size: " + ", ".join(
            f"{t}: {step_s[t][REFERENCE] / mine[t]:.2f}x bf16+m"
            + (f", {step_s[t][FP32_REFERENCE] / mine[t]:.2f}x fp32" if FP32_REFERENCE in step_s[t] else "")
            for t in args.tokens))
    print(f"whole run: {time.perf_counter() - wall:.0f} s")
    if args.json:  # benchmarks/plot.py draws it
        write_json(args.json, dict(config=vars(args), machine=info, reference=REFERENCE, fair_reference=fair,
                                   targets=TARGETS, n_params=n_params, recompiles_timed=recompiled, results=results))


def phase_medians(record: list[tuple[float, float, float]]) -> tuple[float, ...]:
    """The median seconds of each phase over the steps in ``record``."""
    return tuple(statistics_median([r[i] for r in record]) for i in range(len(PHASES)))


def phase_rows(variants: Iterable[str], phase_s: dict[str, tuple[float, ...]]) -> list[list]:
    """One row per variant: each phase's median in ms, and their sum."""
    return [[v, *(f"{1e3 * t:.1f}" for t in phase_s[v]), f"{1e3 * sum(phase_s[v]):.1f}"] for v in variants]


def statistics_median(values: list[float]) -> float:
    import statistics

    if not values:
        raise ValueError("no timed steps: raise --steps above --warmup")
    return statistics.median(values)


if __name__ == "__main__":
    main()
