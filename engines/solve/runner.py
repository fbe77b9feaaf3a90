"""`mlx solve`: read a system, pick SSI or the sparse fallback, solve, check the residual, write `x`."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch

from mlxkit.engines.core.atomic import atomic_file
from mlxkit.engines.core.memory import keep_freed_memory
from mlxkit.engines.core.progress import Reporter
from mlxkit.engines.errors import InputError, NonFiniteError
from mlxkit.engines.solve.grid import (csr_to_stencil, fits_grid, infer_grid, is_symmetric_stencil, stencil_mask,
                                       stencil_to_csr)
from mlxkit.engines.solve.io import Problem, read_problem
from mlxkit.engines.solve.matrix import (DEFAULT_REFINE, METHODS, RESIDUAL_LIMIT, RefinedSolve, relative_residuals,
                                         residual_error, sparse_batch_solver, ssi_batch_solver)
from mlxkit.engines.solve.nullspace import ConstantNullspace, check_constant_nullspace, pin_value
from mlxkit.engines.solve.ssi import factor_bytes
from mlxkit.engines.training.budget import machine_memory_bytes
from mlxkit.engines.training.device import resolve_device


def parse_grid(text: str | None) -> tuple[int, int] | None:
    """'HxW' -> (H, W)."""
    if text is None:
        return None
    parts = text.lower().replace("*", "x").split("x")
    # isascii: str.isdigit also accepts characters such as '²' that int() refuses
    if len(parts) != 2 or not all(p.strip().isascii() and p.strip().isdigit() for p in parts) \
            or min(int(p) for p in parts) < 1:
        raise InputError(f"--grid must look like HxW (e.g. 513x513), got '{text}'")
    return int(parts[0]), int(parts[1])


def _pick_grid(problem: Problem, grid: tuple[int, int] | None, notices: list[str]) -> np.ndarray | None:
    """The stencil `[B, H, W, 3, 3]` when the system is a 9-point grid system, else None (with a notice why)."""
    if problem.stencil is not None:
        return problem.stencil
    a, n = problem.matrix, problem.matrix.shape[0]
    a.eliminate_zeros()
    if grid is not None and grid[0] * grid[1] != n:
        raise InputError(f"--grid {grid[0]}x{grid[1]} has {grid[0] * grid[1]} nodes but the matrix has {n} rows")
    hw = grid or problem.grid
    if hw is not None and not fits_grid(a, *hw):
        notices.append(f"matrix is not a 9-point matrix on the {hw[0]}x{hw[1]} grid")
        return None
    if hw is None:
        hw = infer_grid(a)
        if hw is None:
            notices.append("no 2-D grid structure found in the matrix (not a 9-point grid matrix)")
            return None
        notices.append(f"grid {hw[0]}x{hw[1]} inferred from the diagonal offsets")
    if min(hw) < 2:
        notices.append(f"grid {hw[0]}x{hw[1]} is one-dimensional")
        return None
    return csr_to_stencil(a, *hw)[None]


def _matrices(problem: Problem) -> list[sp.csr_matrix]:
    if problem.matrix is not None:
        return [problem.matrix]
    return [stencil_to_csr(s) for s in problem.stencil]


def _pin(problem: Problem, stencil: np.ndarray | None, notices: list[str]) -> tuple[Problem, np.ndarray | None, int]:
    """Check A 1 = 0 and add d to one diagonal entry; returns the pinned problem and the pinned node."""
    if stencil is not None:
        masked = stencil * stencil_mask(*stencil.shape[1:3])
        check_constant_nullspace(masked.sum((-1, -2)), np.abs(masked).sum((-1, -2)))
        height, width = stencil.shape[1:3]
        k = (height // 2) * width + width // 2
        pinned = stencil.copy()
        pinned[:, height // 2, width // 2, 1, 1] += pin_value(stencil[..., 1, 1])
        return problem, pinned, k
    a = problem.matrix
    check_constant_nullspace(np.asarray(a.sum(axis=1)).ravel(), np.asarray(abs(a).sum(axis=1)).ravel())
    k = a.shape[0] // 2
    pinned = (a + sp.csr_matrix(([pin_value(a.diagonal())], ([k], [k])), shape=a.shape)).tocsr()
    return Problem(source=problem.source, b=problem.b, rhs_shape=problem.rhs_shape, matrix=pinned,
                   grid=problem.grid), None, k


def check_finite_solution(x: np.ndarray) -> None:
    """Refuse a solution with NaN or infinite entries before any residual is computed from it.

    A finite system can still give one: x of a system scaled by 1e-300 with b near 1 passes
    float64's 1.8e308, and its residual is then NaN, which says nothing about the matrix.
    """
    bad = ~np.isfinite(x)
    if bad.any():
        finite = np.abs(x[~bad])
        peak = f"; its finite entries reach {finite.max():.1e}" if finite.size else ""
        raise NonFiniteError(f"the solution has {int(bad.sum())} NaN or infinite entries of {x.size} (it leaves "
                             f"float64's range{peak}); rescale the system; nothing was written")


def _save(out: Path, x: np.ndarray, report: dict, overwrite: bool) -> None:
    """Write the npz atomically: it appears whole or not at all; every number in it is finite."""
    check_finite_solution(x)
    for key in ("residual", "factor_s", "solve_s"):
        if not np.isfinite(report[key]):
            raise NonFiniteError(f"the solve's {key} is {report[key]}; nothing was written")
    out = Path(out)
    if out.exists() and not overwrite:
        raise InputError(f"output '{out}' already exists (pass --overwrite to replace it)")
    with atomic_file(out, overwrite=overwrite) as tmp:
        np.savez(tmp, x=x, residual=np.float64(report["residual"]), method=np.str_(report["method"]),
                 factor_s=np.float64(report["factor_s"]), solve_s=np.float64(report["solve_s"]),
                 report=np.str_(json.dumps(report)))


# Share of the machine's memory up to which a factorisation keeps freed memory in the heap. Reusing
# warm pages makes each elimination level faster (page faults were a third of the factor time at
# 1025^2), but a heap that never shrinks fragments: at 4097^2 in float64 the peak was 22.5 GB with
# the kept heap and 19.9 GB with glibc's defaults, whose 117 s factor against 65 s is the price.
_KEEP_FREED_SHARE = 0.4


def _tune_allocator(stencil: np.ndarray, dtype: str, leaf: int) -> None:
    batch, height, width = stencil.shape[:3]
    symmetric = is_symmetric_stencil(torch.from_numpy(stencil))
    stored, levels = factor_bytes(height, width, batch=batch, dtype=getattr(torch, dtype), symmetric=symmetric,
                                  leaf=leaf)
    total = machine_memory_bytes()
    if total is None or stored + levels <= _KEEP_FREED_SHARE * total:
        keep_freed_memory()


def run_solve(path: str | os.PathLike, *, rhs: str | os.PathLike | None = None, grid: str | None = None,
              method: str = "auto", nullspace: str = "none", precision: str = "float64", leaf: int = 4,
              refine: int | None = None, out: str | os.PathLike | None = None, overwrite: bool = False,
              device: str = "cpu", reporter: Reporter | None = None,
              tune_allocator: bool = False) -> tuple[dict, np.ndarray]:
    """Solve the system in `path`; returns (report, x) and writes `out` when given.

    SSI factorises and solves on `device` (`auto | cpu | cuda | cuda:N`); the sparse direct
    solvers always run on the CPU. `x` comes back to the host once, for the residual check and
    the file. The report has the method, device, timings, grid, sizes and the relative residual
    ``||Ax - b|| / ||b||`` (the largest over the batch), which is always computed in float64.

    `refine` caps the iterative-refinement steps (default `DEFAULT_REFINE` of the factor's precision:
    8 for a float32 SSI factor, 0 otherwise); with any, the report's ``refine`` gives the steps taken
    and the residual before them (``residual`` stays the final one).

    `tune_allocator` is for a caller that owns its process (the CLI): an SSI factorisation on the CPU
    then keeps freed memory in the heap (`keep_freed_memory`), unless its factor would fill more than
    `_KEEP_FREED_SHARE` of the machine.
    """
    reporter = reporter or Reporter()
    compute = resolve_device(device)  # a missing GPU fails before the system is read
    if method not in METHODS:
        raise InputError(f"--method must be one of {', '.join(METHODS)}, got '{method}'")
    if nullspace not in ("none", "constant"):
        raise InputError(f"--nullspace must be 'none' or 'constant', got '{nullspace}'")
    if precision not in RESIDUAL_LIMIT:
        raise InputError(f"--precision must be float64 or float32, got '{precision}'")
    if refine is not None and (isinstance(refine, bool) or not isinstance(refine, int) or refine < 0):
        raise InputError(f"--refine must be an integer >= 0, got '{refine}'")
    if out is not None and Path(out).exists() and not overwrite:
        raise InputError(f"output '{out}' already exists (pass --overwrite to replace it)")
    explicit_grid = parse_grid(grid)
    problem = read_problem(path, rhs)
    notices: list[str] = []
    stencil = _pick_grid(problem, explicit_grid, notices) if method in ("auto", "ssi") else None
    if method == "ssi" and stencil is None:
        raise InputError(f"--method ssi needs a 9-point grid matrix: {notices[-1]}")
    for notice in notices:
        reporter.notice(notice)
    original = problem
    pinned_node = None
    if nullspace == "constant":
        problem, pinned, pinned_node = _pin(problem, stencil, notices)
        stencil = pinned if stencil is not None else None
    t0 = time.perf_counter()
    ssi = None
    if stencil is not None:
        if tune_allocator and compute.type == "cpu":
            _tune_allocator(stencil, precision, leaf)
        solve, ssi = ssi_batch_solver(stencil, precision, leaf, compute)
        used = "ssi"
    else:
        solve, used = sparse_batch_solver(_matrices(problem), "auto" if method == "auto" else method)
        late = [f"using the general sparse direct solver ({used})"] if method == "auto" else []
        late += [f"{used} always works in float64"] if precision != "float64" else []
        late += [f"{used} runs on the CPU (--device {device} applies to SSI)"] if compute.type != "cpu" else []
        compute = torch.device("cpu")
        for notice in late:
            reporter.notice(notice)
        notices += late
    factor_s = time.perf_counter() - t0
    steps = DEFAULT_REFINE[precision if used == "ssi" else "float64"] if refine is None else refine
    refined = None
    if steps:
        # Refine against what was factorised: the pinned system when --nullspace constant.
        factored = [stencil_to_csr(s) for s in stencil] if stencil is not None else _matrices(problem)
        solve = refined = RefinedSolve(solve, factored, steps)
    t0 = time.perf_counter()
    lam = None
    if pinned_node is not None:
        x, lam = ConstantNullspace(solve, problem.batch, problem.b.shape[1], pinned_node).solve(problem.b)
    else:
        x = solve(problem.b, False)
    solve_s = time.perf_counter() - t0
    check_finite_solution(x)
    mats = _matrices(original)
    residuals = relative_residuals(mats, x, original.b)
    limit = RESIDUAL_LIMIT[precision if used == "ssi" else "float64"]
    checked = residuals if lam is None else relative_residuals(mats, x, original.b - lam[:, None, :])
    if not max(checked) <= limit:
        hint = "" if nullspace == "constant" else "; for a pure-Neumann problem try --nullspace constant"
        raise residual_error(max(checked), limit, hint)
    report = {
        "file": str(path), "method": used, "dtype": precision if used == "ssi" else "float64", "device": str(compute),
        "unknowns": int(problem.b.shape[1]), "systems": int(problem.batch), "rhs_columns": int(problem.b.shape[2]),
        "grid": list(stencil.shape[1:3]) if stencil is not None else None,
        "residual": max(residuals), "residuals": residuals, "factor_s": factor_s, "solve_s": solve_s,
        "notices": notices,
    }
    if ssi is not None:
        report["factor_bytes"] = ssi.nbytes()
        report["min_pivot_ratio"] = float(ssi.min_pivot_ratio.min())
    if refined is not None:
        report["refine"] = {"max_steps": steps, "steps": refined.info.refine_steps,
                            "unrefined_residual": refined.info.residuals[0]}
    if lam is not None:
        report["nullspace"] = "constant"
        report["compatible_residual"] = max(checked)
        report["rhs_inconsistency"] = float(np.abs(lam).max())
    x_out = x.reshape(original.rhs_shape)
    if out is not None:
        report["out"] = str(out)
        _save(Path(out), x_out, report, overwrite)
    return report, x_out
