"""Model Breadcrumbs (Davari & Belilovsky, 2023): per task vector, drop the largest `gamma`
fraction of entries by magnitude (outliers) and the smallest ones, keeping a `density` fraction
in between; then a weighted sum (`breadcrumbs`) or TIES' sign consensus (`breadcrumbs-ties`).

mergekit's parameter names and defaults: `density` 1.0 (no sparsification), `gamma` 0.01.
"""

from __future__ import annotations

import torch

from mlxkit.engines.merge.methods.base import WEIGHT, MergeMethod, ParamDef, TensorJob
from mlxkit.engines.merge.methods.ties import combine_sparse
from mlxkit.engines.merge.params import INT8_MASK, LAMBDA


def magnitude_band(delta: torch.Tensor, density: float, gamma: float, rescale: bool) -> torch.Tensor:
    """Keep the entries ranked by |Δ| just below the top `gamma` fraction, `density` of them in all.

    When the band would run past the smallest entry, the top cut shrinks so that `density` is kept.
    `rescale` restores the tensor's L1 norm (sum of |Δ|) after the cut.
    """
    if density >= 1.0:
        return delta
    n = delta.numel()
    keep = int(density * n)
    top = int(gamma * n)
    bottom = n - keep - top
    if bottom < 0:
        bottom, top = 0, n - keep
    order = torch.argsort(delta.reshape(-1).abs(), stable=True)  # ascending: the smallest first
    mask = torch.zeros(n, dtype=torch.bool, device=delta.device)
    mask[order[bottom:n - top]] = True
    out = delta * mask.view_as(delta)
    if rescale:
        kept = out.abs().sum()
        if kept > 0:
            out = out * (delta.abs().sum() / kept)
    return out


class Breadcrumbs(MergeMethod):
    """One class, two registered instances: consensus off (breadcrumbs) or on (breadcrumbs-ties)."""

    name = "breadcrumbs"
    reference = "https://arxiv.org/abs/2312.06795"

    def __init__(self, name: str, consensus: bool) -> None:
        self.name = name  # type: ignore[misc]
        self.consensus = consensus

    def parameters(self) -> list[ParamDef]:
        return [ParamDef("normalize", bool, self.consensus, "divide by the (agreeing) weights"),
                ParamDef("rescale", bool, False, "restore each task vector's L1 norm after the cut"),
                LAMBDA, INT8_MASK]

    def model_parameters(self) -> list[ParamDef]:
        return [WEIGHT,
                ParamDef("density", float, 1.0, "fraction of each task vector's entries kept", per_model=True,
                         low=0.0, high=1.0),
                ParamDef("gamma", float, 0.01, "fraction of the largest entries dropped as outliers",
                         per_model=True, low=0.0, high=1.0)]

    def merge(self, tensors: list[torch.Tensor], job: TensorJob) -> torch.Tensor:
        sparse = torch.stack([magnitude_band(d, p["density"], p["gamma"], job.params["rescale"])
                              for d, p in zip(tensors, job.model_params)])
        return combine_sparse(sparse, job, self.consensus)
