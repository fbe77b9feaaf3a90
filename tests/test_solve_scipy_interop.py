"""`factorized` / `spsolve` as drop-ins for scipy.sparse.linalg's, and float32 factors with float64 refinement.

SciPy (`spsolve`, `splu`) is the independent reference throughout; test matrices are assembled here node
by node or with `sp.kronsum`, not with `engines/solve/grid`.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as spla
import torch
from typer.testing import CliRunner

import mlxkit.engines.solve.matrix as matrix_module
from mlxkit.cli.main import app
from mlxkit.engines.errors import InputError
from mlxkit.engines.solve import SparseFallbackWarning, factorized, spsolve

runner = CliRunner()


def poisson(height: int, width: int, shift: float = 0.0) -> sp.csr_matrix:
    """Dirichlet 5-point Laplacian on `height` rows of `width` nodes (node (y, x) = y * width + x)."""
    def second_difference(m):
        return sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(m, m))

    return (sp.kronsum(second_difference(width), second_difference(height)) + shift * sp.eye(height * width)).tocsr()


def nine_point(height: int, width: int, seed: int) -> sp.csr_matrix:
    """A nonsymmetric, diagonally dominant 9-point matrix with random couplings, row-major H x W."""
    rng = np.random.default_rng(seed)
    rows, cols, vals = [], [], []
    for y in range(height):
        for x in range(width):
            k = y * width + x
            total = 0.0
            for dy in (-1, 0, 1):
                for dx in (-1, 0, 1):
                    yy, xx = y + dy, x + dx
                    if (dy or dx) and 0 <= yy < height and 0 <= xx < width:
                        c = -(0.2 + rng.random())
                        rows.append(k)
                        cols.append(yy * width + xx)
                        vals.append(c)
                        total += abs(c)
            rows.append(k)
            cols.append(k)
            vals.append(total + 0.3)
    n = height * width
    return sp.csr_matrix((vals, (rows, cols)), shape=(n, n))


def close(x, ref, tol=1e-9):
    return np.linalg.norm(np.asarray(x) - ref) <= tol * np.linalg.norm(ref)


def relres(a, x, b):
    return np.linalg.norm(a @ x - b) / np.linalg.norm(b)


# ---- the LinearOperator -----------------------------------------------------------------------------------

def test_is_a_linear_operator_for_the_inverse():
    a = nine_point(9, 7, seed=0)  # nonsymmetric: A^-T differs from A^-1
    rng = np.random.default_rng(1)
    b, block = rng.standard_normal(63), rng.standard_normal((63, 4))
    op = factorized(a)
    assert isinstance(op, spla.LinearOperator)
    assert op.shape == (63, 63) and op.dtype == np.float64 and op.method == "ssi"
    lu = spla.splu(a.tocsc())
    assert close(op @ b, lu.solve(b)) and close(op.matvec(b), lu.solve(b)) and close(op(b), lu.solve(b))
    assert op.matvec(b[:, None]).shape == (63, 1)
    assert close(op.matmat(block), lu.solve(block)) and close(op @ block, lu.solve(block))
    assert close(op.rmatvec(b), spla.spsolve(a.T.tocsc(), b))  # (A^-1)^T = A^-T
    assert close(op.rmatmat(block), lu.solve(block, trans="T"))
    assert close(op.T @ b, lu.solve(b, trans="T")) and close(op.H.matvec(b), lu.solve(b, trans="T"))
    assert close((op * 2.0) @ b, 2.0 * lu.solve(b))  # LinearOperator algebra composes
    assert close(spla.aslinearoperator(a) @ (op @ b), b)


def test_block_is_one_batched_solve_equal_to_k_scipy_solves():
    a = nine_point(11, 8, seed=2)
    block = np.random.default_rng(3).standard_normal((88, 6))
    op = factorized(a)
    calls = []
    inner = op._ssi.solve
    op._ssi.solve = lambda rhs, transpose=False: calls.append(tuple(rhs.shape)) or inner(rhs, transpose)
    x = op.matmat(block)
    assert calls == [(1, 11, 8, 6)]  # all six columns in one SSI call, not a loop over columns
    for j in range(6):
        assert close(x[:, j], spla.spsolve(a.tocsc(), block[:, j]))


def test_trans_keyword_is_scipys():
    a = nine_point(6, 10, seed=4)
    b = np.random.default_rng(5).standard_normal((60, 3))
    lu = spla.splu(a.tocsc())
    for method in ("ssi", "superlu"):
        solve = factorized(a, method=method)
        assert close(solve.solve(b, trans="T"), lu.solve(b, trans="T")), method
        assert close(solve.solve(b, trans="T"), spla.spsolve(a.T.tocsc(), b)), method
        assert close(solve.solve(b, trans="N"), lu.solve(b)), method
        assert close(solve.solve(b, "H"), lu.solve(b, trans="T")), method  # real A: H is T
        with pytest.raises(InputError, match="trans must be"):
            solve.solve(b, trans="X")
        with pytest.raises(TypeError):
            solve.solve(b, transpose=True)  # the old spelling is gone


# ---- grids inferred, and the fallback ---------------------------------------------------------------------

@pytest.mark.parametrize("name, a", [("5-point", poisson(37, 23, shift=0.1)), ("9-point", nine_point(37, 23, 6)),
                                     ("5-point wide", poisson(23, 37, shift=0.1))])
def test_rectangular_grid_inferred(name, a):
    b = np.random.default_rng(7).standard_normal(a.shape[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a grid matrix needs no notice
        solve = factorized(a)
    height, width = (23, 37) if "wide" in name else (37, 23)
    assert solve.method == "ssi" and solve.grid == (height, width), name
    assert close(solve(b), spla.spsolve(a.tocsc(), b)), name


@pytest.mark.parametrize("name, a", [
    ("random", (sp.random(70, 70, density=0.08, random_state=8) + 10 * sp.eye(70)).tocsr()),
    ("tridiagonal", sp.diags([-1.0, 2.5, -1.0], [-1, 0, 1], shape=(40, 40)).tocsr()),
    ("13-point", (poisson(9, 9) + sp.diags([0.1, 0.1], [-18, 18], shape=(81, 81))).tocsr()),
])
def test_non_grid_matrix_falls_back_with_a_notice(name, a):
    b = np.random.default_rng(9).standard_normal((a.shape[0], 2))
    with pytest.warns(SparseFallbackWarning, match="general sparse direct solver") as record:
        solve = factorized(a)
    assert record[0].filename == __file__  # stacklevel points at the caller
    assert solve.method in ("superlu", "pardiso") and solve.grid is None, name
    assert close(solve(b), spla.spsolve(a.tocsc(), b)), name
    assert close(solve.solve(b, trans="T"), spla.spsolve(a.T.tocsc(), b)), name
    with pytest.warns(SparseFallbackWarning):
        assert close(spsolve(a, b), spla.spsolve(a.tocsc(), b)), name


def test_non_square_and_complex_are_typed_errors():
    square = poisson(4, 4)
    for bad, phrase in [(sp.random(4, 6, density=0.5, random_state=0), "square"),
                        (np.ones((3, 5)), "square"),
                        (square.astype(complex), "real numbers"),
                        (square.toarray() + 1j, "real numbers")]:
        with pytest.raises(InputError, match=phrase):
            factorized(bad)
        with pytest.raises(ValueError, match=phrase):  # InputError is a ValueError, as SciPy raises
            spsolve(bad, np.ones(bad.shape[0]))


@pytest.mark.parametrize("name, matrix, phrase", [
    ("non-square", sp.random(4, 6, density=0.5, random_state=0), "square"),
    ("complex", poisson(4, 4).astype(complex) * (1 + 1j), "real numbers"),
])
def test_cli_refuses_non_square_and_complex(tmp_path, name, matrix, phrase):
    path = tmp_path / "a.npz"
    sp.save_npz(path, sp.csr_matrix(matrix))
    arrays = dict(np.load(path))
    np.savez(path, **arrays, b=np.ones(matrix.shape[0]))
    res = runner.invoke(app, ["solve", str(path)])
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and res.stderr.startswith("error:"), res.output
    assert len([line for line in res.output.splitlines() if line.startswith("error:")]) == 1
    assert phrase in res.stderr, res.stderr


# ---- sparse and column right-hand sides, as SciPy's spsolve ----------------------------------------------

@pytest.mark.filterwarnings("ignore::scipy.sparse.SparseEfficiencyWarning")  # SciPy's own, on the reference
def test_sparse_b_follows_scipy_spsolve(monkeypatch):
    a = poisson(8, 9, shift=0.2)
    b = sp.random(72, 5, density=0.2, random_state=10, format="csc") + sp.eye(72, 5, format="csc")
    ref = spla.spsolve(a, b)
    x = spsolve(a, b)
    assert sp.issparse(x) and type(x) is type(ref) is sp.csr_matrix and x.shape == (72, 5)
    assert close(x.toarray(), ref.toarray())
    as_array = spsolve(sp.csr_array(a), b.tocsr())  # A's class and format are kept, as in SciPy
    assert type(as_array) is sp.csr_array and close(as_array.toarray(), ref.toarray())
    assert type(spsolve(a.toarray(), b)) is sp.csc_array
    monkeypatch.setattr(matrix_module, "_SPARSE_BLOCK_VALUES", 72 * 2)  # three dense blocks of <= 2 columns
    assert close(spsolve(a, b).toarray(), ref.toarray())
    column = spsolve(a, b[:, :1])  # a single sparse column: a dense vector, as in SciPy
    assert isinstance(column, np.ndarray) and column.shape == (72,)
    assert close(column, spla.spsolve(a.tocsc(), b[:, :1]))
    with pytest.raises(InputError, match="72 rows"):
        spsolve(a, sp.random(71, 2, density=0.5, random_state=0))
    with pytest.raises(InputError, match="spsolve"):
        factorized(a)(b)  # SciPy's factorized refuses a sparse b too; the message names the way out


def test_dense_column_b_gives_a_vector_like_scipy():
    a = poisson(6, 7, shift=0.1)
    b = np.arange(42.0)[:, None]
    ref = spla.spsolve(a.tocsc(), b)
    x = spsolve(a, b)
    assert x.shape == ref.shape == (42,) and close(x, ref)
    assert factorized(a)(b).shape == (42, 1)  # factorized keeps b's shape, as splu().solve does


# ---- float32 factor, float64 iterative refinement --------------------------------------------------------

@pytest.mark.parametrize("side", [65, 129])
def test_float32_refinement_reaches_float64_residual(side):
    a = poisson(side, side)
    b = np.random.default_rng(11).standard_normal(side * side)
    full = relres(a, factorized(a)(b), b)
    refined_op = factorized(a, dtype="float32")
    assert refined_op.factor_dtype == "float32" and refined_op._ssi.dtype == torch.float32
    refined = relres(a, refined_op(b), b)
    plain = relres(a, factorized(a, dtype="float32", refine=0)(b), b)
    assert full <= 1e-13
    assert refined <= 4 * max(full, 1e-15), (refined, full)
    assert plain >= 1e4 * refined, (plain, refined)  # so the refinement is what closes the gap
    info = refined_op.info
    assert 1 <= info.refine_steps <= refined_op.refine == 8
    assert info.residuals[0] == pytest.approx(plain, rel=1e-6) and info.residual == pytest.approx(refined, rel=1e-6)
    assert list(info.residuals) == sorted(info.residuals, reverse=True)


def test_refinement_stops_at_its_target_and_on_stagnation():
    # A = I, and each correction recovers 90% of the error: the residual falls 10x per step.
    b = np.ones((1, 4, 1))

    def run(steps, target, floor=0.0):
        def correct(r):
            return 0.9 * r + floor  # `floor` is a fixed error no step can remove

        def residual(v):
            return b - v

        x, info = matrix_module.refine_solution(np.zeros_like(b), steps, residual, correct,
                                                lambda r: np.linalg.norm(r, axis=(1, 2)) / 2.0,
                                                matrix_module._select_numpy, target=target)
        return info

    assert run(8, 0.0).refine_steps == 8
    info = run(8, 2e-4)
    assert info.refine_steps == 4 and info.residual <= 2e-4 < info.residuals[-2]  # 1e-1, 1e-2, 1e-3, 1e-4
    assert run(8, 0.0, floor=1e-3).refine_steps <= 3  # stops once a step no longer halves the residual
    assert matrix_module.refine_target(1025 ** 2) == pytest.approx(1025 * np.finfo(np.float64).eps)


def test_float32_refinement_transposed_batched_and_on_tensors():
    a = nine_point(33, 31, seed=12)
    rng = np.random.default_rng(13)
    block = rng.standard_normal((a.shape[0], 3)) * 1e-30  # scaled inside: float32 would flush this to zero
    op = factorized(a, dtype="float32", refine=4)
    assert relres(a.T, op.solve(block, trans="T"), block) <= 1e-13
    assert relres(a, op @ block, block) <= 1e-13
    x = op(torch.from_numpy(block / 1e-30))
    assert isinstance(x, torch.Tensor) and x.dtype == torch.float64  # refined digits need float64
    assert relres(a, x.numpy(), block / 1e-30) <= 1e-13
    unrefined = factorized(a, dtype="float32", refine=0)(torch.from_numpy(block / 1e-30))
    assert unrefined.dtype == torch.float32


def test_refine_option_is_checked():
    a = poisson(5, 5)
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(InputError, match="refine"):
            factorized(a, refine=bad)


def _poisson_npz(path, side):
    a = poisson(side, side)
    sp.save_npz(path, a)
    arrays = dict(np.load(path))
    np.savez(path, **arrays, b=np.random.default_rng(14).standard_normal(side * side))
    return path


def test_cli_float32_refine_reports_the_steps(tmp_path):
    path = _poisson_npz(tmp_path / "p.npz", 65)
    full = json.loads(runner.invoke(app, ["solve", str(path), "--device", "cpu", "--json"]).stdout)
    res = runner.invoke(app, ["solve", str(path), "--device", "cpu", "--precision", "float32", "--json"])
    assert res.exit_code == 0, res.output
    low = json.loads(res.stdout)
    assert "refine" not in full and low["dtype"] == "float32"
    assert low["residual"] <= 4 * max(full["residual"], 1e-15)
    assert low["refine"]["max_steps"] == 8 and 1 <= low["refine"]["steps"] <= 8
    assert low["refine"]["unrefined_residual"] >= 1e4 * low["residual"]
    none = json.loads(runner.invoke(app, ["solve", str(path), "--device", "cpu", "--precision", "float32", "--refine",
                                          "0", "--json"]).stdout)
    assert "refine" not in none and none["residual"] == pytest.approx(low["refine"]["unrefined_residual"])
    plain = runner.invoke(app, ["solve", str(path), "--device", "cpu", "--precision", "float32", "--refine", "2"])
    assert plain.exit_code == 0 and "refinement" in plain.stdout
    bad = runner.invoke(app, ["solve", str(path), "--refine", "-1"])
    assert bad.exit_code == 2 and "Traceback" not in bad.output


def test_cli_float32_refine_with_constant_nullspace(tmp_path):
    a = poisson(12, 15).tolil()
    a.setdiag(0.0)
    a.setdiag(-np.asarray(a.sum(axis=1)).ravel())  # pure Neumann: A 1 = 0
    path = tmp_path / "n.npz"
    sp.save_npz(path, a.tocsr())
    arrays = dict(np.load(path))
    np.savez(path, **arrays, b=np.random.default_rng(15).standard_normal(180))
    res = runner.invoke(app, ["solve", str(path), "--device", "cpu", "--precision", "float32", "--nullspace", "constant",
                              "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["compatible_residual"] <= 1e-12 and report["refine"]["steps"] >= 1
