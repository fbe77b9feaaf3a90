#!/usr/bin/env bash
# A CI job that turns a parent checkpoint into a compressed child, as a plain script:
#   install mlxkit, reuse the cache of earlier runs, search (and distil), fail on a quality
#   regression, and leave the child (weights, config, model card, manifest) and the search's JSON
#   report in $ARTIFACTS for the CI system to upload.
#
# Settings (environment):
#   PARENT         the parent model spec (default: the embedded SmolLM2-135M-Instruct)
#   TARGET         the hardware profile (default: h100)
#   SEARCH_ARGS    more `mlx search` options (default: --gkd-tokens 4096)
#   MAX_KL         fail when the child's held-out KL(parent || child) is above it (default: 0.5)
#   MAX_PPL_RATIO  fail when child / parent held-out perplexity is above it (default: 1.5)
#   ARTIFACTS      where the child and the report go (default: ./artifacts)
#   MLXKIT_CACHE   mlxkit's cache; keep it between runs (default: ./.mlxkit-cache). Block libraries,
#                  sampled calibration text and token shards in it are keyed by what made them, so a
#                  restored cache is reused only where it still applies.
#   MLX            the mlx command (default: mlx, installed from $MLXKIT_SPEC when absent)
#   MLXKIT_SPEC    what pip installs when mlx is absent (default: mlxkit)
set -euo pipefail

PARENT=${PARENT:-smollm2-135m}
TARGET=${TARGET:-h100}
SEARCH_ARGS=${SEARCH_ARGS:---gkd-tokens 4096}
MAX_KL=${MAX_KL:-0.5}
MAX_PPL_RATIO=${MAX_PPL_RATIO:-1.5}
ARTIFACTS=${ARTIFACTS:-artifacts}
export MLXKIT_CACHE=${MLXKIT_CACHE:-$PWD/.mlxkit-cache}
MLX=${MLX:-mlx}

if ! command -v "$MLX" > /dev/null; then
  # The CPU wheel first: a bare torch requirement pulls the CUDA build (a GPU runner keeps its own).
  python3 -m pip install -q "torch>=2.11" "${MLXKIT_SPEC:-mlxkit}"
  MLX=mlx
fi

mkdir -p "$ARTIFACTS"
# stdout is the JSON report; progress goes to stderr as timestamped lines, which the CI log keeps.
# shellcheck disable=SC2086  # SEARCH_ARGS is a list of options
"$MLX" search --model "$PARENT" --target "$TARGET" --out "$ARTIFACTS/child" --overwrite $SEARCH_ARGS --json \
  > "$ARTIFACTS/search.json"

# The quality gate, on the held-out evaluation the search reports (after GKD when it distilled).
python3 - "$ARTIFACTS/search.json" "$MAX_KL" "$MAX_PPL_RATIO" <<'PY'
import json
import sys

report, max_kl, max_ratio = json.load(open(sys.argv[1])), float(sys.argv[2]), float(sys.argv[3])
evaluation = report.get("evaluation_after_gkd") or report.get("evaluation") or {}
kl, ppl, parent_ppl = (evaluation.get(k) for k in ("kl_div", "perplexity", "parent_perplexity"))
if kl is None or ppl is None or not parent_ppl:
    sys.exit("quality gate: the search reported no held-out evaluation")
ratio = ppl / parent_ppl
print(f"quality gate: KL {kl:.4f} (max {max_kl}), perplexity ratio {ratio:.3f} (max {max_ratio})", file=sys.stderr)
if kl > max_kl or ratio > max_ratio:
    sys.exit("quality gate failed: the child is further from its parent than the job allows")
PY
echo "child and report in $ARTIFACTS/" >&2
