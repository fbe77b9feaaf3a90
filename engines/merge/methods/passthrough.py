"""Passthrough: every output tensor is one input's tensor, unchanged or scaled.

With `slices` this assembles layers from several models or repeats them (frankenmerges, depth
up-scaling); `scale` (per model, per tensor through filters) multiplies the copied tensor, e.g.
0 on the output projections of duplicated layers.
"""

from __future__ import annotations

import torch

from mlxkit.engines.merge.methods.base import MergeMethod, ParamDef, TensorJob


class Passthrough(MergeMethod):
    name = "passthrough"
    uses_deltas = False
    needs_base = False
    base_role = "none"
    min_models = 1
    max_models = 1
    reference = "https://github.com/arcee-ai/mergekit/blob/main/docs/merge_methods.md"

    def model_parameters(self) -> list[ParamDef]:
        return [ParamDef("scale", float, 1.0, "factor applied to the copied tensor", per_model=True)]

    def merge(self, tensors: list[torch.Tensor], job: TensorJob) -> torch.Tensor:
        scale = job.model_params[0]["scale"]
        return tensors[0] if scale == 1.0 else tensors[0] * scale
