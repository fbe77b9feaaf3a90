"""NuSLERP (mergekit's `nuslerp`): spherical interpolation of two models by their weights.

t = w_1 / (w_0 + w_1) goes from the first model (t = 0) to the second (0.5 when the weights sum
to about zero). With a base model the two task vectors are interpolated and added back to the
base; without one, the weights themselves. Each tensor is one vector (`nuslerp_flatten`, the
default); otherwise every vector along the last dimension is interpolated on its own, or along
the first dimension with `nuslerp_row_wise` (mergekit's axes). Vectors colinear to within
1 − cos² ≤ 1e-16 are interpolated linearly.
"""

from __future__ import annotations

import torch

from mlxkit.engines.merge.methods.base import WEIGHT, MergeMethod, ParamDef, TensorJob

_EPS = 1e-8


def slerp_vectors(t: float, a: torch.Tensor, b: torch.Tensor, dim: int) -> torch.Tensor:
    """SLERP of every pair of vectors along `dim` (float64 inside), linear where colinear."""
    a64, b64 = a.double(), b.double()
    an = a64 / a64.norm(dim=dim, keepdim=True).clamp_min(1e-7)
    bn = b64 / b64.norm(dim=dim, keepdim=True).clamp_min(1e-7)
    cos = (an * bn).sum(dim, keepdim=True).clamp(-1.0, 1.0)
    colinear = (1 - cos.square()) <= _EPS ** 2
    omega = torch.arccos(torch.where(colinear, torch.zeros_like(cos), cos))
    safe = torch.where(colinear, torch.ones_like(omega), torch.sin(omega))
    out = (torch.sin((1 - t) * omega) * a64 + torch.sin(t * omega) * b64) / safe
    return torch.where(colinear, (1 - t) * a64 + t * b64, out).to(a.dtype)


class NuSlerp(MergeMethod):
    name = "nuslerp"
    uses_deltas = False
    needs_base = False
    min_models = 2
    max_models = 2
    reference = "https://github.com/arcee-ai/mergekit/blob/main/docs/merge_methods.md"

    def parameters(self) -> list[ParamDef]:
        return [ParamDef("nuslerp_flatten", bool, True, "treat each tensor as one vector"),
                ParamDef("nuslerp_row_wise", bool, False,
                         "without flattening: vectors along the first dimension instead of the last")]

    def model_parameters(self) -> list[ParamDef]:
        return [WEIGHT]

    def merge(self, tensors: list[torch.Tensor], job: TensorJob) -> torch.Tensor:
        w0, w1 = (float(p["weight"]) for p in job.model_params)
        t = 0.5 if abs(w0 + w1) < 1e-6 else w1 / (w0 + w1)
        a, b = tensors
        if job.base is not None:
            a, b = a - job.base, b - job.base
        if job.params["nuslerp_flatten"] or a.dim() < 2:
            out = slerp_vectors(t, a.reshape(-1), b.reshape(-1), 0).view_as(a)
        else:
            out = slerp_vectors(t, a, b, 0 if job.params["nuslerp_row_wise"] else -1)
        return out + job.base if job.base is not None else out
