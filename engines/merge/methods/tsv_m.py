"""TSV-M (Gargiulo et al., CVPR 2025): merge the task singular vectors, decorrelated.

For each 2-D tensor: the top ⌊r/T⌋ singular triplets of every task vector (r = min(m, n), the
count computed as int(r·(1/T)) like the official code), placed side by side; the stacked left and
right singular vectors are each replaced by their polar factor (nearest orthonormal matrix), the
singular values kept: M = polar(U) · diag(S) · polar(Vᵀ). Other tensors, and by default the
embeddings and LM head, get the mean of the task vectors. α scales M as for Iso-C.
"""

from __future__ import annotations

import torch

from mlxkit.engines.merge.methods.base import MergeMethod, ParamDef, TensorJob


def _polar(x: torch.Tensor) -> torch.Tensor:
    u, _, vh = torch.linalg.svd(x, full_matrices=False)
    return u @ vh


def tsv_merge(deltas: list[torch.Tensor]) -> torch.Tensor:
    r = min(deltas[0].shape)
    k = int(r * (1.0 / len(deltas)))
    if k == 0:
        return torch.stack(deltas).mean(0)
    us, ss, vhs = [], [], []
    for d in deltas:
        u, s, vh = torch.linalg.svd(d.float(), full_matrices=False)
        us.append(u[:, :k])
        ss.append(s[:k])
        vhs.append(vh[:k])
    u_all = _polar(torch.cat(us, dim=1))
    vh_all = _polar(torch.cat(vhs, dim=0))
    return (u_all * torch.cat(ss)) @ vh_all


class TsvM(MergeMethod):
    name = "tsv-m"
    reference = "https://arxiv.org/abs/2412.00081"

    def parameters(self) -> list[ParamDef]:
        return []

    def model_parameters(self) -> list[ParamDef]:
        return []  # tasks weigh equally, as in the paper

    def merge(self, tensors: list[torch.Tensor], job: TensorJob) -> torch.Tensor:
        if not job.matrix:
            return torch.stack(tensors).mean(0)
        return tsv_merge(tensors)
