"""RegMean (Jin et al., ICLR 2023): the linear layer that best reproduces every model's outputs on its own inputs.

Each input t brings, from the calibration pass, the mean input Gram G_t = X_tᵀX_t / n_t of every
linear layer (X_t: the layer's input rows on the calibration tokens, through model t). For a
linear weight W (out × in), minimising Σ_t w_t ‖X_t Wᵀ − X_t W_tᵀ‖² / n_t gives

    W* = (Σ_t w_t W_t G̃_t) (Σ_t w_t G̃_t)⁻¹,   G̃ = a·G + (1 − a)·diag(G),

where a is `scaling` (the paper's α): it shrinks the off-diagonal entries, which keeps the system
well conditioned when a layer has more inputs than there are calibration tokens, and moves the
merge towards a per-input-coordinate weighted average (a = 0). a = 1 is the exact least-squares
merge. The system is factorised (Cholesky, float64) and solved, never inverted. An input
coordinate that is zero in every model's data leaves its column of W* undetermined; it takes the
weighted mean of the models' columns.

Every other tensor (biases, norms, embeddings, and the LM head unless --matrix-embeddings) gets
the weighted average Σ_t w_t θ_t / Σ_t w_t, as in the paper.

Default a = 0.9: close to the exact solution while always positive definite for inputs the data
exercises. The authors' released configs use 0.1 for most of their classification runs and 0.9
for NER; FusionBench uses 0.6. The inputs' tokenizers are checked to agree, so every model's
Gram comes from the same calibration tokens.
"""

from __future__ import annotations

import torch

from mlxkit.engines.errors import InputError, SingularMatrixError
from mlxkit.engines.merge.methods.base import MergeMethod, ParamDef, TensorJob, weights_of
from mlxkit.engines.merge.params import POSITIVE_WEIGHT


def regmean_merge(weights: list[torch.Tensor], grams: list[torch.Tensor], coefficients: list[float],
                  scaling: float, name: str = "") -> torch.Tensor:
    """W* = (Σ c_t W_t G̃_t)(Σ c_t G̃_t)⁻¹ for weights [out, in] and Grams [in, in], in float32.

    Raises `SingularMatrixError` when Σ c_t G̃_t is not positive definite (at `scaling` = 1 with
    fewer calibration tokens than inputs, or with inputs that are linearly dependent).
    """
    n_in = weights[0].shape[1]
    lhs = torch.zeros(n_in, n_in, dtype=torch.float64, device=weights[0].device)
    rhs = torch.zeros(n_in, weights[0].shape[0], dtype=torch.float64, device=weights[0].device)
    for weight, gram, c in zip(weights, grams, coefficients):
        shrunk = gram.double() * scaling
        shrunk.diagonal().copy_(gram.diagonal())  # a·G off the diagonal, G on it: a·G + (1 − a)·diag(G)
        lhs.add_(shrunk, alpha=c)
        rhs.add_(shrunk @ weight.double().T, alpha=c)
    # A Gram is positive semi-definite, so a zero diagonal entry means a zero row and column: the
    # coordinate decouples from the rest, and any column value reproduces the outputs equally well.
    dead = lhs.diagonal() <= 0
    if bool(dead.any()):
        index = dead.nonzero().squeeze(1)
        lhs[index, index] = float(sum(coefficients))
        rhs[index] = sum(c * w[:, index].double().T for w, c in zip(weights, coefficients))
    factor, info = torch.linalg.cholesky_ex(lhs)
    if int(info) != 0:
        raise SingularMatrixError(f"RegMean on '{name}': the input Gram matrix is singular ({n_in} inputs; "
                                  "fewer calibration tokens than inputs, or inputs that depend on each other); "
                                  "set scaling below 1 or give more calibration_tokens")
    return torch.cholesky_solve(rhs, factor).T.to(torch.float32)


class RegMean(MergeMethod):
    name = "regmean"
    uses_deltas = False
    needs_base = False
    min_models = 2
    base_role = "none"
    statistics = "gram"
    reference = "https://arxiv.org/abs/2212.09849"

    def parameters(self) -> list[ParamDef]:
        return [ParamDef("scaling", float, 0.9, "scale of the Gram matrices' off-diagonal entries (the paper's "
                                                "alpha; 1 = exact least squares)", low=0.0, high=1.0)]

    def model_parameters(self) -> list[ParamDef]:
        return [POSITIVE_WEIGHT]

    def merge(self, tensors: list[torch.Tensor], job: TensorJob) -> torch.Tensor:
        coefficients = [float(p["weight"]) for p in job.model_params]
        if not job.matrix or job.statistics is None:
            w = weights_of(job, tensors[0])
            return (torch.stack(tensors) * w).sum(0) / w.sum()
        n_in = tensors[0].shape[1]
        for gram in job.statistics:
            if tuple(gram.shape) != (n_in, n_in):
                raise InputError(f"RegMean on '{job.name}': the Gram matrix is {tuple(gram.shape)}, the weight "
                                 f"{tuple(tensors[0].shape)} takes {n_in} inputs")
        return regmean_merge(tensors, job.statistics, coefficients, job.params["scaling"], job.name)
