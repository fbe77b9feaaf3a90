"""Spherical linear interpolation between exactly two models, per tensor (as mergekit's slerp).

θ = sin((1−t)Ω)/sin Ω · θ_0 + sin(tΩ)/sin Ω · θ_1, with Ω the angle between the flattened,
normalised tensors; nearly colinear tensors fall back to linear interpolation.
"""

from __future__ import annotations

import math

import torch

from mlxkit.engines.merge.methods.base import MergeMethod, ParamDef, TensorJob

_DOT_THRESHOLD = 0.9995


def slerp(t: float, a: torch.Tensor, b: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    a64, b64 = a.double().reshape(-1), b.double().reshape(-1)
    dot = float((a64 / (a64.norm() + eps)) @ (b64 / (b64.norm() + eps)))
    if abs(dot) > _DOT_THRESHOLD:
        return ((1 - t) * a.double() + t * b.double()).to(a.dtype)
    omega = math.acos(max(-1.0, min(1.0, dot)))
    s = math.sin(omega)
    return ((math.sin((1 - t) * omega) / s) * a.double() + (math.sin(t * omega) / s) * b.double()).to(a.dtype)


class Slerp(MergeMethod):
    name = "slerp"
    uses_deltas = False
    needs_base = False
    base_role = "input"
    min_models = 2
    max_models = 2
    reference = "https://en.wikipedia.org/wiki/Slerp"

    def parameters(self) -> list[ParamDef]:
        return [ParamDef("t", float, 0.5, "interpolation factor: 0 = first model, 1 = second", low=0.0, high=1.0)]

    def model_parameters(self) -> list[ParamDef]:
        return []

    def merge(self, tensors: list[torch.Tensor], job: TensorJob) -> torch.Tensor:
        return slerp(job.params["t"], tensors[0], tensors[1])
