#!/usr/bin/env bash
# The one prepared check of mlxkit's GPU paths on a lent GPU machine, offline, in about 8 minutes.
#
# Here, with the network (once per change of the code or of bench/device/carry.txt):
#   make gpu-prepare                 # scripts/prepare_device.sh fills .device/ (wheels, data, tokenizer)
# On the lent machine, through the device tool, carrying .device:
#   bash bench/gpu_check.sh          # results in $OUT (at most 8 files)
# Rehearsed here on a CPU, in an environment of the image's versions: make gpu-rehearsal.
#
# Steps: the machine (stops at once on a CPU-only torch unless DEVICE=cpu), the install from .device/
# only (pip --no-index --no-deps --target, on top of the image's torch; one line and exit 3 if anything
# is missing), then bench/device/gpu_check.py, which writes gpu-check.jsonl, gpu-check.log,
# calibrated.yaml and summary.json.
#
# Settings (environment): OUT (./gpu-check-out), DEVICE (cuda), SCALE (full; small: tiny shapes for a
# CPU rehearsal), BUDGET_S (480), CARRIED (.device), SITE (a fresh temporary folder), PYTHON (python3).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./gpu-check-out}
DEVICE=${DEVICE:-cuda}
SCALE=${SCALE:-full}
BUDGET_S=${BUDGET_S:-480}
CARRIED=${CARRIED:-.device}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
SITE=${SITE:-$(mktemp -d)}
LOG="$OUT/gpu-check.log"
: > "$LOG"
# Nothing can be fetched there: every client fails at once instead of waiting on retries.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
  PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

say() { echo "$*" | tee -a "$LOG" >&2; }

# ---- the machine ---------------------------------------------------------------------------------------
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> "$LOG" 2>&1 || true
if ! "$PYTHON" - "$DEVICE" >> "$LOG" 2>&1 <<'PY'
import json, sys
import torch
info = {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    info.update(gpu=props.name, memory_gib=round(props.total_memory / 2**30, 1), count=torch.cuda.device_count(),
                capability=f"{props.major}.{props.minor}", bf16=torch.cuda.is_bf16_supported())
print("machine:", json.dumps(info), flush=True)
sys.exit(0 if info["cuda_available"] or sys.argv[1] == "cpu" else 1)
PY
then
  say "error: this torch sees no CUDA device (DEVICE=$DEVICE); set DEVICE=cpu for a rehearsal"
  exit 2
fi
grep '^machine:' "$LOG" >&2

# ---- the install, from the carried folder only ------------------------------------------------------------
if ! ls "$CARRIED"/wheels/mlxkit-*.whl > /dev/null 2>&1; then
  say "error: $CARRIED/wheels holds no mlxkit wheel: run 'make gpu-prepare' here and carry $CARRIED"
  exit 3
fi
if ! "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$CARRIED"/wheels/*.whl >> "$LOG" 2>&1; then
  say "error: installing $CARRIED/wheels failed (see gpu-check.log)"
  exit 3
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
# Every runtime dependency must now import: one line naming the first that does not.
if ! missing=$("$PYTHON" -P - 2>&1 <<'PY'
import importlib, sys
for name in ("torch", "transformers", "accelerate", "safetensors", "pulp", "typer", "rich", "numpy", "scipy",
             "gguf", "yaml", "pydantic", "peft", "mlxkit.cli.main"):
    try:
        importlib.import_module(name)
    except Exception as exc:  # an import that fails for any reason is a missing dependency here
        print(f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        sys.exit(1)
import pulp
if not pulp.PULP_CBC_CMD(msg=False).available():
    print("pulp: its bundled CBC solver does not run on this machine")
    sys.exit(1)
PY
); then
  say "error: a dependency is missing after the offline install: $missing"
  exit 3
fi
"$PYTHON" -P -c 'import transformers, mlxkit; print("installed: mlxkit", mlxkit.__version__, "transformers", transformers.__version__)' 2>&1 | tee -a "$LOG" >&2

# ---- the check ----------------------------------------------------------------------------------------------
"$PYTHON" bench/device/gpu_check.py --device "$DEVICE" --scale "$SCALE" --budget-s "$BUDGET_S" \
  --carried "$CARRIED" --out "$OUT" 2>> "$LOG"
