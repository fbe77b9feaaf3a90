"""Karcher mean: the weighted Riemannian (Fréchet) mean of the models' tensors on the sphere.

Per tensor (flattened, float64): start from the normalised weighted mean of the unit vectors and
repeat m ← exp_m(Σ w_i log_m(x̂_i)) until the step is shorter than `tol` or `max_iter` steps are
done; the result is m scaled by the weighted mean norm. Weights are divided by their sum.
"""

from __future__ import annotations

import torch

from mlxkit.engines.errors import InputError
from mlxkit.engines.merge.methods.base import WEIGHT, MergeMethod, ParamDef, TensorJob
from mlxkit.engines.merge.methods.multislerp import exp_map, log_map


class Karcher(MergeMethod):
    name = "karcher"
    uses_deltas = False
    needs_base = False
    base_role = "none"
    min_models = 2
    reference = "https://en.wikipedia.org/wiki/Fr%C3%A9chet_mean"

    def parameters(self) -> list[ParamDef]:
        return [ParamDef("max_iter", int, 10, "most iterations", low=1, high=1000),
                ParamDef("tol", float, 1e-5, "stop once the tangent step is shorter than this", low=0.0)]

    def model_parameters(self) -> list[ParamDef]:
        return [WEIGHT]

    def merge(self, tensors: list[torch.Tensor], job: TensorJob) -> torch.Tensor:
        x = torch.stack([t.double().reshape(-1) for t in tensors])
        w = torch.tensor([float(p["weight"]) for p in job.model_params], dtype=torch.float64, device=x.device)
        if abs(float(w.sum())) < 1e-12:
            raise InputError(f"karcher mean of '{job.name}': the weights sum to zero")
        w = w / w.sum()
        norms = x.norm(dim=1)
        unit = x / norms.clamp_min(1e-12)[:, None]
        mean = (w[:, None] * unit).sum(0)
        if mean.norm() < 1e-12:
            return torch.zeros_like(tensors[0])
        m = mean / mean.norm()
        for _ in range(job.params["max_iter"]):
            step = (w[:, None] * log_map(m, unit)).sum(0)
            if step.norm() < job.params["tol"]:
                break
            m = exp_map(m, step)
            m = m / m.norm()
        return (m * (w * norms).sum()).reshape(tensors[0].shape).float()
