"""Every merge method against a plain dense reference formula, on tiny random Llamas."""

from __future__ import annotations

import math

import pytest
import torch

from mlxkit.engines.merge.config import validate_config
from mlxkit.engines.merge.methods.base import TensorJob
from mlxkit.engines.merge.methods.registry import get
from mlxkit.engines.merge.run import run_merge
from test_merge_common import make_base, make_finetune, state

EMBEDDINGS = ("embed_tokens", "lm_head")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    base = make_base(root / "base")
    fts = [make_finetune(base, root / f"ft{i}", seed=10 + i) for i in range(3)]
    return base, fts


def _merge(tmp_path, base, fts, method, alpha=1.0, **extra):
    cfg = validate_config({"models": [{"model": str(f)} for f in fts], "base_model": str(base) if base else None,
                           "merge_method": method, "alpha": alpha, **extra})
    out = tmp_path / f"out-{method}"
    run_merge(cfg, out, device="cpu")
    return state(out)


# ---- plain reference definitions (full SVDs, no shortcuts) -----------------------------------

def ref_iso_c(deltas):
    total = sum(deltas)
    u, s, vh = torch.linalg.svd(total, full_matrices=False)
    return s.mean() * u @ vh


def ref_iso_cts(deltas, frac=0.8):
    T = len(deltas)
    total = sum(deltas)
    m, n = total.shape
    r = min(m, n)
    k = r - round((r - int(r * frac)) / T) * T
    s = (r - k) // T
    u, sv, vh = torch.linalg.svd(total, full_matrices=False)
    us, ss, vs = [], [], []
    for d in deltas:
        resid = d - u[:, :k] @ u[:, :k].T @ d
        ut, st, vht = torch.linalg.svd(resid, full_matrices=False)
        us.append(ut[:, :s]); ss.append(st[:s]); vs.append(vht[:s])
    U = torch.cat(us + [u[:, :k]], 1)
    V = torch.cat(vs + [vh[:k]], 0)
    S = torch.cat(ss + [sv[:k]])
    p, _, q = torch.linalg.svd(U, full_matrices=False)
    U = p @ q
    p, _, q = torch.linalg.svd(V, full_matrices=False)
    V = p @ q
    return S.mean() * U @ V


def _expected_iso(base_sd, ft_sds, alpha, matrix_fn):
    out = {}
    for name, b in base_sd.items():
        deltas = [sd[name].double() - b.double() for sd in ft_sds]
        if b.dim() == 2 and not any(e in name for e in EMBEDDINGS):
            m = matrix_fn(deltas)
        else:
            m = sum(deltas) / len(deltas)
        out[name] = b.double() + alpha * m
    return out


def _assert_close(got, want, rtol):
    assert set(got) == set(want)
    for name in want:
        g, w = got[name].double(), want[name].double()
        err = (g - w).norm() / w.norm()
        assert err < rtol, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("method,fn", [("iso-c", ref_iso_c), ("iso-cts", ref_iso_cts)])
def test_isotropic_matches_svd_definition(tmp_path, models, method, fn):
    base, fts = models
    got = _merge(tmp_path, base, fts, method, alpha=1.3)
    want = _expected_iso(state(base), [state(f) for f in fts], 1.3, fn)
    _assert_close(got, want, 1e-5)


def test_iso_cts_full_common_fraction_is_iso_c(tmp_path, models):
    base, fts = models
    a = _merge(tmp_path, base, fts, "iso-cts", parameters={"common_frac": 1.0})
    b = _merge(tmp_path, base, fts, "iso-c")
    _assert_close(a, b, 1e-5)


def test_matrix_embeddings_switch(tmp_path, models):
    base, fts = models
    got = _merge(tmp_path, base, fts, "iso-c", average_embeddings=False)
    b, sds = state(base), [state(f) for f in fts]
    name = "model.embed_tokens.weight"
    want = b[name].double() + ref_iso_c([sd[name].double() - b[name].double() for sd in sds])
    assert torch.allclose(got[name].double(), want, atol=1e-5)


def test_task_arithmetic_linear(tmp_path, models):
    base, fts = models
    b, sds = state(base), [state(f) for f in fts]
    ta = _merge(tmp_path, base, fts, "task-arithmetic", alpha=0.5)
    lin = _merge(tmp_path, None, fts, "linear")
    for name in b:
        want_ta = b[name] + 0.5 * sum(sd[name] - b[name] for sd in sds)
        assert torch.allclose(ta[name], want_ta, atol=1e-6)
        assert torch.allclose(lin[name], sum(sd[name] for sd in sds) / 3, atol=1e-6)


def test_ties_hand_computed_case():
    d1 = torch.tensor([1.0, -2.0, 0.5, 0.0])
    d2 = torch.tensor([2.0, 1.0, -0.5, 3.0])
    d3 = torch.tensor([-1.5, -1.0, 0.1, -4.0])
    job = lambda density: TensorJob("w", False, {"normalize": True},  # noqa: E731
                                    [{"weight": 1.0, "density": density}] * 3)
    # no trimming: elected signs (+, -, +, -); disjoint means of the agreeing entries
    full = get("ties").merge([d1, d2, d3], job(1.0))
    assert torch.allclose(full, torch.tensor([1.5, -1.5, (0.5 + 0.1) / 2, -4.0]))
    # density 0.5 keeps two entries each: [1,-2,0,0], [2,0,0,3], [-1.5,0,0,-4]
    trimmed = get("ties").merge([d1, d2, d3], job(0.5))
    assert torch.allclose(trimmed, torch.tensor([1.5, -2.0, 0.0, -4.0]))


def test_ties_model_matches_dense_formula(tmp_path, models):
    base, fts = models
    got = _merge(tmp_path, base, fts, "ties", parameters={"density": 0.3})
    b, sds = state(base), [state(f) for f in fts]
    for name in b:
        ds = []
        for sd in sds:
            d = (sd[name] - b[name]).flatten()
            keep = d.abs().argsort(descending=True)[: int(0.3 * d.numel())]
            t = torch.zeros_like(d)
            t[keep] = d[keep]
            ds.append(t)
        D = torch.stack(ds)
        sign = torch.where(D.sum(0) >= 0, 1.0, -1.0)
        agree = (D.sign() == sign).float()
        want = (D * agree).sum(0) / agree.sum(0).clamp_min(1)
        assert torch.allclose(got[name].flatten(), b[name].flatten() + want, atol=1e-6), name


def test_dare(tmp_path, models):
    base, fts = models
    b, sds = state(base), [state(f) for f in fts]
    # drop rate 0: dare-linear is task arithmetic, dare-ties is TIES without trimming
    lin0 = _merge(tmp_path, base, fts, "dare-linear", parameters={"drop_rate": 0.0})
    for name in b:
        assert torch.allclose(lin0[name], b[name] + sum(sd[name] - b[name] for sd in sds), atol=1e-6)
    a = _merge(tmp_path / "a", base, fts, "dare-ties", parameters={"drop_rate": 0.5}, seed=3)
    again = _merge(tmp_path / "b", base, fts, "dare-ties", parameters={"drop_rate": 0.5}, seed=3)
    other = _merge(tmp_path / "c", base, fts, "dare-ties", parameters={"drop_rate": 0.5}, seed=4)
    name = "model.layers.0.mlp.up_proj.weight"
    assert all(torch.equal(a[n], again[n]) for n in a)
    assert not torch.equal(a[name], other[name])
    # a single model: about half of the delta entries survive, rescaled by 2
    one = _merge(tmp_path / "d", base, fts[:1], "dare-linear", parameters={"drop_rate": 0.5})
    d, full = one[name] - b[name], sds[0][name] - b[name]
    kept = d != 0
    assert 0.4 < kept.float().mean() < 0.6
    assert torch.allclose(d[kept], 2 * full[kept], atol=1e-5)


def test_slerp(tmp_path, models):
    base, fts = models
    got = _merge(tmp_path, None, fts[:2], "slerp", parameters={"t": 0.3})
    a, c = state(fts[0]), state(fts[1])
    for name in a:
        x, y = a[name].double().flatten(), c[name].double().flatten()
        cos = float(x @ y / (x.norm() * y.norm()))
        if abs(cos) > 0.9995:
            want = 0.7 * x + 0.3 * y
        else:
            om = math.acos(cos)
            want = (math.sin(0.7 * om) * x + math.sin(0.3 * om) * y) / math.sin(om)
        assert torch.allclose(got[name].double().flatten(), want, atol=1e-5), name
