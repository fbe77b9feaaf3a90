"""Hardware profiles: the few numbers the cost model needs about a target device.

A profile is a small YAML file. The packaged ones live in `hw_profiles/` (installed as
`mlxkit.hw_profiles`); `mlx calibrate` writes new ones. Every number carries its source, a
datasheet or a measurement, so a reader can tell a vendor's peak from a fitted factor.

Each profile also names the deployment scenario `mlx search` prices when no `--scenario`
is given (`default_scenario`): a GPU serves the Puzzle paper's batch 256, 128 prompt and
1024 generated tokens (FP8 weights and KV cache where the chip has FP8 units), a CPU a
single small request in fp32.

Example
-------
>>> from mlxkit.engines.hardware.profile import load_profile
>>> h100 = load_profile("h100")
>>> h100.peak_flops("fp8") > h100.peak_flops("bf16")
True
>>> h100.scenario("batch=64").batch, h100.scenario().weight_dtype
(64, 'fp8')
"""

from __future__ import annotations

import math
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator

from mlxkit.engines.core.yaml_config import load_yaml_model, looks_like_file, packaged_yaml, read_yaml_text
from mlxkit.engines.errors import InputError
from mlxkit.engines.hardware.scenario import DTYPE_BYTES, Scenario

# The Puzzle paper's text-generation workload, used for a profile that names no default scenario
# (profiles written before `default_scenario` existed); FP8 where the chip has FP8 units.
PAPER_SCENARIO = Scenario(batch=256, input_len=128, output_len=1024)
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

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

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
    default_scenario : the workload `mlx search` prices on this device when no `--scenario` is
        given (fields of `Scenario`: batch, input_len, output_len, weight_dtype, kv_dtype).
    engine : the serving engine usually run on this device (a name in `engines/serving/capabilities.py`);
        `mlx search` searches only what it builds unless `--engine` names another. None: transformers.
    sources : where each number comes from, keyed like the fields.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

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
    default_scenario: Scenario | None = None
    engine: str | None = None
    sources: dict[str, str]
    calibration: dict[str, Any] | None = None

    @field_validator("calibration")
    @classmethod
    def _finite_calibration(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        # free-form (what calibrate measured), so the model's allow_inf_nan does not reach inside it
        for key, entry in (value or {}).items():
            if isinstance(entry, float) and not math.isfinite(entry):
                raise ValueError(f"calibration.{key} must be a finite number (got {entry})")
        return value

    @field_validator("peak_tflops")
    @classmethod
    def _known_dtypes(cls, value: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(value) - set(DTYPE_BYTES))
        if unknown:
            raise ValueError(f"unknown dtypes {unknown}; known: {sorted(DTYPE_BYTES)}")
        if not value or any(v <= 0 for v in value.values()):
            raise ValueError("peak_tflops needs at least one positive rate")
        return value

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, value: str | None) -> str | None:
        from mlxkit.engines.serving.capabilities import ENGINES

        if value is not None and value not in ENGINES:
            raise ValueError(f"unknown serving engine '{value}'; known: {', '.join(ENGINES)}")
        return value

    @property
    def serving_engine(self) -> str:
        """The engine `mlx search` targets on this device unless `--engine` names another."""
        return self.engine or "transformers"

    def scenario(self, text: str | None = None) -> Scenario:
        """This device's default scenario, with the fields given in `text` (`batch=64,weights=bf16`) replaced."""
        base = self.default_scenario
        if base is None:
            dtype = "fp8" if "fp8" in self.peak_tflops else "bf16"
            base = replace(PAPER_SCENARIO, weight_dtype=dtype, kv_dtype=dtype)
        return Scenario.parse(text, **base.to_dict())

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
    if looks_like_file(text_name) or text_name.startswith("~"):  # a bare word is a packaged profile
        if not path.is_file():
            raise InputError(f"hardware profile file '{text_name}' does not exist")
        origin = f"hardware profile {path}"
        return load_yaml_model(HardwareProfile, read_yaml_text(path, origin), origin)
    key = text_name.lower()
    resource = packaged_yaml("mlxkit.hw_profiles", key)
    if resource is None:
        raise InputError(f"unknown hardware profile '{text_name}'; available: {', '.join(available_profiles())} "
                         "(or pass a path to a YAML profile, e.g. one written by `mlx calibrate`)")
    origin = f"hardware profile hw_profiles/{key}.yaml"
    return load_yaml_model(HardwareProfile, read_yaml_text(resource, origin), origin)
