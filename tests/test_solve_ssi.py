"""SSI against SciPy on random grid systems, plus re-solves, transposes, batches and singular systems."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as spla
import torch

from mlxkit.engines.core.seeds import derive_seed
from mlxkit.engines.errors import InputError, SingularMatrixError
from mlxkit.engines.solve.grid import apply_stencil, csr_to_stencil, infer_grid, stencil_mask, stencil_to_csr
from mlxkit.engines.solve.nullspace import ConstantNullspace
from mlxkit.engines.solve.ssi import SSIFactor


def five_point(rng, height, width, shift=0.1, variable=True):
    s = np.zeros((height, width, 3, 3))
    for iy, ix in [(0, 1), (2, 1), (1, 0), (1, 2)]:
        s[..., iy, ix] = -(1.0 + rng.random((height, width)) if variable else 1.0)
    s *= stencil_mask(height, width)
    s[..., 1, 1] = -s.sum((-1, -2)) + shift
    return s


def nine_point(rng, height, width, symmetric=False):
    s = rng.standard_normal((height, width, 3, 3)) * stencil_mask(height, width)
    if symmetric:
        a = stencil_to_csr(s)
        s = csr_to_stencil((a + a.T) / 2, height, width)
    s[..., 1, 1] = np.abs(s).sum((-1, -2)) + 0.5  # nonsymmetric, diagonally dominant
    return s


def helmholtz(rng, height, width, k2=0.3):
    s = five_point(rng, height, width, shift=0.0, variable=False)
    s[..., 1, 1] -= k2  # eigenvalues of the Laplacian straddle k2: indefinite
    return s


def rel_res(a, x, b):
    return np.linalg.norm(a @ x - b) / np.linalg.norm(b)


CASES = {
    "5pt-variable": lambda rng, h, w: five_point(rng, h, w),
    "9pt-nonsymmetric": lambda rng, h, w: nine_point(rng, h, w),
    "9pt-symmetric": lambda rng, h, w: nine_point(rng, h, w, symmetric=True),
    "helmholtz-indefinite": lambda rng, h, w: helmholtz(rng, h, w),
}


@pytest.mark.parametrize("kind", sorted(CASES))
@pytest.mark.parametrize("shape", [(33, 33), (23, 41), (40, 17), (2, 9), (64, 65)])
def test_matches_scipy(kind, shape):
    rng = np.random.default_rng(derive_seed(0, kind, *shape))  # the same matrices in every process
    s = CASES[kind](rng, *shape)
    a = stencil_to_csr(s)
    b = rng.standard_normal((shape[0], shape[1], 3))
    x = SSIFactor(s).solve(torch.from_numpy(b)).numpy().reshape(-1, 3)
    ref = spla.spsolve(a.tocsc(), b.reshape(-1, 3))
    assert rel_res(a, x, b.reshape(-1, 3)) <= 1e-10
    assert np.linalg.norm(x - ref) <= 1e-8 * np.linalg.norm(ref)


@pytest.mark.parametrize("leaf", [1, 2, 3, 8])
def test_leaf_sizes(leaf):
    rng = np.random.default_rng(leaf)
    s = nine_point(rng, 37, 29)
    b = rng.standard_normal((37, 29))
    x = SSIFactor(s, leaf=leaf).solve(torch.from_numpy(b)).numpy()
    assert rel_res(stencil_to_csr(s), x.ravel(), b.ravel()) <= 1e-10


@pytest.mark.parametrize("workers", [1, 3])
def test_worker_threads_give_the_same_solution(workers, monkeypatch):
    # pieces of uneven size (3 workers over odd block counts) must reassemble in the right order
    monkeypatch.setattr("mlxkit.engines.solve.ssi._THREADED_SOLVE_BYTES", 0)  # threaded solves too
    rng = np.random.default_rng(7)
    stencils = np.stack([nine_point(rng, 45, 38) for _ in range(2)])
    b = rng.standard_normal((2, 45, 38, 2))
    one = SSIFactor(stencils, workers=1)
    many = SSIFactor(stencils, workers=workers)
    assert many.nbytes() == one.nbytes()
    for transpose in (False, True):
        x1 = one.solve(torch.from_numpy(b), transpose=transpose).numpy()
        xw = many.solve(torch.from_numpy(b), transpose=transpose).numpy()
        assert np.abs(xw - x1).max() <= 1e-12 * np.abs(x1).max()
        a = stencil_to_csr(stencils[1])
        assert rel_res(a.T if transpose else a, xw[1].reshape(-1, 2), b[1].reshape(-1, 2)) <= 1e-10


def test_batched_multi_rhs_transpose_and_resolve():
    rng = np.random.default_rng(1)
    stencils = np.stack([nine_point(rng, 21, 30) for _ in range(4)])
    f = SSIFactor(stencils)
    for _ in range(2):  # the factorisation serves any number of new right-hand sides
        b = rng.standard_normal((4, 21, 30, 5))
        x = f.solve(torch.from_numpy(b)).numpy()
        xt = f.solve(torch.from_numpy(b), transpose=True).numpy()
        assert x.shape == b.shape
        for k in range(4):
            a = stencil_to_csr(stencils[k])
            assert rel_res(a, x[k].reshape(-1, 5), b[k].reshape(-1, 5)) <= 1e-10
            assert rel_res(a.T, xt[k].reshape(-1, 5), b[k].reshape(-1, 5)) <= 1e-10
    single = f.solve(torch.from_numpy(b[..., 0]))
    assert single.shape == (4, 21, 30)


def test_float32_accuracy():
    rng = np.random.default_rng(2)
    s = five_point(rng, 65, 65)
    b = rng.standard_normal((65, 65))
    x = SSIFactor(s, dtype=torch.float32).solve(torch.from_numpy(b))
    assert x.dtype == torch.float32
    assert rel_res(stencil_to_csr(s), x.double().numpy().ravel(), b.ravel()) <= 1e-4


@pytest.mark.parametrize("shape", [(1, 1), (2, 3), (7, 5)])
def test_stencil_to_csr_matches_a_dense_loop(shape):
    height, width = shape
    rng = np.random.default_rng(height * 10 + width)
    s = rng.standard_normal((height, width, 3, 3))
    s[rng.random(s.shape) < 0.3] = 0.0  # zeros are not stored
    dense = np.zeros((height * width, height * width))
    for y in range(height):
        for x in range(width):
            for dy in (-1, 0, 1):
                for dx in (-1, 0, 1):
                    if 0 <= y + dy < height and 0 <= x + dx < width:
                        dense[y * width + x, (y + dy) * width + x + dx] = s[y, x, 1 + dy, 1 + dx]
    a = stencil_to_csr(s)
    assert np.array_equal(a.toarray(), dense)
    assert a.nnz == np.count_nonzero(dense)
    check = a.copy()
    check.has_sorted_indices = False
    check.sort_indices()
    assert np.array_equal(check.indices, a.indices)  # the claimed sorted order holds


def test_apply_stencil_matches_csr():
    rng = np.random.default_rng(3)
    s = nine_point(rng, 6, 9)
    x = rng.standard_normal((6, 9, 2))
    y = apply_stencil(torch.from_numpy(s)[None], torch.from_numpy(x)[None])[0].numpy()
    assert np.allclose(y.reshape(-1, 2), stencil_to_csr(s) @ x.reshape(-1, 2))


def neumann(height, width):
    s = five_point(np.random.default_rng(0), height, width, shift=0.0)
    return s


def test_singular_neumann_detected():
    with pytest.raises(SingularMatrixError, match="singular"):
        SSIFactor(neumann(40, 33))


def test_singular_batch_member_named():
    good = five_point(np.random.default_rng(0), 17, 17)
    with pytest.raises(SingularMatrixError, match="system 1 of 2"):
        SSIFactor(np.stack([good, neumann(17, 17)]))


def test_constant_nullspace_mean_zero():
    s = neumann(25, 31)
    a = stencil_to_csr(s)
    pinned = s.copy()
    pinned[12, 15, 1, 1] += 8.0
    f = SSIFactor(pinned[None])
    rng = np.random.default_rng(4)
    b = rng.standard_normal((1, 25 * 31, 2))
    solve = lambda r, t: f.solve(torch.from_numpy(r.reshape(1, 25, 31, -1)), transpose=t).numpy().reshape(r.shape)
    ns = ConstantNullspace(solve, 1, 25 * 31, 12 * 31 + 15)
    x, lam = ns.solve(b)
    assert np.allclose(x.sum(axis=1), 0.0, atol=1e-9)
    assert rel_res(a, x[0], b[0] - lam[0]) <= 1e-10  # A x = b - lam 1: the bordered system


def test_grid_inference():
    rng = np.random.default_rng(5)
    for h, w in [(7, 11), (12, 5), (30, 30)]:
        assert infer_grid(stencil_to_csr(nine_point(rng, h, w))) == (h, w)
        assert infer_grid(stencil_to_csr(five_point(rng, h, w))) == (h, w)
    assert infer_grid(sp.random(50, 50, density=0.2, random_state=0, format="csr")) is None
    assert infer_grid(sp.diags([1.0, 2.0, 1.0], [-1, 0, 1], shape=(9, 9)).tocsr()) is None


def test_bad_stencil_inputs():
    with pytest.raises(InputError):
        SSIFactor(np.zeros((4, 4, 3)))
    s = five_point(np.random.default_rng(0), 5, 5)
    s[2, 2, 1, 1] = np.nan
    with pytest.raises(InputError, match="NaN"):
        SSIFactor(s)
    with pytest.raises(InputError, match="right-hand side"):
        SSIFactor(five_point(np.random.default_rng(0), 5, 5)).solve(torch.zeros(4, 5))
