"""Where mlxkit keeps its cache (converted default model, sampled calibration text)."""

from __future__ import annotations

import os
from pathlib import Path

from mlxkit.engines.errors import InputError


def cache_dir() -> Path:
    """`$MLXKIT_CACHE`, else `$XDG_CACHE_HOME/mlxkit`, else `~/.cache/mlxkit`.

    A cache that cannot be created (no HOME, so `~` falls back to a home such as /nonexistent; a
    read-only home) is an `InputError` that says how to move it.
    """
    if env := os.environ.get("MLXKIT_CACHE"):
        root, source = Path(env).expanduser(), "MLXKIT_CACHE"
    else:
        source = "XDG_CACHE_HOME" if os.environ.get("XDG_CACHE_HOME") else "HOME"
        try:
            base = Path(os.environ["XDG_CACHE_HOME"]) if source == "XDG_CACHE_HOME" else Path.home() / ".cache"
        except RuntimeError:  # no HOME and no home directory in the user database
            raise InputError("cannot find a cache directory (HOME is not set); set MLXKIT_CACHE to a "
                             "writable directory") from None
        root = base / "mlxkit"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        hint = ("choose another MLXKIT_CACHE" if source == "MLXKIT_CACHE"
                else f"set MLXKIT_CACHE to a writable directory (the default comes from {source})")
        raise InputError(f"cannot create the cache directory '{root}' ({exc.strerror or exc}); {hint}") from None
    return root
