"""Singular systems whose null space is the constants (pure-Neumann Laplacians): the mean-zero solution.

We solve the bordered system ``[[A, 1], [1^T, 0]] [x; lam] = [b; 0]`` without forming it. With one
pinned node k, ``A' = A + d e_k e_k^T`` is nonsingular and keeps A's sparsity; ``l = A'^-T e_k`` is a left
null vector of A (``A^T l = (1 - d l_k) e_k`` and ``1^T A^T l = 0`` force ``d l_k = 1``). Then
``lam = l^T b / l^T 1`` removes the inconsistent part of b, ``y = A'^-1 (b - lam 1)`` solves ``A y = b - lam 1``
exactly (``y_k = 0``), and ``x = y - mean(y)`` is the mean-zero solution.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from mlxkit.engines.errors import InputError

# Solves [B, N, C] right-hand sides with the pinned matrix A' (transposed on request).
BatchSolve = Callable[[np.ndarray, bool], np.ndarray]


def check_constant_nullspace(row_sums: np.ndarray, row_scale: np.ndarray) -> None:
    """Raise InputError unless A 1 = 0 to rounding (row sums small next to the rows' absolute sums)."""
    worst = float(np.max(np.abs(row_sums) / np.maximum(row_scale, np.finfo(float).tiny)))
    if worst > 1e-8:
        raise InputError(f"--nullspace constant needs A·1 = 0, but a row sum is {worst:.1e} of its row's size")


def pin_value(diagonal: np.ndarray) -> float:
    """The value added to the pinned diagonal entry: the matrix's own scale keeps A' well conditioned."""
    return float(np.max(np.abs(diagonal))) or 1.0


class ConstantNullspace:
    """Mean-zero solves with a factorisation of the pinned matrix ``A' = A + d e_k e_k^T``.

    Examples
    --------
    >>> a = np.array([[1.0, -1.0, 0.0], [-1.0, 2.0, -1.0], [0.0, -1.0, 1.0]])  # Neumann path graph
    >>> k, d = 1, 2.0
    >>> pinned = a.copy(); pinned[k, k] += d
    >>> ns = ConstantNullspace(lambda b, t: np.linalg.solve(pinned.T if t else pinned, b[0])[None], 1, 3, k)
    >>> x, lam = ns.solve(np.array([[[1.0], [0.0], [-1.0]]]))
    >>> bool(np.allclose(a @ x[0], [[1.0], [0.0], [-1.0]]) and abs(x.sum()) < 1e-12)
    True
    """

    def __init__(self, solve: BatchSolve, batch: int, n: int, pinned: int) -> None:
        self._solve = solve
        e = np.zeros((batch, n, 1))
        e[:, pinned] = 1.0
        self.left = solve(e, True)  # [B, N, 1]: left null vectors of A
        self.denominator = self.left.sum(axis=1, keepdims=True)  # l^T 1, [B, 1, 1]

    def solve(self, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Return (x, lam) for ``b [B, N, C]``: ``A x + lam = b`` and ``sum(x) = 0`` per column."""
        lam = (self.left * b).sum(axis=1, keepdims=True) / self.denominator
        y = self._solve(b - lam, False)
        return y - y.mean(axis=1, keepdims=True), lam[:, 0, :]
