"""The fast spectral kernels against the official-style full-SVD ones, on small matrices."""

from __future__ import annotations

import pytest
import torch

from mlxkit.engines.merge.linalg import (common_rank, iso_c_fast, iso_c_reference, iso_cts_fast,
                                         iso_cts_reference)


def rel(a, b):
    return float((a - b).norm() / b.norm())


def test_common_rank_table():
    # The official Iso-CTS split of r directions over T tasks: k0 = int(r * frac), then
    # k = r - round((r - k0) / T) * T common directions and s = (r - k) / T per task, so that
    # k + s*T = r exactly. E.g. r=768, T=8: k0 = 614, round(154 / 8) = 19, k = 768 - 152 = 616.
    assert common_rank(768, 8, 0.8) == (616, 19)
    assert common_rank(768, 14, 0.8) == (614, 11)
    assert common_rank(768, 20, 0.8) == (608, 8)
    assert common_rank(4096, 3, 0.8) == (3277, 273)


@pytest.mark.parametrize("shape", [(24, 40), (40, 40), (48, 28)])
@pytest.mark.parametrize("frac", [0.1, 0.5, 0.8, 0.95])
def test_iso_cts_fast_matches_reference(shape, frac):
    gen = torch.Generator().manual_seed(1)
    deltas = [torch.randn(shape, generator=gen) for _ in range(3)]
    assert rel(iso_cts_fast(deltas, frac), iso_cts_reference(deltas, frac)) < 1e-4


@pytest.mark.parametrize("shape", [(24, 96), (96, 24), (40, 40), (30, 50)])  # Gram path (aspect <= 0.5) and SVD path
def test_iso_c_fast_matches_reference(shape):
    gen = torch.Generator().manual_seed(5)
    total = sum(torch.randn(shape, generator=gen) for _ in range(3))
    assert rel(iso_c_fast(total), iso_c_reference(total)) < 1e-5


def test_iso_cts_randomized_tall_path_is_close():
    gen = torch.Generator().manual_seed(2)
    # decaying spectra, as real task vectors have: the randomized range finder sees them well
    deltas = [torch.randn(96, 8, generator=gen) @ torch.randn(8, 40, generator=gen)
              + 0.01 * torch.randn(96, 40, generator=gen) for _ in range(3)]
    fast = iso_cts_fast(deltas, 0.8, exact_below=0, power_iters=4)
    assert rel(fast, iso_cts_reference(deltas, 0.8)) < 1e-2


def test_isotropic_spectrum_order_invariance_and_homogeneity():
    gen = torch.Generator().manual_seed(3)
    deltas = [torch.randn(20, 30, generator=gen) for _ in range(3)]
    out = iso_c_fast(sum(deltas))
    s = torch.linalg.svdvals(out)
    assert torch.allclose(s, s.mean().expand_as(s), rtol=1e-4)
    assert torch.allclose(iso_cts_fast(deltas[::-1]), iso_cts_fast(deltas), atol=1e-5)
    assert torch.allclose(iso_c_fast(2.5 * sum(deltas)), 2.5 * out, atol=1e-5)
    assert rel(out, iso_c_reference(sum(deltas))) < 1e-5


def test_rank_deficient_and_zero_inputs_stay_finite():
    gen = torch.Generator().manual_seed(4)
    for m, n in ((48, 64), (64, 48)):
        low = [torch.randn(m, 4, generator=gen) @ torch.randn(4, n, generator=gen) for _ in range(3)]
        assert torch.isfinite(iso_cts_fast(low)).all() and torch.isfinite(iso_c_fast(sum(low))).all()
    assert iso_c_fast(torch.zeros(8, 8)).abs().max() == 0
    assert iso_cts_fast([torch.zeros(8, 8)] * 2).abs().max() == 0
