"""2-D grid matrices and their 9-point stencil form.

Conventions (used by every module of `engines/solve`):

* A grid has H rows (y) and W columns (x); node (y, x) is unknown number ``k = y * W + x``, i.e. the
  C-order flattening of an H x W image.
* A stencil is an array ``[..., H, W, 3, 3]`` with ``stencil[..., y, x, 1 + dy, 1 + dx] = A[k(y, x), k(y + dy, x + dx)]``.
  Entries that point outside the grid are ignored.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import scipy.sparse as sp
import torch

from mlxkit.engines.errors import InputError

OFFSETS = [(dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1)]


# Rows per pass over a matrix's entries: the int64 coordinates of one pass stay ~100 MB, where the
# whole of a 4097^2 9-point matrix's would be several GB.
_ROWS_PER_PASS = 1 << 20


def _entries(a: sp.spmatrix) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(rows, cols, values) of `a`'s nonzero stored entries, a block of rows at a time.

    Indices are int32 when twice the matrix's order fits (half the memory traffic of int64 in the
    passes over them; a difference of two indices must fit too), else int64. Stored zeros are
    skipped: they may sit anywhere (a DIA matrix's padding). Duplicates are kept.
    """
    csr = a.tocsr()
    indptr = csr.indptr
    index = np.int32 if 2 * max(csr.shape) + 2 < 2**31 else np.int64
    for lo in range(0, csr.shape[0], _ROWS_PER_PASS):
        hi = min(csr.shape[0], lo + _ROWS_PER_PASS)
        start, stop = int(indptr[lo]), int(indptr[hi])
        rows = np.repeat(np.arange(lo, hi, dtype=index), np.diff(indptr[lo:hi + 1]))
        cols = csr.indices[start:stop].astype(index, copy=False)
        values = csr.data[start:stop]
        nz = values != 0
        if nz.all():
            yield rows, cols, values
        else:
            yield rows[nz], cols[nz], values[nz]


def _steps(rows: np.ndarray, cols: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dy, dx, fits) of each entry: the grid step from its row's node to its column's, and whether
    that step is one of the nine of a 9-point stencil (an offset of W + 1 may also be a wrap-around)."""
    if width <= 2:  # d = ±1 can then also be a step between rows: decide by the row index itself
        dy, dx = cols // width - rows // width, cols % width - rows % width
        return dy, dx, (np.abs(dy) <= 1) & (np.abs(dx) <= 1)
    d = cols - rows
    dy = (d > 1).astype(d.dtype) - (d < -1)
    dx = d - dy * width
    x_next = rows % width + dx  # the one integer division per entry: the row's column on the grid, moved
    return dy, dx, (np.abs(dx) <= 1) & (x_next >= 0) & (x_next < width)


def _fits(rows: np.ndarray, cols: np.ndarray, width: int) -> bool:
    return bool(_steps(rows, cols, width)[2].all())


def fits_grid(a: sp.spmatrix, height: int, width: int) -> bool:
    """Whether every stored nonzero of `a` couples nodes at most one step apart on an H x W grid."""
    if a.shape != (height * width, height * width):
        return False
    return all(_fits(rows, cols, width) for rows, cols, _ in _entries(a))


def infer_grid(a: sp.spmatrix) -> tuple[int, int] | None:
    """Infer (H, W) of a 9-point grid matrix from its diagonal offsets; None when there is none.

    Offsets of a 9-point matrix are 0, ±1, ±(W-1), ±W, ±(W+1) (a 5-point one: 0, ±1, ±W), so W is read
    from the pattern and H = N / W: each offset larger than one proposes W - 1, W and W + 1, and the first
    proposal whose pattern fits (no coupling wraps a row) wins. Any fitting grid gives an exact SSI
    solve. A matrix with only offsets 0 and ±1 is one-dimensional and has no grid.

    Examples
    --------
    >>> t = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(6, 6))
    >>> lap = sp.kronsum(t, sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(4, 4)))  # H=4 rows of W=6
    >>> infer_grid(lap.tocsr())
    (4, 6)
    """
    n = a.shape[0]
    if a.shape[0] != a.shape[1] or n < 4:
        return None
    offsets = np.zeros(0, dtype=np.int64)
    for rows, cols, _ in _entries(a):
        offsets = np.union1d(offsets, np.unique(np.abs(cols - rows)))
        if offsets.size > 5:
            # A grid matrix has at most 0, 1, W-1, W, W+1; without this exit a general sparse matrix with
            # thousands of distinct offsets would pay one O(nnz) fit per candidate width.
            return None
    tried: set[int] = set()
    for d in offsets[offsets > 1]:
        for width in (int(d), int(d) - 1, int(d) + 1):
            if width < 2 or width in tried or n % width or n // width < 2:
                continue
            tried.add(width)
            # Every offset must be one of a 9-point stencil's on this width before a pass checks wraps.
            if set(offsets.tolist()) <= {0, 1, width - 1, width, width + 1} and fits_grid(a, n // width, width):
                return n // width, width
    return None


def csr_to_stencil(a: sp.spmatrix, height: int, width: int) -> np.ndarray:
    """The `[H, W, 3, 3]` stencil of a grid matrix (duplicates summed). Raises InputError if it does not fit."""
    if a.shape != (height * width, height * width):
        raise InputError(f"matrix is not a 9-point matrix on a {height}x{width} grid")
    stencil = np.zeros((height * width, 9), dtype=np.result_type(a.dtype, np.float64))
    flat = stencil.reshape(-1)
    for rows, cols, values in _entries(a):
        if rows.size == 0:
            continue
        dy, dx, fits = _steps(rows, cols, width)
        if not fits.all():
            raise InputError(f"matrix is not a 9-point matrix on a {height}x{width} grid")
        where = rows.astype(np.int64) * 9 + (3 * (dy + 1) + (dx + 1))
        if np.iscomplexobj(values):
            np.add.at(flat, where, values)
            continue
        # bincount sums duplicates as np.add.at does, ~20x faster; over this pass's rows only.
        first = int(where.min())
        flat[first:first + (int(where.max()) - first + 1)] += np.bincount(where - first, weights=values)
    return stencil.reshape(height, width, 3, 3)


def stencil_mask(height: int, width: int) -> np.ndarray:
    """Boolean `[H, W, 3, 3]`: which stencil entries point inside the grid."""
    y = np.arange(height)[:, None, None, None]
    x = np.arange(width)[None, :, None, None]
    dy = np.arange(-1, 2)[None, None, :, None]
    dx = np.arange(-1, 2)[None, None, None, :]
    return (y + dy >= 0) & (y + dy < height) & (x + dx >= 0) & (x + dx < width)


def stencil_to_csr(stencil: np.ndarray) -> sp.csr_matrix:
    """Assemble the sparse matrix of one `[H, W, 3, 3]` stencil (entries outside the grid and zeros dropped).

    Row k's entries in stencil order (dy, then dx) already have increasing columns k + dy W + dx, so
    the CSR arrays are written directly, a block of rows at a time: no coordinate arrays of the whole
    matrix (several GB at 4097^2) and no sort.
    """
    stencil = np.asarray(stencil)
    height, width = stencil.shape[:2]
    n = height * width
    values = stencil.reshape(n, 9)
    keep = stencil_mask(height, width).reshape(n, 9) & (values != 0)
    index = np.int32 if n + width + 1 < 2**31 else np.int64
    indptr = np.zeros(n + 1, dtype=index)
    np.cumsum(keep.sum(1), out=indptr[1:])
    data = np.empty(int(indptr[-1]), dtype=values.dtype)
    indices = np.empty(int(indptr[-1]), dtype=index)
    step = np.array([dy * width + dx for dy, dx in OFFSETS], dtype=np.int64)
    for lo in range(0, n, _ROWS_PER_PASS):
        hi = min(n, lo + _ROWS_PER_PASS)
        rows = keep[lo:hi]
        start, stop = int(indptr[lo]), int(indptr[hi])
        data[start:stop] = values[lo:hi][rows]
        indices[start:stop] = (np.arange(lo, hi, dtype=np.int64)[:, None] + step)[rows]
    a = sp.csr_matrix((data, indices, indptr), shape=(n, n))
    a.has_sorted_indices = True
    return a


def apply_stencil(stencil: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """y = A x for stencils `[B, H, W, 3, 3]` and vectors `[B, H, W, C]`; differentiable in both.

    Examples
    --------
    >>> s = torch.zeros(1, 2, 3, 3, 3, dtype=torch.float64); s[..., 1, 1] = 2.0
    >>> apply_stencil(s, torch.ones(1, 2, 3, 1, dtype=torch.float64)).flatten().tolist()
    [2.0, 2.0, 2.0, 2.0, 2.0, 2.0]
    """
    height, width = x.shape[1], x.shape[2]
    padded = torch.nn.functional.pad(x, (0, 0, 1, 1, 1, 1))  # zero ghosts make outside entries inert
    out = torch.zeros_like(x)
    for iy in range(3):
        for ix in range(3):
            out = out + stencil[..., iy, ix, None] * padded[:, iy:iy + height, ix:ix + width, :]
    return out


def is_symmetric_stencil(stencil: torch.Tensor) -> bool:
    """Whether every system of `stencil` ``[B, H, W, 3, 3]`` is exactly a symmetric matrix.

    ``A[k(y, x), k(y + dy, x + dx)]`` must equal ``A[k(y + dy, x + dx), k(y, x)]`` for every pair inside
    the grid.

    Examples
    --------
    >>> s = torch.zeros(1, 3, 4, 3, 3, dtype=torch.float64); s[..., 1, 1] = 4.0; s[..., 1, 2] = -1.0
    >>> is_symmetric_stencil(s)
    False
    >>> s[..., 1, 0] = -1.0
    >>> is_symmetric_stencil(s)
    True
    """
    height, width = stencil.shape[1], stencil.shape[2]
    for dy, dx in OFFSETS:
        if (dy, dx) <= (0, 0):  # each pair is checked once, from its upper (or left) node
            continue
        there = stencil[:, max(0, -dy):height - max(0, dy), max(0, -dx):width - max(0, dx), 1 + dy, 1 + dx]
        back = stencil[:, max(0, dy):height - max(0, -dy), max(0, dx):width - max(0, -dx), 1 - dy, 1 - dx]
        if not torch.equal(there, back):
            return False
    return True
