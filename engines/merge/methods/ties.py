"""TIES-merging (Yadav et al., NeurIPS 2023): trim, elect sign, disjoint mean.

Per tensor, as mergekit does it: keep each task vector's top-`density` fraction of entries by
magnitude, elect the sign of the weighted sum per entry, and average (weighted) only the entries
that agree with it. DARE variants live in `dare.py` and share `sign_consensus_mean`.
"""

from __future__ import annotations

import torch

from mlxkit.engines.merge.methods.base import WEIGHT, MergeMethod, ParamDef, TensorJob, weights_of
from mlxkit.engines.merge.params import INT8_MASK, LAMBDA


def magnitude_trim(delta: torch.Tensor, density: float) -> torch.Tensor:
    """Zero all but the `density` fraction of entries with the largest magnitude."""
    if density >= 1.0:
        return delta
    k = int(density * delta.numel())
    if k <= 0:
        return torch.zeros_like(delta)
    flat = delta.reshape(-1)
    keep = torch.topk(flat.abs(), k, sorted=False).indices
    out = torch.zeros_like(flat)
    out[keep] = flat[keep]
    return out.view_as(delta)


def sign_consensus_mean(weighted: torch.Tensor, w: torch.Tensor, normalize: bool) -> torch.Tensor:
    """Σ of the entries whose sign matches the elected one (sign of the sum, ties → +), divided by
    the weights of the agreeing entries when `normalize` (the disjoint mean)."""
    elected = torch.where(weighted.sum(0) >= 0, 1.0, -1.0).to(weighted.dtype)
    agree = weighted.sign() == elected
    out = (weighted * agree).sum(0)
    if normalize:
        divisor = (w * agree).sum(0)
        out = out / torch.where(divisor == 0, torch.ones_like(divisor), divisor)
    return out


def combine_sparse(stacked: torch.Tensor, job: TensorJob, consensus: bool) -> torch.Tensor:
    """Merge the sparsified task vectors `stacked` [T, ...] with their weights: TIES' sign-consensus
    mean when `consensus`, else the weighted sum; `normalize` divides by the (agreeing) weights."""
    w = weights_of(job, stacked[0])
    normalize = job.params["normalize"]
    if consensus:
        return sign_consensus_mean(stacked * w, w.expand_as(stacked), normalize)
    out = (stacked * w).sum(0)
    if normalize:
        total = float(w.sum())
        out = out / (total if abs(total) > 1e-8 else 1.0)
    return out


class Ties(MergeMethod):
    name = "ties"
    reference = "https://arxiv.org/abs/2306.01708"

    def parameters(self) -> list[ParamDef]:
        return [ParamDef("normalize", bool, True, "disjoint mean (divide by the weights of agreeing entries)"),
                LAMBDA, INT8_MASK]

    def model_parameters(self) -> list[ParamDef]:
        return [WEIGHT, ParamDef("density", float, 0.2, "fraction of each task vector's entries kept (by magnitude)",
                                 per_model=True, low=0.0, high=1.0)]

    def merge(self, tensors: list[torch.Tensor], job: TensorJob) -> torch.Tensor:
        trimmed = torch.stack([magnitude_trim(d, p["density"]) for d, p in zip(tensors, job.model_params)])
        w = weights_of(job, tensors[0])
        return sign_consensus_mean(trimmed * w, w.expand_as(trimmed), job.params["normalize"])
