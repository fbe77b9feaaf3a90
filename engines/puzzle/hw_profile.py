"""Hardware profiles: the few numbers the cost model needs about a target device.

A profile is a small YAML file. The packaged ones live in `hw_profiles/` (installed as
`mlxkit.hw_profiles`); `mlx calibrate` writes new ones. Every number carries its source, a
datasheet or a measurement, so a reader can tell a vendor's peak from a fitted factor.

Example
-------
>>> from mlxkit.engines.puzzle.hw_profile import load_profile
>>> h100 = load_profile("h100")
>>> h100.peak_flops("fp8") > h100.peak_flops("bf16")
True
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from mlxkit.engines.errors import InputError

# Bytes per element of each storage dtype the cost model knows.
DTYPE_BYTES: dict[str, float] = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}
# When a chip has no units for the weight dtype, the matmul runs at the next wider rate
# (e.g. FP8 weights on an A100 are upcast to BF16: half the bytes, BF16 speed).
_COMPUTE_FALLBACK: dict[str, tuple[str, ...]] = {
    "fp8": ("fp8", "bf16", "fp16", "fp32"),
    "int8": ("int8", "fp8", "bf16", "fp16", "fp32"),
    "int4": ("int4", "int8", "fp8", "bf16", "fp16", "fp32"),
    "bf16": ("bf16", "fp16", "fp32"),
    "fp16": ("fp16", "bf16", "fp32"),
    "fp32": ("fp32",),
}


class Efficiency(BaseModel):
    """Fractions of peak reached in practice (fitted by `mlx calibrate`, or assumed)."""

    model_config = ConfigDict(extra="forbid")

    matmul: float = Field(gt=0, le=1.5, description="dense matmul FLOP/s as a fraction of peak")
    memory: float = Field(gt=0, le=1.5, description="streaming bandwidth as a fraction of peak")
    attention: float = Field(gt=0, le=1.5, description="attention-kernel FLOP/s as a fraction of peak")


class HardwareProfile(BaseModel):
    """Peak rates, memory, fitted efficiencies and a per-kernel overhead of one device.

    Attributes
    ----------
    peak_tflops : dense (no structured sparsity) matmul TFLOP/s per dtype.
    memory_bandwidth_gbs : peak memory bandwidth in GB/s (1e9 bytes/s).
    memory_capacity_gib : device memory in GiB.
    efficiency : fractions of peak reached by matmuls, memory streaming and attention.
    kernel_overhead_us : fixed cost per kernel launch (GPU) or per op dispatch (CPU), in µs.
    step_overhead_us : fixed framework cost per forward step (scheduler, sampling, Python), in µs.
    overlap : how far compute and memory traffic overlap: 1 is the pure roofline max(compute,
        memory) (GPUs); 0 adds them (a single CPU core that stalls on loads). Fitted by calibrate.
    matmul_half_rows : rows (tokens in a step) at which a matmul reaches half its large-matmul
        efficiency, eff(M) = eff · M / (M + half): skinny decode GEMMs run far below peak.
        0 turns the ramp off.
    gemm_weight_passes : extra passes over the weights when a matmul has more than one row.
        CPU BLAS packs weight panels for GEMM (M > 1) but streams them once for GEMV (M = 1),
        which makes batch-2 decode markedly slower than batch-1 on a CPU; 0 on GPUs. Fitted.
    kernels : optional override of kernels per subblock (keys of `costs.DEFAULT_KERNELS`).
    sources : where each number comes from, keyed like the fields.
    """

    model_config = ConfigDict(extra="forbid")

    name: str
    description: str = ""
    peak_tflops: dict[str, float]
    memory_bandwidth_gbs: float = Field(gt=0)
    memory_capacity_gib: float = Field(gt=0)
    efficiency: Efficiency
    kernel_overhead_us: float = Field(ge=0)
    step_overhead_us: float = Field(default=0.0, ge=0)
    overlap: float = Field(default=1.0, ge=0, le=1)
    matmul_half_rows: float = Field(default=0.0, ge=0)
    gemm_weight_passes: float = Field(default=0.0, ge=0)
    kernels: dict[str, int] | None = None
    sources: dict[str, str]
    calibration: dict[str, Any] | None = None

    @field_validator("peak_tflops")
    @classmethod
    def _known_dtypes(cls, value: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(value) - set(DTYPE_BYTES))
        if unknown:
            raise ValueError(f"unknown dtypes {unknown}; known: {sorted(DTYPE_BYTES)}")
        if not value or any(v <= 0 for v in value.values()):
            raise ValueError("peak_tflops needs at least one positive rate")
        return value

    def compute_dtype(self, weight_dtype: str) -> str:
        """The dtype whose matmul rate applies to weights stored in `weight_dtype`."""
        for candidate in _COMPUTE_FALLBACK.get(weight_dtype, (weight_dtype, "bf16", "fp32")):
            if candidate in self.peak_tflops:
                return candidate
        return max(self.peak_tflops, key=self.peak_tflops.__getitem__)

    def peak_flops(self, weight_dtype: str) -> float:
        """Peak dense FLOP/s for matmuls on weights stored in `weight_dtype`."""
        return self.peak_tflops[self.compute_dtype(weight_dtype)] * 1e12

    @property
    def bandwidth_bytes_s(self) -> float:
        return self.memory_bandwidth_gbs * 1e9

    @property
    def capacity_mib(self) -> float:
        return self.memory_capacity_gib * 1024.0

    def to_yaml(self) -> str:
        data = self.model_dump(exclude_none=True)
        return yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=110)


def available_profiles() -> list[str]:
    """Names of the packaged profiles (`h100`, `cpu`, ...)."""
    root = resources.files("mlxkit.hw_profiles")
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml") and not p.name.startswith("."))


def load_profile(name_or_path: str | Path) -> HardwareProfile:
    """Load a packaged profile by name, or a user's profile from a YAML path.

    Raises
    ------
    InputError
        Unknown name (the message lists the packaged profiles), unreadable file, or a file
        that does not validate.
    """
    text_name = str(name_or_path)
    path = Path(text_name).expanduser()
    looks_like_path = path.suffix in (".yaml", ".yml") or "/" in text_name or path.exists()
    if looks_like_path:
        if not path.is_file():
            raise InputError(f"hardware profile file '{text_name}' does not exist")
        return _parse(path.read_text(), str(path))
    key = text_name.lower()
    resource = resources.files("mlxkit.hw_profiles") / f"{key}.yaml"
    if not resource.is_file():
        raise InputError(f"unknown hardware profile '{text_name}'; available: {', '.join(available_profiles())} "
                         "(or pass a path to a YAML profile, e.g. one written by `mlx calibrate`)")
    return _parse(resource.read_text(), f"hw_profiles/{key}.yaml")


def _parse(text: str, origin: str) -> HardwareProfile:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InputError(f"hardware profile {origin} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise InputError(f"hardware profile {origin} must be a mapping")
    try:
        return HardwareProfile.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise InputError(f"hardware profile {origin}: {where}: {first['msg']}") from exc
