"""Matrix-level solves in the style of `scipy.sparse.linalg`: `factorized(A)` and `spsolve(A, b)`.

A matrix is solved by SSI when it is a 9-point matrix on a known 2-D grid, and by the general sparse
direct solver (`fallback`) when ``method="superlu"`` or ``"pardiso"`` is asked for. The grid is
``grid_shape=(H, W)`` when given (node ``(y, x)`` is unknown ``y * W + x``); without it, only the
square grid is inferred (N a perfect square and the matrix fits the sqrt(N) x sqrt(N) grid), because
offsets alone can fit several rectangles. `mlx solve` (`runner`) builds its solvers with the same
functions (`ssi_batch_solver`, `sparse_batch_solver`) and checks residuals the same way.

Every matrix passes `validate` first: SciPy's compiled kernels trust `indices`/`indptr`, so a
malformed matrix would crash the process instead of raising.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping

import numpy as np
import scipy.sparse as sp
import torch

from mlxkit.engines.errors import InputError, SingularMatrixError
from mlxkit.engines.solve.fallback import SparseDirect
from mlxkit.engines.solve.grid import csr_to_stencil, fits_grid
from mlxkit.engines.solve.ssi import SolverWarning, SSIFactor
from mlxkit.engines.solve.validate import as_csr, grid_shape as check_grid_shape, rhs_matrix
from mlxkit.engines.training.device import resolve_device

__all__ = ["Factorized", "SolveOptions", "factorized", "spsolve"]

METHODS = ("auto", "ssi", "superlu", "pardiso")
# Relative residual ||Ax - b|| / ||b|| above which a solve is reported as singular or too
# ill-conditioned instead of returned; float32 is SSI's reduced-precision mode (~1e-6 typical).
RESIDUAL_LIMIT = {"float64": 1e-6, "float32": 1e-2}

# Solves right-hand sides [B, N, C] of B systems at once, plain (False) or transposed (True).
BatchSolve = Callable[[np.ndarray, bool], np.ndarray]
SSIBatchSolve = Callable[["np.ndarray | torch.Tensor", bool], "np.ndarray | torch.Tensor"]


@dataclass(frozen=True)
class SolveOptions:
    """Expert knobs of `factorized` / `spsolve`, passed as keyword arguments.

    method : "auto" | "ssi" | "superlu" | "pardiso"
        "auto" and "ssi" use SSI on the grid (and need one); the others use the sparse direct solver.
    dtype : "float64" | "float32"
        SSI working precision; the sparse direct solvers always work in float64.
    leaf : int >= 1
        Minimum cells per SSI leaf-patch side.
    device : "cpu" | "cuda" | "cuda:N" | "auto"
        Where SSI factorises and solves ("auto": CUDA when torch sees a GPU). The sparse direct
        solvers run on the CPU whatever it is.
    check : bool
        Raise `SingularMatrixError` when a solve's relative residual exceeds `RESIDUAL_LIMIT`
        (one extra sparse product per solve).
    """

    method: str = "auto"
    dtype: str = "float64"
    leaf: int = 4
    check: bool = True
    device: str | torch.device = "cpu"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InputError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.dtype not in RESIDUAL_LIMIT:
            raise InputError(f"dtype must be 'float64' or 'float32', got {self.dtype!r}")
        if not isinstance(self.leaf, (int, np.integer)) or isinstance(self.leaf, bool) or self.leaf < 1:
            raise InputError(f"leaf must be an integer >= 1, got {self.leaf!r}")
        if not isinstance(self.check, (bool, np.bool_)):
            raise InputError(f"check must be True or False, got {self.check!r}")
        if not isinstance(self.device, (str, torch.device)):
            raise InputError(f"device must be 'cpu', 'cuda', 'cuda:N' or 'auto', got {self.device!r}")
        resolve_device(str(self.device))  # an unknown or unavailable device fails before any work

    @classmethod
    def from_kwargs(cls, options: Mapping[str, Any]) -> SolveOptions:
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise InputError(f"unknown option(s) {', '.join(unknown)}; known: {', '.join(known)}")
        return cls(**options)


def ssi_batch_solver(stencil: np.ndarray, dtype: str, leaf: int,
                     device: str | torch.device = "cpu") -> tuple[SSIBatchSolve, SSIFactor]:
    """Factorise stencils ``[B, H, W, 3, 3]`` with SSI on `device`; the solver maps b [B, N, C] to x [B, N, C].

    A NumPy `b` gives float64 NumPy `x` (the file and SciPy side); a tensor `b` gives `x` as a tensor
    on the factor's device in its working dtype, so torch callers never pay a copy to the host.
    """
    factor = SSIFactor(torch.from_numpy(stencil), dtype=getattr(torch, dtype), leaf=leaf,
                       device=resolve_device(str(device)))
    shape = stencil.shape[:3]

    def solve(b: np.ndarray | torch.Tensor, transpose: bool) -> np.ndarray | torch.Tensor:
        if isinstance(b, torch.Tensor):
            return factor.solve(b.reshape(*shape, -1), transpose=transpose).reshape(b.shape)
        x = factor.solve(torch.from_numpy(b.reshape(*shape, -1)), transpose=transpose)
        return x.to("cpu", torch.float64).numpy().reshape(b.shape)

    return solve, factor


def sparse_batch_solver(mats: list[sp.csr_matrix], backend: str) -> tuple[BatchSolve, str]:
    """Factorise each matrix with `SparseDirect`; returns the solver and the backend used."""
    factors = [SparseDirect(a, backend) for a in mats]

    def solve(b: np.ndarray, transpose: bool) -> np.ndarray:
        return np.stack([f.solve(bi, transpose).reshape(bi.shape) for f, bi in zip(factors, b)])

    return solve, factors[0].backend


def relative_residuals(mats: list[sp.csr_matrix], x: np.ndarray, b: np.ndarray) -> list[float]:
    """``||A_i x_i - b_i|| / ||b_i||`` per system (``||A_i x_i||`` when b_i = 0), in float64."""
    out = []
    for a, xi, bi in zip(mats, x, b):
        norm = np.linalg.norm(bi)
        out.append(float(np.linalg.norm(a @ xi - bi) / (norm if norm > 0 else 1.0)))
    return out


def residual_error(residual: float, limit: float, hint: str = "") -> SingularMatrixError:
    """The error for a solve whose relative residual exceeds `limit` (NaN included)."""
    return SingularMatrixError(f"solve failed the residual check: ||Ax-b||/||b|| = {residual:.2e} > {limit:.0e} "
                               f"(matrix singular or too ill-conditioned){hint}")


def choose_grid(a: sp.csr_matrix, grid_shape: Any, method: str) -> tuple[int, int] | None:
    """The SSI grid for a checked square matrix, or None for the sparse direct methods.

    Raises InputError when SSI is asked for (method "auto" or "ssi") and the grid is neither given
    nor the inferable square one, or when the matrix does not fit the given grid.
    """
    n = a.shape[0]
    given = check_grid_shape(grid_shape, n) if grid_shape is not None else None
    if method in ("superlu", "pardiso"):
        return None
    general = "or method='superlu' for a general sparse matrix"
    if given is not None:
        if min(given) < 2:
            raise InputError(f"SSI needs a grid of at least 2x2 nodes, got grid_shape {given[0]}x{given[1]}; "
                             f"use method='superlu'")
        if not fits_grid(a, *given):
            raise InputError(f"matrix is not a 9-point matrix on the {given[0]}x{given[1]} grid of grid_shape "
                             f"(a node couples to one more than one step away); check grid_shape, {general}")
        return given
    side = math.isqrt(n)
    if side * side != n or side < 2:
        raise InputError(f"cannot infer the grid of a {n}x{n} matrix ({n} is not a square number >= 4, and "
                         f"only square grids are inferred): pass grid_shape=(H, W) with H*W = {n}, {general}")
    if not fits_grid(a, side, side):
        raise InputError(f"matrix is not a 9-point matrix on the {side}x{side} grid (the only grid inferred "
                         f"for {n} unknowns): pass grid_shape=(H, W) with H*W = {n}, {general}")
    return side, side


class Factorized:
    """A factorisation of one square matrix, computed once; call it for any number of right-hand sides.

    Build it with `factorized`. ``solve(b)`` takes ``b`` of shape ``[N]`` or ``[N, K]`` (K right-hand
    sides solved together, as in SciPy) and returns ``x`` of the same shape: float64 NumPy for an
    array ``b``, and for a torch tensor ``b`` a tensor on the factorisation's device (SSI: in its
    working dtype; the sparse direct solvers: float64 on ``b``'s device).

    Attributes
    ----------
    method : str
        "ssi", "superlu" or "pardiso": what was factorised.
    grid : tuple[int, int] or None
        The SSI grid (H, W).
    dtype : str
        Working precision of the factorisation.
    device : torch.device
        Where SSI factorised (the CPU for the sparse direct solvers).
    """

    def __init__(self, a: Any, grid_shape: Any = None, options: SolveOptions | None = None) -> None:
        options = options or SolveOptions()
        self._a = as_csr(a)
        self.shape: tuple[int, int] = self._a.shape
        self.grid = choose_grid(self._a, grid_shape, options.method)
        self._check = bool(options.check)
        self._ssi: SSIFactor | None = None
        device = resolve_device(str(options.device))
        if self.grid is not None:
            stencil = csr_to_stencil(self._a, *self.grid)[None]
            self._solve, self._ssi = ssi_batch_solver(stencil, options.dtype, int(options.leaf), device)
            self.method, self.dtype, self.device = "ssi", options.dtype, device
        else:
            self._solve, self.method = sparse_batch_solver([self._a], options.method)
            self.dtype, self.device = "float64", torch.device("cpu")
            if options.dtype != "float64":
                warnings.warn(f"dtype={options.dtype!r} applies to SSI only; {self.method} works in float64",
                              SolverWarning, stacklevel=3)
            if device.type != "cpu":
                warnings.warn(f"device={options.device!r} applies to SSI only; {self.method} runs on the CPU",
                              SolverWarning, stacklevel=3)

    def solve(self, b: Any, transpose: bool = False) -> np.ndarray:
        """Solve ``A x = b`` (or ``A^T x = b``) for ``b`` ``[N]`` or ``[N, K]``; a sparse b is densified."""
        n = self.shape[0]
        if isinstance(b, torch.Tensor):
            return self._solve_tensor(b, bool(transpose))
        if sp.issparse(b):
            b = as_csr(b, "right-hand side", square=False).toarray()
        flat, shape = rhs_matrix(b, n)
        x = self._solve(flat[None], bool(transpose))
        self._check_residual(x, flat[None], bool(transpose))
        return x[0].reshape(shape)

    def _solve_tensor(self, b: torch.Tensor, transpose: bool) -> torch.Tensor:
        """The torch path of `solve`: x stays a tensor on the device; only the residual check visits SciPy."""
        n = self.shape[0]
        if b.is_complex() or b.dtype == torch.bool:
            raise InputError(f"right-hand side must be real numbers, got dtype {b.dtype}")
        if b.ndim not in (1, 2) or b.shape[0] != n or (b.ndim == 2 and b.shape[1] == 0):
            raise InputError(f"right-hand side has shape {list(b.shape)} but the matrix has {n} rows "
                             f"(expected [{n}] or [{n}, C])")
        if b.is_floating_point() and not bool(torch.isfinite(b).all()):
            raise InputError("right-hand side contains NaN or Inf")
        flat = b.reshape(n, -1)
        if self._ssi is not None:
            x = self._solve(flat[None], transpose)
        else:
            host = self._solve(flat.detach().to("cpu", torch.float64).numpy()[None], transpose)
            x = torch.from_numpy(host).to(b.device)
        if self._check:
            self._check_residual(x.detach().to("cpu", torch.float64).numpy(),
                                 flat.detach().to("cpu", torch.float64).numpy()[None], transpose)
        return x[0].reshape(b.shape)

    def _check_residual(self, x: np.ndarray, b: np.ndarray, transpose: bool) -> None:
        if not self._check:
            return
        a = self._a.T.tocsr() if transpose else self._a
        residual = relative_residuals([a], x, b)[0]
        if not residual <= RESIDUAL_LIMIT[self.dtype]:  # `not <=` so that NaN fails too
            raise residual_error(residual, RESIDUAL_LIMIT[self.dtype])

    def __call__(self, b: Any) -> np.ndarray:
        return self.solve(b)

    def nbytes(self) -> int | None:
        """Memory held by an SSI factorisation (None for the sparse direct solvers)."""
        return self._ssi.nbytes() if self._ssi is not None else None

    def __repr__(self) -> str:
        grid = f", grid={self.grid[0]}x{self.grid[1]}" if self.grid else ""
        where = f", device='{self.device}'" if self.device.type != "cpu" else ""
        return (f"Factorized({self.shape[0]}x{self.shape[1]}, method={self.method!r}, dtype={self.dtype!r}"
                f"{grid}{where})")


def factorized(A: Any, grid_shape: Any = None, **options: Any) -> Factorized:
    """Factorise ``A`` once; the result solves ``A x = b`` when called with ``b``.

    Parameters
    ----------
    A : scipy sparse matrix or array (any format), or a dense 2-D array-like
        Square, real and finite. Its structure is checked before any compiled code runs.
    grid_shape : (H, W), optional
        The 2-D grid of a 9-point matrix, node (y, x) being unknown ``y * W + x``. Needed for SSI
        unless N is a perfect square and A fits the square grid.
    **options
        See `SolveOptions`: ``method``, ``dtype``, ``leaf``, ``check``, ``device``.

    Returns
    -------
    Factorized
        ``solve(b)`` for ``b`` ``[N]`` or ``[N, K]``; ``solve.solve(b, transpose=True)`` solves with A^T.
        With ``device="cuda"``, pass ``b`` as a tensor to keep ``x`` on the GPU.

    Raises
    ------
    InputError
        A malformed or non-square matrix, an unknown option, a wrong grid_shape, or SSI asked for
        without a grid (pass grid_shape, or method="superlu").
    SingularMatrixError
        A is singular to working precision (at factorisation, or when a solve fails the residual check).
    BackendError
        ``device`` names a CUDA device that torch cannot see.

    Examples
    --------
    >>> t = sp.diags([-1.0, 2.5, -1.0], [-1, 0, 1], shape=(5, 5))
    >>> a = sp.kronsum(t, t).tocsr()  # 5x5 grid, 25 unknowns: the square grid is inferred
    >>> solve = factorized(a)
    >>> b = np.arange(50.0).reshape(25, 2)
    >>> bool(np.allclose(a @ solve(b), b)), solve.method
    (True, 'ssi')
    """
    return Factorized(A, grid_shape, SolveOptions.from_kwargs(options))


def spsolve(A: Any, b: Any, grid_shape: Any = None, **options: Any) -> np.ndarray:
    """Solve ``A x = b`` once; ``x`` has b's shape (``[N]`` or ``[N, K]``). See `factorized`.

    Examples
    --------
    >>> a = sp.kronsum(sp.diags([-1.0, 2.5, -1.0], [-1, 0, 1], shape=(3, 3)),
    ...                sp.diags([-1.0, 2.5, -1.0], [-1, 0, 1], shape=(4, 4))).tocsr()  # 4 rows of 3
    >>> b = np.ones(12)
    >>> bool(np.allclose(a @ spsolve(a, b, grid_shape=(4, 3)), b))
    True
    """
    opts = SolveOptions.from_kwargs(options)
    a = as_csr(A)
    if not sp.issparse(b):
        rhs_matrix(b, a.shape[0])  # a bad b fails here, before the factorisation is paid for
    return Factorized(a, grid_shape, opts).solve(b)
