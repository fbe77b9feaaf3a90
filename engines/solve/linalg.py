"""Batched dense LU helpers that are safe and fast on CPU.

Two facts about torch's CPU LAPACK bindings shape this module (measured with torch 2.13 on 2 cores):

* `torch.linalg.lu_factor` on a *batch* of matrices of order >= ~150 with more than one intra-op
  thread returns wrong factors (invalid pivots, oneMKL "DLASWP" errors). Single matrices are fine, so
  large blocks are factorised one at a time.
* Batched LAPACK calls (`lu_solve` above all) run ~10x slower with 2 threads than with 1, so
  levels of many small blocks run single-threaded (`one_thread`), and with several threads a batch
  of large blocks is solved one matrix at a time, each call using every thread.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

# Order from which a batch is factorised matrix by matrix (see the module docstring).
_LOOP_FROM = 64
# Only levels with a few blocks of at least this order run multi-threaded (ssi.py).
SMALL = 512


@contextlib.contextmanager
def one_thread(active: bool) -> Iterator[None]:
    """Run a block of batched small-matrix work on one intra-op thread (see the module docstring).

    Switching the thread count is itself slow on a loaded machine, so callers switch once per batch
    of work (one SSI level), not once per operation.
    """
    if not active:
        yield
        return
    before = torch.get_num_threads()
    if before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def lu_factor(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LU with partial pivoting of a batch `[..., n, n]`; returns `(LU, pivots, info)`.

    `info > 0` marks an exactly zero pivot, as in LAPACK. Example:

    >>> a = torch.tensor([[[4.0, 1.0], [2.0, 3.0]]], dtype=torch.float64)
    >>> lu, piv, info = lu_factor(a)
    >>> bool(torch.allclose(lu_solve(lu, piv, torch.eye(2, dtype=a.dtype)[None]) @ a[0], torch.eye(2, dtype=a.dtype)))
    True
    """
    batch = a.shape[:-2]
    n = a.shape[-1]
    count = a[..., 0, 0].numel() if n else 0
    if a.device.type == "cpu" and n >= _LOOP_FROM and count > 1 and torch.get_num_threads() > 1:
        flat = a.reshape(-1, n, n)
        lus, pivs, infos = [], [], []
        for k in range(flat.shape[0]):
            lu, piv, info = torch.linalg.lu_factor_ex(flat[k])
            lus.append(lu)
            pivs.append(piv)
            infos.append(info)
        return (torch.stack(lus).reshape(*batch, n, n), torch.stack(pivs).reshape(*batch, n),
                torch.stack(infos).reshape(batch))
    return torch.linalg.lu_factor_ex(a)


def lu_solve(lu: torch.Tensor, piv: torch.Tensor, rhs: torch.Tensor, adjoint: bool = False) -> torch.Tensor:
    """Solve `A X = rhs` (or `A^T X = rhs` with `adjoint`) from `lu_factor`'s output."""
    if rhs.shape[-1] == 0 or lu.shape[-1] == 0:
        return rhs.clone()
    n = lu.shape[-1]
    count = lu[..., 0, 0].numel()
    if lu.device.type == "cpu" and count > 1 and torch.get_num_threads() > 1:
        # Multi-threaded batched lu_solve is ~10x slower than one matrix at a time (see module docstring).
        flat_lu, flat_piv = lu.reshape(-1, n, n), piv.reshape(-1, n)
        flat_rhs = rhs.expand(*lu.shape[:-2], *rhs.shape[-2:]).reshape(-1, *rhs.shape[-2:])
        out = torch.stack([torch.linalg.lu_solve(flat_lu[k], flat_piv[k], flat_rhs[k], adjoint=adjoint)
                           for k in range(count)])
        return out.reshape(*lu.shape[:-2], *rhs.shape[-2:])
    return torch.linalg.lu_solve(lu, piv, rhs, adjoint=adjoint)


def pivot_ratio(lu: torch.Tensor) -> torch.Tensor:
    """min |U_ii| / max |U_ii| per matrix: a cheap lower bound on how close each block is to singular."""
    diag = lu.diagonal(dim1=-2, dim2=-1).abs()
    top = diag.amax(-1)
    return torch.where(top > 0, diag.amin(-1) / torch.where(top > 0, top, torch.ones_like(top)),
                       torch.zeros_like(top))
