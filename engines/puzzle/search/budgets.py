"""Parse the user's search budgets (`2x`, `5000`, `80GiB`, `500ms`, `7B`) and turn them into MIP caps.

All MIP constraints are upper bounds on summed stats in the library's units: `memory_mib`,
`runtime_ms` (one scenario, one batch), `num_params`. A throughput target becomes a
runtime cap through the scenario's token count (`batch × (in + out)`, the NVlabs demo's
convention, see `engines/hardware/costs.py`); a multiple such as `2x` is taken against the
parent's runtime. Memory sizes follow the one rule of `core.sizes`: a bare number is bytes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from mlxkit.engines.core.sizes import parse_bytes
from mlxkit.engines.errors import InputError

_NUMBER = r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)"
MIB = float(1 << 20)
_TIME_UNITS = {"": 1.0, "us": 1e-3, "µs": 1e-3, "ms": 1.0, "s": 1e3, "sec": 1e3, "min": 6e4}
_COUNT_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def _split(text: str, what: str, example: str) -> tuple[float, str]:
    match = re.fullmatch(_NUMBER + r"\s*([a-zµ/]*)", str(text).strip().lower().replace("_", "").replace(",", ""))
    if not match:
        raise InputError(f"cannot parse {what} '{text}' (e.g. {example})")
    return _finite(float(match.group(1)), what, text), match.group(2)


def _finite(value: float, what: str, text: object) -> float:
    if not math.isfinite(value):  # '1e400', or '1e305k' once scaled, overflows to inf: no budget means that
        raise InputError(f"{what} '{text}' is too large")
    return value


def parse_memory_mib(text: str | float) -> float:
    """A memory budget in MiB (the stats' unit): `80GiB` → 81920.0, `40GB` → 38146.97…, `1048576` → 1.0.

    As everywhere in mlxkit (`core.sizes.parse_bytes`), a bare number is a count of bytes.
    """
    return parse_bytes(text, "memory") / MIB


def parse_time_ms(text: str | float) -> float:
    """`500ms` → 500.0, `2s` → 2000.0. Bare numbers are milliseconds."""
    value, unit = _split(str(text), "time", "500ms, 2s")
    if unit not in _TIME_UNITS:
        raise InputError(f"unknown time unit '{unit}' in '{text}' (use us, ms, s, min)")
    return _finite(value * _TIME_UNITS[unit], "time", text)


def parse_count(text: str | float) -> float:
    """`7B` → 7e9, `500M` → 5e8 (parameter counts)."""
    value, unit = _split(str(text), "count", "7B, 500M, 1.2e9")
    if unit not in _COUNT_UNITS:
        raise InputError(f"unknown count suffix '{unit}' in '{text}' (use K, M, B, T)")
    return _finite(value * _COUNT_UNITS[unit], "count", text)


@dataclass(frozen=True)
class Throughput:
    """A throughput target: absolute tokens/s, or a multiple of the parent's (`2x`)."""

    tokens_per_s: float | None = None
    multiple: float | None = None

    @classmethod
    def parse(cls, text: str | float) -> "Throughput":
        raw = str(text).strip().lower().replace(" ", "")
        if raw.endswith(("x", "×")):
            value, _ = _split(raw[:-1], "throughput multiple", "2x")
            if value <= 0:
                raise InputError(f"throughput multiple must be positive (got '{text}')")
            return cls(multiple=value)
        raw = re.sub(r"(tok(ens)?/s|tps)$", "", raw)
        value, unit = _split(raw, "throughput", "2x, 5000, 5000tok/s, 5k")
        if unit not in ("", "k", "m"):
            raise InputError(f"cannot parse throughput '{text}' (e.g. 2x, 5000, 5000tok/s)")
        value = _finite(value * _COUNT_UNITS[unit], "throughput", text)
        if value <= 0:
            raise InputError(f"throughput must be positive (got '{text}')")
        return cls(tokens_per_s=value)

    def runtime_cap_ms(self, tokens: int, parent_runtime_ms: float | None = None) -> float:
        """The runtime cap (ms per scenario) meeting this target, for a scenario of `tokens` tokens."""
        if self.multiple is not None:
            if parent_runtime_ms is None:
                raise InputError("a throughput multiple (e.g. 2x) needs the parent's runtime")
            return parent_runtime_ms / self.multiple
        return tokens / self.tokens_per_s * 1e3  # type: ignore[operator]

    def __str__(self) -> str:
        return f"{self.multiple:g}x" if self.multiple is not None else f"{self.tokens_per_s:g} tok/s"


@dataclass(frozen=True)
class Budgets:
    """The user's constraints, before they are priced against a scenario.

    `latency_ms` caps the end-to-end runtime of one batch (the same stat as throughput);
    `extra` holds raw caps on any other summed stat, e.g. ``{"prefill_runtime_ms": 200}``.
    """

    memory_mib: float | None = None
    throughput: Throughput | None = None
    latency_ms: float | None = None
    num_params: float | None = None
    extra: dict[str, float] = field(default_factory=dict)

    @classmethod
    def parse(cls, memory: str | None = None, throughput: str | None = None, latency: str | None = None,
              params: str | None = None, **extra: float) -> "Budgets":
        return cls(memory_mib=parse_memory_mib(memory) if memory is not None else None,
                   throughput=Throughput.parse(throughput) if throughput is not None else None,
                   latency_ms=parse_time_ms(latency) if latency is not None else None,
                   num_params=parse_count(params) if params is not None else None,
                   extra=dict(extra))

    def constraints(self, tokens: int, parent_runtime_ms: float | None = None) -> dict[str, float]:
        """MIP caps `{stat: upper bound}` for a scenario of `tokens` tokens (batch × (in + out))."""
        caps: dict[str, float] = dict(self.extra)
        if self.memory_mib is not None:
            caps["memory_mib"] = self.memory_mib
        runtime_caps = []
        if self.throughput is not None:
            runtime_caps.append(self.throughput.runtime_cap_ms(tokens, parent_runtime_ms))
        if self.latency_ms is not None:
            runtime_caps.append(self.latency_ms)
        if runtime_caps:
            caps["runtime_ms"] = min(runtime_caps)
        if self.num_params is not None:
            caps["num_params"] = self.num_params
        return caps

    def describe(self) -> dict[str, Any]:
        return {"memory_mib": self.memory_mib, "throughput": str(self.throughput) if self.throughput else None,
                "latency_ms": self.latency_ms, "num_params": self.num_params, **self.extra}
