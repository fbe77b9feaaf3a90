"""Spectral kernels for isotropic merging: fast paths and the official-style references.

Official Iso-C runs one full SVD per matrix and Iso-CTS runs T+3 (sum, each task residual, and
two SVD-based polar factors). The fast paths here do less:

* Iso-C: the result σ̄·U Vᵀ equals (‖Δ‖_* / r)·polar(Δ). Both come from one symmetric
  eigendecomposition of the smaller Gram matrix ΔΔᵀ (or ΔᵀΔ), formed in float64 because the
  Gram squares the condition number. Near-square matrices, where the Gram is no smaller, take
  one SVD instead.
* Iso-CTS: the same eigendecomposition gives the common subspace *and* its complement. When
  the common projection acts on the short side (rows ≤ columns, e.g. attention and down
  projections), every task residual lives in the (r−k)-dimensional complement, so its top
  directions come exactly from an (r−k)×(r−k) eigenproblem. On tall matrices the residual has
  full rank and we take its top s=(r−k)/T directions with a randomized range finder that
  applies the projection implicitly. The merged bases are re-orthonormalised without an SVD:
  task left vectors are orthogonal to the common ones, so only a small Gram is needed; the
  right vectors get an exact low-rank correction of (XXᵀ)^{-1/2}.

Everything is tensor-local and runs on whatever device the input tensors live on.
"""

from __future__ import annotations

import torch

# Singular values below this fraction of the largest are treated as zero when inverting.
_RCOND = 1e-12
# Iso-C goes through the Gram matrix only when short side / long side is at most this (measured crossover:
# 1024x4096 gains 2.8x, 4096x14336 2.4x, 4096x4096 loses 0.8x against the SVD).
_GRAM_MAX_ASPECT = 0.5


def common_rank(r: int, num_tasks: int, common_frac: float) -> tuple[int, int]:
    """(k, s) as in the official code: k common directions, s per task, k + s·T = r."""
    k = int(r * common_frac)
    k = r - round((r - k) / num_tasks) * num_tasks  # Python round (half to even), as official
    s = int((r - k) / num_tasks)
    return k, s


# --------------------------------------------------------------------------------------------
# Official-style references (full SVDs), kept for tests and the speed benchmark.

def iso_c_reference(delta_sum: torch.Tensor) -> torch.Tensor:
    """σ̄·U Vᵀ of the summed task matrices via one full SVD (iso-merging `iso_c`)."""
    u, s, vh = torch.linalg.svd(delta_sum.float(), full_matrices=False)
    return s.mean() * (u @ vh)


def iso_cts_reference(deltas: list[torch.Tensor], common_frac: float = 0.8) -> torch.Tensor:
    """Iso-CTS with T+3 full SVDs, line by line as the official `iso_cts`."""
    deltas = [d.float() for d in deltas]
    total = sum(deltas)
    m, n = total.shape
    r = min(m, n)
    k, s = common_rank(r, len(deltas), common_frac)
    u, sv, vh = torch.linalg.svd(total, full_matrices=False)
    uc, sc, vhc = u[:, :k], sv[:k], vh[:k]
    kw = {"device": total.device}
    ucat, scat, vhcat = torch.zeros(m, r, **kw), torch.zeros(r, **kw), torch.zeros(r, n, **kw)
    for i, d in enumerate(deltas):
        resid = d - uc @ (uc.T @ d)
        ut, st, vht = torch.linalg.svd(resid, full_matrices=False)
        ucat[:, i * s:(i + 1) * s] = ut[:, :s]
        scat[i * s:(i + 1) * s] = st[:s]
        vhcat[i * s:(i + 1) * s] = vht[:s]
    t = len(deltas) * s
    ucat[:, t:t + k], scat[t:t + k], vhcat[t:t + k] = uc, sc, vhc
    p, _, q = torch.linalg.svd(ucat, full_matrices=False)
    ucat = p @ q
    p, _, q = torch.linalg.svd(vhcat, full_matrices=False)
    vhcat = p @ q
    return scat.mean() * (ucat @ vhcat)


# --------------------------------------------------------------------------------------------
# Fast paths.

def _gram_eigh(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenpairs of a·aᵀ in float64, largest first: (σ = sqrt(λ) clipped at 0, vectors)."""
    a64 = a.double()
    lam, vec = torch.linalg.eigh(a64 @ a64.T)
    lam, vec = lam.flip(0), vec.flip(1)
    return lam.clamp_min(0).sqrt(), vec


def _safe_inverse(sig: torch.Tensor) -> torch.Tensor:
    """1/σ, with 0 for numerically null directions (their polar image is arbitrary anyway)."""
    cutoff = sig.max().clamp_min(torch.finfo(sig.dtype).tiny) * _RCOND ** 0.5
    return torch.where(sig > cutoff, 1.0 / sig.clamp_min(torch.finfo(sig.dtype).tiny), torch.zeros_like(sig))


def iso_c_fast(delta_sum: torch.Tensor) -> torch.Tensor:
    """(‖Δ‖_* / r)·polar(Δ), from the eigendecomposition of the smaller Gram matrix (float64), or
    from one float32 SVD when the matrix is near-square (there the Gram saves nothing).

    Returns float32. On full-rank input this equals `iso_c_reference` to rounding; on
    rank-deficient input the official SVD spreads σ̄ over arbitrary null-space vectors,
    which we leave out (σ̄ itself still averages all r values, zeros included).
    """
    m, n = delta_sum.shape
    if min(m, n) > _GRAM_MAX_ASPECT * max(m, n):
        # Near-square: the Gram is as large as the matrix and a float64 eigh of it costs more than the
        # float32 SVD (quiet 2-core CPU, 4096²: 17.0 s vs 13.7 s), so take the SVD, null directions dropped.
        u, sig, vh = torch.linalg.svd(delta_sum.float(), full_matrices=False)
        keep = _safe_inverse(sig.double()) > 0
        return sig.mean() * (u[:, keep] @ vh[keep])
    wide = m <= n
    a = delta_sum if wide else delta_sum.T
    r = a.shape[0]
    sig, u = _gram_eigh(a)
    sbar = sig.sum() / r
    if sbar == 0:
        return torch.zeros_like(delta_sum, dtype=torch.float32)
    # polar(a) = (a aᵀ)^{-1/2} a = U diag(1/σ) Uᵀ a
    w = (u * _safe_inverse(sig)) @ u.T
    out = (sbar * w) @ a.double()
    out = out.float()
    return out if wide else out.T.contiguous()


def _polar_columns(x: torch.Tensor) -> torch.Tensor:
    """polar(x) = x (xᵀx)^{-1/2} for a tall-or-square x with few columns (float64 in, float64 out)."""
    lam, vec = torch.linalg.eigh(x.T @ x)
    sig = lam.clamp_min(0).sqrt()
    return x @ ((vec * _safe_inverse(sig)) @ vec.T)


def _polar_rows_lowrank(vt: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
    """polar([vt; vc]) when the rows of vc are orthonormal, without an SVD of the whole stack.

    With X = [vt; vc], XXᵀ = I + E and E = [[vt vtᵀ − I, B], [Bᵀ, 0]], B = vt vcᵀ, whose range
    lies in span(first rows) ⊕ range(Bᵀ). With Z an orthonormal basis of that span,
    (I + E)^{-1/2} = I + Z Y (diag((1+μ)^{-1/2}) − I) Yᵀ Zᵀ, where (μ, Y) = eigh(Zᵀ E Z).
    Cost O(s·k·n) instead of O(r²·n) for a full polar factor. All in float64.
    """
    p = vt.shape[0]
    b = vt @ vc.T                                           # p × k
    qb, _ = torch.linalg.qr(b.T)                            # k × p, orthonormal basis of range(Bᵀ)
    size = p + qb.shape[1]                                  # qb has min(k, p) columns
    core = torch.zeros(size, size, dtype=vt.dtype, device=vt.device)
    core[:p, :p] = vt @ vt.T - torch.eye(p, dtype=vt.dtype, device=vt.device)
    core[:p, p:] = b @ qb
    core[p:, :p] = core[:p, p:].T
    mu, y = torch.linalg.eigh(core)
    one_plus = (1 + mu).clamp_min(0)
    f = torch.where(one_plus > _RCOND, one_plus.rsqrt(), torch.zeros_like(one_plus)) - 1
    m = (y * f) @ y.T                                       # size × size
    zt_x = torch.cat([vt, qb.T @ vc], dim=0)                # Zᵀ X, size × n
    corr = m @ zt_x                                         # size × n, still in Z coordinates
    top = vt + corr[:p]
    bottom = vc + qb @ corr[p:]
    return torch.cat([top, bottom], dim=0)


def _randomized_top(apply, apply_t, shape: tuple[int, int], s: int, *, oversample: int, power_iters: int,
                    generator: torch.Generator | None, dtype, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-s SVD of an implicit m×n operator (Halko et al. 2011, Alg. 4.4 + 5.1)."""
    m, n = shape
    q = min(n, m, s + oversample)
    omega = torch.randn(n, q, generator=generator, dtype=torch.float32).to(device=device, dtype=dtype)
    y, _ = torch.linalg.qr(apply(omega))
    for _ in range(power_iters):
        z, _ = torch.linalg.qr(apply_t(y))
        y, _ = torch.linalg.qr(apply(z))
    bt = apply_t(y)                                         # n × q  = (yᵀ R)ᵀ
    # SVD of the small q×n matrix via its q×q Gram, in float64
    sig, w = _gram_eigh(bt.T)
    u = y.double() @ w[:, :s]
    vh = (w[:, :s].T @ bt.T.double()) * _safe_inverse(sig[:s])[:, None]
    return u, sig[:s], vh


def iso_cts_fast(deltas: list[torch.Tensor], common_frac: float = 0.8, *, oversample: int | None = None,
                 power_iters: int = 4, seed: int = 0, exact_below: int = 1024) -> torch.Tensor:
    """Iso-CTS without full SVDs beyond one Gram eigendecomposition. Returns float32.

    Exact (to float64 rounding of the Gram) when rows ≤ columns or columns ≤ `exact_below`; on
    larger tall matrices the per-task residual directions come from a seeded randomized SVD
    (`power_iters` subspace iterations).
    """
    deltas = [d.float() for d in deltas]
    device = deltas[0].device
    total = sum(deltas)
    m, n = total.shape
    r, T = min(m, n), len(deltas)
    k, s = common_rank(r, T, common_frac)
    t64 = total.double()
    if m <= n:
        sig, u = _gram_eigh(total)                          # u: m × m, all directions
        uc, sc = u[:, :k], sig[:k]
        vhc = (uc.T @ t64) * _safe_inverse(sc)[:, None]     # k × n
        uperp = u[:, k:]                                    # m × (r − k)
        task_u, task_s, task_vh = [], [], []
        for d in (deltas if s > 0 else []):
            c = uperp.T @ d.double()                        # residual in complement coordinates
            st, w = _gram_eigh(c)
            task_u.append(uperp @ w[:, :s])
            task_s.append(st[:s])
            task_vh.append((w[:, :s].T @ c) * _safe_inverse(st[:s])[:, None])
    else:
        sig, v = _gram_eigh(total.T)                        # v: n × n
        sc = sig[:k]
        vhc = v[:, :k].T.contiguous()
        uc = (t64 @ v[:, :k]) * _safe_inverse(sc)[None, :]  # m × k
        uc32 = uc.float()
        gen = torch.Generator().manual_seed(seed)
        task_u, task_s, task_vh = [], [], []
        for d in (deltas if s > 0 and n <= exact_below else []):
            # small enough for an exact eigendecomposition of the residual's n×n Gram
            resid = d.double() - uc @ (uc.T @ d.double())
            st, w = _gram_eigh(resid.T)
            task_u.append((resid @ w[:, :s]) * _safe_inverse(st[:s])[None, :])
            task_s.append(st[:s])
            task_vh.append(w[:, :s].T.contiguous())
        for d in (deltas if s > 0 and n > exact_below else []):
            def apply(x, d=d):                              # (I − Uc Ucᵀ) d x
                y = d @ x
                return y - uc32 @ (uc32.T @ y)

            def apply_t(y, d=d):                            # dᵀ (I − Uc Ucᵀ) y
                return d.T @ (y - uc32 @ (uc32.T @ y))

            ut, st, vht = _randomized_top(apply, apply_t, (m, n), s, oversample=oversample or max(10, s),
                                          power_iters=power_iters, generator=gen, dtype=torch.float32,
                                          device=device)
            ut = ut - uc @ (uc.T @ ut)                      # keep exactly out of the common span
            task_u.append(ut)
            task_s.append(st)
            task_vh.append(vht)
    sbar = (sc.sum() + sum(float(t.sum()) for t in task_s)) / r
    if T * s > 0:
        ut_all = _polar_columns(torch.cat(task_u, dim=1))   # orthogonal to uc, so only this block needs it
        vh_all = _polar_rows_lowrank(torch.cat(task_vh, dim=0), vhc)
        u_all = torch.cat([ut_all, uc], dim=1)
    else:
        u_all, vh_all = uc, vhc
    return (sbar * (u_all.float() @ vh_all.float())).float()
