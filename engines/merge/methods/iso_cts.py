"""Iso-CTS (Marczak et al., ICML 2025): common subspace of the sum plus each task's own top
directions, re-orthonormalised, with an isotropic spectrum. `common_frac` is k/r (paper: 0.8);
common_frac = 1 reduces to Iso-C. Non-matrix tensors get the mean of the task vectors.
"""

from __future__ import annotations

import torch

from mlxkit.engines.merge import linalg
from mlxkit.engines.merge.methods.base import MergeMethod, ParamDef, TensorJob


class IsoCTS(MergeMethod):
    name = "iso-cts"
    reference = "https://arxiv.org/abs/2502.04959"

    def parameters(self) -> list[ParamDef]:
        return [
            ParamDef("common_frac", 0.8, "fraction k/r of directions taken from the common subspace"),
            ParamDef("power_iters", 4, "subspace iterations of the randomized SVD (tall matrices only)"),
            ParamDef("exact_below", 1024, "tall matrices with at most this many columns get exact residual "
                                          "directions; wider ones use the randomized SVD"),
            ParamDef("exact", False, "use the official T+3 full SVDs instead of the fast path"),
        ]

    def model_parameters(self) -> list[ParamDef]:
        return []

    def merge(self, tensors: list[torch.Tensor], job: TensorJob) -> torch.Tensor:
        if not job.matrix:
            return torch.stack(tensors).mean(0)
        frac = float(job.params.get("common_frac", 0.8))
        if not 0.0 < frac <= 1.0:
            from mlxkit.engines.errors import InputError

            raise InputError(f"common_frac must be in (0, 1] (got {frac})")
        if job.params.get("exact"):
            return linalg.iso_cts_reference(tensors, frac)
        return linalg.iso_cts_fast(tensors, frac, power_iters=int(job.params.get("power_iters", 4)), seed=job.seed,
                                   exact_below=int(job.params.get("exact_below", 1024)))
