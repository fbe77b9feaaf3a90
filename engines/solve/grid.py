"""2-D grid matrices and their 9-point stencil form.

Conventions (used by every module of `engines/solve`):

* A grid has H rows (y) and W columns (x); node (y, x) is unknown number ``k = y * W + x``, i.e. the
  C-order flattening of an H x W image.
* A stencil is an array ``[..., H, W, 3, 3]`` with ``stencil[..., y, x, 1 + dy, 1 + dx] = A[k(y, x), k(y + dy, x + dx)]``.
  Entries that point outside the grid are ignored.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import torch

from mlxkit.engines.errors import InputError

OFFSETS = [(dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1)]


def _coords(n_rows: int, n_cols: int, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    return n_rows // width, n_rows % width, n_cols // width, n_cols % width


def fits_grid(a: sp.spmatrix, height: int, width: int) -> bool:
    """Whether every stored nonzero of `a` couples nodes at most one step apart on an H x W grid."""
    if a.shape != (height * width, height * width):
        return False
    coo = sp.coo_matrix(a)
    nz = coo.data != 0
    ry, rx, cy, cx = _coords(coo.row[nz].astype(np.int64), coo.col[nz].astype(np.int64), width)
    return bool(np.all(np.abs(ry - cy) <= 1) and np.all(np.abs(rx - cx) <= 1))


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
    coo = sp.coo_matrix(a)
    nz = coo.data != 0
    offsets = np.unique(np.abs(coo.col[nz].astype(np.int64) - coo.row[nz].astype(np.int64)))
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
            if fits_grid(a, n // width, width):
                return n // width, width
    return None


def csr_to_stencil(a: sp.spmatrix, height: int, width: int) -> np.ndarray:
    """The `[H, W, 3, 3]` stencil of a grid matrix (duplicates summed). Raises InputError if it does not fit."""
    if not fits_grid(a, height, width):
        raise InputError(f"matrix is not a 9-point matrix on a {height}x{width} grid")
    coo = sp.coo_matrix(a)
    nz = coo.data != 0  # stored zeros may sit anywhere (a DIA matrix's padding): fits_grid ignores them too
    ry, rx, cy, cx = _coords(coo.row[nz].astype(np.int64), coo.col[nz].astype(np.int64), width)
    stencil = np.zeros((height, width, 3, 3), dtype=np.result_type(coo.data.dtype, np.float64))
    np.add.at(stencil, (ry, rx, cy - ry + 1, cx - rx + 1), coo.data[nz])
    return stencil


def stencil_mask(height: int, width: int) -> np.ndarray:
    """Boolean `[H, W, 3, 3]`: which stencil entries point inside the grid."""
    y = np.arange(height)[:, None, None, None]
    x = np.arange(width)[None, :, None, None]
    dy = np.arange(-1, 2)[None, None, :, None]
    dx = np.arange(-1, 2)[None, None, None, :]
    return (y + dy >= 0) & (y + dy < height) & (x + dx >= 0) & (x + dx < width)


def stencil_to_csr(stencil: np.ndarray) -> sp.csr_matrix:
    """Assemble the sparse matrix of one `[H, W, 3, 3]` stencil (entries outside the grid dropped)."""
    stencil = np.asarray(stencil)
    height, width = stencil.shape[:2]
    mask = stencil_mask(height, width) & (stencil != 0)
    y, x, iy, ix = np.nonzero(mask)
    rows = y * width + x
    cols = (y + iy - 1) * width + (x + ix - 1)
    n = height * width
    return sp.csr_matrix((stencil[mask], (rows, cols)), shape=(n, n))


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
