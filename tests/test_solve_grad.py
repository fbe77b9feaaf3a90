"""gradcheck of the differentiable SSI solve (fp64), and the factor re-use in backward."""

from __future__ import annotations

import numpy as np
import torch

from mlxkit.engines.solve.autograd import SSISolve, solve_stencil
from mlxkit.engines.solve.grid import stencil_mask


def _stencil(batch, height, width, seed):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(*batch, height, width, 3, 3, generator=g, dtype=torch.float64)
    s = s * torch.as_tensor(stencil_mask(height, width))
    s[..., 1, 1] = s.abs().sum((-1, -2)) + 0.5  # nonsymmetric 9-point, well conditioned
    return s


def test_gradcheck_stencil_and_rhs():
    s = _stencil((), 5, 7, 0).requires_grad_(True)
    b = torch.randn(5, 7, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda s_, b_: solve_stencil(s_, b_), (s, b))


def test_gradcheck_batched():
    s = _stencil((2,), 4, 6, 1).requires_grad_(True)
    b = torch.randn(2, 4, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda s_, b_: solve_stencil(s_, b_, leaf=2), (s, b))


def test_backward_reuses_forward_factorisation(monkeypatch):
    import mlxkit.engines.solve.autograd as autograd_module

    built = []
    original = autograd_module.SSIFactor

    class Counting(original):
        def __init__(self, *args, **kwargs):
            built.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(autograd_module, "SSIFactor", Counting)
    s = _stencil((), 9, 9, 2).requires_grad_(True)
    b = torch.randn(9, 9, dtype=torch.float64, requires_grad=True)
    SSISolve.apply(s, b, 4, True).square().sum().backward()
    assert len(built) == 1 and s.grad is not None and b.grad is not None
    # dL/db agrees with a dense reference: A^T lam = 2x
    a = np.zeros((81, 81))
    sd = s.detach().numpy()
    for y in range(9):
        for x in range(9):
            for iy in range(3):
                for ix in range(3):
                    yy, xx = y + iy - 1, x + ix - 1
                    if 0 <= yy < 9 and 0 <= xx < 9:
                        a[y * 9 + x, yy * 9 + xx] = sd[y, x, iy, ix]
    x_ref = np.linalg.solve(a, b.detach().numpy().ravel())
    assert np.allclose(b.grad.numpy().ravel(), np.linalg.solve(a.T, 2 * x_ref))
