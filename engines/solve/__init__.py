"""`mlx solve`: direct solvers for sparse linear systems, led by the Schwarz–Schur involution (SSI).

SSI factorises linear systems on 2-D grids whose couplings stay within a 9-point stencil with batched
dense linear algebra; other matrices go to a general sparse direct solver (`fallback`).
`factorized(A)` (a `LinearOperator` for A^-1) and `spsolve(A, b)` are the matrix-level entry points,
drop-ins for `scipy.sparse.linalg`'s.
"""

from mlxkit.engines.solve.autograd import solve_stencil
from mlxkit.engines.solve.grid import apply_stencil, csr_to_stencil, infer_grid, stencil_to_csr
from mlxkit.engines.solve.matrix import (Factorized, SolveInfo, SolveOptions, SparseFallbackWarning, factorized,
                                         spsolve)
from mlxkit.engines.solve.ssi import SSIFactor, LinearSolveWarning

__all__ = ["Factorized", "SSIFactor", "SolveInfo", "SolveOptions", "LinearSolveWarning", "SparseFallbackWarning",
           "apply_stencil", "csr_to_stencil", "factorized", "infer_grid", "solve_stencil", "spsolve", "stencil_to_csr"]
