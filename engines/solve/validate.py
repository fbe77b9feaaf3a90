"""Structural checks of matrix input, done before any compiled code sees the arrays.

SciPy's sparse kernels (`sum_duplicates`, `tocsr`, products, SuperLU) index memory straight from
`indices` / `indptr` without bounds checks, and the sparse constructors check only lengths, not
values: `csr_matrix((data, [0, 1, 10**9], [0, 1, 2, 3]), shape=(3, 3))` is accepted and then
segfaults the process in the first kernel. So every matrix that reaches `engines/solve` (from a file
or from a library caller) is taken apart into its arrays, checked here with NumPy comparisons only,
and rebuilt as a canonical float64 CSR matrix. Every failure is one `InputError` line.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from mlxkit.engines.errors import InputError

# The layouts `scipy.sparse.save_npz` writes, with the arrays each one needs besides format/shape/data.
FORMAT_KEYS = {"csr": ("indices", "indptr"), "csc": ("indices", "indptr"), "bsr": ("indices", "indptr"),
               "coo": ("row", "col"), "dia": ("offsets",)}
# Largest dimension accepted: `rows + 1` (the length of indptr) must still fit in int64.
MAX_DIM = int(np.iinfo(np.int64).max) - 1


def _error(source: str | None, message: str) -> InputError:
    return InputError(f"{source}: {message}" if source else message)


def _integers(name: str, value: np.ndarray, source: str | None, ndim: int = 1) -> np.ndarray:
    """An integer array (bool, float and object arrays are refused) of the given rank."""
    value = np.asarray(value)
    if value.dtype.kind not in "iu":
        raise _error(source, f"'{name}' must hold integers, got dtype {value.dtype}")
    if value.ndim != ndim:
        raise _error(source, f"'{name}' must be {ndim}-D, got shape {list(value.shape)}")
    return value


def _in_range(name: str, value: np.ndarray, upper: int, what: str, source: str | None) -> None:
    """All of `value` in [0, upper); comparisons only, so unsigned and huge values cannot wrap."""
    if value.size == 0:
        return
    low, high = value.min(), value.max()
    if low < 0 or high >= upper:
        bad = int(low) if low < 0 else int(high)
        raise _error(source, f"'{name}' has {what} {bad} outside [0, {upper})")


def real_values(name: str, value, source: str | None = None, ndim: int | None = None) -> np.ndarray:
    """`value` as finite float64; integer and floating dtypes only (no bool, complex, text or objects)."""
    try:
        value = np.asarray(value)
    except (ValueError, TypeError) as exc:  # ragged nested lists and the like
        raise _error(source, f"{name} is not a numeric array ({exc})") from None
    if value.dtype.kind not in "iuf":
        raise _error(source, f"{name} must be real numbers, got dtype {value.dtype}")
    if ndim is not None and value.ndim != ndim:
        raise _error(source, f"{name} must be {ndim}-D, got shape {list(value.shape)}")
    with np.errstate(over="ignore"):  # float128 beyond float64's range becomes inf, refused just below
        value = value.astype(np.float64, copy=False)
    if not np.all(np.isfinite(value)):
        raise _error(source, f"{name} contains NaN or Inf")
    return value


def _format(value, source: str | None) -> str:
    value = np.asarray(value)
    if value.dtype.kind not in "SU" or value.size != 1:
        raise _error(source, f"'format' must be one string such as 'csr', got {value.dtype} of shape "
                             f"{list(value.shape)}")
    text = value.reshape(()).item()
    if isinstance(text, bytes):  # save_npz writes the format as ASCII bytes
        text = text.decode("ascii", errors="replace")
    if text not in FORMAT_KEYS:
        raise _error(source, f"unsupported sparse format '{text}' (expected one of {', '.join(FORMAT_KEYS)})")
    return text


def _shape(value, source: str | None, square: bool) -> tuple[int, int]:
    value = _integers("shape", value, source)
    if value.shape != (2,):
        raise _error(source, f"'shape' must be two integers (rows, cols), got {value.tolist()}")
    rows, cols = (int(v) for v in value.tolist())  # Python ints: no wrap-around below
    if min(rows, cols) < 0 or max(rows, cols) > MAX_DIM:
        raise _error(source, f"'shape' must be two non-negative integers below 2**63 - 1, got [{rows}, {cols}]")
    if square and rows != cols:
        raise _error(source, f"matrix must be square, has shape [{rows}, {cols}]")
    if square and rows == 0:
        raise _error(source, "matrix is empty (0x0)")
    return rows, cols


@dataclass(frozen=True)
class SparseParts:
    """The checked arrays of one sparse matrix; `to_csr` is the only way on to compiled code."""

    format: str
    shape: tuple[int, int]
    data: np.ndarray  # float64
    indices: np.ndarray | None = None  # csr, csc, bsr (int64)
    indptr: np.ndarray | None = None
    row: np.ndarray | None = None  # coo (int64)
    col: np.ndarray | None = None
    offsets: np.ndarray | None = None  # dia (int64)

    def to_csr(self) -> sp.csr_matrix:
        """Canonical float64 CSR (duplicates summed, indices sorted)."""
        if self.format == "dia":
            a = self._dia_to_coo()
        elif self.format == "coo":
            a = sp.coo_matrix((self.data, (self.row, self.col)), shape=self.shape)
        else:
            cls = {"csr": sp.csr_matrix, "csc": sp.csc_matrix, "bsr": sp.bsr_matrix}[self.format]
            a = cls((self.data, self.indices, self.indptr), shape=self.shape)
        a = sp.csr_matrix(a, dtype=np.float64)
        a.sum_duplicates()
        return a

    def _dia_to_coo(self) -> sp.coo_matrix:
        # scipy's dia_tocsr is compiled; with NumPy the walk along each diagonal stays bounds-safe.
        rows, cols = self.shape
        width = min(self.data.shape[1], cols)
        j = np.arange(width, dtype=np.int64)
        parts_r, parts_c, parts_v = [], [], []
        for k, offset in enumerate(self.offsets.tolist()):
            keep = (j - offset >= 0) & (j - offset < rows)
            parts_r.append(j[keep] - offset)
            parts_c.append(j[keep])
            parts_v.append(self.data[k, :width][keep])
        cat = (lambda p, dt: np.concatenate(p) if p else np.zeros(0, dtype=dt))
        return sp.coo_matrix((cat(parts_v, np.float64), (cat(parts_r, np.int64), cat(parts_c, np.int64))),
                             shape=self.shape)


def _compressed(fmt: str, shape: tuple[int, int], arrays: Mapping, source: str | None) -> SparseParts:
    rows, cols = shape
    indices = _integers("indices", arrays["indices"], source)
    indptr = _integers("indptr", arrays["indptr"], source)
    nnz = indices.shape[0]
    if fmt == "bsr":
        data = real_values("'data'", arrays["data"], source, ndim=3)
        block_r, block_c = data.shape[1], data.shape[2]
        if block_r < 1 or block_c < 1 or rows % block_r or cols % block_c:
            raise _error(source, f"bsr blocks {block_r}x{block_c} (from 'data') do not tile shape [{rows}, {cols}]")
        major, minor = rows // block_r, cols // block_c
    else:
        data = real_values("'data'", arrays["data"], source, ndim=1)
        major, minor = (rows, cols) if fmt == "csr" else (cols, rows)
    if data.shape[0] != nnz:
        raise _error(source, f"'data' has {data.shape[0]} entries but 'indices' has {nnz}")
    if indptr.shape[0] != major + 1:
        raise _error(source, f"'indptr' has length {indptr.shape[0]}, expected {major + 1} "
                             f"({'rows' if fmt != 'csc' else 'columns'} + 1)")
    if indptr[0] != 0:
        raise _error(source, f"'indptr' must start at 0, starts at {int(indptr[0])}")
    if not np.all(indptr[1:] >= indptr[:-1]):  # a comparison, not np.diff: unsigned values must not wrap
        first = int(np.flatnonzero(indptr[1:] < indptr[:-1])[0])
        raise _error(source, f"'indptr' must be non-decreasing, but indptr[{first + 1}] = {int(indptr[first + 1])}"
                             f" < indptr[{first}] = {int(indptr[first])}")
    if indptr[-1] != nnz:
        raise _error(source, f"'indptr' must end at the number of stored entries {nnz}, ends at {int(indptr[-1])}")
    _in_range("indices", indices, minor, "row index" if fmt == "csc" else "column index", source)
    return SparseParts(fmt, shape, data, indices=indices.astype(np.int64), indptr=indptr.astype(np.int64))


def _coo(shape: tuple[int, int], arrays: Mapping, source: str | None) -> SparseParts:
    if "row" in arrays and "col" in arrays:
        row, col = _integers("row", arrays["row"], source), _integers("col", arrays["col"], source)
    else:  # newer save_npz may write the n-D layout, coords [2, nnz]
        coords = _integers("coords", arrays["coords"], source, ndim=2)
        if coords.shape[0] != 2:
            raise _error(source, f"'coords' must have shape [2, nnz] for a matrix, got {list(coords.shape)}")
        row, col = coords[0], coords[1]
    data = real_values("'data'", arrays["data"], source, ndim=1)
    if not row.shape == col.shape == data.shape:
        raise _error(source, f"'row', 'col' and 'data' must have one length, got {row.shape[0]}, {col.shape[0]} "
                             f"and {data.shape[0]}")
    _in_range("row", row, shape[0], "row index", source)
    _in_range("col", col, shape[1], "column index", source)
    return SparseParts("coo", shape, data, row=row.astype(np.int64), col=col.astype(np.int64))


def _dia(shape: tuple[int, int], arrays: Mapping, source: str | None) -> SparseParts:
    rows, cols = shape
    offsets = _integers("offsets", arrays["offsets"], source)
    data = real_values("'data'", arrays["data"], source, ndim=2)
    if data.shape[0] != offsets.shape[0]:
        raise _error(source, f"'data' holds {data.shape[0]} diagonals but 'offsets' has {offsets.shape[0]}")
    if offsets.size and (offsets.min() <= -max(rows, 1) or offsets.max() >= max(cols, 1)):
        raise _error(source, f"'offsets' must lie in [{1 - rows}, {cols - 1}], got {offsets.tolist()}")
    if np.unique(offsets).size != offsets.size:
        raise _error(source, "'offsets' has duplicate diagonals")
    return SparseParts("dia", shape, data, offsets=offsets.astype(np.int64))


def sparse_parts(arrays: Mapping[str, np.ndarray], source: str | None = None, *, square: bool = True) -> SparseParts:
    """Check the arrays of a `scipy.sparse.save_npz` layout (format, shape, data and the format's index arrays).

    Checks: the keys are present; shape is 2-D, non-negative (and square, non-empty when `square`);
    index arrays are integers of the right rank and length; `indptr` starts at 0, never decreases
    and ends at nnz; every index lies inside the shape; data is real, finite and of matching length.

    Examples
    --------
    >>> arrays = {"format": np.array(b"csr"), "shape": np.array([3, 3]), "data": np.ones(3),
    ...           "indices": np.array([0, 1, 10**9]), "indptr": np.array([0, 1, 2, 3])}
    >>> sparse_parts(arrays, "a.npz")
    Traceback (most recent call last):
    ...
    mlxkit.engines.errors.InputError: a.npz: 'indices' has column index 1000000000 outside [0, 3)
    >>> arrays["indices"] = np.array([0, 1, 2])
    >>> sparse_parts(arrays).to_csr().toarray().tolist()
    [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
    """
    for key in ("format", "shape", "data"):
        if key not in arrays:
            raise _error(source, f"sparse matrix is missing key '{key}'")
    fmt = _format(arrays["format"], source)
    shape = _shape(arrays["shape"], source, square)
    needed = FORMAT_KEYS[fmt]
    if fmt == "coo" and "coords" in arrays:
        needed = ("coords",)
    missing = [key for key in needed if key not in arrays]
    if missing:
        raise _error(source, f"sparse '{fmt}' matrix is missing key(s) {', '.join(missing)}")
    if fmt in ("csr", "csc", "bsr"):
        return _compressed(fmt, shape, arrays, source)
    if fmt == "coo":
        return _coo(shape, arrays, source)
    return _dia(shape, arrays, source)


def matrix_parts(a, source: str | None = None, *, square: bool = True) -> SparseParts:
    """Check any SciPy sparse matrix or array, or a dense 2-D array-like, without compiled code."""
    if sp.issparse(a):
        if a.ndim != 2:
            raise _error(source, f"matrix must be 2-D, got {a.ndim}-D")
        if a.format not in FORMAT_KEYS:
            a = a.tocoo()  # lil and dok keep Python containers: their conversion is not index-trusting
        arrays: dict = {"format": np.str_(a.format), "shape": np.asarray(a.shape), "data": a.data}
        if a.format in ("csr", "csc", "bsr"):
            arrays.update(indices=a.indices, indptr=a.indptr)
        elif a.format == "coo":
            arrays.update(row=a.row, col=a.col)
        else:
            arrays.update(offsets=a.offsets)
        return sparse_parts(arrays, source, square=square)
    dense = real_values("matrix", a, source)
    if dense.ndim != 2:
        raise _error(source, f"matrix must be 2-D, got shape {list(dense.shape)}")
    shape = _shape(np.asarray(dense.shape), source, square)
    row, col = np.nonzero(dense)
    return SparseParts("coo", shape, dense[row, col], row=row.astype(np.int64), col=col.astype(np.int64))


def as_csr(a, source: str | None = None, *, square: bool = True) -> sp.csr_matrix:
    """`matrix_parts(a).to_csr()`: a checked, canonical float64 CSR matrix."""
    return matrix_parts(a, source, square=square).to_csr()


def grid_shape(value, n: int, source: str | None = None) -> tuple[int, int]:
    """Check a grid shape (H, W): two positive integers with H * W = n, multiplied without overflow."""
    if isinstance(value, (tuple, list)):
        if not all(isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) for v in value):
            raise _error(source, f"grid_shape must be two positive integers (H, W), got {_show(value)}")
        values = [int(v) for v in value]  # Python ints: a value beyond int64 must not wrap in np.asarray
    else:
        try:
            array = np.asarray(value)
        except (ValueError, TypeError):
            array = np.asarray([None])
        if array.dtype.kind not in "iu":
            raise _error(source, f"grid_shape must be two positive integers (H, W), got {_show(value)}")
        values = [int(v) for v in array.ravel().tolist()]
    if len(values) != 2 or min(values) < 1:
        raise _error(source, f"grid_shape must be two positive integers (H, W), got {values}")
    height, width = values
    if height * width != n:  # Python ints: H * W cannot wrap around to n
        raise _error(source, f"grid_shape {height}x{width} has {height * width} nodes but the matrix has {n} rows")
    return height, width


def _show(value) -> str:
    text = repr(value.tolist() if isinstance(value, np.ndarray) else value)
    return text if len(text) <= 60 else text[:57] + "..."


def rhs_matrix(b, n: int, source: str | None = None, *,
               row_vector: bool = False) -> tuple[np.ndarray, tuple[int, ...]]:
    """A right-hand side for an n x n matrix as finite float64 ``[N, C]``, and the shape to return x in.

    `b` is ``[N]`` or ``[N, C]`` (C columns solved at once). With `row_vector`, ``[1, N]`` is read as one
    right-hand side too, the way files often store a vector.
    """
    b = real_values("right-hand side", b, source)
    if row_vector and b.ndim == 2 and b.shape[0] == 1 and b.shape[1] == n and n != 1:
        b = b[0]
    if b.ndim not in (1, 2) or b.shape[0] != n:
        raise _error(source, f"right-hand side has shape {list(b.shape)} but the matrix has {n} rows "
                             f"(expected [{n}] or [{n}, C])")
    if b.ndim == 2 and b.shape[1] == 0:
        raise _error(source, "right-hand side has no columns")
    if n == 0:
        raise _error(source, "right-hand side is empty")
    return b.reshape(n, -1), b.shape
