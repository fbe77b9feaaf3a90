"""Batched dense LU helpers that are safe and fast on CPU.

Two facts about torch's CPU LAPACK bindings shape this module (measured with torch 2.13 on 2 cores):

* `torch.linalg.lu_factor` on a *batch* of matrices of order >= ~150 with more than one intra-op
  thread returns wrong factors (invalid pivots, oneMKL "DLASWP" errors). Single matrices are fine, so
  large blocks are factorised one at a time.
* Batched LAPACK calls (`lu_solve` above all) run ~10x slower with 2 threads than with 1, so every
  kernel runs on one intra-op thread (`one_intra_op_thread`) and parallelism comes from `BlockWorkers`, which
  hands disjoint blocks of a level to Python threads (1.7x on 2 cores at 1025^2). With several intra-op
  threads anyway, a batch of large blocks is solved one matrix at a time, each call using every thread.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

import torch

T = TypeVar("T")

# Order from which a batch is factorised matrix by matrix (see the module docstring).
_LOOP_FROM = 64
# Work memory of one range of blocks (`BlockWorkers.split`): the dense matrices a range assembles
# live at once, so bounding them bounds the factorisation's transient peak (at 2049^2 in float64
# the leaf step alone would otherwise assemble 1.4 GB of patch matrices at once). Each range is
# also a piece that solves loop over, so the bound is a few hundred MiB rather than a few MiB.
CHUNK_BYTES = 256 * 2**20


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


class BlockWorkers:
    """Run independent batches of block work on several Python threads, each on one intra-op thread.

    torch releases the GIL inside its kernels, so two threads that each eliminate half of a level's
    blocks overlap almost fully, where torch's own intra-op threading over a batch of small LAPACK
    calls is slower than one thread (module docstring). Thread-local state that the work relies on
    (one intra-op thread, grad mode off, flush-to-zero for fp32) is set in every worker.
    """

    def __init__(self, workers: int, flush_denormal: bool = False) -> None:
        self.workers = max(1, int(workers))
        self._pool = None
        if self.workers > 1:
            self._pool = ThreadPoolExecutor(self.workers, initializer=self._init_thread, initargs=(flush_denormal,))

    @staticmethod
    def _init_thread(flush_denormal: bool) -> None:
        torch.set_num_threads(1)
        torch.set_flush_denormal(flush_denormal)

    def split(self, count: int, item_bytes: int = 0) -> list[tuple[int, int]]:
        """Contiguous ranges covering 0..count: one per worker, more when a range's work memory
        (`item_bytes` per item) would pass `CHUNK_BYTES`; never more ranges than items."""
        parts = min(self.workers, count) if self._pool is not None else 1
        parts = min(max(parts, -(-count * item_bytes // CHUNK_BYTES)), max(1, count))
        edges = [count * k // max(1, parts) for k in range(parts + 1)]
        return [(lo, hi) for lo, hi in zip(edges[:-1], edges[1:])] or [(0, 0)]

    def map(self, jobs: list[Callable[[], T]]) -> list[T]:
        """Results of `jobs`, in order; the first exception raised by a job propagates."""
        if self._pool is None or len(jobs) < 2:
            return [job() for job in jobs]
        futures = [self._pool.submit(self._no_grad, job) for job in jobs]
        return [f.result() for f in futures]

    @staticmethod
    def _no_grad(job: Callable[[], T]) -> T:
        with torch.no_grad():
            return job()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
