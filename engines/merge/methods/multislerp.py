"""Multi-SLERP: a weighted spherical mean of several models in one tangent-space step.

Per tensor (flattened, float64): unit vectors x̂_i and norms ‖x_i‖; the weighted chordal mean,
normalised, is the point m; each x̂_i is mapped to the tangent space at m (log map), the weighted
tangent vectors are averaged and mapped back (exp map); the result is scaled by the weighted
mean norm. With a base model this is done on the task vectors and the base added back.
Weights are divided by their sum when `normalize_weights`.
"""

from __future__ import annotations

import torch

from mlxkit.engines.errors import InputError
from mlxkit.engines.merge.methods.base import WEIGHT, MergeMethod, ParamDef, TensorJob


def log_map(m: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Tangent vector at unit `m` pointing to unit `x` (rows of x), of length the angle between them."""
    cos = (x @ m).clamp(-1.0, 1.0)
    theta = torch.arccos(cos)
    perp = x - cos[:, None] * m[None, :]
    sin = torch.sin(theta)
    scale = torch.where(sin > 1e-12, theta / sin.clamp_min(1e-12), torch.ones_like(theta))
    return scale[:, None] * perp


def exp_map(m: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    norm = v.norm()
    if norm < 1e-12:
        return m
    return torch.cos(norm) * m + torch.sin(norm) * v / norm


class MultiSlerp(MergeMethod):
    name = "multislerp"
    uses_deltas = False
    needs_base = False
    min_models = 2
    reference = "https://github.com/arcee-ai/mergekit/blob/main/docs/merge_methods.md"

    def parameters(self) -> list[ParamDef]:
        return [ParamDef("normalize_weights", bool, True, "divide the weights by their sum"),
                ParamDef("eps", float, 1e-8, "added to norms before dividing by them", low=0.0, high=1.0)]

    def model_parameters(self) -> list[ParamDef]:
        return [WEIGHT]

    def merge(self, tensors: list[torch.Tensor], job: TensorJob) -> torch.Tensor:
        shape = tensors[0].shape
        x = torch.stack([t.double().reshape(-1) for t in tensors])
        if job.base is not None:
            x = x - job.base.double().reshape(1, -1)
        w = torch.tensor([float(p["weight"]) for p in job.model_params], dtype=torch.float64, device=x.device)
        if job.params["normalize_weights"]:
            if abs(float(w.sum())) < 1e-12:
                raise InputError(f"multislerp of '{job.name}': the weights sum to zero")
            w = w / w.sum()
        eps = job.params["eps"]
        norms = x.norm(dim=1)
        unit = x / (norms[:, None] + eps)
        mean = (w[:, None] * unit).sum(0)
        if mean.norm() < 1e-12:
            out = torch.zeros_like(x[0])
        else:
            m = mean / mean.norm()
            out = exp_map(m, (w[:, None] * log_map(m, unit)).sum(0)) * (w * norms).sum()
        out = out.reshape(shape)
        return (out + job.base.double() if job.base is not None else out).float()
