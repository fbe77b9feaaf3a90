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
            ParamDef("common_frac", float, 0.8, "fraction k/r of directions taken from the common subspace",
                     low=0.0, low_open=True, high=1.0),
            # a few iterations already converge on the decaying spectra of task vectors; the cap only
            # refuses values that would make one tensor take hours
            ParamDef("power_iters", int, 4, "subspace iterations of the randomized SVD (tall matrices only)",
                     low=0, high=100),
            ParamDef("exact_below", int, 1024, "tall matrices with at most this many columns get exact residual "
                                               "directions; wider ones use the randomized SVD", low=0),
            ParamDef("exact", bool, False, "use the official T+3 full SVDs instead of the fast path"),
        ]

    def model_parameters(self) -> list[ParamDef]:
        return []

    def merge(self, tensors: list[torch.Tensor], job: TensorJob) -> torch.Tensor:
        if not job.matrix:
            return torch.stack(tensors).mean(0)
        frac = job.params["common_frac"]  # range (0, 1] checked with the config
        if job.params["exact"]:
            return linalg.iso_cts_reference(tensors, frac)
        return linalg.iso_cts_fast(tensors, frac, power_iters=job.params["power_iters"], seed=job.seed,
                                   exact_below=job.params["exact_below"])
