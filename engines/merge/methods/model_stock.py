"""Model Stock (Jang et al., ECCV 2024): interpolate between the base and the average of the
fine-tunes by a ratio read from the geometry of their task vectors.

With cos θ the mean pairwise cosine of the task vectors (of each tensor, or of each row with
`filter_wise`) and N models, t = N·cos θ / (1 + (N − 1)·cos θ) and θ_merged = t·mean(θ_i) +
(1 − t)·θ_base, i.e. M = t·mean(Δ_i). Zero task vectors count as orthogonal (t = 0: the base).
"""

from __future__ import annotations

import torch

from mlxkit.engines.merge.methods.base import MergeMethod, ParamDef, TensorJob

_EPS = 1e-12


class ModelStock(MergeMethod):
    name = "model-stock"
    min_models = 2
    reference = "https://arxiv.org/abs/2403.19522"

    def parameters(self) -> list[ParamDef]:
        return [ParamDef("filter_wise", bool, False, "one ratio per row instead of one per tensor")]

    def model_parameters(self) -> list[ParamDef]:
        return []  # the ratio comes from the geometry, not from weights

    def merge(self, tensors: list[torch.Tensor], job: TensorJob) -> torch.Tensor:
        n = len(tensors)
        rowwise = job.params["filter_wise"] and tensors[0].dim() > 1
        flat = [d.double().reshape(d.shape[0], -1) if rowwise else d.double().reshape(1, -1) for d in tensors]
        cosines = []
        for i in range(n):
            for j in range(i + 1, n):
                dot = (flat[i] * flat[j]).sum(1)
                norms = flat[i].norm(dim=1) * flat[j].norm(dim=1)
                cosines.append(torch.where(norms > _EPS, dot / norms.clamp_min(_EPS), torch.zeros_like(dot)))
        cos = torch.stack(cosines).mean(0).clamp(-1.0, 1.0)
        t = n * cos / (1 + (n - 1) * cos)
        mean = torch.stack(flat).mean(0)
        return (t[:, None] * mean).reshape(tensors[0].shape).float()
