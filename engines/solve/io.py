"""Readers for `mlx solve` inputs; every malformed input becomes one `InputError` line.

Accepted files
--------------
``.npz`` in `scipy.sparse.save_npz` layout (csr, csc, coo, ...)
    Extra keys: ``b`` (right-hand side, ``[N]`` or ``[N, C]``) and ``grid_shape`` (``[H, W]``).
    Every key is read with ``np.load(allow_pickle=False)`` and checked by `validate.sparse_parts`
    before SciPy builds the matrix (SciPy's kernels trust indices and would crash on bad ones).
``.npz`` in stencil form (no ``format`` key)
    ``stencil``: ``[H, W, 3, 3]`` or ``[B, H, W, 3, 3]`` with ``stencil[..., y, x, 1 + dy, 1 + dx]`` the
    coefficient coupling node (y, x) to node (y + dy, x + dx); or, instead, up to nine named ``[H, W]``
    (or ``[B, H, W]``) arrays, missing ones meaning zero: ``c`` (centre), ``n`` (y - 1), ``s`` (y + 1),
    ``w`` (x - 1), ``e`` (x + 1), ``nw``, ``ne``, ``sw``, ``se``. Row y grows downwards as in an image.
    ``b``: ``[H, W]`` or ``[H, W, C]`` (batched stencil: ``[B, H, W]`` or ``[B, H, W, C]``).
``.mtx`` Matrix Market (coordinate or array), with the right-hand side from ``--rhs``.
``--rhs`` may be ``.npy``, ``.npz`` (key ``b`` or its only array), ``.mtx`` or text (``.txt``, ``.csv``).
"""

from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.io
import scipy.sparse as sp

from mlxkit.engines.errors import InputError
from mlxkit.engines.solve.validate import as_csr, grid_shape, real_values, rhs_matrix, sparse_parts

NAMED = {"nw": (0, 0), "n": (0, 1), "ne": (0, 2), "w": (1, 0), "c": (1, 1), "e": (1, 2), "sw": (2, 0), "s": (2, 1),
         "se": (2, 2)}
_SPARSE_KEYS = {"format", "shape"}


@dataclass
class Problem:
    """A linear system (or a batch of them on one grid) ready to solve."""

    source: str
    b: np.ndarray  # [B, N, C], float64
    rhs_shape: tuple[int, ...]  # the solution is returned in this shape
    matrix: sp.csr_matrix | None = None  # sparse input (B = 1)
    stencil: np.ndarray | None = None  # stencil input [B, H, W, 3, 3]
    grid: tuple[int, int] | None = None  # from the file (grid_shape or the stencil's shape)

    @property
    def batch(self) -> int:
        return self.b.shape[0]


def _open_npz(path: Path) -> dict[str, np.ndarray]:
    # np.load falls back to unpickling for anything that is neither .npy nor zip, so its error for a
    # text file talks about pickled data; the zip check first gives the real reason.
    if not zipfile.is_zipfile(path):
        raise InputError(f"{path}: not a readable .npz file: not a zip archive (an .npz is a zip of .npy arrays)")
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {key: npz[key] for key in npz.files}
    except ValueError as exc:
        if "allow_pickle" in str(exc):  # an object array inside the archive
            raise InputError(f"{path}: holds object (pickled) arrays, which are refused; store plain numeric "
                             f"arrays") from None
        raise InputError(f"{path}: not a readable .npz file (ValueError: {exc})") from None
    except (zipfile.BadZipFile, OSError, EOFError, KeyError, NotImplementedError) as exc:
        raise InputError(f"{path}: not a readable .npz file ({exc.__class__.__name__}: {exc})") from None


def _check_file(path: Path) -> None:
    if not path.exists():
        raise InputError(f"{path}: no such file")
    if path.is_dir():
        raise InputError(f"{path}: is a directory, expected a file")
    if os.path.getsize(path) == 0:
        raise InputError(f"{path}: file is empty")


def read_rhs(path: str | os.PathLike) -> np.ndarray:
    """A right-hand side from .npy, .npz, .mtx or a text file."""
    path = Path(path)
    _check_file(path)
    suffix = path.suffix.lower()
    try:
        if suffix == ".npy":
            with open(path, "rb") as handle:
                if handle.read(6) != b"\x93NUMPY":  # else np.load would try to unpickle it
                    raise InputError(f"{path}: not a .npy file (no NumPy header)")
            values = np.load(path, allow_pickle=False)
        elif suffix == ".npz":
            arrays = _open_npz(path)
            if "b" not in arrays and len(arrays) != 1:
                raise InputError(f"{path}: expected a key 'b' (or a single array), found {sorted(arrays)}")
            values = arrays.get("b", next(iter(arrays.values())))
        elif suffix == ".mtx":
            values = scipy.io.mmread(path)
            values = values.toarray() if sp.issparse(values) else np.asarray(values)
        elif suffix in (".txt", ".csv", ".dat"):
            values = np.loadtxt(path, delimiter="," if suffix == ".csv" else None, ndmin=1)
        else:
            raise InputError(f"{path}: unsupported right-hand-side format '{suffix}' (use .npy, .npz, .mtx, .txt)")
    except InputError:
        raise
    except Exception as exc:  # each reader has its own exception zoo; all mean "unreadable"
        raise InputError(f"{path}: cannot read right-hand side ({exc.__class__.__name__}: {exc})") from None
    return real_values("right-hand side", values, str(path))


def _sparse_rhs(b, n: int, source: str) -> tuple[np.ndarray, tuple[int, ...]]:
    """`b` ([N], [N, C] or a [1, N] row) as [1, N, C], and the shape to return x in."""
    flat, shape = rhs_matrix(b, n, source, row_vector=True)
    return flat[None], shape


def _stencil_problem(arrays: dict[str, np.ndarray], source: str, rhs: np.ndarray | None) -> Problem:
    if "stencil" in arrays:
        stencil = np.asarray(arrays["stencil"])
        if stencil.ndim not in (4, 5) or stencil.shape[-2:] != (3, 3):
            raise InputError(f"{source}: 'stencil' must have shape [H, W, 3, 3] or [B, H, W, 3, 3], "
                             f"got {list(stencil.shape)}")
    else:
        named = {k: real_values(f"stencil array '{k}'", v, source) for k, v in arrays.items() if k in NAMED}
        shapes = {v.shape for v in named.values()}
        if len(shapes) != 1 or len(next(iter(shapes))) not in (2, 3):
            raise InputError(f"{source}: stencil arrays {sorted(named)} must all have one shape [H, W] or [B, H, W]")
        shape = next(iter(shapes))
        stencil = np.zeros(shape + (3, 3))
        for key, value in named.items():
            stencil[..., NAMED[key][0], NAMED[key][1]] = value
    stencil = real_values("stencil", stencil, source)
    batched = stencil.ndim == 5
    stencil = stencil if batched else stencil[None]
    bsz, height, width = stencil.shape[:3]
    if height * width == 0:
        raise InputError(f"{source}: stencil grid is empty ({height}x{width})")
    b = rhs if rhs is not None else arrays.get("b")
    if b is None:
        raise InputError(f"{source}: no right-hand side (store it under 'b' or pass --rhs)")
    b = real_values("right-hand side", b, source)
    lead = (bsz,) if batched else ()
    if b.shape[:len(lead) + 2] != lead + (height, width) or b.ndim not in (len(lead) + 2, len(lead) + 3):
        want = "[B, H, W] or [B, H, W, C]" if batched else "[H, W] or [H, W, C]"
        raise InputError(f"{source}: right-hand side must have shape {want} = {list(lead + (height, width))}, "
                         f"got {list(b.shape)}")
    flat = b.reshape(bsz, height * width, -1)
    return Problem(source=source, b=flat, rhs_shape=b.shape, stencil=stencil, grid=(height, width))


def read_problem(path: str | os.PathLike, rhs: str | os.PathLike | None = None) -> Problem:
    """Read a system from .npz (sparse or stencil form) or .mtx; see the module docstring."""
    path = Path(path)
    _check_file(path)
    source = str(path)
    b_override = read_rhs(rhs) if rhs is not None else None
    suffix = path.suffix.lower()
    if suffix == ".npz":
        arrays = _open_npz(path)
        if not arrays:
            raise InputError(f"{source}: the .npz holds no arrays")
        if "stencil" in arrays or (set(arrays) & set(NAMED) and not _SPARSE_KEYS <= set(arrays)):
            return _stencil_problem(arrays, source, b_override)
        if not _SPARSE_KEYS <= set(arrays):
            raise InputError(f"{source}: neither a scipy save_npz matrix (keys format, shape, ...) nor a stencil "
                             f"(key 'stencil'); found keys {sorted(arrays)}")
        # Every array is checked before scipy's compiled kernels see it (see `validate`); the matrix is
        # built only once the right-hand side is known to fit, so a bad b costs no conversion.
        parts = sparse_parts(arrays, source)
        n = parts.shape[0]
        b = b_override if b_override is not None else arrays.get("b")
        if b is None:
            raise InputError(f"{source}: no right-hand side (store it under 'b' or pass --rhs)")
        flat, shape = _sparse_rhs(b, n, source)
        grid = grid_shape(arrays["grid_shape"], n, source) if "grid_shape" in arrays else None
        return Problem(source=source, b=flat, rhs_shape=shape, matrix=parts.to_csr(), grid=grid)
    if suffix == ".mtx":
        try:
            a = scipy.io.mmread(path)
        except Exception as exc:
            raise InputError(f"{source}: not a readable Matrix Market file ({exc.__class__.__name__}: {exc})") from None
        a = as_csr(a, source)
        if b_override is None:
            raise InputError(f"{source}: a .mtx file holds no right-hand side; pass --rhs FILE")
        flat, shape = _sparse_rhs(b_override, a.shape[0], source)
        return Problem(source=source, b=flat, rhs_shape=shape, matrix=a)
    raise InputError(f"{source}: unsupported format '{suffix or path.name}' (expected .npz or .mtx)")
