"""The accelerators of claim C11 (post section 5.2) as published numbers, and this machine's as measured ones.

The post gives speedups on A100, V100 and RTX 3090 and advises disabling ECC on consumer cards. What each card
can do is public: :data:`ACCELERATORS` holds, per card, the vendor's *dense* (no 2:4 sparsity) tensor-core
throughput in bf16/fp16, tf32 and fp8, memory size and bandwidth, interconnect, and whether it has fp8 tensor
cores and ECC (with what ECC costs). Every figure carries its source in the row itself (``sources``: the
document each field comes from), so a table printed from it is its own bibliography.

Conventions:

- throughput is the peak dense tensor-core rate with fp32 accumulation, what training uses. GeForce cards run
  fp32 accumulation at half their fp16-accumulate rate; their fp32-accumulate figure is the one given. V100 has
  no bf16 tensor cores: its 16-bit figure is fp16 (training on it uses fp16 with loss scaling);
- ``link_gbs`` is the bandwidth each way per GPU for collectives (half the bidirectional NVLink or PCIe figure);
  ``link_latency_us`` is an assumption (marked as such), not a published number;
- ECC: HBM stores ECC bits beside the data ("side-band"), so it costs neither capacity nor bandwidth (Volta
  whitepaper: "ECC can be active without a bandwidth or capacity penalty"); GDDR cards that offer ECC store it
  in-line, in the data memory (the same whitepaper: 6.25% of the K40's GDDR5 reserved).

:func:`measure_machine` adds the machine this runs on: matmul throughput in fp32 and bf16 and copy bandwidth,
timed now (on a CUDA device too, which is how ``benchmarks/gpu_check.sh`` checks a GPU against its row): the fastest
of several runs, in CPU seconds of the calling thread when a CPU runs one thread (:func:`clock`), so that other
processes on a shared machine do not count. :class:`OpCounter` counts what a training step runs (every aten op, the
bytes the non-view ones read and write, each matmul's shape and strides) and :func:`matmul_seconds` times those
matmuls alone: what the step-time model is checked with on this machine.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from macroarch._compat.dispatch import TorchDispatchMode, tensors_in
from macroarch.measure.step_time import Device

GB = 1e9
T = 1e12

#: the documents the figures come from, by the short name the rows use
SOURCES: dict[str, str] = {
    "V100 DS": "NVIDIA V100 Tensor Core GPU datasheet (SXM2 column)",
    "Volta WP": "NVIDIA Tesla V100 GPU Architecture whitepaper (2017), 'ECC Memory Resiliency'",
    "A100 DS": "NVIDIA A100 Tensor Core GPU datasheet (SXM column; 40 GB HBM2 / 80 GB HBM2e)",
    "A100 WP": "NVIDIA A100 Tensor Core GPU Architecture whitepaper (2020)",
    "GA102 WP": "NVIDIA Ampere GA102 GPU Architecture whitepaper, appendix A (GeForce RTX 3090)",
    "Ada WP": "NVIDIA Ada GPU Architecture whitepaper, appendix A (GeForce RTX 4090)",
    "H100 DS": "NVIDIA H100 Tensor Core GPU datasheet (SXM column)",
    "H200 DS": "NVIDIA H200 Tensor Core GPU datasheet (SXM column)",
    "Hopper WP": "NVIDIA H100 Tensor Core GPU Architecture whitepaper (2022), HBM3 ECC",
    "Chaos KB": "Chaos support, 'ECC State for Nvidia GPUs' (third party: GeForce ECC off by default, driver toggle)",
    "Notebookcheck": "Notebookcheck, 'RTX 5090 drops VRAM ECC' (third party: RTX 3090 Ti and 4090 have a toggle)",
    "assumed": "an assumption of this model, not a published figure (the RTX 4090's ECC capacity cost: NVIDIA's "
               "in-line GDDR ECC reserves 1/16, Volta WP)",
    "measured": "measured on this machine when the notebook ran",
}


@dataclass(frozen=True)
class Accelerator:
    """One card (or this machine) as the step-time model sees it, with where each figure comes from.

    Attributes:
        name: the card, as NVIDIA names it.
        key: a short name for metric names (``a100``, ``rtx3090``).
        memory_type: HBM2, HBM2e, HBM3, HBM3e, GDDR6X, DDR (host).
        memory_gb: memory size in GB (10^9 bytes).
        bandwidth_gbs: peak memory bandwidth, GB/s.
        bf16_tflops: dense bf16 tensor throughput (fp32 accumulate), TFLOP/s; None without bf16 tensor cores.
        fp16_tflops: dense fp16 tensor throughput (fp32 accumulate), TFLOP/s.
        tf32_tflops: dense tf32 tensor throughput, TFLOP/s; None without tf32.
        fp8_tflops: dense fp8 tensor throughput (fp32 accumulate), TFLOP/s; None: no fp8 tensor cores.
        fp32_tflops: fp32 throughput without tensor cores, TFLOP/s.
        interconnect: what links the cards of one node.
        link_gbs: bandwidth each way per card for collectives, GB/s.
        link_latency_us: latency of one ring step of a collective, microseconds (assumed).
        ecc: what ECC there is and its state by default.
        ecc_capacity_cost: fraction of memory ECC takes when on (0: none; None: no ECC).
        ecc_bandwidth_cost: fraction of bandwidth ECC takes when on (0: none; None: no ECC or not published).
        sources: field name -> short source name (a key of :data:`SOURCES`); ``"*"`` covers every other field.
    """

    name: str
    key: str
    memory_type: str
    memory_gb: float
    bandwidth_gbs: float
    bf16_tflops: float | None
    fp16_tflops: float | None
    tf32_tflops: float | None
    fp8_tflops: float | None
    fp32_tflops: float
    interconnect: str
    link_gbs: float | None
    link_latency_us: float | None
    ecc: str
    ecc_capacity_cost: float | None
    ecc_bandwidth_cost: float | None
    sources: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("memory_gb", "bandwidth_gbs", "fp32_tflops"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{self.name}: {name}={getattr(self, name)!r} must be positive")
        if self.half_tflops is None:
            raise ValueError(f"{self.name}: needs a bf16 or an fp16 throughput")
        unknown = sorted(set(self.sources.values()) - set(SOURCES))
        if unknown:
            raise ValueError(f"{self.name}: unknown sources {unknown}; known: {sorted(SOURCES)}")
        if "*" not in self.sources:
            raise ValueError(f"{self.name}: sources needs a '*' entry (the document of every other figure)")

    @property
    def has_fp8(self) -> bool:
        return self.fp8_tflops is not None

    @property
    def has_ecc(self) -> bool:
        return self.ecc_capacity_cost is not None

    @property
    def half_tflops(self) -> float | None:
        """The 16-bit tensor rate training uses: bf16 where the card has it, else fp16 (V100)."""
        return self.bf16_tflops or self.fp16_tflops

    def source(self, field_name: str) -> str:
        return self.sources.get(field_name, self.sources["*"])

    def device(self, *, ecc_on: bool = False) -> Device:
        """The card as the step-time model's :class:`Device`, at peak; ``ecc_on`` takes ECC's costs off capacity
        and bandwidth (where it has ECC; unknown bandwidth costs count as none)."""
        capacity, bandwidth = self.memory_gb * GB, self.bandwidth_gbs * GB
        if ecc_on and self.has_ecc:
            capacity *= 1 - self.ecc_capacity_cost
            bandwidth *= 1 - (self.ecc_bandwidth_cost or 0.0)
        rates = {"bf16": self.half_tflops * T, "fp32": (self.tf32_tflops or self.fp32_tflops) * T}
        if self.fp8_tflops:
            rates["fp8"] = self.fp8_tflops * T
        return Device(name=self.name, matmul_flops=rates, bandwidth=bandwidth, memory=capacity,
                      link_bandwidth=None if self.link_gbs is None else self.link_gbs * GB,
                      link_latency=None if self.link_latency_us is None else self.link_latency_us * 1e-6,
                      asynchronous=True)


_HBM_ECC = "on by default; HBM side-band ECC: no capacity or bandwidth cost"
_NVL = {"link_latency_us": "assumed"}


def _card(name: str, **kw) -> Accelerator:
    return Accelerator(name=name, **kw)


ACCELERATORS: dict[str, Accelerator] = {a.name: a for a in (
    _card("V100 SXM2 32GB", key="v100", memory_type="HBM2", memory_gb=32, bandwidth_gbs=900,
          bf16_tflops=None, fp16_tflops=125, tf32_tflops=None, fp8_tflops=None, fp32_tflops=15.7,
          interconnect="NVLink 2, 300 GB/s", link_gbs=150, link_latency_us=5.0,
          ecc=_HBM_ECC, ecc_capacity_cost=0.0, ecc_bandwidth_cost=0.0,
          sources={"*": "V100 DS", "ecc": "Volta WP", "ecc_capacity_cost": "Volta WP",
                   "ecc_bandwidth_cost": "Volta WP", **_NVL}),
    _card("A100 SXM4 40GB", key="a100_40gb", memory_type="HBM2", memory_gb=40, bandwidth_gbs=1555,
          bf16_tflops=312, fp16_tflops=312, tf32_tflops=156, fp8_tflops=None, fp32_tflops=19.5,
          interconnect="NVLink 3, 600 GB/s", link_gbs=300, link_latency_us=5.0,
          ecc=_HBM_ECC, ecc_capacity_cost=0.0, ecc_bandwidth_cost=0.0,
          sources={"*": "A100 DS", "ecc": "A100 WP", "ecc_capacity_cost": "Volta WP",
                   "ecc_bandwidth_cost": "Volta WP", **_NVL}),
    _card("A100 SXM4 80GB", key="a100", memory_type="HBM2e", memory_gb=80, bandwidth_gbs=2039,
          bf16_tflops=312, fp16_tflops=312, tf32_tflops=156, fp8_tflops=None, fp32_tflops=19.5,
          interconnect="NVLink 3, 600 GB/s", link_gbs=300, link_latency_us=5.0,
          ecc=_HBM_ECC, ecc_capacity_cost=0.0, ecc_bandwidth_cost=0.0,
          sources={"*": "A100 DS", "ecc": "A100 WP", "ecc_capacity_cost": "Volta WP",
                   "ecc_bandwidth_cost": "Volta WP", **_NVL}),
    _card("RTX 3090", key="rtx3090", memory_type="GDDR6X", memory_gb=24, bandwidth_gbs=936,
          bf16_tflops=71, fp16_tflops=71, tf32_tflops=35.6, fp8_tflops=None, fp32_tflops=35.6,
          interconnect="PCIe 4.0 x16, 64 GB/s (NVLink bridge: 2 cards only)", link_gbs=32, link_latency_us=10.0,
          ecc="none: nothing to disable (the driver toggle came with the RTX 3090 Ti and 4090)",
          ecc_capacity_cost=None, ecc_bandwidth_cost=None,
          sources={"*": "GA102 WP", "ecc": "Notebookcheck", "link_latency_us": "assumed"}),
    _card("RTX 4090", key="rtx4090", memory_type="GDDR6X", memory_gb=24, bandwidth_gbs=1008,
          bf16_tflops=165.2, fp16_tflops=165.2, tf32_tflops=82.6, fp8_tflops=330.3, fp32_tflops=82.6,
          interconnect="PCIe 4.0 x16, 64 GB/s (no NVLink)", link_gbs=32, link_latency_us=10.0,
          ecc="driver toggle, off by default; in-line (in the data memory)",
          ecc_capacity_cost=0.0625, ecc_bandwidth_cost=None,
          sources={"*": "Ada WP", "ecc": "Chaos KB", "ecc_capacity_cost": "assumed",
                   "ecc_bandwidth_cost": "Chaos KB", "link_latency_us": "assumed"}),
    _card("H100 SXM5 80GB", key="h100", memory_type="HBM3", memory_gb=80, bandwidth_gbs=3350,
          bf16_tflops=989.4, fp16_tflops=989.4, tf32_tflops=494.7, fp8_tflops=1978.9, fp32_tflops=66.9,
          interconnect="NVLink 4, 900 GB/s", link_gbs=450, link_latency_us=5.0,
          ecc=_HBM_ECC, ecc_capacity_cost=0.0, ecc_bandwidth_cost=0.0,
          sources={"*": "H100 DS", "ecc": "Hopper WP", "ecc_capacity_cost": "Volta WP",
                   "ecc_bandwidth_cost": "Volta WP", **_NVL}),
    _card("H200 SXM 141GB", key="h200", memory_type="HBM3e", memory_gb=141, bandwidth_gbs=4800,
          bf16_tflops=989.4, fp16_tflops=989.4, tf32_tflops=494.7, fp8_tflops=1978.9, fp32_tflops=66.9,
          interconnect="NVLink 4, 900 GB/s", link_gbs=450, link_latency_us=5.0,
          ecc=_HBM_ECC, ecc_capacity_cost=0.0, ecc_bandwidth_cost=0.0,
          sources={"*": "H200 DS", "ecc": "Hopper WP", "ecc_capacity_cost": "Volta WP",
                   "ecc_bandwidth_cost": "Volta WP", **_NVL}),
)}

#: the cards whose speedups the post states: (theoretical, achieved)
POST_SPEEDUPS: dict[str, tuple[float, float]] = {
    "A100 SXM4 80GB": (3.2, 2.8),
    "V100 SXM2 32GB": (2.1, 1.7),
    "RTX 3090": (1.8, 1.3),
}

#: "consumer cards" in the post's sense: GeForce
CONSUMER = ("RTX 3090", "RTX 4090")


def get_accelerator(name: str) -> Accelerator:
    """The row of that name; a ``KeyError`` that lists the known names otherwise."""
    try:
        return ACCELERATORS[name]
    except KeyError:
        raise KeyError(f"no accelerator {name!r}; known: {', '.join(ACCELERATORS)}") from None


# ------------------------------------------------------------------------------------------- measured
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock(device: torch.device):
    """The clock timings use: on a CPU running one thread, that thread's CPU time (a process that takes the core
    away, on a shared machine, does not inflate it); otherwise wall time."""
    return time.thread_time if device.type == "cpu" and torch.get_num_threads() == 1 else time.perf_counter


def best_seconds(fn, device: torch.device, repeats: int) -> float:
    """The fastest of ``repeats`` timed calls (after one warm-up): load from elsewhere only ever adds time."""
    now = clock(device)
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = now()
        fn()
        _sync(device)
        best = min(best, now() - start)
    return best


def matmul_flops(dtype: torch.dtype, n: int = 1024, device: str = "cpu", repeats: int = 5) -> float:
    """FLOP/s of an ``n x n`` by ``n x n`` matmul in ``dtype`` on ``device`` (best of ``repeats``)."""
    dev = torch.device(device)
    a, b = torch.randn(n, n, device=dev).to(dtype), torch.randn(n, n, device=dev).to(dtype)
    return 2 * n ** 3 / best_seconds(lambda: a @ b, dev, repeats)


def copy_bandwidth(megabytes: float = 64, device: str = "cpu", repeats: int = 5) -> float:
    """Bytes/s of a tensor copy of ``megabytes`` (read + write counted, as STREAM's copy does)."""
    dev = torch.device(device)
    src = torch.empty(int(megabytes * 2 ** 20) // 4, device=dev)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / best_seconds(lambda: dst.copy_(src), dev, repeats)


def op_overhead(device: str = "cpu", ops: int = 2000) -> float:
    """Seconds the host spends dispatching one tiny op (a one-element add): the floor of every op."""
    dev = torch.device(device)
    x = torch.zeros(1, device=dev)

    def loop() -> None:
        for _ in range(ops):
            x.add_(1.0)

    return best_seconds(loop, dev, 3) / ops


def _host_memory_gb() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 / GB
    except OSError:
        pass
    return float("nan")


def measure_machine(device: str = "cpu", *, matmul_n: int = 1024, copy_mb: float = 64,
                    repeats: int = 5) -> tuple[Accelerator, float]:
    """This machine's row (every figure measured now) and its per-op host overhead in seconds.

    On CPU the row's 16-bit rate is a bf16 matmul (emulated, hence slow, where the CPU has no native bf16);
    on CUDA the device's own name, memory and measured rates.
    """
    from macroarch.measure.machine import cpu_model

    dev = torch.device(device)
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        name, memory_gb, memory_type = props.name, props.total_memory / GB, "device"
    else:
        name, memory_gb, memory_type = cpu_model(), _host_memory_gb(), "host DRAM"
    fp32 = matmul_flops(torch.float32, matmul_n, device, repeats) / T
    bf16 = matmul_flops(torch.bfloat16, matmul_n, device, repeats) / T
    label = f"{name} (this machine{f', {torch.get_num_threads()} threads' if dev.type == 'cpu' else ''})"
    row = Accelerator(
        name=label, key="this_machine", memory_type=memory_type, memory_gb=memory_gb,
        bandwidth_gbs=copy_bandwidth(copy_mb, device, repeats) / GB,
        bf16_tflops=bf16, fp16_tflops=None, tf32_tflops=None, fp8_tflops=None, fp32_tflops=fp32,
        interconnect="-", link_gbs=None, link_latency_us=None,
        ecc="not visible from here" if dev.type == "cpu" else _cuda_ecc(dev),
        ecc_capacity_cost=None, ecc_bandwidth_cost=None, sources={"*": "measured"})
    return row, op_overhead(device)


def _cuda_ecc(device: torch.device) -> str:
    try:
        import subprocess

        out = subprocess.run(["nvidia-smi", "-i", str(device.index or 0), "--query-gpu=ecc.mode.current",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=10)
        return f"current mode: {out.stdout.strip()}" if out.returncode == 0 else "unknown (nvidia-smi failed)"
    except (OSError, subprocess.SubprocessError):
        return "unknown (no nvidia-smi)"


def machine_device(row: Accelerator, op_overhead_s: float, device: str = "cpu") -> Device:
    """A measured row as the step-time model's :class:`Device`: the rates are achievable ones, and a CPU runs its
    ops one after another (host time adds), a GPU behind its host (the longer of the two counts)."""
    base = row.device()
    rates = {"bf16": row.bf16_tflops * T, "fp32": row.fp32_tflops * T}
    return Device(name=base.name, matmul_flops=rates, bandwidth=base.bandwidth, memory=base.memory,
                  link_bandwidth=None, link_latency=None, op_overhead=op_overhead_s,
                  asynchronous=torch.device(device).type == "cuda")


# ------------------------------------------------------------------------------------------- a step, counted
_MATMULS = {torch.ops.aten.mm.default: (0, 1), torch.ops.aten.bmm.default: (0, 1),
            torch.ops.aten.addmm.default: (1, 2), torch.ops.aten.baddbmm.default: (1, 2)}


class OpCounter(TorchDispatchMode):
    """Every aten op run inside: how many, the shape of each matmul, and the bytes read + written by the others
    (views move nothing and are not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops, self.bytes = 0, 0
        self.matmuls: dict[tuple, int] = {}  # (func, a's shape and strides, b's, dtype) -> count

    @property
    def flops(self) -> int:
        return sum(2 * math.prod(a[0][:-1]) * a[0][-1] * b[0][-1] * c for (_, a, b, _), c in self.matmuls.items())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from macroarch.mvas import MVASWeight

        if any(issubclass(t, MVASWeight) for t in types):
            return NotImplemented  # a packed weight dequantises through plain ops: those come back here, counted
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        if func in _MATMULS:
            i, j = _MATMULS[func]
            a, b = args[i], args[j]  # with their strides: a transposed operand can take another kernel
            key = (func, (tuple(a.shape), a.stride()), (tuple(b.shape), b.stride()), a.dtype)
            self.matmuls[key] = self.matmuls.get(key, 0) + 1
        elif not func.is_view:
            tensors = tensors_in((args, kwargs, out))
            self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        return out


def matmul_seconds(matmuls: dict[tuple, int], device: str = "cpu", repeats: int = 3) -> float:
    """The time of a step's matmuls, each (shape, strides) timed alone (fastest of ``repeats``) and counted as
    often as the step runs it: this machine's matmul rate at exactly the shapes and layouts the model uses."""
    dev = torch.device(device)
    total = 0.0
    for (func, (a_shape, a_stride), (b_shape, b_stride), dtype), count in matmuls.items():
        a = torch.empty_strided(a_shape, a_stride, dtype=dtype, device=dev).normal_()
        b = torch.empty_strided(b_shape, b_stride, dtype=dtype, device=dev).normal_()
        batched = func in (torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default)
        call = (lambda a=a, b=b: torch.bmm(a, b)) if batched else (lambda a=a, b=b: a @ b)
        total += count * best_seconds(call, dev, repeats)
    return total


def count_ops(fn) -> OpCounter:
    """Run ``fn`` under an :class:`OpCounter` and return the counter."""
    counter = OpCounter()
    with counter:
        fn()
    return counter


# ------------------------------------------------------------------------------------------- the table
COLUMNS = ("card", "bf16/fp16 TFLOP/s", "tf32 TFLOP/s", "fp8 TFLOP/s", "memory", "bandwidth GB/s", "interconnect",
           "fp8 tensor cores", "ECC", "ECC cost (capacity / bandwidth)", "sources")


def _cost(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2%}" if x else "none"


def table_rows(rows: list[Accelerator]) -> list[list[str]]:
    """The table as text cells (header first): every figure, and the sources of the row's figures."""

    def num(x: float | None, fmt: str = "{:,.1f}") -> str:
        return "-" if x is None else fmt.format(x)

    out = [list(COLUMNS)]
    for a in rows:
        half = num(a.half_tflops) + ("" if a.bf16_tflops else " (fp16 only)")
        bandwidth_cost = ("not published" if a.has_ecc and a.ecc_bandwidth_cost is None
                          else _cost(a.ecc_bandwidth_cost))
        out.append([a.name, half, num(a.tf32_tflops), num(a.fp8_tflops), f"{a.memory_gb:,.0f} GB {a.memory_type}",
                    num(a.bandwidth_gbs, "{:,.0f}"), a.interconnect, "yes" if a.has_fp8 else "no", a.ecc,
                    f"{_cost(a.ecc_capacity_cost)} / {bandwidth_cost}" if a.has_ecc else "-", sources_text(a)])
    return out


_LABELS = {"ecc": "ECC", "ecc_capacity_cost": "ECC capacity", "ecc_bandwidth_cost": "ECC bandwidth",
           "link_latency_us": "link latency"}


def sources_text(a: Accelerator) -> str:
    """``"A100 DS; ECC: A100 WP; ECC capacity: Volta WP; ..."``: the row's document, then each field sourced elsewhere
    (the short names are keys of :data:`SOURCES`)."""
    rest = [f"{_LABELS.get(k, k)}: {v}" for k, v in a.sources.items()
            if k != "*" and (a.has_ecc or not k.startswith("ecc_"))]
    return "; ".join([a.sources["*"], *rest])


def legend(rows: list[Accelerator]) -> str:
    """The full title of every source the rows use, one per line."""
    used = sorted({v for a in rows for v in a.sources.values()})
    return "\n".join(f"{k}: {SOURCES[k]}" for k in used)
