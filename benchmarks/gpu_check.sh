#!/usr/bin/env bash
# The GPU path, checked in one go on a machine with a CUDA GPU (claim C11, issue 17).
#
#   benchmarks/gpu_check.sh [OUT_DIR]        # default: benchmarks/results/gpu_check/<device>-<UTC time>
#
# 1. notebook 09 (hardware speedups) with its gpu profile: this GPU's row measured (matmul throughput, copy
#    bandwidth), the step-time model validated against small Llamas trained on the GPU (baseline vs MVAS + DGR):
#    the measured speedup on this card, and the model's error here;
# 2. every other notebook of papermill_runs/gpu.yaml at smoke size: the ci profile's sizes with the gpu profile's
#    device (so every `device: cuda` code path runs on the GPU), each under its own timeout.
# Everything fits in BUDGET_S seconds (default 480: 8 minutes); what does not fit is listed as skipped.
#
# Results, with the device's name: OUT_DIR/device.json (name, memory, capability, driver, ECC mode, versions),
# OUT_DIR/<notebook>.ipynb (executed; .failed.ipynb if it failed), OUT_DIR/gpu/<claim>/result.json and figures,
# OUT_DIR/wandb (offline runs), OUT_DIR/summary.md. Commit OUT_DIR: it is the GPU evidence the paper can cite.
# Uses GPU 0 only (CUDA_VISIBLE_DEVICES), so no notebook starts NCCL between GPUs. Without a CUDA GPU it stops
# at once with exit status 2.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
BUDGET_S="${BUDGET_S:-480}"
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
START=$(date +%s)

if [[ ! -x "$PY" ]]; then
    echo "gpu_check: no Python at $PY: build the project's .venv first (make test builds it) or set PYTHON=" >&2
    exit 2
fi

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() and torch.cuda.device_count() > 0 else 1)"; then
    echo "gpu_check: no CUDA GPU visible (torch.cuda.is_available() is False; CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES)." >&2
    echo "gpu_check: this script measures the GPU path and has nothing to run here; the cpu profile is the evidence" >&2
    echo "gpu_check: (make reproduce). Run it on a machine with one CUDA GPU." >&2
    exit 2
fi

DEVICE_NAME="$("$PY" -c "import torch; print(torch.cuda.get_device_name(0))")"
SLUG="$(echo "$DEVICE_NAME" | tr '[:upper:]' '[:lower:]' | tr -cs 'a-z0-9' '-' | sed 's/^-//; s/-$//')"
OUT="${1:-$ROOT/benchmarks/results/gpu_check/${SLUG}-$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
export MACROARCH_OUT="$OUT" WANDB_DIR="$OUT" WANDB_MODE="${WANDB_MODE:-offline}" WANDB_SILENT=true
echo "gpu_check: $DEVICE_NAME -> $OUT (budget ${BUDGET_S}s)"

# The device, recorded beside the results.
"$PY" - "$OUT/device.json" <<'EOF'
import json, subprocess, sys, torch
p = torch.cuda.get_device_properties(0)
info = {"name": p.name, "memory_bytes": p.total_memory, "capability": f"{p.major}.{p.minor}",
        "multiprocessors": p.multi_processor_count, "torch": torch.__version__, "cuda": torch.version.cuda,
        "bf16": torch.cuda.is_bf16_supported(), "visible_devices": torch.cuda.device_count()}
try:
    q = subprocess.run(["nvidia-smi", "-i", "0", "--query-gpu=driver_version,ecc.mode.current,memory.total",
                        "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
    info["nvidia_smi"] = q.stdout.strip() if q.returncode == 0 else f"failed: {q.stderr.strip()}"
except (OSError, subprocess.SubprocessError) as e:
    info["nvidia_smi"] = f"unavailable: {e}"
json.dump(info, open(sys.argv[1], "w"), indent=2)
print(json.dumps(info))
EOF

# One line per notebook: "<stem><TAB><parameters as YAML flow>": 09 with its gpu values, the others with the ci
# values (smoke size) and the gpu entry's device. Notebooks without a ci entry have no smoke size: skipped.
PLAN="$OUT/plan.tsv"
"$PY" - "$PLAN" <<'EOF'
import sys
import yaml
profiles = {p: {e["notebook"]: e.get("parameters") or {} for e in yaml.safe_load(open(f"papermill_runs/{p}.yaml"))["notebooks"]}
            for p in ("ci", "gpu")}
measured = "09_hardware_speedups"
order = [measured] + [s for s in profiles["gpu"] if s != measured]
with open(sys.argv[1], "w") as f:
    for stem in order:
        if stem not in profiles["gpu"]:
            continue
        if stem == measured:
            params = profiles["gpu"][stem]
        elif stem in profiles["ci"]:
            params = dict(profiles["ci"][stem])
            params.update({k: v for k, v in profiles["gpu"][stem].items() if k in ("device", "compute_dtype")})
        else:
            f.write(f"{stem}\tSKIP\n")
            continue
        f.write(f"{stem}\t{yaml.safe_dump(params, default_flow_style=True, width=10**6).strip()}\n")
EOF

SUMMARY="$OUT/summary.md"
{
    echo "# gpu_check on $DEVICE_NAME ($(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'))"
    echo
    echo "09_hardware_speedups at its gpu profile (the measured part); every other notebook at ci (smoke) sizes on the gpu"
    echo "profile's device. Results: gpu/<claim>/result.json beside this file."
    echo
    echo "| notebook | status | seconds |"
    echo "|---|---|---|"
} > "$SUMMARY"

FAILED=0
while IFS=$'\t' read -r STEM PARAMS; do
    LEFT=$(( BUDGET_S - ($(date +%s) - START) ))
    if [[ "$PARAMS" == "SKIP" ]]; then
        echo "| $STEM | skipped: no ci (smoke) entry | - |" >> "$SUMMARY"; continue
    fi
    if (( LEFT < 30 )); then
        echo "| $STEM | skipped: the ${BUDGET_S}s budget is spent | - |" >> "$SUMMARY"; continue
    fi
    LIMIT=$(( LEFT < 240 ? LEFT : 240 ))
    echo "gpu_check: $STEM (limit ${LIMIT}s) $PARAMS"
    T0=$(date +%s)
    if timeout --signal=INT --kill-after=20 "$LIMIT" "$PY" -m papermill "notebooks/$STEM.ipynb" "$OUT/$STEM.ipynb" \
            -p profile gpu -y "$PARAMS" --cwd "$ROOT" -k python3 --no-progress-bar > "$OUT/$STEM.log" 2>&1; then
        STATUS=ok
    else
        RC=$?
        STATUS="failed (exit $RC; see $STEM.log)"
        if (( RC == 124 || RC == 130 || RC == 137 )); then STATUS="timed out after ${LIMIT}s (exit $RC; see $STEM.log)"; fi
        [[ -f "$OUT/$STEM.ipynb" ]] && mv "$OUT/$STEM.ipynb" "$OUT/$STEM.failed.ipynb"
        FAILED=$(( FAILED + 1 ))
    fi
    echo "| $STEM | $STATUS | $(( $(date +%s) - T0 )) |" >> "$SUMMARY"
done < "$PLAN"

# The verdicts the runs recorded (claim, grade, measured), from their result files.
"$PY" - "$OUT" >> "$SUMMARY" <<'EOF'
import json, sys
from pathlib import Path
rows = []
for path in sorted(Path(sys.argv[1], "gpu").glob("*/result.json")):
    r = json.loads(path.read_text())
    v = r.get("verdict") or {}
    rows.append(f"| {r['claim']} | {r['status']} | {v.get('grade', '-')} | {(v.get('measured') or '-')[:300]} |")
print("\n| claim | status | grade | measured |\n|---|---|---|---|")
print("\n".join(rows) or "| - | no results | - | - |")
EOF

echo "gpu_check: $(( $(date +%s) - START ))s, $FAILED failed; summary: $SUMMARY"
exit $(( FAILED > 0 ? 1 : 0 ))
