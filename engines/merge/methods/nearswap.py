"""NearSwap (as mergekit's `nearswap`): take the second model's value only where it is near the base's.

Per element, with d = |θ_base − θ_1| and the sameness threshold t:
w = clamp(t / d, 0, 1) (1 where d = 0), θ = w·θ_1 + (1 − w)·θ_base. Elements that moved less than t
take the second model's value; the further an element moved, the more of the base it keeps.
"""

from __future__ import annotations

import torch

from mlxkit.engines.merge.methods.base import MergeMethod, ParamDef, TensorJob


class NearSwap(MergeMethod):
    name = "nearswap"
    uses_deltas = False
    base_role = "input"   # the base is the first of the two tensors
    min_models = 2
    max_models = 2
    reference = "https://huggingface.co/alchemonaut/QuartetAnemoi-70B-t0.0001"

    def parameters(self) -> list[ParamDef]:
        return [ParamDef("t", float, None, "sameness threshold: elements closer than t to the base swap fully",
                         required=True, low=0.0, low_open=True)]

    def model_parameters(self) -> list[ParamDef]:
        return []

    def merge(self, tensors: list[torch.Tensor], job: TensorJob) -> torch.Tensor:
        base, other = tensors[0].double(), tensors[1].double()
        distance = (base - other).abs()
        # t / 0 is inf: an unchanged element swaps fully (clamped to 1), like any element nearer than t.
        weight = (job.params["t"] / distance).nan_to_num(nan=1.0, posinf=1.0).clamp(0.0, 1.0)
        return (weight * other + (1.0 - weight) * base).to(tensors[0].dtype)
