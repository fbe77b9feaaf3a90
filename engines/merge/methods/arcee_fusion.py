"""Arcee Fusion (mergekit): keep only the changes of one model that matter most.

Importance of each entry: |Δ| times the KL divergence, along the last dimension, between the
softmax of the model's and of the base's weights. Entries whose importance reaches median +
1.5·IQR (quartiles by linear interpolation, median the lower middle value as torch.median) take
the model's value, all others keep the base's: M = mask·Δ.
"""

from __future__ import annotations

import torch

from mlxkit.engines.merge.methods.base import MergeMethod, ParamDef, TensorJob

_EPS = 1e-8


def importance(theta: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    p = torch.softmax(theta.double(), dim=-1) + _EPS
    q = torch.softmax(base.double(), dim=-1) + _EPS
    kl = (p * torch.log(p / q)).sum(-1, keepdim=True)
    return (theta.double() - base.double()).abs() * kl


def _quantile(sorted_values: torch.Tensor, q: float) -> torch.Tensor:
    """torch.quantile's linear interpolation, without its limit on the input's size."""
    pos = q * (sorted_values.numel() - 1)
    low = int(pos)
    high = min(low + 1, sorted_values.numel() - 1)
    return sorted_values[low] + (pos - low) * (sorted_values[high] - sorted_values[low])


def fusion_mask(scores: torch.Tensor) -> torch.Tensor:
    flat = scores.reshape(-1).sort().values
    median = flat[(flat.numel() - 1) // 2]
    iqr = _quantile(flat, 0.75) - _quantile(flat, 0.25)
    return scores >= median + 1.5 * iqr


class ArceeFusion(MergeMethod):
    name = "arcee-fusion"
    min_models = 1
    max_models = 1
    reference = "https://github.com/arcee-ai/mergekit/blob/main/docs/merge_methods.md"

    def parameters(self) -> list[ParamDef]:
        return []

    def model_parameters(self) -> list[ParamDef]:
        return []

    def merge(self, tensors: list[torch.Tensor], job: TensorJob) -> torch.Tensor:
        assert job.base is not None  # needs_base: the planner refuses a merge without one
        delta = tensors[0]
        return delta * fusion_mask(importance(job.base + delta, job.base)).to(delta.dtype)
