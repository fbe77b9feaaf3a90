"""SCE (FuseChat, Wan et al., 2024): Select, Calculate, Erase.

Select: keep the `select_topk` fraction of entries whose task vectors vary most across models
(population variance; counted among entries with non-zero variance). Calculate: each model's
weight is the mean square of its selected task vector, divided by the sum over models (equal
weights when all are zero). Erase: TIES' sign election; entries disagreeing with it are dropped
and the rest averaged with those weights, M = Σ w_i·Δ_i·agree_i / max(Σ w_i·agree_i, 1e-6).
"""

from __future__ import annotations

import torch

from mlxkit.engines.merge.methods.base import MergeMethod, ParamDef, TensorJob
from mlxkit.engines.merge.params import INT8_MASK


def variance_mask(deltas: torch.Tensor, fraction: float) -> torch.Tensor:
    if fraction >= 1.0:
        return torch.ones_like(deltas[0], dtype=torch.bool)
    var = deltas.var(0, unbiased=False)
    k = int(int(torch.count_nonzero(var)) * fraction)
    mask = torch.zeros(var.numel(), dtype=torch.bool, device=var.device)
    if k > 0:
        mask[torch.topk(var.reshape(-1), k).indices] = True
    return mask.view_as(var)


class Sce(MergeMethod):
    name = "sce"
    reference = "https://arxiv.org/abs/2408.07990"

    def parameters(self) -> list[ParamDef]:
        return [ParamDef("select_topk", float, 1.0, "fraction of entries with the highest variance kept",
                         low=0.0, high=1.0), INT8_MASK]

    def model_parameters(self) -> list[ParamDef]:
        return []  # the weights are calculated from the task vectors

    def merge(self, tensors: list[torch.Tensor], job: TensorJob) -> torch.Tensor:
        deltas = torch.stack(tensors)
        deltas = deltas * variance_mask(deltas, job.params["select_topk"])
        energy = deltas.pow(2).reshape(len(tensors), -1).mean(1)
        total = float(energy.sum())
        w = energy / total if abs(total) >= 1e-6 else torch.full_like(energy, 1.0 / len(tensors))
        w = w.view(-1, *([1] * tensors[0].dim()))
        elected = torch.where(deltas.sum(0) >= 0, 1.0, -1.0).to(deltas.dtype)
        agree = (deltas.sign() == elected).to(deltas.dtype)
        return (deltas * agree * w).sum(0) / (w * agree).sum(0).clamp_min(1e-6)
