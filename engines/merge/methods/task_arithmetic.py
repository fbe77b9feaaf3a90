"""Task arithmetic (Ilharco et al., ICLR 2023): M = Σ_t w_t Δ_t; α plays the role of λ."""

from __future__ import annotations

import torch

from mlxkit.engines.merge.methods.base import MergeMethod, ParamDef, TensorJob, weights_of


class TaskArithmetic(MergeMethod):
    name = "task-arithmetic"
    reference = "https://arxiv.org/abs/2212.04089"

    def parameters(self) -> list[ParamDef]:
        return [ParamDef("normalize", False, "divide by the sum of the weights")]

    def merge(self, tensors: list[torch.Tensor], job: TensorJob) -> torch.Tensor:
        stacked = torch.stack(tensors)
        w = weights_of(job, tensors[0])
        out = (stacked * w).sum(0)
        if job.params.get("normalize"):
            total = float(w.sum())
            out = out / (total if abs(total) > 1e-8 else 1.0)
        return out
