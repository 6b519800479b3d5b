"""Two versions of one optimizer step, timed in lock-step: is a kernel change faster, on a machine whose speed drifts?

    python benchmarks/step_ab.py --b-optimizer "MVASAdamW fp8 weights (eager)"  # compiled against eager, this tree
    python benchmarks/step_ab.py --a-path /tmp/before --b-path .                # two checkouts of the repository
    python benchmarks/step_ab.py --a-optimizer "torch AdamW fp32 foreach"       # MVASAdamW against foreach
    python benchmarks/step_ab.py --a-path /tmp/before --a-env ATEN_CPU_CAPABILITY=avx2 --b-env ATEN_CPU_CAPABILITY=avx2

On the 2-core machines this project runs on, the same step takes up to twice as long from one minute to the next
(other tenants, the host's clock), so two runs one after the other compare the hour, not the code; a change of a few
percent needs both versions measured side by side. Here each version runs in its own warm worker process (its
checkout on ``PYTHONPATH``, its environment: the kernels compile in that process, as a user's would; an optimizer
row's own switch, such as the compiled rows' ``MACROARCH_COMPILE``, wins over ``--*-env``), and the two
take turns: A runs ``--steps`` steps of ``optimizer_step.py``'s optimizer on one tensor, then B, then B, then A, and
so on for ``--blocks`` blocks each (ABBA, so neither always goes first). The ratio of each B block to the A block
beside it cancels the drift both saw; the report is the median of those ratios with its quartiles, and each side's
fastest and median block, with the minor page faults of its steps. The same version on both sides (``--b-env X=1``)
shows the method's own spread: on this repository's machine, MVASAdamW's fp8 step on 2^20 elements, seven runs of
10-20 blocks gave medians of 0.950-1.015 (quartiles within 0.86-1.09), and one 0.558: that run's A took 1.8x B's time
in every block, a process that stayed slow throughout (before the faults were counted; the benchmarks' notes
found such processes getting fresh pages for the kernel's temporaries on every step; a later A/B of two checkouts of
the same kernel caught one: 1999 faults a step and 1.95x the time, then 0.997 with none on the next run). A side whose
steps fault and the other's not is warned about; run it twice.

Both workers are pinned to the same cores (the first ``--threads`` this process may use; one by default): on a VM
the cores need not run at one speed, and unpinned, the same comparison of MVASAdamW with foreach AdamW at 2^20
elements gave 1.13 and 1.96 in two runs, pinned 1.24 and 1.28 on either core. While one worker runs, the other's
tensors stay in the caches it shares, so a ratio of two *different* optimizers here is the cache-warm one (at 2^20
elements foreach's 16 MB of state stays in L3); ``optimizer_step.py``, whose round-robin over many optimizers evicts
them, measures the other regime. This tool is for two versions of one optimizer. The first ``--warmup`` steps
(compilation) are not timed. Where a worker fails (a checkout without the optimizer, a bad environment), its error
is shown and nothing is reported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from _common import format_size, parse_sizes, write_json

HERE = Path(__file__).resolve().parent
DEFAULT = "MVASAdamW fp8 weights (compiled)"

# The worker: one optimizer of optimizer_step.py on one tensor of ``numel`` elements (rows of 1024), warmed up, then
# ``steps`` steps per "go" line on stdin, their mean seconds per step printed back.
WORKER = r"""
import sys, time, torch
import os, resource
bench_dir, name, numel, steps, warmup, threads = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
os.sched_setaffinity(0, [int(c) for c in sys.argv[7].split(",")])
sys.path.insert(0, bench_dir)
import optimizer_step as ob
torch.set_num_threads(threads)
setup = ob.setups().get(name)
if not isinstance(setup, ob.Setup):
    sys.exit(f"{name!r} cannot run in {bench_dir}: {setup or 'no such optimizer'}")
values = [torch.randn(numel // ob.ROW, ob.ROW, generator=torch.Generator().manual_seed(0)) * 0.02]
params = ob.build_params(values, setup.weights)
for p in params:
    p.grad = (torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 1e-3).to(
        torch.float32 if setup.weights == "fp32" else torch.bfloat16)
opt = setup.make(params)
with ob.compile_switch(setup.compile):
    for _ in range(warmup):
        opt.step()
    print("ready", flush=True)
    for _line in sys.stdin:
        faults, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        for _ in range(steps):
            opt.step()
        seconds = (time.perf_counter() - start) / steps
        print(seconds, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / steps, flush=True)
"""


def parse_env(text: str | None, *, name: str) -> dict[str, str]:
    """``"A=1,B=x"`` -> ``{"A": "1", "B": "x"}``; ValueError naming ``name`` for an item without ``=``."""
    env = {}
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{name}: {item!r} is not NAME=VALUE")
        env[key.strip()] = value.strip()
    return env


def checkout(path: str | None, *, name: str) -> Path:
    """The repository root holding ``macroarch/`` and ``benchmarks/optimizer_step.py`` (this one by default)."""
    root = HERE.parent if path is None else Path(path).resolve()
    if not (root / "macroarch").is_dir() or not (root / "benchmarks" / "optimizer_step.py").is_file():
        raise ValueError(f"{name}: {root} is not a checkout of this repository (no macroarch/ and "
                         f"benchmarks/optimizer_step.py)")
    return root


class Worker:
    """One version's process: started, ``wait_ready()`` once warm, then one block of steps per ``block()``."""

    def __init__(self, root: Path, env: dict[str, str], optimizer: str, numel: int, *, steps: int, warmup: int,
                 threads: int, cpus: list[int]) -> None:
        environ = {**os.environ, **env, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
        args = [sys.executable, "-c", WORKER, str(root / "benchmarks"), optimizer, str(numel), str(steps),
                str(warmup), str(threads), ",".join(map(str, cpus))]
        # run in the checkout: python -c puts the working directory first on sys.path
        self.proc = subprocess.Popen(args, env=environ, cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.label = f"{root} {' '.join(f'{k}={v}' for k, v in env.items())}".strip()

    def wait_ready(self) -> None:
        """Until the worker has warmed up (both start at once: their imports and compiles overlap, untimed)."""
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(self.failure())

    def block(self) -> tuple[float, float]:
        """Seconds per step of one block, and minor page faults per step."""
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(self.failure())
        seconds, faults = map(float, line.split())
        return seconds, faults

    def failure(self) -> str:
        self.proc.kill()
        err = self.proc.communicate()[1].strip().splitlines()
        return f"the worker for {self.label} failed: " + (err[-1] if err else "no output")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None and not stream.closed:
                stream.close()


def lockstep(a: Worker, b: Worker, blocks: int) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """``(seconds, page faults)`` per step of ``blocks`` blocks of each, in ABBA order."""
    blocks_a, blocks_b = [], []
    for i in range(blocks):
        order = ((a, blocks_a), (b, blocks_b)) if i % 2 == 0 else ((b, blocks_b), (a, blocks_a))
        for worker, out in order:
            out.append(worker.block())
    return blocks_a, blocks_b


def summary(blocks_a: list[tuple[float, float]], blocks_b: list[tuple[float, float]]) -> dict[str, Any]:
    """Each side's fastest and median block and its page faults per step (mean), and the B/A ratios of the blocks
    side by side: median and quartiles."""
    times_a, times_b = [t for t, _ in blocks_a], [t for t, _ in blocks_b]
    ratios = sorted(b / a for a, b in zip(times_a, times_b))
    q = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else [ratios[0]] * 3
    return dict(a_min_s=min(times_a), a_median_s=statistics.median(times_a),
                a_faults_per_step=statistics.mean(f for _, f in blocks_a), b_min_s=min(times_b),
                b_median_s=statistics.median(times_b), b_faults_per_step=statistics.mean(f for _, f in blocks_b),
                ratio_median=statistics.median(ratios), ratio_quartiles=(q[0], q[2]), blocks=len(ratios))


def fault_warning(result: dict[str, Any], *, threshold: float = 100.0) -> str | None:
    """A warning where one side's steps take page faults (``threshold`` a step or more) and the other's far fewer: a
    process whose kernels' temporaries get fresh pages on every step runs up to twice as slow for its whole life (this
    machine: 1999 faults a step and 1.95x the time, the same code on both sides), so the ratio says nothing of code."""
    fa, fb = result["a_faults_per_step"], result["b_faults_per_step"]
    if max(fa, fb) < threshold or min(fa, fb) > max(fa, fb) / 2:
        return None
    slow, fast = ("A", "B") if fa > fb else ("B", "A")
    return (f"warning: {slow}'s steps take {max(fa, fb):.0f} page faults each, {fast}'s {min(fa, fb):.0f}: {slow}'s "
            f"process gets fresh pages for its temporaries on every step, which alone can double its time; run again")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for side in ("a", "b"):
        parser.add_argument(f"--{side}-path", default=None, help=f"checkout for {side.upper()} (default: this one)")
        parser.add_argument(f"--{side}-env", default=None, help=f"NAME=VALUE,... set for {side.upper()}")
        parser.add_argument(f"--{side}-optimizer", default=None, help=f"optimizer_step.py name ({DEFAULT!r})")
    parser.add_argument("--size", default="1M", help="elements of the one tensor (a multiple of 128k)")
    parser.add_argument("--blocks", type=int, default=40, help="blocks of each side")
    parser.add_argument("--steps", type=int, default=10, help="steps per block")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="also write the blocks and the summary as JSON")
    args = parser.parse_args(argv)
    try:
        numel = parse_sizes(args.size, name="--size", multiple_of=1024 * 128)[0]
        cpus = sorted(os.sched_getaffinity(0))[:args.threads]  # both workers on the same cores
        for name in ("blocks", "steps", "warmup", "threads"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name} {getattr(args, name)} must be >= 1")
        sides = [(checkout(getattr(args, f"{s}_path"), name=f"--{s}-path"),
                  parse_env(getattr(args, f"{s}_env"), name=f"--{s}-env"), getattr(args, f"{s}_optimizer") or DEFAULT)
                 for s in ("a", "b")]
    except ValueError as e:
        parser.error(str(e))
    workers = []
    try:
        for root, env, optimizer in sides:
            workers.append(Worker(root, env, optimizer, numel, steps=args.steps, warmup=args.warmup,
                                  threads=args.threads, cpus=cpus))
        for w in workers:
            w.wait_ready()
        blocks_a, blocks_b = lockstep(*workers, args.blocks)
    except RuntimeError as e:
        sys.exit(str(e))
    finally:
        for w in workers:
            w.close()
    result = summary(blocks_a, blocks_b)
    for side, (_root, _env, optimizer), w in zip("AB", sides, workers):
        print(f"{side}: {optimizer}; {w.label}")
    print(f"{format_size(numel)} elements, {args.threads} thread(s) on CPU {','.join(map(str, cpus))}, {args.blocks} "
          f"blocks of {args.steps} steps each:")
    for side in "ab":
        print(f"  {side.upper()}  fastest {1e3 * result[f'{side}_min_s']:.3f} ms a step, median "
              f"{1e3 * result[f'{side}_median_s']:.3f}; {result[f'{side}_faults_per_step']:.0f} page faults a step")
    lo, hi = result["ratio_quartiles"]
    print(f"  B/A, blocks side by side: median {result['ratio_median']:.3f} (quartiles {lo:.3f}-{hi:.3f}); "
          f"below 1: B is faster")
    warning = fault_warning(result)
    if warning:
        print(warning)
    if args.out:
        write_json(args.out, dict(config=vars(args), sides=[dict(path=str(r), env=e, optimizer=o) for r, e, o in sides],
                                  a_blocks=blocks_a, b_blocks=blocks_b, **result))
    return result


if __name__ == "__main__":
    main()
