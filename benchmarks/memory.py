"""Analytic vs measured memory of one training step, by category.

    python benchmarks/memory.py --model gpt3_175b --precision post --fake
    python benchmarks/memory.py --model llama_65b_tiny --precision bf16_mixed --batch-size 4 --seq-len 64

The analytic column is ``macroarch.measure.memory.analytic`` (training state and activations); the measured
columns come from ``measure_training_step`` (MemTracker): each category's maximum over the step, what
was alive when the forward pass ended, and the composition of the peak. Full-size models need
``--fake`` (fake tensors: a few seconds, no memory); without a GPU use the CPU kernels (the default).
"""

from __future__ import annotations

import argparse

from macroarch.measure.memory import (
    CATEGORIES,
    PRECISIONS,
    activation_bytes,
    format_bytes,
    korthikanti_activation_bytes,
    measure_training_step,
    training_state_bytes,
)
from macroarch.models import MODELS, get_model_spec


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt3_tiny", choices=sorted(MODELS))
    parser.add_argument("--precision", default="bf16_mixed", choices=sorted(PRECISIONS))
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=None, help="default: the model's max_seq_len")
    parser.add_argument("--fake", action="store_true", help="measure under FakeTensorMode")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--unit", default="GB", help="B, MB, GB, TB (decimal) or MiB, GiB (binary)")
    args = parser.parse_args(argv)

    spec = get_model_spec(args.model)
    seq_len = args.seq_len or spec.shape.max_seq_len
    report = measure_training_step(
        spec, args.batch_size, seq_len, args.precision, fake=args.fake, device=args.device
    )
    device_type = report.device.split(":")[0]
    analytic = training_state_bytes(spec, args.precision)
    analytic["activations"] = activation_bytes(spec, args.batch_size, seq_len, args.precision, device_type)["total"]

    def fmt(n: int | None) -> str:
        return "-" if n is None else format_bytes(n, args.unit, 3)

    print(
        f"{spec.name} ({spec.description}), precision={args.precision}, batch={args.batch_size}, "
        f"seq={seq_len}, device={report.device}, fake={report.fake}, step {report.seconds:.1f} s"
    )
    header = f"{'category':<16}{'analytic':>18}{'measured max':>18}{'end of forward':>18}{'at peak':>18}"
    print(header)
    print("-" * len(header))
    for category in CATEGORIES:
        print(
            f"{category:<16}{fmt(analytic.get(category)):>18}{fmt(report.max_by_category[category]):>18}"
            f"{fmt(report.end_of_forward[category]):>18}{fmt(report.by_category[category]):>18}"
        )
    print(f"{'peak':<16}{'':>18}{'':>18}{'':>18}{fmt(report.peak_bytes):>18}")
    print()
    for phase, peak in report.phases.items():
        print(f"peak during {phase:<10} {fmt(peak.peak_bytes)}")
    measured_act = report.activation_bytes
    on_gpu = activation_bytes(spec, args.batch_size, seq_len, args.precision, "cuda")["total"]
    print(
        f"activations: measured {fmt(measured_act)}, analytic {fmt(analytic['activations'])} "
        f"({(measured_act - analytic['activations']) / analytic['activations']:+.2%}); "
        f"analytic with CUDA kernels {fmt(on_gpu)}; "
        f"Korthikanti et al. {fmt(korthikanti_activation_bytes(spec, args.batch_size, seq_len))}"
    )


if __name__ == "__main__":
    main()
