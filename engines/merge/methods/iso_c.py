"""Iso-C (Marczak et al., ICML 2025): flatten the spectrum of the summed task matrices.

M = σ̄·U Vᵀ of Σ_t Δ_t for 2-D tensors (σ̄ = mean of all r singular values); every other tensor,
and by default embeddings and the LM head, gets the mean of the task vectors, as the official code.
"""

from __future__ import annotations

import torch

from mlxkit.engines.merge import linalg
from mlxkit.engines.merge.methods.base import MergeMethod, ParamDef, TensorJob


class IsoC(MergeMethod):
    name = "iso-c"
    reference = "https://arxiv.org/abs/2502.04959"

    def parameters(self) -> list[ParamDef]:
        return [ParamDef("exact", bool, False, "use the official full-SVD computation instead of the Gram fast path")]

    def model_parameters(self) -> list[ParamDef]:
        return []  # isotropic merging weighs tasks equally

    def merge(self, tensors: list[torch.Tensor], job: TensorJob) -> torch.Tensor:
        if not job.matrix:
            return torch.stack(tensors).mean(0)
        total = torch.stack(tensors).sum(0)
        return linalg.iso_c_reference(total) if job.params["exact"] else linalg.iso_c_fast(total)
