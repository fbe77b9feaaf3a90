"""RAM, Reinforced Agent Merging (as mergekit's `ram` and `ramplus_tl`), on task vectors.

An element of Δ_t counts as changed when |Δ_t| > ε. Where exactly one model changed an element,
its change is kept whole; where several did, their changes are averaged over those models only
(unchanged models do not dilute it, unlike task arithmetic's mean). RAM+ (tensor-local) scales the
unique changes of each model by λ_t = 1 + r·clamp(ρ_t, 0, α), with ρ_t the ratio of that model's
shared to unique changed elements in the tensor.
"""

from __future__ import annotations

import torch

from mlxkit.engines.merge.methods.base import MergeMethod, ParamDef, TensorJob

_EPSILON = ParamDef("epsilon", float, 1e-5, "a task-vector element counts as changed above this magnitude", low=0.0)


class Ram(MergeMethod):
    name = "ram"
    reference = "https://arxiv.org/abs/2601.13572"

    def __init__(self, name: str = "ram", plus: bool = False):
        self.name = name  # type: ignore[misc]
        self.plus = plus

    def parameters(self) -> list[ParamDef]:
        extra = [ParamDef("r", float, 0.1, "RAM+ gain on a model's unique changes", low=0.0),
                 ParamDef("alpha", float, 0.2, "RAM+ cap on the shared-to-unique ratio", low=0.0)] if self.plus else []
        return [*extra, _EPSILON]

    def model_parameters(self) -> list[ParamDef]:
        return []

    def merge(self, tensors: list[torch.Tensor], job: TensorJob) -> torch.Tensor:
        eps = job.params["epsilon"]
        changed = [t.abs() > eps for t in tensors]
        counts = torch.stack(changed).sum(0)
        unique, shared = counts == 1, counts > 1
        out = torch.zeros_like(tensors[0])
        for delta, mask in zip(tensors, changed):
            gain = 1.0
            if self.plus:
                n_unique = float((mask & unique).sum())
                rho = float((mask & shared).sum()) / max(n_unique, eps)
                gain = 1.0 + job.params["r"] * min(max(rho, 0.0), job.params["alpha"])
            out += torch.where(mask & unique, delta * gain, torch.zeros_like(delta))
            out += torch.where(mask & shared, delta / counts.clamp(min=1), torch.zeros_like(delta))
        return out
