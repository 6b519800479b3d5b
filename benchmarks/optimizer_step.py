"""Optimizer step alone: time per step per million parameters, bytes moved, achieved GB/s against the copy bandwidth.

    python benchmarks/optimizer_step.py                            # 1M, 4M, 16M and 64M elements; 1 and all threads
    python benchmarks/optimizer_step.py --sizes 1M,4M --threads 1 --repeats 3
    python benchmarks/optimizer_step.py --only "torch AdamW fp32 foreach,MVASAdamW fp8 weights" --out step.json

Issue 14's question: MVASAdamW moves about a third of the bytes of fp32 AdamW per step, so it should take no
longer. Each size is one parameter tensor of that many elements (``--tensors k`` splits it in ``k`` equal
tensors, rows of 1024), with a fixed random gradient; every optimizer gets its own copy of the weights and the
same gradient tensor (read only), and only ``optimizer.step()`` is timed: ``--warmup`` untimed steps (the first
one compiles where an optimizer compiles: its seconds are reported apart), then ``--repeats`` timed steps,
round-robin over the optimizers so that load from other processes hits all alike; the median is reported. It
runs with one thread and with every core this process may use (``--threads``).

Optimizers: torch AdamW on fp32 weights (``foreach``, and ``fused`` where the build has a CPU kernel),
``CompensatedAdamW`` (fp32; and bf16 weights with an fp32 master, the mixed-precision reference),
``MVASAdamW`` on MVAS weights (bf16 compute and gradients, fp8 e4m3 or fp4 e2m1 weights in blocks of 32,
fp8 moments in blocks of 128), compiled and eager where ``macroarch.mvas._kernels`` exists (the eager row sets
``MACROARCH_COMPILE=0``; a row says how many of its steps ran compiled), torchao ``AdamW8bit`` and
bitsandbytes ``AdamW8bit`` (fp32 weights, 8-bit block-quantised moments) when importable ("not installed"
otherwise).

**Bytes per step** (``step_traffic``) are counted from the state each optimizer holds after its first step, as
the least a fused kernel must move: it reads the gradient once, reads and writes the stored weight (payload and
block scales of a packed one) and every state tensor (moments and their scales, master copies, step counters),
except that a weight with an fp32 master is only written (the master is read instead) and lookup tables
(torchao's and bitsandbytes' ``qmap``) are only read. Tensor subclasses count the plain tensors they hold.
Per element: fp32 AdamW 4 + 2 x (4 + 8) = 28 B; bf16 + fp32 master 2 + 2 + 2 x 12 = 28 B; MVASAdamW with fp8
weights 2 + 2 x (1.125 + 2 x 1.03) = 8.4 B, fp4 weights 7.4 B; 8-bit torchao/bitsandbytes 4 + 2 x (4 + 2.03) =
16.1 B. Achieved GB/s is those bytes over the median step; the physical limit is this machine's copy bandwidth,
measured in the same run (``copy_bandwidth``: the fastest in-place streaming kernel, ``a.mul_``, ``a.add_`` or
``a.addcmul_`` on ``--copy-elements`` fp32 elements, bytes read and written; a ``dst.copy_(src)`` undercounts its
traffic; where an optimizer in the run streamed faster, that is the limit instead: ``bandwidth_limits``). An
optimizer that makes several passes over memory shows up as a low fraction of it. **Page faults**: a step whose
temporaries glibc gets as fresh pages each time (where its heap layout ends up) runs up to 1.7x slower: counted.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import resource
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from _common import (
    FOREACH_REFERENCE,
    all_threads,
    compile_switch,
    format_size,
    format_table,
    kernel_stats,
    kernels,
    machine_lines,
    machine_record,
    parse_sizes,
    time_calls,
    write_json,
)

from macroarch.mvas import MVASWeight, pack
from macroarch.mvas.optim import MVASAdamW
from macroarch.optim import CompensatedAdamW

REFERENCE = FOREACH_REFERENCE
ROW = 1024  # elements per row of the 2-D tensors (MVAS packs whole blocks of 32; the moments blocks of 128)
READ_ONLY_STATE = ("qmap", "qmap1", "qmap2")
LR = 1e-3


@dataclass(frozen=True)
class Traffic:
    """Bytes one optimizer step reads and writes at least (module docstring)."""

    read: int
    written: int

    @property
    def total(self) -> int:
        return self.read + self.written


def plain_tensors(t: torch.Tensor, name: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """``(attribute name, plain tensor)`` for the storage ``t`` holds: itself, or the inner tensors of a
    tensor subclass (``__tensor_flatten__``, recursively: MVASWeight, torchao's optimizer states)."""
    if type(t) in (torch.Tensor, torch.nn.Parameter) or not hasattr(t, "__tensor_flatten__"):
        yield name, t
        return
    for attr in t.__tensor_flatten__()[0]:
        yield from plain_tensors(getattr(t, attr), attr)


def stored_bytes(t: torch.Tensor) -> int:
    """Bytes of the storage ``t`` holds (packed payload and scales for a packed tensor)."""
    return sum(inner.numel() * inner.element_size() for _, inner in plain_tensors(t))


def step_traffic(weight: int, grad: int, state: int, *, master: bool = False, read_only: int = 0) -> Traffic:
    """The least one step moves: the gradient read, the weight read and written (only written when an fp32
    master in ``state`` stands in for it), ``state`` read and written, ``read_only`` (lookup tables) read."""
    if min(weight, grad, state, read_only) < 0:
        raise ValueError(f"step_traffic: byte counts must be >= 0, got weight={weight}, grad={grad}, "
                         f"state={state}, read_only={read_only}")
    return Traffic(read=grad + (0 if master else weight) + state + read_only, written=weight + state)


def optimizer_traffic(opt: torch.optim.Optimizer) -> Traffic:
    """``step_traffic`` summed over ``opt``'s parameters, from the state it holds now (after a step)."""
    read = written = 0
    for group in opt.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            state = opt.state.get(p, {})
            held = read_only = 0
            for key, value in state.items():
                if not torch.is_tensor(value):
                    continue
                for attr, inner in plain_tensors(value, key):
                    nbytes = inner.numel() * inner.element_size()
                    if attr in READ_ONLY_STATE or key in READ_ONLY_STATE:
                        read_only += nbytes
                    else:
                        held += nbytes
            t = step_traffic(stored_bytes(p), stored_bytes(p.grad), held, master="master" in state,
                             read_only=read_only)
            read, written = read + t.read, written + t.written
    return Traffic(read, written)


def copy_bandwidth(numel: int, *, repeats: int = 10) -> float:
    """Bytes per second this machine streams through memory the way an optimizer step does: in place, each
    element read and written back, from and to the same lines. The fastest of ``repeats`` runs of three such
    kernels on ``numel`` fp32 elements, counting the bytes read and written: ``a.mul_(c)`` (2 per element),
    ``a.add_(b)`` (3), ``a.addcmul_(b, c)`` (4); the best of them is the limit. (A ``dst.copy_(src)`` is not: the
    cache fills each line of ``dst`` before it is written, a read the byte count does not see, so it came out at
    13 GB/s here against 20 for torch's fused AdamW.)"""
    a, b, c = torch.rand(numel), torch.rand(numel), torch.rand(numel)
    kernels = ((lambda: a.mul_(1.0), 2), (lambda: a.add_(b, alpha=0.0), 3), (lambda: a.addcmul_(b, c, value=0.0), 4))
    best = 0.0
    for kernel, streams in kernels:
        timing = time_calls(kernel, warmup=1, repeats=repeats)
        best = max(best, streams * a.nbytes / min(timing.times))
    return best


# --------------------------------------------------------------------------------------------- optimizers
@dataclass(frozen=True)
class Setup:
    """One optimizer on one kind of weight: ``weights`` builds the parameters from fp32 values and the gradient
    dtype, ``make`` the optimizer; ``compile`` None, or the MVAS kernels' switch for its steps."""

    weights: str  # "fp32", "bf16" or an MVAS format
    make: Callable[[list[torch.Tensor]], torch.optim.Optimizer]
    compile: bool | None = None


def _fused_adamw_available() -> bool:
    try:
        p = torch.nn.Parameter(torch.zeros(4))
        p.grad = torch.ones(4)
        torch.optim.AdamW([p], fused=True).step()
        return True
    except (RuntimeError, ValueError):
        return False


def _mvas_takes_compile() -> bool:
    return "compile" in inspect.signature(MVASAdamW.__init__).parameters


def _mvas(fmt: str, compile: bool | None) -> Setup:
    kwargs = {"compile": compile} if compile is not None and _mvas_takes_compile() else {}
    return Setup(fmt, lambda ps: MVASAdamW(ps, lr=LR, seed=0, **kwargs), compile)


def setups() -> dict[str, Setup | str]:
    """Every optimizer of the table by name: a ``Setup``, or why it cannot run here (a string)."""
    table: dict[str, Setup | str] = {
        "torch AdamW fp32 foreach": Setup("fp32", lambda ps: torch.optim.AdamW(ps, lr=LR, foreach=True)),
        "torch AdamW fp32 fused": (Setup("fp32", lambda ps: torch.optim.AdamW(ps, lr=LR, fused=True))
                                   if _fused_adamw_available() else "no fused CPU kernel in this torch build"),
        "CompensatedAdamW fp32": Setup("fp32", lambda ps: CompensatedAdamW(ps, lr=LR)),
        "CompensatedAdamW bf16 + fp32 master": Setup(
            "bf16", lambda ps: CompensatedAdamW(ps, lr=LR, master_weights=True)),
    }
    for fmt, label in (("fp8_e4m3", "fp8"), ("fp4_e2m1", "fp4")):
        if kernels is None:
            table[f"MVASAdamW {label} weights"] = _mvas(fmt, None)
        else:
            table[f"MVASAdamW {label} weights (compiled)"] = _mvas(fmt, True)
            table[f"MVASAdamW {label} weights (eager)"] = _mvas(fmt, False)
    try:
        import torchao.optim

        table["torchao AdamW8bit"] = Setup("fp32", lambda ps: torchao.optim.AdamW8bit(ps, lr=LR))
    except ImportError:
        table["torchao AdamW8bit"] = "not installed"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import bitsandbytes as bnb
        table["bitsandbytes AdamW8bit"] = Setup("fp32", lambda ps: bnb.optim.AdamW8bit(ps, lr=LR))
    except ImportError:
        table["bitsandbytes AdamW8bit"] = "not installed"
    return table


def build_params(values: list[torch.Tensor], weights: str) -> list[torch.Tensor]:
    """Parameters holding ``values`` (fp32): fp32 or bf16 copies, or MVAS weights (blocks of 32, bf16 compute)."""
    if weights == "fp32":
        return [torch.nn.Parameter(v.clone()) for v in values]
    if weights == "bf16":
        return [torch.nn.Parameter(v.to(torch.bfloat16)) for v in values]
    return [torch.nn.Parameter(MVASWeight.from_packed(pack(v, weights, 32), torch.bfloat16)) for v in values]


def _compiled_calls() -> int:
    return int(kernel_stats().get("compiled_calls", 0))


def run_size(numel: int, n_tensors: int, chosen: dict[str, Setup], *, warmup: int, repeats: int,
             seed: int = 0) -> dict[str, dict[str, Any]]:
    """Every chosen optimizer on ``n_tensors`` tensors of ``numel`` elements in all: timings and traffic (or why
    it was skipped: a "compiled" MVAS row whose warm-up step ran no compiled kernel)."""
    gen = torch.Generator().manual_seed(seed)
    per = numel // n_tensors
    values = [torch.randn(per // ROW, ROW, generator=gen) * 0.02 for _ in range(n_tensors)]
    grads = {dtype: [torch.randn(v.shape, generator=gen).to(dtype) * 1e-3 for v in values]
             for dtype in (torch.float32, torch.bfloat16)}
    runs, skipped = {}, {}
    for name, setup in chosen.items():
        params = build_params(values, setup.weights)
        for p, g in zip(params, grads[torch.float32 if setup.weights == "fp32" else torch.bfloat16]):
            p.grad = g  # read only by every optimizer here: one gradient tensor serves all
        runs[name] = (params, setup.make(params), setup.compile, [], [], [0], [])
    for i in range(warmup + repeats):
        if i == warmup:  # a "compiled" row whose warm-up ran no compiled kernel would time the eager path twice
            for name in [n for n, r in runs.items() if r[2] and not r[5][0]]:
                skipped[name] = "not compiled here (= eager row)"
                del runs[name]
        for _params, opt, flag, first, times, compiled, faults in runs.values():
            before, faulted = _compiled_calls(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            with compile_switch(flag):
                start = time.perf_counter()
                opt.step()
                seconds = time.perf_counter() - start
            compiled[0] += _compiled_calls() - before
            (first if i < warmup else times).append(seconds)
            if i >= warmup:
                faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faulted)
    results: dict[str, dict[str, Any]] = {name: dict(numel=numel, tensors=n_tensors, skipped=why)
                                          for name, why in skipped.items()}
    for name, (_params, opt, flag, first, times, compiled, faults) in runs.items():
        traffic = optimizer_traffic(opt)
        median = statistics.median(times)
        results[name] = dict(numel=numel, tensors=n_tensors, first_step_s=first[0] if first else None,
                             step_s=median, times_s=times, ms_per_mparam=1e3 * median / (numel / 1e6),
                             bytes_read=traffic.read, bytes_written=traffic.written,
                             bytes_per_element=traffic.total / numel, gb_per_s=traffic.total / median / 1e9,
                             compiled_calls=compiled[0] if flag is not None else None,
                             page_faults_per_step=statistics.mean(faults))
    del runs
    gc.collect()
    return results


def table_rows(results: list[dict[str, Any]], copy_gbs: dict[int, float]) -> list[list[Any]]:
    """Rows of the printed table from the flat result records (``optimizer``, ``threads`` and ``run_size``'s
    fields), with the time ratio against ``REFERENCE`` at the same size and threads."""
    ref = {(r["numel"], r["threads"]): r["step_s"] for r in results if r["optimizer"] == REFERENCE}
    rows = []
    for r in results:
        if r.get("skipped"):
            rows.append([r["optimizer"], format_size(r["numel"]), r["threads"], r["skipped"]] + [None] * 7)
            continue
        base = ref.get((r["numel"], r["threads"]))
        bw = copy_gbs.get(r["threads"])
        rows.append([r["optimizer"], format_size(r["numel"]), r["threads"], f"{1e3 * r['step_s']:.1f}",
                     f"{r['ms_per_mparam']:.2f}", f"{base / r['step_s']:.2f}x" if base else None,
                     f"{r['bytes_per_element']:.1f}", f"{r['gb_per_s']:.2f}",
                     f"{r['gb_per_s'] / bw:.0%}" if bw else None,
                     f"{r['first_step_s']:.2f}" if r["first_step_s"] is not None else None,
                     f"{r['page_faults_per_step']:.0f}" if r.get("page_faults_per_step") is not None else None])
    return rows


def bandwidth_limits(results: list[dict[str, Any]], stream_gbs: dict[int, float]) -> dict[int, tuple[float, str]]:
    """Per thread count, the best bandwidth measured in this run and where it came from: the in-place stream
    kernels (``copy_bandwidth``) or an optimizer that moved its bytes faster (on this VM torch's fused AdamW
    sometimes streams faster than ATen's single-threaded ``mul_``/``add_``). Every measurement is a lower bound of
    the machine's limit, so the largest is the tightest one known; no row then reads above 100%."""
    limits = {}
    for threads, gbs in stream_gbs.items():
        best = max((r for r in results if r["threads"] == threads and not r.get("skipped")),
                   key=lambda r: r["gb_per_s"], default=None)
        if best is not None and best["gb_per_s"] > gbs:
            limits[threads] = (best["gb_per_s"], f"{best['optimizer']} at {format_size(best['numel'])} elements "
                                                 f"(the stream kernels: {gbs:.2f} GB/s)")
        else:
            limits[threads] = (gbs, "the in-place stream kernels")
    return limits


HEADERS = ["optimizer", "size", "threads", "step ms", "ms/M params", "speed vs foreach", "B/element", "GB/s",
           "of stream BW", "first step s", "faults/step"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1M,4M,16M,64M", help="elements per step, e.g. 1M,4M,64M")
    parser.add_argument("--tensors", type=int, default=1, help="split each size into this many equal tensors")
    parser.add_argument("--threads", default="1,all", help="comma-separated thread counts; 'all' = the cores "
                                                            "this process may use")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--copy-elements", default="64M", help="fp32 elements of the copy-bandwidth tensor")
    parser.add_argument("--only", default=None, help="comma-separated optimizer names")
    parser.add_argument("--out", default=None, help="also write the results as JSON to this file")
    args = parser.parse_args(argv)
    try:
        args.tensors = max(1, args.tensors)
        args.sizes = parse_sizes(args.sizes, name="--sizes", multiple_of=ROW * args.tensors * 128)
        args.copy_elements = parse_sizes(args.copy_elements, name="--copy-elements")[0]
        args.threads = parse_threads(args.threads)
        if args.warmup < 1 or args.repeats < 1:
            raise ValueError(f"--warmup {args.warmup} and --repeats {args.repeats} must be >= 1 (the first step "
                             f"allocates state and compiles: it is never timed)")
    except ValueError as e:
        parser.error(str(e))
    known = setups()
    args.only = list(known) if args.only is None else [v.strip() for v in args.only.split(",")]
    unknown = [v for v in args.only if v not in known]
    if unknown:
        parser.error(f"unknown optimizer(s) {unknown}; known: {', '.join(known)}")
    return args


def parse_threads(text: str) -> list[int]:
    """``"1,all"`` -> ``[1, all_threads()]`` without repeats; ValueError on anything but positive ints and 'all'."""
    out = []
    for item in text.split(","):
        item = item.strip()
        n = all_threads() if item == "all" else int(item) if item.isdigit() else 0
        if n < 1:
            raise ValueError(f"--threads: {item!r} must be a positive int or 'all'")
        if n not in out:
            out.append(n)
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    known = setups()
    chosen = {n: known[n] for n in args.only if isinstance(known[n], Setup)}
    missing = {n: known[n] for n in args.only if not isinstance(known[n], Setup)}
    start = time.perf_counter()
    for line in machine_lines():
        print(line)
    if kernels is not None and not _mvas_takes_compile():
        print("MVASAdamW has no compile= argument in this build: its rows switch MACROARCH_COMPILE per step")
    results, copy_gbs = [], {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        copy_gbs[threads] = copy_bandwidth(args.copy_elements) / 1e9
        print(f"\n{threads} thread(s): in-place stream bandwidth {copy_gbs[threads]:.2f} GB/s "
              f"({format_size(args.copy_elements)} fp32 elements, read + written)", flush=True)
        for numel in args.sizes:
            t0 = time.perf_counter()
            for name, r in run_size(numel, args.tensors, chosen, warmup=args.warmup, repeats=args.repeats).items():
                results.append(dict(optimizer=name, threads=threads, **r))
            for name, why in missing.items():
                results.append(dict(optimizer=name, threads=threads, numel=numel, skipped=why))
            print(f"  {format_size(numel)} elements: {time.perf_counter() - t0:.0f} s", flush=True)
    results.sort(key=lambda r: (r["threads"], r["numel"], args.only.index(r["optimizer"])))
    limits = bandwidth_limits(results, copy_gbs)
    print()
    print(format_table(HEADERS, table_rows(results, {t: gbs for t, (gbs, _) in limits.items()})))
    for threads, (gbs, source) in limits.items():
        print(f"{threads} thread(s): the bandwidth limit is {gbs:.2f} GB/s, from {source}")
    print(f"\nstep ms: median of {args.repeats} after {args.warmup} warm-up step(s) (first step s: the first, "
          f"compilation included); B/element: least bytes read + written per step (module docstring); "
          f"of stream BW: achieved GB/s over the limit above; faults/step: minor page faults in a timed step (mean), "
          f"fresh pages for its temporaries, microseconds each. "
          f"Whole run {time.perf_counter() - start:.0f} s.")
    if args.out:  # benchmarks/plot.py draws it
        limit = {t: g for t, (g, _) in limits.items()}
        write_json(args.out, dict(config=vars(args), machine=machine_record(), reference=REFERENCE,
                                  copy_gb_per_s=copy_gbs, limit_gb_per_s=limit, results=results))


if __name__ == "__main__":
    main()
