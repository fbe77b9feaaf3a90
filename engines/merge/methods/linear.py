"""Weighted average of the models' weights (model soups): Σ w_t θ_t / Σ w_t."""

from __future__ import annotations

import torch

from mlxkit.engines.errors import InputError
from mlxkit.engines.merge.methods.base import MergeMethod, ParamDef, TensorJob, weights_of


class Linear(MergeMethod):
    name = "linear"
    uses_deltas = False
    needs_base = False
    base_role = "none"
    reference = "https://arxiv.org/abs/2203.05482"

    def parameters(self) -> list[ParamDef]:
        return [ParamDef("normalize", bool, True, "divide by the sum of the weights")]

    def merge(self, tensors: list[torch.Tensor], job: TensorJob) -> torch.Tensor:
        w = weights_of(job, tensors[0])
        out = (torch.stack(tensors) * w).sum(0)
        if job.params["normalize"]:
            total = float(w.sum())
            if abs(total) < 1e-12:
                raise InputError(f"linear merge of '{job.name}': the weights sum to zero")
            out = out / total
        return out
