"""Where mlxkit keeps its cache (converted default model, sampled calibration text)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$MLXKIT_CACHE`, else `$XDG_CACHE_HOME/mlxkit`, else `~/.cache/mlxkit`."""
    if env := os.environ.get("MLXKIT_CACHE"):
        root = Path(env)
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mlxkit"
    root.mkdir(parents=True, exist_ok=True)
    return root
