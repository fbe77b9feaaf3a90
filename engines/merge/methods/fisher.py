"""Fisher merging (Matena & Raffel, NeurIPS 2022): each parameter averaged with its models' Fisher information.

θ* = Σ_t w_t F_t θ_t / Σ_t w_t F_t, element by element, where F_t is model t's diagonal empirical
Fisher from the calibration pass (the squared gradient of the next-token loss, averaged over the
calibration sequences) and w_t its weight. Each F_t is floored at `epsilon` first, so a parameter
that no model's data reaches gets the weighted average instead of 0/0. With equal Fisher values
the merge is the weighted average; a tensor without Fisher values (none is stored for buffers)
gets the weighted average too.
"""

from __future__ import annotations

import torch

from mlxkit.engines.errors import InputError
from mlxkit.engines.merge.methods.base import MergeMethod, ParamDef, TensorJob, weights_of
from mlxkit.engines.merge.params import POSITIVE_WEIGHT


def fisher_merge(tensors: list[torch.Tensor], fishers: list[torch.Tensor], weights: torch.Tensor,
                 epsilon: float) -> torch.Tensor:
    """Σ w_t F_t θ_t / Σ w_t F_t per element, F_t floored at `epsilon`; `weights` broadcast as [T, 1, ...]."""
    importance = torch.stack(fishers).clamp_min(epsilon) * weights
    return (importance * torch.stack(tensors)).sum(0) / importance.sum(0)


class Fisher(MergeMethod):
    name = "fisher"
    uses_deltas = False
    needs_base = False
    min_models = 2
    base_role = "none"
    statistics = "fisher"
    reference = "https://arxiv.org/abs/2111.09832"

    def parameters(self) -> list[ParamDef]:
        # The authors' code adds 1e-10 to every Fisher value for the same purpose.
        return [ParamDef("epsilon", float, 1e-10, "floor of the Fisher values (a parameter no model's data "
                                                  "reaches is averaged)", low=0.0, low_open=True)]

    def model_parameters(self) -> list[ParamDef]:
        return [POSITIVE_WEIGHT]

    def merge(self, tensors: list[torch.Tensor], job: TensorJob) -> torch.Tensor:
        w = weights_of(job, tensors[0])
        if job.statistics is None:
            return (torch.stack(tensors) * w).sum(0) / w.sum()
        for fisher in job.statistics:
            if fisher.shape != tensors[0].shape:
                raise InputError(f"Fisher merge of '{job.name}': the Fisher values are {tuple(fisher.shape)}, "
                                 f"the tensor {tuple(tensors[0].shape)}")
        return fisher_merge(tensors, job.statistics, w, job.params["epsilon"])
