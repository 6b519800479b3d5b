"""``macroarch plan`` beside accelerate's ``estimate-memory`` and DeepSpeed's ZeRO-3 estimator, with a real step as
the arbiter.

Four models: a 7B Llama (Llama-2-7B's config, written to a local config.json), open_clip ViT-L/14, BERT-large
(``macroarch.models.bert_large_config``) and timm's ViT-B/16. For each, one plain training step in ``bf16_mixed``
(bf16 weights and gradients, ``MasterWeightAdamW``: fp32 master and moments), one device:

- **ours**: ``macroarch.planner.plan``, bytes by category and the measured peak (fake tensors, CPU kernels);
- **accelerate**: ``accelerate estimate-memory`` (the pinned release) with the local config; offline it needs the
  Hub, so where the command refuses, the table says so and uses the same functions it calls
  (``accelerate.utils.calculate_maximum_sizes`` on our model built on ``"meta"``, then
  ``accelerate.commands.estimate.estimate_training_usage(size, "bfloat16")``; the command prints the largest of
  its entries as "Training using Adam");
- **DeepSpeed ZeRO-3**: the published closed form of ``estimate_zero3_model_states_mem_needs``
  (``deepspeed/runtime/zero/stage3.py``; DeepSpeed's "Memory Requirements" docs): without offload, per GPU,
  ``4 * largest_layer_params + 18 * total_params / gpus`` bytes, where the largest layer is the module with the
  most direct parameters; no activations;
- **arbiter**: a real-tensor step (MemTracker on allocated tensors) of a scaled-down copy of each model (same layer
  types, fewer layers and a smaller width), on which all three tools are run too, and each tool's error is its
  total (ours: the peak) against the arbiter's peak.

    .venv/bin/python benchmarks/plan_compare.py            # writes benchmarks/figures/plan_compare.md

The full-size rows are the tools' answers; only the scaled rows have a measured truth to compare with.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MACROARCH_COMPILE", "0")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from macroarch.measure.fit import measure_training  # noqa: E402
from macroarch.planner import plan  # noqa: E402
from macroarch.planner.core import _setup  # noqa: E402
from macroarch.planner.models import Model, from_open_clip, from_timm, from_transformers_config, resolve  # noqa: E402
from macroarch.planner.run import _stack  # noqa: E402

GB = 1e9
OUT = Path(__file__).resolve().parent / "figures" / "plan_compare.md"
LLAMA_7B = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
            "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
LLAMA_SMALL = {**LLAMA_7B, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
               "num_attention_heads": 4, "num_key_value_heads": 4}


def _models(tmp: Path) -> list[tuple[str, Model, Model, int, int | None, int | None]]:
    """(label, full model, scaled copy, batch, full seq, scaled seq) for each of the four models."""
    from transformers import BertConfig

    from macroarch.models import bert_large_config

    full_cfg, small_cfg = tmp / "llama7b", tmp / "llama_small"
    for d, cfg in ((full_cfg, LLAMA_7B), (small_cfg, LLAMA_SMALL)):
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
    import open_clip

    clip = open_clip.get_model_config("ViT-L-14")
    clip_small = {"embed_dim": 128, "vision_cfg": {"image_size": 112, "layers": 4, "width": 256, "patch_size": 14},
                  "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 128, "heads": 4, "layers": 2}}
    bert_small = BertConfig(**{**bert_large_config().to_dict(), "hidden_size": 256, "num_hidden_layers": 4,
                               "num_attention_heads": 4, "intermediate_size": 1024})
    return [
        ("Llama 7B config (batch 1 x 2048)", resolve(str(full_cfg)), resolve(str(small_cfg)), 1, 2048, 256),
        ("open_clip ViT-L/14 (batch 32)", from_open_clip("ViT-L-14", clip),
         from_open_clip("ViT-L-14 (scaled)", clip_small), 32, None, None),
        ("BERT-large (batch 8 x 512)", resolve("bert_large"),
         from_transformers_config("BERT (scaled)", bert_small), 8, 512, 128),
        ("timm ViT-B/16 (batch 32)", from_timm("vit_base_patch16_224"),
         from_timm("vit_base_patch16_224", embed_dim=192, num_heads=3, depth=4), 32, None, None),
    ]


def _meta(model: Model, seq: int | None) -> nn.Module:
    return model.build(None, torch.float32, seq if model.seq_name != "tokens" else None)


def accelerate_estimate(model: Model, seq: int | None, config_dir: str | None) -> tuple[int, str]:
    """accelerate's "Training using Adam" bytes in bfloat16, and how they were obtained."""
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes

    how = "Python API (no local config to give the command)"
    if config_dir is not None:
        cmd = [str(Path(sys.executable).parent / "accelerate"), "estimate-memory", config_dir, "--library_name",
               "transformers", "--dtypes", "float16"]  # its fp16 row: the same mixed-precision count as bf16
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode == 0:
            return -1, "CLI: " + done.stdout.strip().splitlines()[-2]
        last = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1][:160]
        how = f"CLI refused (`{' '.join(cmd[1:3])}`: {last}); its Python API on our meta model"
    total, _ = calculate_maximum_sizes(_meta(model, seq))
    return max(estimate_training_usage(total, "bfloat16").values()), how


def deepspeed_zero3(model: Model, seq: int | None, gpus: int = 1) -> int:
    """``estimate_zero3_model_states_mem_needs`` without offload (module docstring), per GPU."""
    net = _meta(model, seq)
    total = sum({id(p): p.numel() for p in net.parameters()}.values())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in net.modules())
    return 4 * largest + int(18 * total / gpus)


def real_step(model: Model, batch: int, seq: int | None):
    """The arbiter: one plain bf16_mixed step of ``model`` on real tensors, measured by MemTracker."""
    setup, _ = _setup(None, "bf16_mixed", None, 1)

    def build():
        torch.manual_seed(0)
        net = model.build(None, setup.policy.param_dtype, seq if model.seq_name != "tokens" else None, device="cpu")
        data = model.batch(batch, seq, setup.policy.activation_dtype)
        runner, optimizer = _stack(net, frozenset(), setup, lambda m: model.loss(m, data))
        return net, runner, optimizer, data

    return measure_training(build, model.loss, fake=False)


def _cats(c) -> str:
    b = c.bytes.categories
    return " / ".join(f"{b[k] / GB:.2f}" for k in ("weights", "gradients", "master", "optimizer", "activations"))


def _err(x: float, truth: float) -> str:
    return f"{(x - truth) / truth:+.1%}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows_full, rows_small, notes = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for label, full, small, batch, seq, small_seq in _models(Path(tmp)):
            start = time.perf_counter()
            ours = plan(full, batch, seq).combination("plain")
            seconds = time.perf_counter() - start
            cfg_dir = full.name if full.kind == "transformers" else None
            acc, acc_how = accelerate_estimate(full, seq, cfg_dir)
            notes.append(f"{label}: accelerate via {acc_how}")
            ds = deepspeed_zero3(full, seq)
            rows_full.append(f"| {label} | {_cats(ours)} | {ours.bytes.peak / GB:.2f} | {seconds:.0f} s | "
                             f"{acc / GB:.2f} | {ds / GB:.2f} |")
            s_seq = small_seq
            ours_s = plan(small, batch, s_seq).combination("plain")
            acc_s, _ = accelerate_estimate(small, s_seq, None)
            ds_s = deepspeed_zero3(small, s_seq)
            truth = real_step(small, batch, s_seq).peak_bytes
            rows_small.append(f"| {label.split(' (')[0]}, scaled | {truth / GB:.3f} | {ours_s.bytes.peak / GB:.3f} "
                              f"({_err(ours_s.bytes.peak, truth)}) | {acc_s / GB:.3f} ({_err(acc_s, truth)}) | "
                              f"{ds_s / GB:.3f} ({_err(ds_s, truth)}) |")
            print(rows_full[-1], rows_small[-1], sep="\n", flush=True)
    text = "\n".join([
        "# `macroarch plan` against accelerate and DeepSpeed, with a real step as the arbiter",
        "",
        f"Written by `benchmarks/plan_compare.py` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch "
        f"{torch.__version__}). One plain training step, bf16 weights and gradients with fp32 master and moments "
        "(`bf16_mixed`), one device; GB = 1e9 bytes.",
        "",
        "Full size: the tools' answers (ours: weights / gradients / master / optimizer / activations, each its own "
        "maximum over the step, and the measured peak; the time is the planner's wall time on this shared 2-core "
        "machine).",
        "",
        "| model | ours by category (GB) | ours peak | time | accelerate | DeepSpeed ZeRO-3 |",
        "|---|---|---|---|---|---|",
        *rows_full,
        "",
        "Scaled-down copies (same layer types, fewer layers, smaller width): a real-tensor step is the arbiter; each "
        "tool's total against its peak.",
        "",
        "| model | real step peak (GB) | ours | accelerate | DeepSpeed ZeRO-3 |",
        "|---|---|---|---|---|",
        *rows_small,
        "",
        "accelerate counts weights, gradients and Adam state in the largest of its entries (no activations); "
        "DeepSpeed's ZeRO-3 estimator is model states only (18 bytes per parameter over the GPUs, plus 4 bytes per "
        "parameter of the largest layer); neither counts activations, which is where they miss.",
        "",
        *(f"- {n}" for n in notes),
        "",
    ])
    args.out.write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
