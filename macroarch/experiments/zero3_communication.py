"""Notebook 03's experiment: under ZeRO-3, the share of a step spent in parameter sync (claim C5, section 2.2).

The post: "once communication latency exceeds 200 us, parameter synchronisation takes over 38% of each
training step". It names no model, cluster or batch; the setting here is GPT-3 175B (its section 2.2) on
8x A100 (section 4.2), with LLaMA-65B and a ~10B Llama beside it. The model is ``macroarch.measure.zero3``
(alpha-beta ring collectives, ``3 L + 2`` per step, Kaplan FLOPs over peak x MFU; serial and FSDP-overlapped).

- :func:`post_setting`: the share against latency per model, the share at 200 us, the latency where it
  reaches 38% (serial and overlapped), and the training state each GPU holds;
- :func:`sensitivity`: the share at 200 us over what the post leaves open, tokens per GPU and MFU;
- :func:`calibrate`: this machine's collectives timed on gloo ranks (``macroarch.measure.calibrate``) and the
  alpha-beta fit per collective; :func:`check_here`: the model with the fitted link and measured compute
  beside a real FSDP2 step on those ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from macroarch._table import format_table
from macroarch.measure.calibrate import measure_zero3
from macroarch.measure.memory import format_bytes, parameter_count, training_state_bytes
from macroarch.measure.workload import Workload
from macroarch.measure.zero3 import Cluster, StepTime, fit_alpha_beta, latency_for_share, zero3_step
from macroarch.models import ModelSpec, get_model_spec

POST_LATENCY = 200e-6
"""The latency of the claim, seconds per ring step."""
TOKEN_GRID = (512, 1024, 2048, 4096, 8192, 16384)
"""Tokens per GPU per step that the sensitivity sweeps."""
FITTED_OPS = ("all_gather", "reduce_scatter")


def latency_grid(range_us: list[float], points: int) -> np.ndarray:
    """``points`` latencies in seconds, log-spaced over ``range_us`` (microseconds)."""
    return np.logspace(np.log10(range_us[0] * 1e-6), np.log10(range_us[1] * 1e-6), points)


def a100_cluster(world_size: int, nvlink_GBps: float, bus_efficiency: float, peak_tflops: float,
                 mfu: float) -> Cluster:
    """``world_size`` A100 SXM on NVLink3 through NVSwitch, at the claim's 200 us latency."""
    return Cluster(f"{world_size}x A100 SXM, NVLink3 via NVSwitch", world_size, latency=POST_LATENCY,
                   bandwidth=nvlink_GBps * 1e9 * bus_efficiency, peak_flops=peak_tflops * 1e12, mfu=mfu)


def share_curve(spec: ModelSpec, cluster: Cluster, tokens: int, latencies: np.ndarray,
                **kw) -> tuple[np.ndarray, np.ndarray]:
    """Share of the step in parameter sync at each latency: ``(serial, overlapped)``."""
    steps = [zero3_step(spec, cluster.with_latency(a), tokens, **kw) for a in latencies]
    return np.array([s.share_serial for s in steps]), np.array([s.share_overlapped for s in steps])


@dataclass(frozen=True)
class ModelShare:
    spec: ModelSpec
    at_200us: StepTime
    serial: np.ndarray
    overlapped: np.ndarray
    crossing: tuple[float | None, float | None]
    """Latency (s) where the share reaches the target, serial and overlapped; None: never (below 10 s)."""
    state_per_gpu: float
    """bf16 mixed-precision training state (16 B/param) sharded over the ranks."""


@dataclass(frozen=True)
class PostSetting:
    cluster: Cluster
    tokens: int
    latencies: np.ndarray
    share_target: float
    graded: str
    """The model the claim is graded on; its metrics carry no prefix."""
    models: dict[str, ModelShare]

    def metrics(self) -> dict[str, float]:
        m: dict[str, float] = {}
        for name, s in self.models.items():
            key = "" if name == self.graded else f"{name}_"
            step = s.at_200us
            m |= {f"{key}sync_share_at_200us": step.share_serial,
                  f"{key}sync_share_at_200us_overlapped": step.share_overlapped,
                  f"{key}compute_s": step.compute, f"{key}sync_s_at_200us": step.comm,
                  f"{key}latency_part_s_at_200us": step.latency_part, f"{key}collectives_per_step": step.collectives,
                  f"{key}state_bytes_per_gpu": s.state_per_gpu}
            for suffix, latency in zip(("", "_overlapped"), s.crossing):
                if latency is not None:
                    m[f"{key}latency_at_38pct{suffix}_us"] = latency * 1e6
        return m

    def series(self) -> list[tuple[int, dict[str, float]]]:
        """``(index, values)`` rows for ``run.log``: the share curves against latency."""
        return [(i, {k: v for name, s in self.models.items() for k, v in (
            (f"{name}_latency_us", a * 1e6), (f"{name}_share", s.serial[i]),
            (f"{name}_share_overlapped", s.overlapped[i]))}) for i, a in enumerate(self.latencies)]

    def table(self) -> str:
        rows = [("model", "params", "state/GPU", "collectives", "compute s", "sync s @200us", "share @200us",
                 "overlapped", "38% reached at (serial / overlapped)")]
        for name, s in self.models.items():
            us = " / ".join("never" if c is None else f"{c * 1e6:.0f} us" for c in s.crossing)
            step = s.at_200us
            rows.append((name, f"{parameter_count(s.spec) / 1e9:.1f}B", format_bytes(s.state_per_gpu, "GB", 0),
                         step.collectives, f"{step.compute:.2f}", f"{step.comm:.2f}", f"{step.share_serial:.1%}",
                         f"{step.share_overlapped:.1%}", us))
        return (format_table(rows) + f"\n(state/GPU: bf16 mixed-precision training state, 16 B/param, sharded over "
                f"{self.cluster.world_size} GPUs; an A100 has 80 GB)")


def post_setting(models: list[str], cluster: Cluster, tokens: int, latencies: np.ndarray, share_target: float, *,
                 seq_len: int, param_bytes: int, grad_bytes: int) -> PostSetting:
    """Every model of ``models`` on ``cluster``; the first is the graded one."""
    kw = dict(seq_len=seq_len, param_bytes=param_bytes, grad_bytes=grad_bytes)
    shares = {}
    for name in models:
        spec = get_model_spec(name)
        shares[name] = ModelShare(
            spec, zero3_step(spec, cluster.with_latency(POST_LATENCY), tokens, **kw),
            *share_curve(spec, cluster, tokens, latencies, **kw),
            tuple(latency_for_share(spec, cluster, tokens, share_target, overlap=o, **kw) for o in (False, True)),
            training_state_bytes(spec, "bf16_mixed")["total"] / cluster.world_size)
    return PostSetting(cluster, tokens, latencies, share_target, models[0], shares)


@dataclass(frozen=True)
class Sensitivity:
    model: str
    tokens: tuple[int, ...]
    shares: dict[float, list[float]]
    """Serial share at 200 us per MFU, one per entry of ``tokens``."""

    def metrics(self) -> dict[str, float]:
        return {"sync_share_at_200us_max_over_sensitivity": max(max(s) for s in self.shares.values())}

    def text(self) -> str:
        return "\n".join(f"MFU {m:.2f}: share at 200 us for {list(self.tokens)} tokens/GPU: "
                         + ", ".join(f"{s:.1%}" for s in shares) for m, shares in self.shares.items())


def sensitivity(model: str, cluster: Cluster, *, seq_len: int, param_bytes: int, grad_bytes: int,
                tokens: tuple[int, ...] = TOKEN_GRID) -> Sensitivity:
    """The serial share at 200 us over tokens per GPU and MFU 0.3, the cluster's, 0.7."""
    spec = get_model_spec(model)
    base = cluster.with_latency(POST_LATENCY)
    return Sensitivity(model, tuple(tokens), {
        m: [zero3_step(spec, replace(base, mfu=m), t, seq_len=seq_len, param_bytes=param_bytes,
                       grad_bytes=grad_bytes).share_serial for t in tokens]
        for m in sorted({0.3, cluster.mfu, 0.7})})


@dataclass(frozen=True)
class Calibration:
    """Collectives timed on this machine's ranks (``measure_zero3``'s result) and one alpha-beta fit each."""

    measured: dict
    fits: dict[str, tuple[float, float]]
    """``(alpha seconds, bandwidth bytes/s)`` of all-gather and reduce-scatter."""

    @property
    def world_size(self) -> int:
        return self.measured["world_size"]

    def ring_seconds(self, op: str, nbytes):
        """The fitted ring time of ``op`` for ``nbytes`` (a number or an array)."""
        a, b = self.fits[op]
        n = self.world_size
        return (n - 1) * a + (n - 1) / n * nbytes / b

    def metrics(self) -> dict[str, float]:
        (alpha, bandwidth), (rs_alpha, rs_bandwidth) = self.fits["all_gather"], self.fits["reduce_scatter"]
        return dict(here_alpha_us=alpha * 1e6, here_bandwidth_GBps=bandwidth / 1e9, here_rs_alpha_us=rs_alpha * 1e6,
                    here_rs_bandwidth_GBps=rs_bandwidth / 1e9)

    def series(self) -> list[tuple[int, dict[str, float]]]:
        seconds = self.measured["seconds"]
        return [(i, {"calibration_bytes": s, "all_gather_s": seconds["all_gather"][i],
                     "reduce_scatter_s": seconds["reduce_scatter"][i], "all_reduce_s": seconds["all_reduce"][i]})
                for i, s in enumerate(self.measured["sizes"])]

    def table(self) -> str:
        seconds = self.measured["seconds"]
        rows = [("bytes", *(f"{op} ms" for op in seconds), "fit AG / RS ms")]
        for i, s in enumerate(self.measured["sizes"]):
            rows.append((s, *(f"{seconds[op][i] * 1e3:.3f}" for op in seconds),
                         " / ".join(f"{self.ring_seconds(op, s) * 1e3:.3f}" for op in FITTED_OPS)))
        fits = [f"fit {op}: alpha = {a * 1e6:.1f} us per ring step, B = {b / 1e9:.2f} GB/s each way"
                for op, (a, b) in self.fits.items()]
        return "\n".join([format_table(rows), *fits])


def calibrate(work: Workload, sizes_log2: list[int], repeats: int, steps: int, world_size: int,
              threads: int) -> Calibration:
    """Time the collectives at gathered sizes ``2**k`` for every other ``k`` of ``sizes_log2`` (both ends
    included), and ``steps`` FSDP2 steps of ``work``, on ``world_size`` gloo ranks; fit each collective."""
    sizes = [2**k for k in range(sizes_log2[0], sizes_log2[1] + 1, 2)]
    measured = measure_zero3(work, sizes=sizes, repeats=repeats, steps=steps, world_size=world_size, threads=threads)
    # One alpha-beta fit per collective: gloo's reduce-scatter is not as fast as its all-gather.
    fits = {op: fit_alpha_beta(measured["sizes"], measured["seconds"][op], world_size) for op in FITTED_OPS}
    return Calibration(measured, fits)


@dataclass(frozen=True)
class HereCheck:
    """The ZeRO-3 model of this machine (fitted link, measured compute) beside the measured FSDP2 step."""

    cluster: Cluster
    tokens: int
    predicted: StepTime
    """The model's step at this machine's own latency."""
    step_s: float
    compute_s: float
    collectives: int
    n_params: int
    curve: tuple[np.ndarray, np.ndarray]
    at_200us: StepTime
    crossing: float | None

    @property
    def sync_measured(self) -> float:
        return self.step_s - self.compute_s

    def metrics(self) -> dict[str, float]:
        p = self.predicted
        m = dict(fsdp_step_s=self.step_s, fsdp_compute_s=self.compute_s, fsdp_sync_measured_s=self.sync_measured,
                 fsdp_sync_predicted_s=p.comm, fsdp_predicted_over_measured=p.comm / self.sync_measured,
                 fsdp_step_predicted_serial_s=p.serial, fsdp_step_predicted_overlapped_s=p.overlapped,
                 fsdp_collectives_measured=self.collectives, fsdp_collectives_predicted=p.collectives,
                 here_share_measured=self.sync_measured / self.step_s, here_share_model=p.share_serial,
                 here_sync_share_at_200us=self.at_200us.share_serial)
        return m | ({} if self.crossing is None else {"here_latency_at_38pct_us": self.crossing * 1e6})

    def text(self) -> str:
        p, n = self.predicted, self.cluster.world_size
        return (f"FSDP2 on {n} gloo ranks, {self.n_params / 1e6:.1f}M params (fp32), {self.tokens} tokens/rank:\n"
                f"  collectives per step: FSDP2 issued {self.collectives}, model {p.collectives}\n"
                f"  step: measured {self.step_s * 1e3:.1f} ms (compute alone {self.compute_s * 1e3:.1f} ms); "
                f"model {p.serial * 1e3:.1f} ms serial, {p.overlapped * 1e3:.1f} ms overlapped\n"
                f"  sync time: measured {self.sync_measured * 1e3:.1f} ms, model {p.comm * 1e3:.1f} ms "
                f"(ratio model / measured {p.comm / self.sync_measured:.2f})\n"
                f"  this machine: share {p.share_serial:.1%} at its own alpha, {self.at_200us.share_serial:.1%} at "
                f"200 us; measured share {self.sync_measured / self.step_s:.1%}")


def check_here(calib: Calibration, work: Workload, latencies: np.ndarray, share_target: float) -> HereCheck:
    """fp32 gathers and reduce-scatters (4 bytes), as the FSDP2 step ran."""
    (alpha, bandwidth), (rs_alpha, rs_bandwidth) = calib.fits["all_gather"], calib.fits["reduce_scatter"]
    n = calib.world_size
    here = Cluster(f"{n} gloo ranks on loopback (this machine)", n, latency=alpha, bandwidth=bandwidth,
                   peak_flops=1.0, scatter_latency=rs_alpha, scatter_bandwidth=rs_bandwidth)
    m = calib.measured
    kw = dict(seq_len=work.seq_len, param_bytes=4, grad_bytes=4, compute_seconds=m["compute_s"])
    small = work.spec()
    return HereCheck(here, work.tokens, zero3_step(small, here, work.tokens, **kw), m["fsdp_step_s"], m["compute_s"],
                     m["fsdp_collectives"], m["n_params"], share_curve(small, here, work.tokens, latencies, **kw),
                     zero3_step(small, here.with_latency(POST_LATENCY), work.tokens, **kw),
                     latency_for_share(small, here, work.tokens, share_target, **kw))


def plot_sync_share(post: PostSetting, sens: Sensitivity, calib: Calibration, here: HereCheck) -> Figure:
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    us, cluster = post.latencies * 1e6, post.cluster
    ax = axes[0]
    for name, s in post.models.items():
        line, = ax.semilogx(us, s.serial, lw=1.6, label=f"{name} (serial)")
        ax.semilogx(us, s.overlapped, ls="--", lw=1.2, color=line.get_color(), label=f"{name} (overlapped)")
    ax.semilogx(us, here.curve[0], color="k", lw=1.4, label="this machine's model (serial)")
    ax.axhline(post.share_target, color="r", lw=0.8, ls=":", label=f"{post.share_target:.0%} (the post)")
    ax.axvline(POST_LATENCY * 1e6, color="r", lw=0.8, ls=":")
    ax.set(xlabel="latency alpha per ring step (us)", ylabel="share of step in parameter sync", ylim=(0, 1),
           title=f"ZeRO-3 on {cluster.name}\n{post.tokens} tokens/GPU, MFU {cluster.mfu}, "
                 f"{cluster.bandwidth / 1e9:.0f} GB/s")
    ax.legend(fontsize=6.5)
    ax = axes[1]
    for m, shares in sens.shares.items():
        ax.semilogx(sens.tokens, shares, "o-", ms=3, label=f"MFU {m:.2f}")
    ax.axhline(post.share_target, color="r", lw=0.8, ls=":")
    ax.set(xlabel="tokens per GPU per step", ylabel="share at 200 us (serial)",
           title=f"{sens.model}: what the post leaves open", ylim=(0, 1))
    ax.legend(fontsize=7)
    ax = axes[2]
    sizes = np.array(calib.measured["sizes"], dtype=float)
    for op in ("all_gather", "reduce_scatter", "all_reduce"):
        ax.loglog(sizes, np.array(calib.measured["seconds"][op]) * 1e3, "o", ms=4, label=f"{op} (measured)")
    for op, color in zip(FITTED_OPS, ("C0", "C1")):
        a, b = calib.fits[op]
        ax.loglog(sizes, calib.ring_seconds(op, sizes) * 1e3, "-", color=color, lw=1,
                  label=f"{op} fit: alpha {a * 1e6:.0f} us, B {b / 1e9:.2f} GB/s")
    ax.set(xlabel="bytes (gathered tensor)", ylabel="ms", title=f"gloo, {calib.world_size} ranks on loopback; FSDP2 "
           f"sync measured {here.sync_measured * 1e3:.0f} ms vs model {here.predicted.comm * 1e3:.0f} ms")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def c5_texts(post: PostSetting, calib: Calibration, here: HereCheck, metrics: dict[str, float]) -> dict[str, str]:
    """``scale``, ``measured_text`` and ``note`` for C5's verdict, from the run's metrics."""
    m, cluster, graded = metrics, post.cluster, post.models[post.graded]
    alpha, bandwidth = calib.fits["all_gather"]
    cross = graded.crossing[0]
    others = [name for name in post.models if name != post.graded]
    return dict(
        scale=(f"alpha-beta model of ZeRO-3 ({3 * graded.spec.shape.n_layers + 2} collectives/step) for {post.graded} "
               f"on {cluster.name}, {post.tokens} tokens/GPU, MFU {cluster.mfu}, {cluster.bandwidth / 1e9:.0f} GB/s; "
               f"collectives calibrated on {calib.world_size} gloo ranks here (alpha {alpha * 1e6:.0f} us, "
               f"B {bandwidth / 1e9:.2f} GB/s), FSDP2 check {here.tokens} tokens x {here.n_params / 1e6:.1f}M params"),
        measured_text=(f"share at 200 us: {m['sync_share_at_200us']:.1%} serial, "
                       f"{m['sync_share_at_200us_overlapped']:.1%} overlapped; {post.share_target:.0%} reached at "
                       f"alpha = " + ("never (<10 s)" if cross is None else f"{cross * 1e6:.0f} us") + "; "
                       + ", ".join(f"{name}: {m[name + '_sync_share_at_200us']:.1%}" for name in others)),
        note=(f"the share at 200 us depends on tokens per GPU and MFU more than on latency (up to "
              f"{m['sync_share_at_200us_max_over_sensitivity']:.0%} over 512-16384 tokens and MFU 0.3-0.7); "
              f"with FSDP's overlap almost all of the sync is hidden. {post.graded} needs "
              f"{format_bytes(m['state_bytes_per_gpu'], 'GB', 0)} of training state per GPU under ZeRO-3 on "
              f"{cluster.world_size} GPUs (80 GB each): it only runs with offload. FSDP2 check here: model / measured "
              f"sync time {m['fsdp_predicted_over_measured']:.2f}, collectives {here.collectives} measured vs "
              f"{here.predicted.collectives} modelled"),
    )


__all__ = ["POST_LATENCY", "TOKEN_GRID", "Calibration", "HereCheck", "ModelShare", "PostSetting", "Sensitivity",
           "a100_cluster", "c5_texts", "calibrate", "check_here", "latency_grid", "plot_sync_share", "post_setting",
           "sensitivity", "share_curve"]
