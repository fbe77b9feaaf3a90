"""`factorized` / `spsolve` on in-memory matrices, against scipy.sparse.linalg.spsolve as the reference.

The test matrices are assembled here node by node (or with `sp.kronsum`), not with `engines/solve/grid`,
so the reference does not share code with what it checks.
"""

from __future__ import annotations

import doctest

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as spla

import mlxkit.engines.solve.matrix as matrix_module
import mlxkit.engines.solve.validate as validate_module
from mlxkit.engines.errors import InputError, SingularMatrixError
from mlxkit.engines.solve import Factorized, LinearSolveWarning, SparseFallbackWarning, factorized, spsolve


def poisson(height: int, width: int, shift: float = 0.0) -> sp.csr_matrix:
    """Dirichlet 5-point Laplacian on `height` rows of `width` nodes (node (y, x) = y * width + x)."""
    def second_difference(m):
        return sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(m, m))

    return (sp.kronsum(second_difference(width), second_difference(height)) + shift * sp.eye(height * width)).tocsr()


def variable_coefficient(height: int, width: int, seed: int, nine_point: bool = False) -> sp.csr_matrix:
    """-div(k grad u) + u with random edge conductivities k (optionally with random diagonal couplings)."""
    rng = np.random.default_rng(seed)
    rows, cols, vals = [], [], []
    steps = [(0, 1), (1, 0)] + ([(1, 1), (1, -1)] if nine_point else [])
    diagonal = np.ones(height * width)
    for y in range(height):
        for x in range(width):
            k = y * width + x
            for dy, dx in steps:
                yy, xx = y + dy, x + dx
                if 0 <= yy < height and 0 <= xx < width:
                    j, c = yy * width + xx, 0.5 + rng.random()
                    rows += [k, j]
                    cols += [j, k]
                    vals += [-c, -c * (1.0 if not nine_point else 0.5 + rng.random())]  # 9-point: nonsymmetric
                    diagonal[k] += c
                    diagonal[j] += c
    n = height * width
    return (sp.coo_matrix((vals, (rows, cols)), shape=(n, n)) + sp.diags(diagonal)).tocsr()


def reference(a, b):
    return spla.spsolve(a.tocsc(), b)


def close(x, ref):
    return np.linalg.norm(x - ref) <= 1e-9 * np.linalg.norm(ref)


@pytest.mark.parametrize("name, a", [
    ("poisson 12x12", poisson(12, 12)),
    ("poisson 2x2", poisson(2, 2)),
    ("variable 5-point 15x15", variable_coefficient(15, 15, seed=1)),
    ("variable 9-point 9x9", variable_coefficient(9, 9, seed=2, nine_point=True)),
])
def test_square_grid_inferred_matches_scipy(name, a):
    rng = np.random.default_rng(3)
    b = rng.standard_normal(a.shape[0])
    solve = factorized(a)
    assert solve.method == "ssi" and solve.grid == (int(np.sqrt(a.shape[0])),) * 2, name
    assert close(solve(b), reference(a, b)), name
    assert close(spsolve(a, b), reference(a, b)), name


def test_rectangular_grid_inferred_or_given():
    a = variable_coefficient(7, 11, seed=4, nine_point=True)
    b = np.random.default_rng(5).standard_normal((77, 3))
    solve = factorized(a)  # 77 unknowns: W = 11 read from the outer diagonals, H = 77 / 11
    assert solve.method == "ssi" and solve.grid == (7, 11) and close(solve(b), reference(a, b))
    x = spsolve(a, b, grid_shape=(7, 11))
    assert x.shape == b.shape and close(x, reference(a, b))
    assert close(factorized(a, grid_shape=[7, 11])(b), reference(a, b))


def test_batched_transposed_and_resolve():
    a = variable_coefficient(10, 13, seed=6, nine_point=True)
    solve = factorized(a, grid_shape=(10, 13))
    rng = np.random.default_rng(7)
    for _ in range(2):  # one factorisation, many right-hand sides
        b = rng.standard_normal((130, 4))
        assert close(solve(b), reference(a, b))
        assert close(solve.solve(b, trans="T"), reference(a.T, b))
    column = solve(b[:, :1])
    assert column.shape == (130, 1) and close(column[:, 0], reference(a, b[:, 0]))
    with pytest.raises(InputError, match="sparse right-hand side"):
        solve(sp.csr_matrix(b))  # as SciPy's factorized: never densified behind the caller's back


@pytest.mark.parametrize("fmt", ["csr", "csc", "coo", "dia", "bsr", "lil", "dok", "dense", "csr_array"])
def test_every_input_format(fmt):
    a = poisson(6, 6, shift=0.3)
    given = {"dense": lambda m: m.toarray(), "csr_array": sp.csr_array,
             "bsr": lambda m: m.tobsr(blocksize=(2, 2))}.get(fmt, lambda m: m.asformat(fmt))(a)
    b = np.arange(36.0)
    assert close(spsolve(given, b), reference(a, b))


def test_sparse_direct_methods_for_general_matrices():
    rng = np.random.default_rng(8)
    a = (sp.random(50, 50, density=0.1, random_state=9) + 10 * sp.eye(50)).tocsr()
    b = rng.standard_normal(50)
    with pytest.raises(InputError, match="method='auto'"):
        spsolve(a, b, method="ssi")  # no grid in the pattern, and the error names the way out
    with pytest.warns(SparseFallbackWarning, match="general sparse direct solver"):
        assert close(spsolve(a, b), reference(a, b))
    solve = factorized(a, method="superlu")
    assert solve.method == "superlu" and solve.grid is None
    assert close(solve(b), reference(a, b))
    with pytest.warns(LinearSolveWarning, match="float64"):
        factorized(a, method="superlu", dtype="float32")


def test_float32_ssi():
    a = poisson(20, 20, shift=0.1)
    b = np.ones(400)
    x = spsolve(a, b, dtype="float32")
    assert x.dtype == np.float64
    assert np.linalg.norm(x - reference(a, b)) <= 1e-4 * np.linalg.norm(reference(a, b))


@pytest.mark.parametrize("grid_shape, message", [
    ((4, 5), "has 20 nodes but the matrix has 16 rows"),
    ((2, 8), "not a 9-point matrix on the 2x8 grid"),  # right node count, wrong rectangle
    ((4, 2**62 + 4), "nodes but the matrix has 16 rows"),  # 4 * (2**62 + 4) wraps to 16 in int64
    (np.array([4, 2**62 + 4], dtype=np.int64), "nodes but the matrix has 16 rows"),
    ((0, 16), "positive integers"),
    ((-4, -4), "positive integers"),
    ((4.0, 4.0), "positive integers"),
    ((True, 16), "positive integers"),
    ((16,), "positive integers"),
    ("4x4", "positive integers"),
    ((1, 16), "at least 2x2"),
])
def test_wrong_grid_shape(grid_shape, message):
    with pytest.raises(InputError, match=message):
        factorized(poisson(4, 4), grid_shape=grid_shape)


def test_bad_matrices_and_options():
    a = poisson(4, 4)
    with pytest.raises(InputError, match="square"):
        spsolve(sp.random(4, 6, density=0.5, random_state=0), np.ones(4))
    with pytest.raises(InputError, match="NaN"):
        spsolve(np.array([[1.0, np.nan], [0.0, 1.0]]), np.ones(2))
    with pytest.raises(InputError, match="real numbers"):
        spsolve(a.astype(complex), np.ones(16))
    with pytest.raises(InputError, match="16 rows"):
        spsolve(a, np.ones(15))
    with pytest.raises(InputError, match="NaN or Inf"):
        factorized(a)(np.full(16, np.inf))
    with pytest.raises(InputError, match="unknown option"):
        factorized(a, methdo="ssi")
    with pytest.raises(InputError, match="method"):
        factorized(a, method="cholmod")
    with pytest.raises(InputError, match="leaf"):
        factorized(a, leaf=0)


def test_bad_b_fails_before_factorising(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("factorised a system whose right-hand side was already known to be wrong")

    monkeypatch.setattr(Factorized, "__init__", refuse)
    with pytest.raises(InputError, match="16 rows"):
        spsolve(poisson(4, 4), np.ones(17))


def test_singular_matrix_raises():
    neumann = poisson(6, 6).tolil()
    neumann.setdiag(0.0)
    neumann.setdiag(-np.asarray(neumann.sum(axis=1)).ravel())  # rows sum to zero: A 1 = 0
    with pytest.raises(SingularMatrixError):
        spsolve(neumann.tocsr(), np.ones(36))


@pytest.mark.parametrize("module", [matrix_module, validate_module])
def test_docstring_examples(module):
    result = doctest.testmod(module, extraglobs={"np": np, "sp": sp})
    assert result.failed == 0
