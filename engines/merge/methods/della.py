"""DELLA (Deep et al., 2024): MAGPRUNE drops each task-vector entry at random with a keep
probability that grows with its magnitude rank, rescales the survivors by 1/p, then combines
with TIES' sign consensus (`della`) or a weighted sum (`della-linear`).

Per row (the last dimension; a 1-D tensor is one row), the entry of rank i among n by |Δ|
(0 = smallest) is kept with probability p_i = density − ε + 2ε·i/(n−1), so probabilities span
[density − ε, density + ε] as in mergekit. Seeded per tensor and model.
"""

from __future__ import annotations

import torch

from mlxkit.engines.errors import InputError
from mlxkit.engines.merge.methods.base import WEIGHT, MergeMethod, ParamDef, TensorJob, tensor_generator
from mlxkit.engines.merge.methods.ties import combine_sparse
from mlxkit.engines.merge.params import INT8_MASK, LAMBDA


def keep_probabilities(delta: torch.Tensor, density: float, epsilon: float) -> torch.Tensor:
    rows = delta.reshape(-1, delta.shape[-1]) if delta.dim() > 1 else delta.reshape(1, -1)
    n = rows.shape[1]
    ranks = torch.argsort(torch.argsort(rows.abs(), dim=1, stable=True), dim=1).to(delta.dtype)
    spread = ranks / (n - 1) if n > 1 else torch.full_like(ranks, 0.5)
    return (density - epsilon + 2 * epsilon * spread).view_as(delta)


def magprune(delta: torch.Tensor, density: float, epsilon: float, rescale: bool, gen: torch.Generator
             ) -> torch.Tensor:
    if density >= 1.0:
        return delta
    p = keep_probabilities(delta, density, epsilon)
    keep = torch.rand(delta.shape, generator=gen, device=delta.device) < p
    out = delta * keep
    return torch.where(keep, out / p, out) if rescale else out


class Della(MergeMethod):
    """One class, two registered instances: consensus on (della) or off (della-linear)."""

    name = "della"
    reference = "https://arxiv.org/abs/2406.11617"

    def __init__(self, name: str, consensus: bool) -> None:
        self.name = name  # type: ignore[misc]
        self.consensus = consensus

    def parameters(self) -> list[ParamDef]:
        return [ParamDef("normalize", bool, self.consensus, "divide by the (agreeing) weights"),
                ParamDef("rescale", bool, True, "rescale each survivor by 1/its keep probability"),
                LAMBDA, INT8_MASK]

    def model_parameters(self) -> list[ParamDef]:
        return [WEIGHT,
                ParamDef("density", float, 1.0, "mean fraction of each task vector's entries kept", per_model=True,
                         low=0.0, high=1.0),
                ParamDef("epsilon", float, 0.15, "half-width of the keep probabilities around density",
                         per_model=True, low=0.0, high=0.5)]

    def merge(self, tensors: list[torch.Tensor], job: TensorJob) -> torch.Tensor:
        rescale = job.params["rescale"]
        pruned = []
        for i, (d, p) in enumerate(zip(tensors, job.model_params)):
            density, eps = p["density"], p["epsilon"]
            if density < 1.0 and (density - eps < 0.0 or density + eps > 1.0):
                raise InputError(f"{self.name} on '{job.name}': density ± epsilon must stay within [0, 1] "
                                 f"(model {i}: density {density:g}, epsilon {eps:g})")
            pruned.append(magprune(d, density, eps, rescale, tensor_generator(job, i, d.device)))
        stacked = torch.stack(pruned)
        return combine_sparse(stacked, job, self.consensus)
