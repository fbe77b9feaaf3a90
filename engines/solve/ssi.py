"""The Schwarz–Schur involution (SSI) factorisation of 9-point grid systems.

Method (Y. Wang, S. M. Abulnaga, Y. Balbastre, B. Fischl, "Schwarz-Schur Involution: Lightspeed
Differentiable Sparse Linear Solvers", ICML 2025, PMLR 267; the authors' code is
github.com/wangyu9/Schwarz_Schur_Involution):

1. Schwarz step: the matrix is split additively into dense per-patch matrices (couplings shared by
   neighbouring patches are divided between them), and every patch eliminates the nodes it owns
   alone: one batched static condensation for all patches of a geometry.
2. Schur steps: neighbouring subdomains are merged pairwise, alternating the axis; the merged
   subdomain eliminates the interface nodes nobody else shares (a batched Schur complement).
3. The root step eliminates the last separator; back-substitution runs the steps in reverse.

Each elimination of ``[[RR, RS], [SR, SS]]`` stores ``LU(SS)``, ``RS`` and ``T = SS^-1 SR``; the
Schur complement is ``RR - RS T``. No large block is inverted. Those three tensors serve plain and transposed
solves alike, so a factorisation is computed once and re-solves any number of right-hand sides.
A symmetric system keeps no ``T``: its ``SR`` is ``RS^T``, so back-substitution forms ``SS^-1 (RS^T u_R)``
from the other two, which saves the largest stored tensor (``RS`` and ``T`` are each ~45% of the
factor) for one more triangular solve per block.
Blocks with small separators (most blocks of the low levels) store ``SS^-1`` and ``RS SS^-1``
explicitly instead, so that their sweeps are two batched products per block (`_InverseBlock`).

On CPU the blocks of every level are split into contiguous *pieces*, one per worker thread; a piece is
what one thread eliminates (and later solves with), so the stored factors are kept per piece.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from mlxkit.engines.errors import InputError, SingularMatrixError
from mlxkit.engines.core.threads import one_intra_op_thread
from mlxkit.engines.solve.grid import is_symmetric_stencil, stencil_mask
from mlxkit.engines.solve.linalg import BlockWorkers, lu_factor, lu_solve, pivot_ratio
from mlxkit.engines.solve.plan import LeafGroup, MergeGroup, Plan, build_plan
from mlxkit.engines.training.budget import check_fits


# Separators of at most this many nodes are stored as explicit inverses (`_InverseBlock`): the
# blocks are small and well conditioned (a few nodes inside a patch or along a short interface), and
# the solve's cost there is per call, not per flop.
_INVERSE_MAX_SEPARATOR = 32
# Factor size from which solves also use the worker threads (see `SSIFactor.solve`).
_THREADED_SOLVE_BYTES = 512 * 2**20


class LinearSolveWarning(UserWarning):
    """A solve finished, but its result deserves a second look (e.g. a large residual)."""


def pivot_tolerance(dtype: torch.dtype, unknowns: int) -> float:
    """Smallest LU pivot ratio (min/max |U_ii| of a block) accepted as nonsingular.

    For a singular system (pure-Neumann Laplacian) the root pivot ratio is rounding noise that grows
    like ~0.1 eps N (measured: 4.6e-12 at 513^2 in fp64); a well-posed 2-D problem stays >= 1e-3 but
    not far above it on large grids (9.4e-3 for the variable-coefficient 9-point benchmark at 4097^2
    in fp32), so the threshold never exceeds 1e-3. From N ~ 0.01 / eps (fp32: ~300^2) the noise can
    pass that, and a singular float32 system is left to the residual check of the refined solve.
    """
    eps = torch.finfo(dtype).eps
    floor, cap = (1e-13, 1e-6) if dtype == torch.float64 else (1e-6, 1e-3)
    return min(cap, max(floor, eps * unknowns))


@functools.lru_cache(maxsize=8)
def _cached_plan(height: int, width: int, leaf: int) -> Plan:
    return build_plan(height, width, leaf)


def _block_elements(count: int, kept: int, separator: int, symmetric: bool) -> tuple[int, int]:
    """(values, int32 pivots) that `_eliminate` stores for `count` blocks of one shape."""
    sides = 1 if symmetric else 2  # RS and T (or W and T); a symmetric block keeps one of the two
    pivots = separator if separator > _INVERSE_MAX_SEPARATOR else 0
    return count * (separator * separator + sides * kept * separator), count * pivots


def factor_bytes(height: int, width: int, *, batch: int = 1, dtype: torch.dtype = torch.float64,
                 symmetric: bool = False, leaf: int = 4) -> tuple[int, int]:
    """Memory of an SSI factorisation, from its plan alone: ``(stored factor, largest pair of levels)``.

    The first is what `SSIFactor.nbytes` reports once factored; the second is the Schur complements of
    one level and the next, which live together while a level is merged. The factorisation's peak is at
    least their sum.
    """
    plan = _cached_plan(height, width, max(1, int(leaf)))
    element = torch.finfo(dtype).bits // 8
    shapes = [(len(g.members), len(g.kept), len(g.order) - len(g.kept)) for g in plan.leaves]
    shapes += [(mg.count, mg.kept, mg.size - mg.kept) for step in plan.steps for mg in step.merges]
    values, pivots = map(sum, zip(*(_block_elements(*shape, symmetric) for shape in shapes)))
    stored = values * element + pivots * 4
    levels = [sum(len(g.members) * len(g.kept) ** 2 for g in plan.leaves)]
    levels += [sum(len(g.members) * len(g.kept) ** 2 for g in step.groups) for step in plan.steps]
    pair = max((a + b for a, b in zip(levels, levels[1:])), default=levels[0])
    return stored * batch, pair * element * batch


@contextlib.contextmanager
def flush_denormals(dtype: torch.dtype) -> Iterator[None]:
    """Flush subnormals to zero in fp32 on CPU: decaying Schur complements otherwise run ~50x slower."""
    if dtype != torch.float32:
        yield
        return
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass
class _LUBlock:
    """Factors of one batched elimination ``[[RR, RS], [SR, SS]]`` with `kept` rows in R."""

    lu: torch.Tensor  # [B, n, s, s]
    piv: torch.Tensor
    rs: torch.Tensor  # [B, n, r, s]
    t: torch.Tensor | None  # [B, n, s, r] = SS^-1 SR; None for a symmetric system (SR = RS^T)
    kept: int

    def up(self, f: torch.Tensor, transpose: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Condense a right-hand side ``[B, n, r + s, C]``; returns the kept part and what `down` needs.

        A symmetric block (no `T`) is never asked for a transposed solve: A^T = A.
        """
        f_r, f_s = f[:, :, :self.kept], f[:, :, self.kept:]
        if transpose:  # (SR^T SS^-T) f_S = T^T f_S
            return f_r - self.t.mT @ f_s, f_s
        z = lu_solve(self.lu, self.piv, f_s)
        return f_r - self.rs @ z, z

    def down(self, u_r: torch.Tensor, saved: torch.Tensor, transpose: bool) -> torch.Tensor:
        """Recover the eliminated unknowns from the kept ones; returns ``[u_R; u_S]``."""
        if transpose:
            u_s = lu_solve(self.lu, self.piv, saved - self.rs.mT @ u_r, adjoint=True)
        elif self.t is None:
            u_s = saved - lu_solve(self.lu, self.piv, self.rs.mT @ u_r)
        else:
            u_s = saved - self.t @ u_r
        return torch.cat([u_r, u_s], dim=2)

    def nbytes(self) -> int:
        return _nbytes(self.lu, self.piv, self.rs, self.t)


@dataclass
class _InverseBlock:
    """A small elimination stored as explicit operators: ``SS^-1``, ``T = SS^-1 SR`` and ``W = RS SS^-1``.

    Low levels hold tens of thousands of blocks with separators of a few nodes, where each batched
    LAPACK or BLAS call costs about the same per block whatever its size: two products per block and
    sweep replace two products and two triangular solves. The memory is that of `_LUBlock` (a symmetric
    system keeps no ``W``: it is ``T^T``). Only blocks up to `_INVERSE_MAX_SEPARATOR` nodes are inverted.
    """

    inv: torch.Tensor  # [B, n, s, s]
    t: torch.Tensor  # [B, n, s, r]
    w: torch.Tensor | None  # [B, n, r, s]; None for a symmetric system
    kept: int

    def up(self, f: torch.Tensor, transpose: bool) -> tuple[torch.Tensor, torch.Tensor]:
        f_r, f_s = f[:, :, :self.kept], f[:, :, self.kept:]
        w = self.t.mT if transpose or self.w is None else self.w
        return f_r - w @ f_s, f_s

    def down(self, u_r: torch.Tensor, saved: torch.Tensor, transpose: bool) -> torch.Tensor:
        if transpose:
            u_s = self.inv.mT @ saved - self.w.mT @ u_r
        else:
            u_s = self.inv @ saved - self.t @ u_r
        return torch.cat([u_r, u_s], dim=2)

    def nbytes(self) -> int:
        return _nbytes(self.inv, self.t, self.w)


_Block = _LUBlock | _InverseBlock


@dataclass
class _Piece:
    """Blocks ``lo:hi`` of one leaf or merge group, eliminated together by one worker."""

    group: LeafGroup | MergeGroup
    lo: int
    hi: int
    block: _Block
    index: tuple[torch.Tensor, ...]  # leaves: (ys, xs); merges: (il, ir, pl, pr), positions sliced to lo:hi


def _eliminate(m: torch.Tensor, kept: int, keep_t: bool) -> tuple[torch.Tensor, _Block, torch.Tensor]:
    """Schur complement of the trailing block of ``m [B, n, k, k]``; also returns each block's pivot ratio.

    Without `keep_t` (a symmetric system) ``T`` is dropped once the Schur complement is formed.
    """
    ss = m[:, :, kept:, kept:]
    sr = m[:, :, kept:, :kept]
    rs = m[:, :, :kept, kept:].contiguous()
    if ss.shape[-1] == 0:
        lu, piv, ratio = ss.clone(), ss.new_zeros(ss.shape[:-1], dtype=torch.int32), m.new_ones(m.shape[:2])
    else:
        lu, piv, info = lu_factor(ss)
        ratio = pivot_ratio(lu).masked_fill(info > 0, 0.0)
    t = lu_solve(lu, piv, sr)
    # RR - RS T in one fused pass into a fresh buffer (no separate product temporary).
    b, n = m.shape[:2]
    schur = torch.baddbmm(m[:, :, :kept, :kept].flatten(0, 1), rs.flatten(0, 1), t.flatten(0, 1),
                          alpha=-1).view(b, n, kept, kept)
    separator = ss.shape[-1]
    if 0 < separator <= _INVERSE_MAX_SEPARATOR:
        inv = lu_solve(lu, piv, torch.eye(separator, dtype=m.dtype, device=m.device).expand_as(lu))
        block: _Block = _InverseBlock(inv=inv, t=t, w=None if not keep_t else rs @ inv, kept=kept)
    else:
        block = _LUBlock(lu=lu, piv=piv, rs=rs, t=t if keep_t else None, kept=kept)
    return schur, block, ratio


def _scatter_square(dense: torch.Tensor, flat: torch.Tensor, block: torch.Tensor, add: bool) -> None:
    """dense[..., i, j] (+)= block[..., a, b] for (i, j) = (index[a], index[b]), through one flat index."""
    target = dense.view(*dense.shape[:2], -1)
    source = block.reshape(*block.shape[:2], -1)
    if add:
        target.index_add_(2, flat, source)
    else:
        target.index_copy_(2, flat, source)


def _flat(index: torch.Tensor, size: int) -> torch.Tensor:
    return (index[:, None] * size + index[None, :]).reshape(-1)


def _as_stencil(stencil, dtype: torch.dtype, device) -> tuple[torch.Tensor, bool]:
    s = torch.as_tensor(stencil)
    if s.is_complex():
        raise InputError("complex systems are not supported")
    if s.ndim not in (4, 5) or s.shape[-2:] != (3, 3):
        raise InputError(f"stencil must have shape [H, W, 3, 3] or [B, H, W, 3, 3], got {list(s.shape)}")
    batched = s.ndim == 5
    if s.is_floating_point() and not torch.isfinite(s).all():
        raise InputError("stencil has NaN or Inf entries")
    narrowed = (s if batched else s[None]).to(dtype=dtype, device=device)
    if narrowed.shape[1] < 2 or narrowed.shape[2] < 2:
        raise InputError(f"SSI needs a grid of at least 2x2 nodes, got {narrowed.shape[1]}x{narrowed.shape[2]}")
    if not torch.isfinite(narrowed).all():
        # finite in the file, infinite once cast: a float32 factor of a system scaled by 1e300
        peak = float(s.abs().max())
        raise InputError(f"stencil entries reach {peak:.1e}, beyond {str(dtype).removeprefix('torch.')}'s "
                         f"range ({torch.finfo(dtype).max:.1e}); use --precision float64 or rescale the system")
    return narrowed, batched


class SSIFactor:
    """SSI factorisation of a batch of 9-point grid systems, computed once and re-used for every solve.

    Parameters
    ----------
    stencil : array or tensor ``[H, W, 3, 3]`` or ``[B, H, W, 3, 3]``
        ``stencil[..., y, x, 1 + dy, 1 + dx]`` couples node (y, x) to node (y + dy, x + dx) (see `grid`).
    dtype : torch.dtype, default float64
        float32 halves time and memory on CPU at ~1e-6 relative accuracy (subnormals are flushed).
    device : str or torch.device, default "cpu"
    leaf : int
        Minimum cells per leaf-patch side (patches are leaf..2*leaf-1 cells wide).
    check : bool
        Raise `SingularMatrixError` when a pivot block is singular to working precision.
    pivot_tol : float, optional
        Override the singularity threshold of `pivot_tolerance`.
    workers : int, optional
        Python threads that eliminate disjoint parts of each level at once (CPU only; default: torch's
        intra-op thread count). Results do not depend on it beyond rounding.
    symmetric : bool, optional
        Store the factor of a symmetric system without ``T`` (about 0.55x the memory; see the module
        docstring). Default: detected from the stencil (exact symmetry, at the working precision).
        False keeps ``T`` anyway; True on a nonsymmetric stencil raises `InputError`.

    Examples
    --------
    >>> import scipy.sparse as sp
    >>> from mlxkit.engines.solve.grid import stencil_to_csr
    >>> s = np.zeros((5, 7, 3, 3)); s[..., 1, 1] = 4.2; s[..., 0, 1] = s[..., 2, 1] = s[..., 1, 0] = s[..., 1, 2] = -1
    >>> f = SSIFactor(s)
    >>> b = np.random.default_rng(0).standard_normal((5, 7))
    >>> x = f.solve(torch.from_numpy(b)).numpy()
    >>> bool(np.allclose(stencil_to_csr(s) @ x.ravel(), b.ravel()))
    True
    """

    def __init__(self, stencil, *, dtype: torch.dtype = torch.float64, device: str | torch.device = "cpu",
                 leaf: int = 4, check: bool = True, pivot_tol: float | None = None,
                 workers: int | None = None, symmetric: bool | None = None) -> None:
        if dtype not in (torch.float64, torch.float32):
            raise InputError(f"dtype must be float64 or float32, got {dtype}")
        self.dtype, self.device = dtype, torch.device(device)
        # Each worker runs one intra-op thread: torch's own threading over batches of small LAPACK calls
        # loses to one thread (linalg.py), while splitting a level's blocks between threads scales.
        self.workers = 1 if self.device.type != "cpu" else (torch.get_num_threads() if workers is None else workers)
        s, self.batched = _as_stencil(stencil, dtype, self.device)
        self.batch, self.height, self.width = s.shape[0], s.shape[1], s.shape[2]
        found = symmetric is not False and is_symmetric_stencil(s)  # False asks for no pass over the stencil
        if symmetric and not found:
            raise InputError("symmetric=True, but the stencil is not symmetric")
        self.symmetric = found if symmetric is None else bool(symmetric)
        self.plan = _cached_plan(self.height, self.width, max(1, int(leaf)))
        self._check_memory(leaf)
        self.profile: list[tuple[str, float]] = []
        # `_factor` owns the working copy of the stencil so that it can free it after the leaf step.
        held = [s]
        del s
        with flush_denormals(dtype), torch.no_grad():
            self._factor(held)
        tol = pivot_tolerance(dtype, self.height * self.width) if pivot_tol is None else pivot_tol
        self.min_pivot_ratio = self._ratio.cpu().numpy()
        bad = np.flatnonzero(~(self.min_pivot_ratio > tol))
        if check and bad.size:
            which = f" (system {int(bad[0])} of {self.batch})" if self.batched else ""
            raise SingularMatrixError(
                f"matrix is singular to working precision{which}: smallest pivot ratio "
                f"{self.min_pivot_ratio[bad[0]]:.2e} < {tol:.0e}; for a pure-Neumann problem use "
                f"--nullspace constant, or pin one value")

    # -- factorisation -------------------------------------------------------------------------------

    def _check_memory(self, leaf: int) -> None:
        """Refuse, before any work, a factorisation whose factor and two levels exceed the device's memory."""
        stored, levels = factor_bytes(self.height, self.width, batch=self.batch, dtype=self.dtype,
                                      symmetric=self.symmetric, leaf=leaf)
        systems = f"{self.batch} systems on " if self.batched else ""
        hint = ("a float32 factor (--precision float32, refined in float64) needs about half"
                if self.dtype == torch.float64 else "solve a smaller grid or batch")
        check_fits(stored + levels, self.device,
                   f"the SSI factor of {systems}a {self.height}x{self.width} grid ({str(self.dtype)[6:]})", hint)

    def _index(self, a: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(a, dtype=torch.long, device=self.device)

    def _weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Share of each stencil entry and each node that every patch containing it receives."""
        plan = self.plan
        on_cut_x = np.zeros(self.width, dtype=bool)
        on_cut_x[plan.cuts_x[1:-1]] = True
        on_cut_y = np.zeros(self.height, dtype=bool)
        on_cut_y[plan.cuts_y[1:-1]] = True
        cnt_x = np.where(on_cut_x, 2.0, 1.0)
        cnt_y = np.where(on_cut_y, 2.0, 1.0)
        w = np.ones((self.height, self.width, 3, 3))
        w[:, :, :, 1] /= cnt_x[None, :, None]  # dx = 0: the pair lies on a vertical cut line if x does
        w[:, :, 1, :] /= cnt_y[:, None, None]  # dy = 0
        w *= stencil_mask(self.height, self.width)
        node = 1.0 / (cnt_y[:, None] * cnt_x[None, :])
        return (torch.as_tensor(w, dtype=self.dtype, device=self.device),
                torch.as_tensor(node, dtype=self.dtype, device=self.device))

    def _factor(self, held: list[torch.Tensor]) -> None:
        entry_w, self._node_w = self._weights()
        sw = (held.pop() * entry_w).reshape(self.batch, self.height, self.width, 9)
        t0 = time.perf_counter()
        workers = BlockWorkers(self.workers, flush_denormal=self.dtype == torch.float32)
        try:
            with one_intra_op_thread(self.device.type == "cpu"):
                level, ratio = self._factor_leaves(sw, workers)
                del sw  # the merges read only the leaves' Schur complements
                self.profile.append(("schwarz (leaf patches)", time.perf_counter() - t0))
                self._factor_merges(level, ratio, workers)
        finally:
            workers.close()

    def _factor_leaves(self, sw: torch.Tensor, workers: BlockWorkers) -> tuple[list[torch.Tensor], torch.Tensor]:
        def eliminate(g, out: torch.Tensor, rows, offset, flat, ys: torch.Tensor, xs: torch.Tensor):
            m = len(g.order)
            dense = sw.new_zeros(self.batch, ys.shape[0], m * m)
            dense[:, :, flat] = sw[:, ys[:, rows], xs[:, rows], offset]
            schur, block, ratio = _eliminate(dense.view(self.batch, -1, m, m), len(g.kept), keep_t=not self.symmetric)
            out.copy_(schur)
            return block, ratio

        # Each range writes its Schur complements straight into its group's share of the next level.
        level = [sw.new_empty(self.batch, len(g.members), len(g.kept), len(g.kept)) for g in self.plan.leaves]

        jobs, where = [], []
        itemsize = sw.element_size()
        for gi, g in enumerate(self.plan.leaves):
            m = len(g.order)
            ys, xs = self._index(g.ys), self._index(g.xs)
            rows, offset = self._index(g.rows), self._index(g.offset)
            flat = self._index(g.rows * len(g.order) + g.cols)
            # The patch matrix, its gathered entries and the factors' share: ~3 dense m x m per patch.
            for lo, hi in workers.split(len(g.members), 3 * m * m * self.batch * itemsize):
                sl = (ys[lo:hi], xs[lo:hi])
                jobs.append(functools.partial(eliminate, g, level[gi][:, lo:hi], rows, offset, flat, *sl))
                where.append((gi, lo, hi, sl))
        self._leaf_pieces: list[list[_Piece]] = [[] for _ in self.plan.leaves]
        ratio = sw.new_full((self.batch,), float("inf"))
        for (gi, lo, hi, sl), (block, r) in zip(where, workers.map(jobs)):
            self._leaf_pieces[gi].append(_Piece(self.plan.leaves[gi], lo, hi, block, sl))
            ratio = torch.minimum(ratio, r.amin(1))
        return level, ratio

    def _factor_merges(self, level: list[torch.Tensor], ratio: torch.Tensor, workers: BlockWorkers) -> None:
        def eliminate(mg, out: torch.Tensor, lo: int, hi: int, flat_l, flat_r, pl, pr):
            dense = ratio.new_zeros(self.batch, hi - lo, mg.size, mg.size)
            _scatter_square(dense, flat_l, level[mg.left_group][:, pl], add=False)
            _scatter_square(dense, flat_r, level[mg.right_group][:, pr], add=True)
            schur, block, r = _eliminate(dense, mg.kept, keep_t=not self.symmetric)
            out.copy_(schur)
            return block, r

        self._steps: list[list[_Piece]] = []
        itemsize = ratio.element_size()
        for k, step in enumerate(self.plan.steps):
            t0 = time.perf_counter()
            jobs, where = [], []
            below = [ratio.new_empty(self.batch, len(g.members), len(g.kept), len(g.kept)) for g in step.groups]
            for mg in step.merges:
                il, ir = self._index(mg.index_left), self._index(mg.index_right)
                pl, pr = self._index(mg.left_pos), self._index(mg.right_pos)
                flat_l, flat_r = _flat(il, mg.size), _flat(ir, mg.size)
                # The merged matrix and what `_eliminate` forms from it: ~2 dense size^2 per block.
                for lo, hi in workers.split(mg.count, 2 * mg.size**2 * self.batch * itemsize):
                    out = below[mg.out_group][:, mg.out_start + lo:mg.out_start + hi]
                    jobs.append(functools.partial(eliminate, mg, out, lo, hi, flat_l, flat_r, pl[lo:hi], pr[lo:hi]))
                    where.append((mg, lo, hi, (il, ir, pl[lo:hi], pr[lo:hi])))
            pieces = []
            for (mg, lo, hi, index), (block, r) in zip(where, workers.map(jobs)):
                ratio = torch.minimum(ratio, r.amin(1))
                pieces.append(_Piece(mg, lo, hi, block, index))
            level[:] = below  # in place: the caller's list must not keep the step's inputs alive
            del below
            self._steps.append(pieces)
            sizes = max(mg.size - mg.kept for mg in step.merges)
            self.profile.append((f"schur {k + 1} ({step.axis}, separator <= {sizes})", time.perf_counter() - t0))
        self._ratio = ratio

    # -- solves --------------------------------------------------------------------------------------

    def nbytes(self) -> int:
        """Memory held by the factorisation."""
        pieces = [p for g in self._leaf_pieces for p in g] + [p for step in self._steps for p in step]
        return sum(p.block.nbytes() for p in pieces)

    def _normalise_rhs(self, b) -> tuple[torch.Tensor, tuple[int, ...]]:
        b = torch.as_tensor(b)
        grid = (self.height, self.width)
        lead = (self.batch,) if self.batched else ()
        if tuple(b.shape[:len(lead) + 2]) != lead + grid or b.ndim not in (len(lead) + 2, len(lead) + 3):
            want = "[B, H, W] or [B, H, W, C]" if self.batched else "[H, W] or [H, W, C]"
            raise InputError(f"right-hand side must have shape {want} with {want[1:-1].split(', C')[0].split(' or ')[0]}"
                             f" = {list(lead + grid)}, got {list(b.shape)}")
        shape = tuple(b.shape)
        b = b.to(dtype=self.dtype, device=self.device)
        if b.ndim == len(lead) + 2:
            b = b[..., None]
        if not self.batched:
            b = b[None]
        return b, shape

    def solve(self, b, transpose: bool = False) -> torch.Tensor:
        """Solve ``A x = b`` (or ``A^T x = b``) for right-hand sides shaped like the grid.

        `b` is ``[H, W]`` or ``[H, W, C]`` (batched factor: ``[B, H, W]`` or ``[B, H, W, C]``); the
        result has the same shape.
        """
        b4, shape = self._normalise_rhs(b)
        transpose = transpose and not self.symmetric  # A^T = A, and a symmetric factor stores no T
        # A solve streams through the stored factors once up and once down (memory-bound products).
        # Worker threads pay off only on large factors (measured on 2 cores: 1025^2, 1 GB: 0.20 s vs
        # 0.24 s; 513^2, 0.2 GB: 0.11 s vs 0.06 s).
        threads = self.workers if self.nbytes() >= _THREADED_SOLVE_BYTES else 1
        workers = BlockWorkers(threads, flush_denormal=self.dtype == torch.float32)
        try:
            with flush_denormals(self.dtype), torch.no_grad(), one_intra_op_thread(self.device.type == "cpu"):
                x = self._solve4(b4, transpose, workers)
        finally:
            workers.close()
        return x.reshape(shape)

    def _solve4(self, b: torch.Tensor, transpose: bool, workers: BlockWorkers) -> torch.Tensor:
        # Every job gathers its own inputs and writes its own share of the next level, so the worker
        # threads also carry the data movement between levels (disjoint block ranges: no two jobs
        # write the same entry, except the leaves' shared cut nodes, which both write the same value).
        bsz, channels = b.shape[0], b.shape[-1]
        bw = b * self._node_w[None, :, :, None]

        def leaf_up(p: _Piece, out: torch.Tensor) -> torch.Tensor:
            kept, keep = p.block.up(bw[:, p.index[0], p.index[1], :], transpose)
            out[:, p.lo:p.hi] = kept
            return keep

        def merge_up(p: _Piece, level: list[torch.Tensor], out: list[torch.Tensor]) -> torch.Tensor:
            mg, (il, ir, pl, pr) = p.group, p.index
            f = b.new_zeros(bsz, p.hi - p.lo, mg.size, channels)
            f.index_copy_(2, il, level[mg.left_group][:, pl])
            f.index_add_(2, ir, level[mg.right_group][:, pr])
            kept, keep = p.block.up(f, transpose)
            out[mg.out_group][:, mg.out_start + p.lo:mg.out_start + p.hi] = kept
            return keep

        def merge_down(p: _Piece, keep: torch.Tensor, u: list[torch.Tensor], child: list[torch.Tensor]) -> None:
            mg, (il, ir, pl, pr) = p.group, p.index
            start = mg.out_start + p.lo
            full = p.block.down(u[mg.out_group][:, start:start + p.hi - p.lo], keep, transpose)
            child[mg.left_group][:, pl] = full[:, :, il]
            child[mg.right_group][:, pr] = full[:, :, ir]

        def leaf_down(p: _Piece, keep: torch.Tensor, u_g: torch.Tensor, x: torch.Tensor) -> None:
            x[:, p.index[0], p.index[1], :] = p.block.down(u_g[:, p.lo:p.hi], keep, transpose)

        def vectors(groups) -> list[torch.Tensor]:
            return [b.new_zeros(bsz, len(g.members), len(g.kept), channels) for g in groups]

        level = vectors(self.plan.leaves)
        saved_leaf = [workers.map([functools.partial(leaf_up, p, level[gi]) for p in pieces])
                      for gi, pieces in enumerate(self._leaf_pieces)]
        saved_steps = []
        for step, pieces in zip(self.plan.steps, self._steps):
            above = vectors(step.groups)
            saved_steps.append(workers.map([functools.partial(merge_up, p, level, above) for p in pieces]))
            level = above
        # The root keeps nothing; walk back down.
        u = vectors(self.plan.steps[-1].groups if self.plan.steps else self.plan.leaves)
        for k in range(len(self.plan.steps) - 1, -1, -1):
            child = vectors(self.plan.steps[k - 1].groups if k else self.plan.leaves)
            workers.map([functools.partial(merge_down, p, keep, u, child)
                         for p, keep in zip(self._steps[k], saved_steps[k])])
            u = child
        x = torch.empty_like(b)
        for pieces, keeps, u_g in zip(self._leaf_pieces, saved_leaf, u):
            workers.map([functools.partial(leaf_down, p, keep, u_g, x) for p, keep in zip(pieces, keeps)])
        return x
