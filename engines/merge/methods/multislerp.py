"""Multi-SLERP (mergekit's `multislerp`): barycentric interpolation on the sphere in one step.

Per tensor (flattened, float64): unit vectors x̂_i = x_i / (‖x_i‖ + eps) and norms ‖x_i‖; m is
the normalised weighted mean of the x̂_i; each x̂_i is projected onto the tangent plane at m
(x̂_i − ⟨x̂_i, m⟩·m), the weighted projections summed to T, and the result is
m·cos(‖T‖ + eps) + T·sin(‖T‖ + eps)/(‖T‖ + eps), scaled by the weighted mean norm. With a base
model this is done on the task vectors and the base added back. Weights are divided by their
sum when `normalize_weights`. When the weighted mean of two unit vectors vanishes (antipodal),
the result is their weighted sum, as mergekit does; for more models that is an error.
"""

from __future__ import annotations

import torch

from mlxkit.engines.errors import InputError
from mlxkit.engines.merge.methods.base import WEIGHT, MergeMethod, ParamDef, TensorJob


def log_map(m: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Riemannian log map at unit `m` of the unit rows of `x`: the tangent vector toward each,
    of length the angle between them (used by the Karcher mean)."""
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
    min_models = 1
    reference = "https://goddard.blog/posts/multislerp-wow-what-a-cool-idea"

    def parameters(self) -> list[ParamDef]:
        return [ParamDef("normalize_weights", bool, True, "divide the weights by their sum"),
                ParamDef("eps", float, 1e-8, "added to norms before dividing by them", low=0.0, high=1.0)]

    def model_parameters(self) -> list[ParamDef]:
        return [WEIGHT]

    def merge(self, tensors: list[torch.Tensor], job: TensorJob) -> torch.Tensor:
        if len(tensors) == 1:
            return tensors[0]
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
        if mean.norm() < eps:
            if len(tensors) != 2:
                raise InputError(f"multislerp of '{job.name}': the weighted mean direction is zero "
                                 "(antipodal inputs whose weights cancel); change the weights")
            out = (w[:, None] * x).sum(0)
        else:
            m = mean / mean.norm()
            tangent = (w[:, None] * (unit - (unit @ m)[:, None] * m[None, :])).sum(0)
            length = tangent.norm() + eps
            out = (m * torch.cos(length) + tangent * (torch.sin(length) / length)) * (w * norms).sum()
        out = out.reshape(shape)
        return (out + job.base.double() if job.base is not None else out).float()
