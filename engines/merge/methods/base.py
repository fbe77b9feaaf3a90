"""The contract every merge method follows (mergekit's MergeMethod, reduced to what we need).

A method combines one tensor at a time. Task-vector methods (`uses_deltas = True`) receive
the task vectors Δ_t = θ_t − θ_base in float32 and return the combined delta M; the executor
writes θ_base + α·M (times the per-tensor `lambda`, mergekit's name for α, when the method
declares it). Weight-space methods (linear, slerp) receive the models' own weights and return
the merged weight. Methods never read files and never see more than one tensor name.

`base_role` says what a base model listed among the inputs means (mergekit's rules): "base"
takes it out of the inputs (it is the origin of the task vectors), "input" puts it first (SLERP's
t = 0), "none" leaves the inputs as listed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Optional

import torch

from mlxkit.engines.core.seeds import seeded_generator
from mlxkit.engines.merge.params import WEIGHT, ParamDef

__all__ = ["WEIGHT", "MergeMethod", "ParamDef", "TensorJob", "tensor_generator", "weights_of"]


@dataclass
class TensorJob:
    """Everything a method needs to know about the tensor it is merging."""

    name: str
    matrix: bool                      # 2-D and not excluded: spectral methods may treat it as a matrix
    params: dict[str, Any]            # global parameters, resolved for this tensor and checked
    model_params: list[dict[str, Any]] = field(default_factory=list)  # one dict per input model, same
    seed: int = 0                     # per-tensor seed for random methods (stable across runs)
    base: Optional[torch.Tensor] = None  # the base tensor in float32 on the compute device, when there is one
    # Data-aware methods only: each input's calibration statistic for this tensor, aligned with the
    # tensors, on the compute device (see `statistics`); None when any input has none for it.
    statistics: Optional[list[torch.Tensor]] = None


class MergeMethod(ABC):
    name: ClassVar[str]
    uses_deltas: ClassVar[bool] = True   # False: inputs are weights and the output is a weight
    needs_base: ClassVar[bool] = True
    min_models: ClassVar[int] = 1
    max_models: ClassVar[int | None] = None
    reference: ClassVar[str] = ""
    base_role: ClassVar[Literal["base", "input", "none"]] = "base"
    # What a data-aware method learns from calibration text, per input model, before merging:
    # "gram" (each linear layer's input Gram XᵀX / n) or "fisher" (the diagonal Fisher); None: no data.
    statistics: ClassVar[Optional[Literal["gram", "fisher"]]] = None

    def parameters(self) -> list[ParamDef]:
        return []

    def model_parameters(self) -> list[ParamDef]:
        return [WEIGHT]

    def all_parameters(self) -> dict[str, ParamDef]:
        return {p.name: p for p in [*self.parameters(), *self.model_parameters()]}

    @abstractmethod
    def merge(self, tensors: list[torch.Tensor], job: TensorJob) -> torch.Tensor:
        """Combine one tensor across the input models (deltas or weights, float32)."""


def weights_of(job: TensorJob, like: torch.Tensor) -> torch.Tensor:
    """Per-model weights shaped to broadcast against a stacked [T, ...] tensor."""
    w = torch.tensor([float(p["weight"]) for p in job.model_params], dtype=like.dtype, device=like.device)
    return w.view(-1, *([1] * like.dim()))


def tensor_generator(job: TensorJob, model_index: int, device: torch.device) -> torch.Generator:
    """A generator for (this tensor, model `model_index`): `job.seed` is already per tensor name,
    so results do not depend on the order tensors are merged in."""
    return seeded_generator(job.seed, "model", model_index, device=device)
