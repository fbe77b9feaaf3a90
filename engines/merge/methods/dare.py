"""DARE (Yu et al., ICML 2024): drop each delta entry with probability p, rescale survivors by
1/(1−p), then combine with TIES' sign consensus (`dare-ties`) or a weighted sum (`dare-linear`).
Seeded per tensor and model, so a rerun gives the same bits.
"""

from __future__ import annotations

import torch

from mlxkit.engines.merge.methods.base import WEIGHT, MergeMethod, ParamDef, TensorJob, tensor_generator
from mlxkit.engines.merge.methods.ties import combine_sparse
from mlxkit.engines.merge.params import INT8_MASK, LAMBDA


def drop_and_rescale(delta: torch.Tensor, drop_rate: float, rescale: bool, gen: torch.Generator) -> torch.Tensor:
    if drop_rate <= 0.0:
        return delta
    if drop_rate >= 1.0:
        return torch.zeros_like(delta)
    keep = torch.rand(delta.shape, generator=gen, device=delta.device) >= drop_rate
    out = delta * keep
    return out / (1.0 - drop_rate) if rescale else out


class Dare(MergeMethod):
    """One class, two registered instances: consensus on (dare-ties) or off (dare-linear)."""

    name = "dare"
    reference = "https://arxiv.org/abs/2311.03099"

    def __init__(self, name: str, consensus: bool) -> None:
        self.name = name  # type: ignore[misc]
        self.consensus = consensus

    def parameters(self) -> list[ParamDef]:
        return [ParamDef("rescale", bool, True, "rescale survivors by 1/(1-drop_rate)"),
                ParamDef("normalize", bool, self.consensus, "divide by the (agreeing) weights"),
                LAMBDA, INT8_MASK]

    def model_parameters(self) -> list[ParamDef]:
        return [WEIGHT, ParamDef("drop_rate", float, 0.9, "probability of dropping each delta entry",
                                 per_model=True, low=0.0, high=1.0)]

    def merge(self, tensors: list[torch.Tensor], job: TensorJob) -> torch.Tensor:
        rescale = job.params["rescale"]
        dropped = torch.stack([
            drop_and_rescale(d, p["drop_rate"], rescale, tensor_generator(job, i, d.device))
            for i, (d, p) in enumerate(zip(tensors, job.model_params))])
        return combine_sparse(dropped, job, self.consensus)
