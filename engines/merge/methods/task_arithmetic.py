"""Task arithmetic (Ilharco et al., ICLR 2023): M = Σ_t w_t Δ_t; α plays the role of λ."""

from __future__ import annotations

import torch

from mlxkit.engines.merge.methods.base import MergeMethod, ParamDef, TensorJob
from mlxkit.engines.merge.params import INT8_MASK, LAMBDA


class TaskArithmetic(MergeMethod):
    name = "task-arithmetic"
    reference = "https://arxiv.org/abs/2212.04089"

    def parameters(self) -> list[ParamDef]:
        return [ParamDef("normalize", bool, False, "divide by the sum of the weights"), LAMBDA, INT8_MASK]

    def merge(self, tensors: list[torch.Tensor], job: TensorJob) -> torch.Tensor:
        weights = [p["weight"] for p in job.model_params]
        out = tensors[0] * weights[0]  # accumulate in place: no [T, ...] stack (memory-bound on CPU)
        for t, w in zip(tensors[1:], weights[1:]):
            out.add_(t, alpha=w)
        if job.params["normalize"]:
            total = sum(weights)
            out = out / (total if abs(total) > 1e-8 else 1.0)
        return out
