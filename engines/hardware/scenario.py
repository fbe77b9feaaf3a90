"""Deployment scenarios (batch, prompt and generated lengths, storage dtypes) and dtype sizes."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, replace
from typing import Any

from mlxkit.engines.errors import InputError

# Bytes per element of each storage dtype the cost model knows.
DTYPE_BYTES: dict[str, float] = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}
# Weight dtypes whose deployments quantise the KV cache to the same dtype (TensorRT-LLM's FP8
# recipe, and the Puzzle paper's H100 setting).
_CACHE_FOLLOWS_WEIGHTS = ("fp8", "int8")


@dataclass(frozen=True)
class Scenario:
    """One deployment workload: `batch` sequences of `input_len` prompt tokens, `output_len` generated.

    `weight_dtype` and `kv_dtype` are storage dtypes (`fp32`, `bf16`, `fp16`, `fp8`, `int8`,
    `int4`); activations are 16-bit unless the weights are fp32.
    """

    batch: int = 1
    input_len: int = 128
    output_len: int = 128
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"

    def __post_init__(self) -> None:
        if self.batch < 1 or self.input_len < 1 or self.output_len < 1:
            raise InputError(f"scenario needs batch, input and output lengths ≥ 1 (got {self})")
        for label, dtype in (("weight", self.weight_dtype), ("kv", self.kv_dtype)):
            if dtype not in DTYPE_BYTES:
                raise InputError(f"unknown {label} dtype '{dtype}' (known: {', '.join(DTYPE_BYTES)})")

    _KEYS = {"batch": "batch", "b": "batch", "bs": "batch",
             "in": "input_len", "input": "input_len", "input_len": "input_len", "prefill": "input_len",
             "out": "output_len", "output": "output_len", "output_len": "output_len", "gen": "output_len",
             "weights": "weight_dtype", "weight_dtype": "weight_dtype", "dtype": "weight_dtype", "w": "weight_dtype",
             "kv": "kv_dtype", "kv_dtype": "kv_dtype"}

    @classmethod
    def parse(cls, text: str | None, **defaults: Any) -> "Scenario":
        """Parse `batch=256,in=128,out=1024[,weights=fp8,kv=fp8]`; unspecified fields take `defaults`.

        `dtype=` is an alias of `weights=`. When the text sets FP8 or INT8 weights without
        `kv=`, the KV cache takes the weight dtype too; otherwise it keeps its default.
        """
        values: dict[str, Any] = dict(defaults)
        saw_weights = saw_kv = False
        given: dict[str, str] = {}
        for part in filter(None, (p.strip() for p in re.split(r"[,;\s]+", text or ""))):
            key, sep, raw = part.partition("=")
            field_name = cls._KEYS.get(key.strip().lower())
            if field_name is not None and sep and field_name in given:
                # Two values for one field (`batch=1,batch=2`, or `dtype=` and `weights=`): no silent last-wins.
                raise InputError(f"scenario sets {field_name} twice ('{given[field_name]}' and '{part}'); give it once")
            if field_name is not None:
                given[field_name] = part
            if not sep or field_name is None:
                raise InputError(f"bad scenario item '{part}'; expected e.g. batch=256,in=128,out=1024,weights=fp8,kv=fp8")
            raw = raw.strip()
            if field_name.endswith("dtype"):
                values[field_name] = raw.lower()
                saw_kv |= field_name == "kv_dtype"
                saw_weights |= field_name == "weight_dtype"
            else:
                try:
                    values[field_name] = int(float(raw.lower().replace("k", "e3")))
                except ValueError:
                    raise InputError(f"scenario item '{part}' needs an integer") from None
        if saw_weights and not saw_kv and values["weight_dtype"] in _CACHE_FOLLOWS_WEIGHTS:
            values["kv_dtype"] = values["weight_dtype"]
        return cls(**values)

    def with_batch(self, batch: int) -> "Scenario":
        return replace(self, batch=batch)

    @property
    def seq_len(self) -> int:
        return self.input_len + self.output_len

    @property
    def tokens(self) -> int:
        """Tokens counted by the throughput convention: prompt plus generated, for the whole batch."""
        return self.batch * self.seq_len

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        return (f"batch={self.batch},in={self.input_len},out={self.output_len},"
                f"weights={self.weight_dtype},kv={self.kv_dtype}")
