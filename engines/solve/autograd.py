"""Differentiable SSI solves: the backward pass re-uses the forward factorisation for the adjoint solve.

For ``x = A^-1 b`` and an upstream gradient ``g = dL/dx``: ``lam = A^-T g`` (one transposed solve with
the cached factors), ``dL/db = lam`` and ``dL/dA_ij = -sum_c lam_ic x_jc`` restricted to the stencil
pattern, i.e. ``dL/dstencil[y, x, 1 + dy, 1 + dx] = -sum_c lam[y, x, c] * x[y + dy, x + dx, c]``.
"""

from __future__ import annotations

import torch

from mlxkit.engines.solve.grid import stencil_mask
from mlxkit.engines.solve.ssi import SSIFactor


def stencil_outer(lam: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``out[B, y, x, 1 + dy, 1 + dx] = sum_c lam[B, y, x, c] * x[B, y + dy, x + dx, c]`` (0 off the grid)."""
    height, width = x.shape[1], x.shape[2]
    padded = torch.nn.functional.pad(x, (0, 0, 1, 1, 1, 1))
    rows = []
    for iy in range(3):
        rows.append(torch.stack([(lam * padded[:, iy:iy + height, ix:ix + width, :]).sum(-1) for ix in range(3)], -1))
    return torch.stack(rows, -2)


class SSISolve(torch.autograd.Function):
    """``x = A(stencil)^-1 b`` with gradients for `stencil` and `b`; see `solve_stencil`."""

    @staticmethod
    def forward(ctx, stencil: torch.Tensor, b: torch.Tensor, leaf: int, check: bool):  # type: ignore[override]
        factor = SSIFactor(stencil.detach(), dtype=stencil.dtype, device=stencil.device, leaf=leaf, check=check)
        x = factor.solve(b.detach())
        ctx.factor = factor
        ctx.rhs_shape = b.shape
        ctx.save_for_backward(x)
        return x

    @staticmethod
    def backward(ctx, grad_x: torch.Tensor):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        factor: SSIFactor = ctx.factor
        lam = factor.solve(grad_x, transpose=True)  # the adjoint solve re-uses the forward factors
        grad_b = lam if ctx.needs_input_grad[1] else None
        grad_s = None
        if ctx.needs_input_grad[0]:
            lam4, _ = factor._normalise_rhs(lam)
            x4, _ = factor._normalise_rhs(x)
            mask = torch.as_tensor(stencil_mask(factor.height, factor.width), device=x.device)
            grad_s = -stencil_outer(lam4, x4) * mask
            if not factor.batched:
                grad_s = grad_s[0]
        return grad_s, grad_b, None, None


def solve_stencil(stencil: torch.Tensor, b: torch.Tensor, *, leaf: int = 4, check: bool = True) -> torch.Tensor:
    """Differentiable SSI solve of ``A(stencil) x = b`` (shapes as in `SSIFactor.solve`).

    Examples
    --------
    >>> s = torch.zeros(4, 5, 3, 3, dtype=torch.float64); s[..., 1, 1] = 4.5
    >>> s[..., 0, 1] = s[..., 2, 1] = s[..., 1, 0] = s[..., 1, 2] = -1.0
    >>> s.requires_grad_(True)
    ... # doctest: +ELLIPSIS
    tensor(...)
    >>> b = torch.ones(4, 5, dtype=torch.float64, requires_grad=True)
    >>> torch.autograd.gradcheck(lambda s_, b_: solve_stencil(s_, b_), (s, b))
    True
    """
    return SSISolve.apply(stencil, b, leaf, check)
