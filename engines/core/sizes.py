"""Byte sizes typed by users (`--memory 40GiB`, `--shard-size 5GB`).

One rule everywhere: a bare number is a count of bytes; `KB`, `MB`, `GB`, `TB` are
decimal (powers of 1000) and `KiB`, `MiB`, `GiB`, `TiB` binary (powers of 1024). Case
does not matter, and `K`/`M`/`G`/`T` alone are decimal, as in `5G`.
"""

from __future__ import annotations

import math
import re

from mlxkit.engines.errors import InputError

SIZE_HELP = "bytes, or with a unit: KB/MB/GB/TB (powers of 1000) or KiB/MiB/GiB/TiB (powers of 1024)"

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)")


def parse_bytes(text: str | int | float, what: str = "size") -> int:
    """`'40GiB'` → 42949672960; `'5GB'` → 5000000000; `'1024'` → 1024 (bytes)."""
    if isinstance(text, bool):
        raise InputError(f"{what} must be a size, not a boolean")
    if isinstance(text, (int, float)):
        value, unit = float(text), ""
    else:
        match = _SIZE.fullmatch(str(text).strip().lower().replace("_", ""))
        if not match:
            raise InputError(f"cannot read {what} '{text}' ({SIZE_HELP})")
        value, unit = float(match.group(1)), match.group(2)
    if unit not in _UNITS:
        raise InputError(f"unknown unit '{unit}' in {what} '{text}' ({SIZE_HELP})")
    size = value * _UNITS[unit]
    if not math.isfinite(size) or size < 1:
        raise InputError(f"{what} '{text}' must be at least one byte")
    if size > 2**62:
        raise InputError(f"{what} '{text}' is larger than any machine's memory")
    return int(size)
