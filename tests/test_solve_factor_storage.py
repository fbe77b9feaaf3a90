"""How the SSI factor is stored: without T for symmetric systems, and in bounded ranges of blocks.

The references are SciPy's: its transpose decides symmetry, `spsolve` gives the solutions.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse.linalg as spla
import torch

from mlxkit.engines.errors import InputError
from mlxkit.engines.solve import linalg
from mlxkit.engines.solve.grid import csr_to_stencil, is_symmetric_stencil, stencil_mask, stencil_to_csr
from mlxkit.engines.solve.ssi import SSIFactor, factor_bytes


def random_nine_point(rng: np.random.Generator, height: int, width: int, symmetric: bool) -> np.ndarray:
    s = rng.standard_normal((height, width, 3, 3)) * stencil_mask(height, width)
    if symmetric:
        a = stencil_to_csr(s)
        s = csr_to_stencil((a + a.T) / 2, height, width)
    s[..., 1, 1] = np.abs(s).sum((-1, -2)) + 0.5
    return s


def rel_res(a, x, b) -> float:
    return float(np.linalg.norm(a @ x - b) / np.linalg.norm(b))


@pytest.mark.parametrize("seed", range(6))
def test_symmetry_detection_agrees_with_scipy_transpose(seed):
    rng = np.random.default_rng(seed)
    height, width = int(rng.integers(2, 9)), int(rng.integers(2, 9))
    s = random_nine_point(rng, height, width, symmetric=seed % 2 == 0)
    if seed == 4:  # entries pointing outside the grid are not part of the matrix
        s[0, :, 0, :] = 7.0
    if seed == 5:  # one coupling broken by rounding-sized noise still counts as nonsymmetric
        s = random_nine_point(rng, height, width, symmetric=True)
        s[1, 1, 1, 2] *= 1 + 1e-15
    a = stencil_to_csr(s)
    expected = abs(a - a.T).max() == 0
    assert is_symmetric_stencil(torch.from_numpy(s)[None]) == expected


def test_a_batch_is_symmetric_only_when_every_system_is():
    rng = np.random.default_rng(0)
    sym = random_nine_point(rng, 6, 5, symmetric=True)
    other = random_nine_point(rng, 6, 5, symmetric=False)
    assert is_symmetric_stencil(torch.from_numpy(np.stack([sym, sym])))
    assert not is_symmetric_stencil(torch.from_numpy(np.stack([sym, other])))


@pytest.mark.parametrize("shape", [(33, 33), (23, 41)])
def test_symmetric_factor_keeps_no_t_and_solves_like_the_general_one(shape):
    rng = np.random.default_rng(shape[1])
    s = random_nine_point(rng, *shape, symmetric=True)
    a = stencil_to_csr(s)
    b = rng.standard_normal((*shape, 2))
    compact = SSIFactor(s)
    general = SSIFactor(s, symmetric=False)
    assert compact.symmetric and not general.symmetric
    # T is one of the three stored tensors and about as large as RS.
    assert compact.nbytes() < 0.7 * general.nbytes()
    x = compact.solve(torch.from_numpy(b)).numpy().reshape(-1, 2)
    ref = spla.spsolve(a.tocsc(), b.reshape(-1, 2))
    assert rel_res(a, x, b.reshape(-1, 2)) <= 1e-12
    assert np.linalg.norm(x - ref) <= 1e-10 * np.linalg.norm(ref)
    xt = compact.solve(torch.from_numpy(b), transpose=True).numpy().reshape(-1, 2)
    assert rel_res(a.T.tocsr(), xt, b.reshape(-1, 2)) <= 1e-12


def test_symmetric_true_on_a_nonsymmetric_stencil_is_refused():
    s = random_nine_point(np.random.default_rng(1), 8, 8, symmetric=False)
    with pytest.raises(InputError, match="not symmetric"):
        SSIFactor(s, symmetric=True)


def test_a_mixed_batch_keeps_t_and_solves_both_systems():
    rng = np.random.default_rng(2)
    stencils = np.stack([random_nine_point(rng, 17, 19, symmetric=True), random_nine_point(rng, 17, 19, symmetric=False)])
    f = SSIFactor(stencils)
    assert not f.symmetric
    b = rng.standard_normal((2, 17, 19))
    for transpose in (False, True):
        x = f.solve(torch.from_numpy(b), transpose=transpose).numpy()
        for k in range(2):
            a = stencil_to_csr(stencils[k])
            a = a.T.tocsr() if transpose else a
            assert rel_res(a, x[k].ravel(), b[k].ravel()) <= 1e-12


def test_split_bounds_each_range_by_its_work_memory():
    workers = linalg.BlockWorkers(2)
    try:
        for count, item in [(10, 0), (1000, linalg.CHUNK_BYTES // 7), (5, linalg.CHUNK_BYTES * 3), (1, 1)]:
            ranges = workers.split(count, item)
            assert ranges[0][0] == 0 and ranges[-1][1] == count
            assert all(hi == lo for (_, hi), (lo, _) in zip(ranges[:-1], ranges[1:]))  # contiguous
            assert len(ranges) >= min(2, count)
            if item <= linalg.CHUNK_BYTES:
                assert all((hi - lo) * item <= linalg.CHUNK_BYTES for lo, hi in ranges)
            else:  # a block larger than the bound gets a range of its own
                assert all(hi - lo == 1 for lo, hi in ranges)
    finally:
        workers.close()


@pytest.mark.parametrize("symmetric", [True, False])
def test_small_ranges_give_the_same_factor(monkeypatch, symmetric):
    # Dozens of ranges per level write their Schur complements into the next level out of order.
    rng = np.random.default_rng(3)
    s = random_nine_point(rng, 45, 38, symmetric=symmetric)
    b = torch.from_numpy(rng.standard_normal((45, 38)))
    whole = SSIFactor(s, workers=2).solve(b).numpy()
    monkeypatch.setattr(linalg, "CHUNK_BYTES", 4096)
    chunked = SSIFactor(s, workers=2)
    pieces = sum(len(g) for g in chunked._leaf_pieces) + sum(len(step) for step in chunked._steps)
    assert pieces > 100
    x = chunked.solve(b).numpy()
    assert np.linalg.norm(x - whole) <= 1e-12 * np.linalg.norm(whole)
    assert rel_res(stencil_to_csr(s), x.ravel(), b.numpy().ravel()) <= 1e-12


@pytest.mark.parametrize("shape, batch, dtype, symmetric", [
    ((33, 33), 1, torch.float64, True), ((23, 41), 2, torch.float64, False),
    ((90, 70), 1, torch.float32, True), ((90, 70), 1, torch.float64, False), ((2, 9), 1, torch.float64, False),
])
def test_factor_size_from_the_plan_is_the_size_factored(shape, batch, dtype, symmetric):
    rng = np.random.default_rng(batch)
    s = np.stack([random_nine_point(rng, *shape, symmetric=symmetric) for _ in range(batch)])
    f = SSIFactor(s if batch > 1 else s[0], dtype=dtype)
    stored, levels = factor_bytes(*shape, batch=batch, dtype=dtype, symmetric=symmetric)
    assert f.symmetric == symmetric
    assert stored == f.nbytes()
    assert 0 < levels < stored


def test_a_factor_beyond_memory_is_refused_before_any_work(monkeypatch):
    from mlxkit.engines.errors import ResourceError

    stored, levels = factor_bytes(64, 64, dtype=torch.float64, symmetric=True)
    monkeypatch.setattr("mlxkit.engines.training.budget.machine_memory_bytes", lambda: stored + levels - 1)
    factored = []
    monkeypatch.setattr(SSIFactor, "_factor", lambda self, held: (factored.append(1),
                                                                  setattr(self, "_ratio", torch.ones(1))))
    s = random_nine_point(np.random.default_rng(0), 64, 64, symmetric=True)
    with pytest.raises(ResourceError, match=r"64x64 grid \(float64\).*--precision float32"):
        SSIFactor(s)
    assert not factored
    monkeypatch.setattr("mlxkit.engines.training.budget.machine_memory_bytes", lambda: stored + levels)
    SSIFactor(s, check=False)  # exactly enough is accepted (the check only reads memory, not the factor)
    assert factored
