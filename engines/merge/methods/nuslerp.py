"""NuSLERP (mergekit's "new" SLERP): spherical interpolation of two models by their weights.

t = w_1 / (w_0 + w_1) goes from the first model (t = 0) to the second. With a base model the two
task vectors are interpolated and added back to the base; without one, the weights themselves.
Each tensor is one vector (`nuslerp_flatten`), or each row (`nuslerp_row_wise`) or each column
is interpolated on its own. Nearly colinear vectors are interpolated linearly.
"""

from __future__ import annotations

import torch

from mlxkit.engines.errors import InputError
from mlxkit.engines.merge.methods.base import WEIGHT, MergeMethod, ParamDef, TensorJob

_DOT_THRESHOLD = 0.9995


def slerp_vectors(t: float, a: torch.Tensor, b: torch.Tensor, dim: int) -> torch.Tensor:
    """SLERP of every pair of vectors along `dim` (float64 inside), linear where colinear."""
    a64, b64 = a.double(), b.double()
    an = a64 / a64.norm(dim=dim, keepdim=True).clamp_min(1e-12)
    bn = b64 / b64.norm(dim=dim, keepdim=True).clamp_min(1e-12)
    dot = (an * bn).sum(dim, keepdim=True).clamp(-1.0, 1.0)
    omega = torch.arccos(dot)
    sin = torch.sin(omega)
    colinear = dot.abs() > _DOT_THRESHOLD
    safe = torch.where(colinear, torch.ones_like(sin), sin)
    wa = torch.where(colinear, torch.full_like(dot, 1 - t), torch.sin((1 - t) * omega) / safe)
    wb = torch.where(colinear, torch.full_like(dot, t), torch.sin(t * omega) / safe)
    return (wa * a64 + wb * b64).to(a.dtype)


class NuSlerp(MergeMethod):
    name = "nuslerp"
    uses_deltas = False
    needs_base = False
    min_models = 2
    max_models = 2
    reference = "https://github.com/arcee-ai/mergekit/blob/main/docs/merge_methods.md"

    def parameters(self) -> list[ParamDef]:
        return [ParamDef("nuslerp_flatten", bool, True, "treat each tensor as one vector"),
                ParamDef("nuslerp_row_wise", bool, False, "without flattening: interpolate rows, not columns")]

    def model_parameters(self) -> list[ParamDef]:
        return [WEIGHT]

    def merge(self, tensors: list[torch.Tensor], job: TensorJob) -> torch.Tensor:
        w0, w1 = (float(p["weight"]) for p in job.model_params)
        if abs(w0 + w1) < 1e-12:
            raise InputError(f"nuslerp of '{job.name}': the two weights sum to zero")
        t = w1 / (w0 + w1)
        a, b = tensors
        if job.base is not None:
            a, b = a - job.base, b - job.base
        if job.params["nuslerp_flatten"] or a.dim() < 2:
            out = slerp_vectors(t, a.reshape(-1), b.reshape(-1), 0).view_as(a)
        else:
            out = slerp_vectors(t, a, b, -1 if job.params["nuslerp_row_wise"] else 0)
        return out + job.base if job.base is not None else out
