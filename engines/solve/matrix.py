"""Matrix-level solves shaped like `scipy.sparse.linalg`: `factorized(A)` and `spsolve(A, b)`.

A matrix is solved by SSI when it is a 9-point matrix on a 2-D grid, and by the general sparse
direct solver (`fallback`) otherwise. The grid is ``grid_shape=(H, W)`` when given (node ``(y, x)``
is unknown ``y * W + x``); without it, W is read from the sparsity pattern (the outer diagonals of a
row-major grid sit at offsets ±W, and ±W±1 for a 9-point stencil) and H = N / W (`grid.infer_grid`).
A matrix with no grid falls back to the sparse direct solver with a `SparseFallbackWarning`, where
SciPy's `factorized` would simply work. `mlx solve` (`runner`) builds its solvers with the same
functions (`ssi_batch_solver`, `sparse_batch_solver`, `RefinedSolve`) and checks residuals the same way.

``dtype="float32"`` stores and applies the SSI factor in float32 (half the memory and time) and
recovers float64 accuracy by iterative refinement: ``r = b - A x`` in float64 with the sparse A,
``x += F^-1 r`` with the float32 factor F, for up to ``refine`` steps (`refine_solution`).

Every matrix passes `validate` first: SciPy's compiled kernels trust `indices`/`indptr`, so a
malformed matrix would crash the process instead of raising.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping, TypeVar

import numpy as np
import scipy.sparse as sp
import torch
from scipy.sparse.linalg import LinearOperator

from mlxkit.engines.errors import InputError, SingularMatrixError
from mlxkit.engines.solve.fallback import SparseDirect
from mlxkit.engines.solve.grid import apply_stencil, csr_to_stencil, fits_grid, infer_grid
from mlxkit.engines.solve.ssi import LinearSolveWarning, SSIFactor
from mlxkit.engines.solve.validate import as_csr, grid_shape as check_grid_shape, rhs_matrix, sparse_parts
from mlxkit.engines.training.device import resolve_device

__all__ = ["Factorized", "SolveInfo", "SolveOptions", "SparseFallbackWarning", "factorized", "spsolve"]

METHODS = ("auto", "ssi", "superlu", "pardiso")
# Relative residual ||Ax - b|| / ||b|| above which a solve is reported as singular or too
# ill-conditioned instead of returned; float32 is SSI's reduced-precision mode (~1e-6 typical).
# The limit follows the factor's precision, refined or not: it catches garbage, it is no accuracy target.
RESIDUAL_LIMIT = {"float64": 1e-6, "float32": 1e-2}
# Refinement steps when none are asked for. A float32 SSI solve of Poisson leaves ~3e-6 and each step
# gains ~5 digits (measured, random b: 65^2 1.9e-6, 8.3e-12, 1.4e-15 vs 4.0e-15 for the float64 solve;
# 257^2 3.8e-6, 6.2e-11, 3.9e-15 vs 7.5e-15), so two steps reach float64 level on small grids. The
# condition grows like N, and each step gains less on larger grids (4097^2 Poisson: 5.6e-10 after
# three). The loop stops once a step no longer halves the residual, so the spare steps of a small
# grid cost at most one solve.
DEFAULT_REFINE = {"float64": 0, "float32": 8}
# SciPy's spelling of a solve with A (N) or its transpose (T); H is T for a real matrix.
TRANS = {"N": False, "T": True, "H": True}
# Values per dense column block when a sparse right-hand side is solved (32 MiB of float64).
_SPARSE_BLOCK_VALUES = 2**22

# Solves right-hand sides [B, N, C] of B systems at once, plain (False) or transposed (True).
BatchSolve = Callable[[np.ndarray, bool], np.ndarray]
SSIBatchSolve = Callable[["np.ndarray | torch.Tensor", bool], "np.ndarray | torch.Tensor"]
Array = TypeVar("Array", np.ndarray, torch.Tensor)


def refine_target(unknowns: int) -> float:
    """The relative residual at which refinement stops: sqrt(N) float64 epsilons, about where a float64
    direct solve lands (SSI measured: 1.5e-14 at 257^2, 3.4e-14 at 1025^2, 1.6e-13 at 2049^2)."""
    return float(np.sqrt(max(1, unknowns)) * np.finfo(np.float64).eps)


class SparseFallbackWarning(LinearSolveWarning):
    """The matrix is not a 9-point matrix on any 2-D grid, so the general sparse direct solver was used."""


@dataclass(frozen=True)
class SolveOptions:
    """Expert knobs of `factorized` / `spsolve`, passed as keyword arguments.

    method : "auto" | "ssi" | "superlu" | "pardiso"
        "auto": SSI when the matrix is a grid matrix, else the sparse direct solver (with a
        `SparseFallbackWarning`); "ssi" insists on SSI; the others use the sparse direct solver.
    dtype : "float64" | "float32"
        Precision the SSI factor is stored and applied in; the sparse direct solvers always work in float64.
    refine : int >= 0, optional
        At most this many iterative-refinement steps per solve (residual in float64 with the sparse A,
        correction solved with the factor); stops early once a step no longer halves the residual.
        Default: `DEFAULT_REFINE` of the factor's precision (at most 8 for float32, 0 for float64).
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
    refine: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InputError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.dtype not in RESIDUAL_LIMIT:
            raise InputError(f"dtype must be 'float64' or 'float32', got {self.dtype!r}")
        if not isinstance(self.leaf, (int, np.integer)) or isinstance(self.leaf, bool) or self.leaf < 1:
            raise InputError(f"leaf must be an integer >= 1, got {self.leaf!r}")
        if not isinstance(self.check, (bool, np.bool_)):
            raise InputError(f"check must be True or False, got {self.check!r}")
        if self.refine is not None and (not isinstance(self.refine, (int, np.integer))
                                        or isinstance(self.refine, (bool, np.bool_)) or self.refine < 0):
            raise InputError(f"refine must be an integer >= 0 (or None for the default), got {self.refine!r}")
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


def trans_flag(trans: Any) -> bool:
    """SciPy's ``trans`` ('N' or 'T'; 'H' is 'T' for a real matrix) as "solve with A^T"."""
    if not isinstance(trans, str) or trans not in TRANS:
        raise InputError(f"trans must be 'N' (solve A x = b) or 'T' (A^T x = b), got {trans!r}")
    return TRANS[trans]


def ssi_batch_solver(stencil: np.ndarray, dtype: str, leaf: int,
                     device: str | torch.device = "cpu") -> tuple[SSIBatchSolve, SSIFactor]:
    """Factorise stencils ``[B, H, W, 3, 3]`` with SSI on `device`; the solver maps b [B, N, C] to x [B, N, C].

    A NumPy `b` gives float64 NumPy `x` (the file and SciPy side); a tensor `b` gives `x` as a tensor
    on the factor's device in its working dtype, so torch callers never pay a copy to the host.
    """
    factor = SSIFactor(torch.from_numpy(stencil), dtype=getattr(torch, dtype), leaf=leaf,
                       device=resolve_device(str(device)))
    shape = stencil.shape[:3]
    low = dtype == "float32"

    def solve(b: np.ndarray | torch.Tensor, transpose: bool) -> np.ndarray | torch.Tensor:
        tensor = isinstance(b, torch.Tensor)
        scale = None
        if low:
            # float32 spans ~1e-38..3e38: each column scaled to max |b| = 1 enters the factor without
            # under- or overflow, which matters for refinement residuals that shrink towards 1e-16 |b|.
            peak = b.abs().amax(1, keepdim=True) if tensor else np.abs(b).max(axis=1, keepdims=True)
            scale = peak + (peak == 0)
            b = b / scale
        if tensor:
            x = factor.solve(b.reshape(*shape, -1), transpose=transpose).reshape(b.shape)
            return x if scale is None else x * scale.to(x.dtype)
        x = factor.solve(torch.from_numpy(b.reshape(*shape, -1)), transpose=transpose)
        x = x.to("cpu", torch.float64).numpy().reshape(b.shape)
        return x if scale is None else x * scale

    return solve, factor


def sparse_batch_solver(mats: list[sp.csr_matrix], backend: str) -> tuple[BatchSolve, str]:
    """Factorise each matrix with `SparseDirect`; returns the solver and the backend used."""
    factors = [SparseDirect(a, backend) for a in mats]

    def solve(b: np.ndarray, transpose: bool) -> np.ndarray:
        return np.stack([f.solve(bi, transpose).reshape(bi.shape) for f, bi in zip(factors, b)])

    return solve, factors[0].backend


def relative_residuals(mats: list[sp.csr_matrix], x: np.ndarray, b: np.ndarray) -> list[float]:
    """``||A_i x_i - b_i|| / ||b_i||`` per system (``||A_i x_i||`` when b_i = 0), in float64."""
    return _relative(_residuals(mats, x, b), b).tolist()


def _residuals(mats: list[sp.csr_matrix], x: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.stack([bi - a @ xi for a, xi, bi in zip(mats, x, b)])


def _norms(v: Array) -> Array:
    """Per-system Frobenius norms of ``[B, N, C]``, scaled first: squares of |v| beyond 1e154 or below
    1e-154 would leave float64's range, and refinement residuals of a tiny b get that small."""
    if isinstance(v, torch.Tensor):
        peak = v.abs().amax(dim=(1, 2))
        safe = torch.where(peak > 0, peak, torch.ones_like(peak))
        return peak * torch.linalg.vector_norm(v / safe[:, None, None], dim=(1, 2))
    peak = np.abs(v).max(axis=(1, 2))
    safe = np.where(peak > 0, peak, 1.0)
    return peak * np.sqrt(((v / safe[:, None, None]) ** 2).sum(axis=(1, 2)))


def _relative(r: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per-system ``||r_i|| / ||b_i||`` of ``[B, N, C]`` arrays (``||r_i||`` when b_i = 0)."""
    norm_b = _norms(b)
    return _norms(r) / np.where(norm_b > 0, norm_b, 1.0)


def residual_error(residual: float, limit: float, hint: str = "") -> SingularMatrixError:
    """The error for a solve whose relative residual exceeds `limit` (NaN included)."""
    return SingularMatrixError(f"solve failed the residual check: ||Ax-b||/||b|| = {residual:.2e} > {limit:.0e} "
                               f"(matrix singular or too ill-conditioned){hint}")


@dataclass(frozen=True)
class SolveInfo:
    """How one solve ended.

    residuals : tuple of float
        Relative residual ``||b - A x|| / ||b||`` (float64, the largest over a batch of systems) of the
        unrefined solve, then after each accepted refinement step.
    """

    residuals: tuple[float, ...]

    @property
    def residual(self) -> float:
        """The final relative residual."""
        return self.residuals[-1]

    @property
    def refine_steps(self) -> int:
        """Refinement steps applied."""
        return len(self.residuals) - 1


def refine_solution(x: Array, steps: int, residual: Callable[[Array], Array], correct: Callable[[Array], Array],
                    relative: Callable[[Array], np.ndarray], select: Callable[[np.ndarray, Array, Array], Array],
                    target: float = 0.0) -> tuple[Array, SolveInfo]:
    """Iterative refinement of ``x [B, N, C]``: ``x += correct(residual(x))`` for at most `steps` steps.

    `residual` must work in float64 (``b - A x`` with the exact A), `correct` solves with the factor,
    `relative` gives each system's relative residual and `select(mask, new, old)` picks per system.
    A step is kept only for systems whose residual it lowers, and the loop stops once every system's
    residual is at most `target` or no system's residual halves: beyond that point the factor's
    rounding, not the residual's, limits the answer. With ``steps = 0`` this only measures the residual.
    """
    r = residual(x)
    rel = relative(r)
    history = [float(rel.max())]
    for _ in range(steps):
        if not (np.all(np.isfinite(rel)) and rel.max() > target):
            break
        x_new = x + correct(r)
        r_new = residual(x_new)
        rel_new = relative(r_new)
        better = rel_new < rel  # NaN compares False: a system that diverged keeps its iterate
        if not better.any():
            break
        progressing = bool(np.any(better & (rel_new <= 0.5 * rel)))
        x, r = select(better, x_new, x), select(better, r_new, r)
        rel = np.where(better, rel_new, rel)
        history.append(float(rel.max()))
        if not progressing:
            break
    return x, SolveInfo(tuple(history))


def _select_numpy(mask: np.ndarray, new: np.ndarray, old: np.ndarray) -> np.ndarray:
    return np.where(mask[:, None, None], new, old)


class RefinedSolve:
    """A `BatchSolve` followed by float64 refinement against the matrices it factorised.

    `info` describes the most recent call. ``steps = 0`` only measures the residual.
    """

    def __init__(self, solve: BatchSolve, mats: list[sp.csr_matrix], steps: int) -> None:
        self._solve, self._mats, self.steps = solve, mats, int(steps)
        self._transposed: list[sp.csr_matrix] | None = None
        self.info: SolveInfo | None = None

    def __call__(self, b: np.ndarray, transpose: bool) -> np.ndarray:
        if transpose and self._transposed is None:
            self._transposed = [a.T.tocsr() for a in self._mats]
        mats = self._transposed if transpose else self._mats
        x, self.info = refine_solution(self._solve(b, transpose), self.steps,
                                       residual=lambda v: _residuals(mats, v, b),
                                       correct=lambda r: self._solve(r, transpose),
                                       relative=lambda r: _relative(r, b), select=_select_numpy,
                                       target=refine_target(b.shape[1]))
        return x


def choose_grid(a: sp.csr_matrix, grid_shape: Any, method: str) -> tuple[int, int] | None:
    """The SSI grid for a checked square matrix, or None for the sparse direct solver.

    A given grid_shape must fit; otherwise the grid is inferred from the sparsity pattern. Raises
    InputError when the matrix does not fit the given grid, or when method "ssi" finds no grid.
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
    found = infer_grid(a)
    if found is None and method == "ssi":
        raise InputError(f"method='ssi' needs a 9-point matrix on a 2-D grid, and the {n}x{n} matrix's sparsity "
                         f"pattern fits none (its outer diagonals are not at ±W, ±W±1 of an H x W grid with "
                         f"H, W >= 2): pass grid_shape=(H, W), or method='auto' for the general sparse solver")
    return found


class Factorized(LinearOperator):
    """A factorisation of one square matrix A, computed once; a `LinearOperator` for A^-1.

    Build it with `factorized`. ``solve(b)`` (or ``solve.solve(b, trans='N'|'T')``, ``solve @ b``,
    ``solve.matvec(b)``, ``solve.matmat(B)``) takes ``b`` of shape ``[N]`` or ``[N, K]`` and returns
    ``x`` of the same shape; the K right-hand sides of a block are solved in one batched call.
    ``rmatvec`` / ``rmatmat`` apply A^-T. An array ``b`` gives float64 NumPy ``x``; a torch tensor ``b``
    gives a tensor on the factorisation's device (SSI: in its working dtype, or float64 once refined;
    the sparse direct solvers: float64 on ``b``'s device). A sparse ``b`` is refused, as SciPy's
    `factorized` refuses it: use `spsolve` for a sparse x.

    Attributes
    ----------
    shape, dtype
        As a LinearOperator: ``(N, N)`` and float64 (what a solve returns for an array).
    method : str
        "ssi", "superlu" or "pardiso": what was factorised.
    grid : tuple[int, int] or None
        The SSI grid (H, W).
    factor_dtype : str
        Precision the factor is stored and applied in ("float64" or "float32").
    refine : int
        Maximum iterative-refinement steps per solve.
    device : torch.device
        Where SSI factorised (the CPU for the sparse direct solvers).
    info : SolveInfo or None
        Residuals of the most recent solve (None before the first, or with ``check=False, refine=0``).
    """

    def __init__(self, a: Any, grid_shape: Any = None, options: SolveOptions | None = None) -> None:
        options = options or SolveOptions()
        self._a = as_csr(a)
        super().__init__(np.float64, self._a.shape)
        self.grid = choose_grid(self._a, grid_shape, options.method)
        self._check = bool(options.check)
        self._ssi: SSIFactor | None = None
        self._stencils: dict[bool, torch.Tensor] = {}
        self.info: SolveInfo | None = None
        device = resolve_device(str(options.device))
        if self.grid is not None:
            stencil = csr_to_stencil(self._a, *self.grid)[None]
            self._solve, self._ssi = ssi_batch_solver(stencil, options.dtype, int(options.leaf), device)
            self.method, self.factor_dtype, self.device = "ssi", options.dtype, device
        else:
            self._solve, self.method = sparse_batch_solver([self._a], options.method)
            self.factor_dtype, self.device = "float64", torch.device("cpu")
            if options.method == "auto":
                warnings.warn(f"no 2-D grid found in the {self.shape[0]}x{self.shape[0]} matrix (not a 9-point "
                              f"matrix on any H x W grid): using the general sparse direct solver ({self.method})",
                              SparseFallbackWarning, stacklevel=3)
            if options.dtype != "float64":
                warnings.warn(f"dtype={options.dtype!r} applies to SSI only; {self.method} works in float64",
                              LinearSolveWarning, stacklevel=3)
            if device.type != "cpu":
                warnings.warn(f"device={options.device!r} applies to SSI only; {self.method} runs on the CPU",
                              LinearSolveWarning, stacklevel=3)
        self.refine = DEFAULT_REFINE[self.factor_dtype] if options.refine is None else int(options.refine)
        self._host = RefinedSolve(self._solve, [self._a], self.refine) if self.refine or self._check else None

    # -- SciPy's calling conventions -----------------------------------------------------------------

    def solve(self, b: Any, trans: str = "N") -> Any:
        """Solve ``A x = b`` (``trans='N'``) or ``A^T x = b`` (``trans='T'``) for ``b`` ``[N]`` or ``[N, K]``."""
        transposed = trans_flag(trans)
        if isinstance(b, torch.Tensor):
            return self._solve_tensor(b, transposed)
        if sp.issparse(b):
            raise InputError("a sparse right-hand side is not densified implicitly (SciPy's factorized refuses "
                             "it too): pass b.toarray(), or call spsolve(A, b), which returns a sparse x for a "
                             "sparse b")
        flat, shape = rhs_matrix(b, self.shape[0])
        return self._solve_block(flat, transposed).reshape(shape)

    def __call__(self, b: Any) -> Any:
        return self.solve(b)

    def _matvec(self, x: np.ndarray) -> np.ndarray:
        return self.solve(x)

    def _matmat(self, x: np.ndarray) -> np.ndarray:
        return self.solve(x)

    def _rmatvec(self, x: np.ndarray) -> np.ndarray:
        return self.solve(x, trans="T")  # A is real: (A^-1)^H = A^-T

    def _rmatmat(self, x: np.ndarray) -> np.ndarray:
        return self.solve(x, trans="T")

    # -- the solves ----------------------------------------------------------------------------------

    def _solve_block(self, flat: np.ndarray, transposed: bool) -> np.ndarray:
        """``[N, K]`` float64 in, ``[N, K]`` out: one batched solve, refined and checked."""
        if self._host is None:
            return self._solve(flat[None], transposed)[0]
        x = self._host(flat[None], transposed)
        self.info = self._host.info
        self._check_info(self.info)
        return x[0]

    def _solve_sparse(self, b: sp.csc_matrix) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Solve the columns of a sparse ``b`` in dense blocks of bounded size; returns x's (data, rows, cols)."""
        n, k = b.shape
        width = max(1, _SPARSE_BLOCK_VALUES // n)
        data, rows, cols, worst = [], [], [], None
        for lo in range(0, k, width):
            x = self._solve_block(b[:, lo:lo + width].toarray(), False)
            if self.info is not None and (worst is None or not self.info.residual <= worst.residual):
                worst = self.info
            r, c = np.nonzero(x)
            data.append(x[r, c])
            rows.append(r)
            cols.append(c + lo)
        self.info = worst
        return np.concatenate(data), np.concatenate(rows), np.concatenate(cols)

    def _solve_tensor(self, b: torch.Tensor, transposed: bool) -> torch.Tensor:
        """The torch path of `solve`: x stays a tensor on the device, refined there too."""
        n = self.shape[0]
        check_tensor_rhs(b, n)
        flat = b.detach().reshape(n, -1)[None]
        if self._ssi is None:  # the sparse direct solvers live on the host anyway
            host = flat.to("cpu", torch.float64).numpy()
            return torch.from_numpy(self._solve_block(host[0], transposed)).to(b.device).reshape(b.shape)
        x = self._solve(flat, transposed)
        if self.refine or self._check:
            x = self._refine_on_device(x, flat, transposed)
        return x[0].reshape(b.shape)

    def _refine_on_device(self, x: torch.Tensor, b: torch.Tensor, transposed: bool) -> torch.Tensor:
        """Refine (or only measure) an SSI solve ``[1, N, C]`` on the factor's device, residuals in float64."""
        height, width = self.grid
        if transposed not in self._stencils:
            a = self._a.T.tocsr() if transposed else self._a
            self._stencils[transposed] = torch.from_numpy(csr_to_stencil(a, height, width)[None]).to(self.device)
        stencil = self._stencils[transposed]
        b64 = b.to(self.device, torch.float64)
        norm_b = _norms(b64)
        norm_b = torch.where(norm_b > 0, norm_b, torch.ones_like(norm_b))

        def residual(v: torch.Tensor) -> torch.Tensor:
            product = apply_stencil(stencil, v.to(torch.float64).reshape(1, height, width, -1))
            return b64 - product.reshape(b64.shape)

        def relative(r: torch.Tensor) -> np.ndarray:
            return (_norms(r) / norm_b).cpu().numpy()

        def select(mask: np.ndarray, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
            return torch.where(torch.as_tensor(mask, device=new.device)[:, None, None], new, old)

        start = x.to(torch.float64) if self.refine else x  # a refined x carries float64 digits
        with torch.no_grad():
            x, self.info = refine_solution(start, self.refine, residual,
                                           lambda r: self._solve(r, transposed).to(torch.float64), relative, select,
                                           target=refine_target(height * width))
        self._check_info(self.info)
        return x

    def _check_info(self, info: SolveInfo) -> None:
        if not self._check:
            return
        limit = RESIDUAL_LIMIT[self.factor_dtype]
        if not info.residual <= limit:  # `not <=` so that NaN fails too
            raise residual_error(info.residual, limit)

    def nbytes(self) -> int | None:
        """Memory held by an SSI factorisation (None for the sparse direct solvers)."""
        return self._ssi.nbytes() if self._ssi is not None else None

    def __repr__(self) -> str:
        grid = f", grid={self.grid[0]}x{self.grid[1]}" if self.grid else ""
        refine = f", refine={self.refine}" if self.refine else ""
        where = f", device='{self.device}'" if self.device.type != "cpu" else ""
        return (f"Factorized({self.shape[0]}x{self.shape[1]}, method={self.method!r}, "
                f"factor_dtype={self.factor_dtype!r}{refine}{grid}{where})")


def factorized(A: Any, grid_shape: Any = None, **options: Any) -> Factorized:
    """Factorise ``A`` once; the result solves ``A x = b`` when called with ``b``.

    Parameters
    ----------
    A : scipy sparse matrix or array (any format), or a dense 2-D array-like
        Square, real and finite. Its structure is checked before any compiled code runs.
    grid_shape : (H, W), optional
        The 2-D grid of a 9-point matrix, node (y, x) being unknown ``y * W + x``. Without it the grid
        is inferred from the sparsity pattern (W from the outer diagonals, H = N / W); a matrix that
        fits no grid gets the general sparse direct solver and a `SparseFallbackWarning`.
    **options
        See `SolveOptions`: ``method``, ``dtype``, ``refine``, ``leaf``, ``check``, ``device``.

    Returns
    -------
    Factorized
        A `scipy.sparse.linalg.LinearOperator` for A^-1 that is also callable: ``solve(b)`` for ``b``
        ``[N]`` or ``[N, K]``; ``solve.solve(b, trans='T')`` solves with A^T. With ``device="cuda"``,
        pass ``b`` as a tensor to keep ``x`` on the GPU.

    Raises
    ------
    InputError
        A malformed, non-square or complex matrix, an unknown option, a grid_shape the matrix does not
        fit, or method="ssi" for a matrix with no grid.
    SingularMatrixError
        A is singular to working precision (at factorisation, or when a solve fails the residual check).
    BackendError
        ``device`` names a CUDA device that torch cannot see.

    Examples
    --------
    >>> t = sp.diags([-1.0, 2.5, -1.0], [-1, 0, 1], shape=(7, 7))
    >>> a = sp.kronsum(t, sp.diags([-1.0, 2.5, -1.0], [-1, 0, 1], shape=(4, 4))).tocsr()  # 4 rows of 7
    >>> solve = factorized(a)
    >>> b = np.arange(56.0).reshape(28, 2)
    >>> bool(np.allclose(a @ solve(b), b)), solve.method, solve.grid
    (True, 'ssi', (4, 7))
    >>> bool(np.allclose(a.T @ solve.solve(b, trans="T"), b) and np.allclose(solve @ b, solve(b)))
    True
    >>> low = factorized(a, dtype="float32")  # float32 factor, float64 accuracy by refinement
    >>> bool(np.allclose(a @ low(b), b, rtol=1e-12)), low.info.refine_steps > 0
    (True, True)
    """
    return Factorized(A, grid_shape, SolveOptions.from_kwargs(options))


def check_tensor_rhs(b: torch.Tensor, n: int) -> None:
    """Raise InputError unless the tensor b is a real, finite ``[N]`` or ``[N, C]`` right-hand side."""
    if b.is_complex() or b.dtype == torch.bool:
        raise InputError(f"right-hand side must be real numbers, got dtype {b.dtype}")
    if b.ndim not in (1, 2) or b.shape[0] != n or (b.ndim == 2 and b.shape[1] == 0):
        raise InputError(f"right-hand side has shape {list(b.shape)} but the matrix has {n} rows "
                         f"(expected [{n}] or [{n}, C])")
    if b.is_floating_point() and not bool(torch.isfinite(b).all()):
        raise InputError("right-hand side contains NaN or Inf")


def _sparse_rhs(b: Any, n: int) -> sp.csc_matrix:
    """A checked float64 CSC right-hand side ``[N, K]`` from any sparse b (a 1-D sparse array is ``[N, 1]``)."""
    if b.ndim == 1:
        coo = b.tocoo()
        b = {"format": np.str_("coo"), "shape": np.asarray([b.shape[0], 1]), "data": coo.data,
             "row": coo.coords[0], "col": np.zeros_like(coo.coords[0])}
        csr = sparse_parts(b, "right-hand side", square=False).to_csr()
    else:
        csr = as_csr(b, "right-hand side", square=False)
    if csr.shape[0] != n:
        raise InputError(f"right-hand side has shape {list(csr.shape)} but the matrix has {n} rows "
                         f"(expected [{n}] or [{n}, C])")
    if csr.shape[1] == 0:
        raise InputError("right-hand side has no columns")
    return csr.tocsc()


def spsolve(A: Any, b: Any, grid_shape: Any = None, **options: Any) -> Any:
    """Solve ``A x = b`` once, returning x the way `scipy.sparse.linalg.spsolve` does. See `factorized`.

    Dense ``b``: ``[N]`` and ``[N, 1]`` give ``x`` ``[N]``, ``[N, K]`` gives ``[N, K]`` (a torch tensor
    keeps its shape). Sparse ``b``, as in SciPy: a single column gives a dense ``x`` ``[N]``; K > 1
    columns give a sparse ``x`` of A's class when A is CSR or CSC (else ``csc_array``), solved in dense
    column blocks of bounded size, never the whole b at once.

    Examples
    --------
    >>> a = sp.kronsum(sp.diags([-1.0, 2.5, -1.0], [-1, 0, 1], shape=(3, 3)),
    ...                sp.diags([-1.0, 2.5, -1.0], [-1, 0, 1], shape=(4, 4))).tocsr()  # 4 rows of 3
    >>> b = np.ones(12)
    >>> bool(np.allclose(a @ spsolve(a, b), b))
    True
    >>> x = spsolve(a, sp.eye(12, 3, format="csc"))
    >>> type(x).__name__, bool(np.allclose((a @ x).toarray(), np.eye(12, 3)))
    ('csr_matrix', True)
    """
    opts = SolveOptions.from_kwargs(options)
    a = as_csr(A)
    n = a.shape[0]
    # A bad b fails here, before the factorisation is paid for.
    if sp.issparse(b):
        rhs = _sparse_rhs(b, n)
        solver = Factorized(a, grid_shape, opts)
        if rhs.shape[1] == 1:
            return solver.solve(rhs.toarray()[:, 0])
        data, rows, cols = solver._solve_sparse(rhs)
        kind = type(A) if sp.issparse(A) and A.format in ("csr", "csc") else sp.csc_array
        return kind((data, (rows, cols)), shape=rhs.shape)
    if isinstance(b, torch.Tensor):
        check_tensor_rhs(b, n)
        return Factorized(a, grid_shape, opts).solve(b)
    flat, shape = rhs_matrix(b, n)
    x = Factorized(a, grid_shape, opts).solve(flat)
    return x[:, 0] if len(shape) == 1 or shape[1] == 1 else x
