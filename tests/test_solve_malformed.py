"""Malformed sparse input: one `error:` line and no output through the CLI, `InputError` through the library.

Before these checks, an out-of-range column index or a decreasing `indptr` reached SciPy's compiled
kernels, which trust them: the process segfaulted instead of reporting the input.
"""

from __future__ import annotations

import io
import re

import numpy as np
import pytest
import scipy.sparse as sp
from typer.testing import CliRunner

from mlxkit.cli.main import app
from mlxkit.engines.errors import InputError
from mlxkit.engines.solve import spsolve
from mlxkit.engines.solve.io import read_problem
from mlxkit.engines.solve.runner import run_solve

runner = CliRunner()


def csr3(**changes) -> dict:
    """A valid 3x3 save_npz CSR layout plus b; each change replaces a key (None removes it)."""
    arrays = {"format": np.array(b"csr"), "shape": np.array([3, 3]), "data": np.array([4.0, 4.0, 4.0]),
              "indices": np.array([0, 1, 2]), "indptr": np.array([0, 1, 2, 3]), "b": np.ones(3)}
    arrays.update(changes)
    return {k: v for k, v in arrays.items() if v is not None}


def coo3(**changes) -> dict:
    """The same matrix as `csr3` in COO layout."""
    layout = dict(format=np.array(b"coo"), indices=None, indptr=None, row=np.array([0, 1, 2]), col=np.array([0, 1, 2]))
    return csr3(**{**layout, **changes})


def poisson16(**changes) -> dict:
    t = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(4, 4))
    a = sp.kronsum(t, t).tocsr()
    arrays = {"format": np.array(b"csr"), "shape": np.array(a.shape), "data": a.data, "indices": a.indices,
              "indptr": a.indptr, "b": np.ones(16)}
    arrays.update(changes)
    return arrays


def npy_bytes() -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.eye(3))
    return buffer.getvalue()


# id -> (file content: arrays for np.savez, or raw bytes; a phrase the one error line must contain)
CASES = {
    "column index out of range": (csr3(indices=np.array([0, 1, 10**9])), "column index 1000000000 outside [0, 3)"),
    "negative column index": (csr3(indices=np.array([0, -1, 2])), "column index -1"),
    "indptr decreasing": (csr3(indptr=np.array([0, 2, 1, 3])), "non-decreasing"),
    "indptr decreasing unsigned": (csr3(indptr=np.array([0, 2, 1, 3], dtype=np.uint64)), "non-decreasing"),
    "indptr not from 0": (csr3(indptr=np.array([1, 1, 2, 3])), "start at 0"),
    "indptr not ending at nnz": (csr3(indptr=np.array([0, 1, 2, 2])), "end at the number of stored entries 3"),
    "indptr wrong length": (csr3(indptr=np.array([0, 1, 3])), "expected 4"),
    "data shorter than indices": (csr3(data=np.array([4.0, 4.0])), "'data' has 2 entries"),
    "data NaN": (csr3(data=np.array([4.0, np.nan, 4.0])), "NaN"),
    "data complex": (csr3(data=np.array([4.0, 4.0, 4.0 + 1j])), "real numbers"),
    "data text": (csr3(data=np.array(["a", "b", "c"])), "real numbers"),
    "data bool": (csr3(data=np.array([True, True, True])), "real numbers"),
    "indices float": (csr3(indices=np.array([0.0, 1.0, 2.0])), "integers"),
    "indices 2-D": (csr3(indices=np.array([[0, 1, 2]])), "1-D"),
    "shape not square": (csr3(shape=np.array([3, 4])), "square"),
    "shape 3-D": (csr3(shape=np.array([3, 3, 3])), "two integers"),
    "shape negative": (csr3(shape=np.array([-3, -3])), "non-negative"),
    "shape beyond int64": (csr3(shape=np.array([2**63, 2**63], dtype=np.uint64)), "below 2**63"),
    "shape float": (csr3(shape=np.array([3.0, 3.0])), "integers"),
    "shape empty": (csr3(shape=np.array([0, 0]), data=np.zeros(0), indices=np.zeros(0, dtype=int),
                         indptr=np.array([0])), "empty"),
    "indptr missing": (csr3(indptr=None), "missing key(s) indptr"),
    "data missing": (csr3(data=None), "missing key 'data'"),
    "format unknown": (csr3(format=np.array(b"xyz")), "unsupported sparse format 'xyz'"),
    "format not text": (csr3(format=np.array([1])), "'format' must be one string"),
    "coo row out of range": (coo3(row=np.array([0, 1, 3])), "row index 3"),
    "coo lengths differ": (coo3(col=np.array([0, 1])), "one length"),
    "dia duplicate offsets": (csr3(format=np.array(b"dia"), indices=None, indptr=None, offsets=np.array([0, 0]),
                                   data=np.ones((2, 3))), "duplicate"),
    "dia offset off the matrix": (csr3(format=np.array(b"dia"), indices=None, indptr=None,
                                       offsets=np.array([0, 7]), data=np.ones((2, 3))), "'offsets' must lie"),
    "bsr blocks do not tile": (csr3(format=np.array(b"bsr"), data=np.ones((1, 2, 2)), indices=np.array([0]),
                                    indptr=np.array([0, 1])), "do not tile"),
    "grid_shape wrong product": (csr3(grid_shape=np.array([2, 2])), "4 nodes but the matrix has 3 rows"),
    "grid_shape overflows int64": (poisson16(grid_shape=np.array([4, 2**62 + 4])),
                                   "nodes but the matrix has 16 rows"),  # numpy's product wraps to 16
    "grid_shape float": (csr3(grid_shape=np.array([3.0, 1.0])), "positive integers"),
    "grid_shape not positive": (poisson16(grid_shape=np.array([-4, -4])), "positive integers"),
    "b NaN": (csr3(b=np.array([1.0, np.nan, 1.0])), "NaN or Inf"),
    "b wrong length": (csr3(b=np.ones(4)), "3 rows"),
    "b text": (csr3(b=np.array(["1", "2", "3"])), "real numbers"),
    "object array inside": (csr3(data=np.array([4.0, "x", None], dtype=object)), "object (pickled) arrays"),
    "text file named .npz": (b"this is a text file\n1 2 3\n", "not a zip archive"),
    "npy file named .npz": (npy_bytes(), "not a zip archive"),
}


def write_case(path, content) -> None:
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        np.savez(path, **content)  # object arrays are pickled here; mlx solve must refuse them


def in_memory(arrays) -> tuple | None:
    """The case as an in-memory scipy matrix, its arrays set behind the constructors' back (None if no analogue).

    Setting the attributes directly is how a library caller ends up with such a matrix: scipy's
    constructors check lengths only, not index values.
    """
    if not isinstance(arrays, dict) or {"format", "shape", "data"} - set(arrays):
        return None
    fmt = arrays["format"].reshape(-1)[0] if arrays["format"].dtype.kind == "S" else None
    shape = arrays["shape"]
    if fmt not in (b"csr", b"coo", b"dia") or shape.shape != (2,) or shape.dtype.kind != "i" or shape.min() < 0:
        return None
    cls, keys = {b"csr": (sp.csr_matrix, ("data", "indices", "indptr")), b"coo": (sp.coo_matrix, ("data", "row", "col")),
                 b"dia": (sp.dia_matrix, ("data", "offsets"))}[fmt]
    m = cls(tuple(int(s) for s in shape))
    for key in keys:
        if key not in arrays:
            return None
        setattr(m, key, arrays[key])
    return m, arrays.get("b"), arrays.get("grid_shape")


@pytest.mark.parametrize("case", sorted(CASES))
def test_cli_one_error_line_and_no_output(case, tmp_path):
    content, phrase = CASES[case]
    path = tmp_path / "input.npz"
    write_case(path, content)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    res = runner.invoke(app, ["solve", str(path), "--out", str(out_dir / "x.npz")])
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and res.stderr.startswith("error:"), res.output
    assert phrase in res.stderr, res.stderr
    assert list(out_dir.iterdir()) == []  # neither x.npz nor a hidden temporary


@pytest.mark.parametrize("case", sorted(CASES))
def test_library_raises_input_error(case, tmp_path):
    content, phrase = CASES[case]
    path = tmp_path / "input.npz"
    write_case(path, content)
    with pytest.raises(InputError, match=re.escape(phrase)):
        read_problem(path)
    with pytest.raises(InputError):
        run_solve(path, out=tmp_path / "x.npz")
    assert not list(tmp_path.glob("*x.npz*"))
    memory = in_memory(content)
    if memory is not None:
        a, b, grid_shape = memory
        with pytest.raises(InputError):
            spsolve(a, b, grid_shape=grid_shape)


def test_most_cases_have_an_in_memory_analogue():
    # guards the builder above: the library checks must see the same broken arrays, not skip them
    assert sum(in_memory(content) is not None for content, _ in CASES.values()) >= 20


def test_valid_layouts_still_solve(tmp_path):
    for name, arrays in {"csr": csr3(), "coo": coo3(), "grid": poisson16(grid_shape=np.array([4, 4]))}.items():
        path = tmp_path / f"{name}.npz"
        np.savez(path, **arrays)
        report, x = run_solve(path)
        assert report["residual"] <= 1e-12, name
        a, b, grid_shape = in_memory(arrays)
        assert np.allclose(x, spsolve(a, b, grid_shape=grid_shape, method="superlu")), name
