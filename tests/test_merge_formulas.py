"""Each added merge method against its formula written out here in numpy, on small random tensors.

The references share nothing with the library but, for the randomized methods, the uniform draws
(taken from the same per-tensor generator, so the comparison is exact).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mlxkit.engines.merge.methods.base import TensorJob, tensor_generator
from mlxkit.engines.merge.methods.registry import get


def _rand(*shape, seed):
    return torch.from_numpy(np.random.default_rng(seed).standard_normal(shape)).float()


def _job(method, params=None, model_params=None, n=2, base=None, matrix=True, seed=123):
    m = get(method)
    defaults = {k: p.default for k, p in m.all_parameters().items() if not p.per_model}
    per = [{k: p.default for k, p in m.all_parameters().items() if p.per_model} for _ in range(n)]
    for i, extra in enumerate(model_params or []):
        per[i].update(extra)
    return m, TensorJob("model.layers.0.mlp.up_proj.weight", matrix, {**defaults, **(params or {})}, per, seed,
                        base=base)


def _close(got, want, tol=1e-5):
    np.testing.assert_allclose(got.double().numpy(), np.asarray(want, dtype=np.float64), rtol=tol, atol=tol)


def _elect(stack):
    return np.where(stack.sum(0) >= 0, 1.0, -1.0)


# ---- breadcrumbs -------------------------------------------------------------------------------

def _band(d, density, gamma):
    flat = d.reshape(-1)
    n = flat.size
    keep, top = int(density * n), int(gamma * n)
    bottom = n - keep - top
    if bottom < 0:
        bottom, top = 0, n - keep
    ranked = np.argsort(np.abs(flat), kind="stable")
    mask = np.zeros(n)
    mask[ranked[bottom:n - top]] = 1
    return (flat * mask).reshape(d.shape)


@pytest.mark.parametrize("name", ["breadcrumbs", "breadcrumbs-ties"])
def test_breadcrumbs(name):
    deltas = [_rand(6, 10, seed=s) for s in (1, 2)]
    mp = [{"weight": 0.7, "density": 0.6, "gamma": 0.1}, {"weight": 0.4, "density": 0.5, "gamma": 0.2}]
    m, job = _job(name, model_params=mp)
    w = np.array([0.7, 0.4])[:, None, None]
    kept = np.stack([_band(d.numpy(), p["density"], p["gamma"]) for d, p in zip(deltas, mp)]) * w
    if name == "breadcrumbs":
        want = kept.sum(0)  # normalize defaults to false, as mergekit
    else:
        agree = np.sign(kept) == _elect(kept)
        want = (kept * agree).sum(0) / np.where((w * agree).sum(0) == 0, 1, (w * agree).sum(0))
    _close(m.merge(deltas, job), want)
    # 60% kept of 60 entries, the 6 largest dropped
    assert (m.merge(deltas[:1], _job(name, model_params=mp[:1], n=1)[1]) != 0).sum() == 36


# ---- della -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["della", "della-linear"])
def test_della(name):
    deltas = [_rand(5, 8, seed=s) for s in (3, 4)]
    mp = [{"weight": 1.0, "density": 0.5, "epsilon": 0.1}, {"weight": 0.5, "density": 0.4, "epsilon": 0.2}]
    m, job = _job(name, model_params=mp)
    pruned = []
    for i, (d, p) in enumerate(zip(deltas, mp)):
        x = d.numpy()
        ranks = np.argsort(np.argsort(np.abs(x), axis=1, kind="stable"), axis=1, kind="stable")
        prob = p["density"] - p["epsilon"] + 2 * p["epsilon"] * ranks / (x.shape[1] - 1)
        u = torch.rand(d.shape, generator=tensor_generator(job, i, torch.device("cpu"))).numpy()
        keep = u < prob
        pruned.append(np.where(keep, x / prob, 0.0))  # rescale defaults to true
    w = np.array([1.0, 0.5])[:, None, None]
    stack = np.stack(pruned) * w
    if name == "della":
        agree = np.sign(stack) == _elect(stack)
        want = (stack * agree).sum(0) / np.where((w * agree).sum(0) == 0, 1, (w * agree).sum(0))
    else:
        want = stack.sum(0)
    got = m.merge(deltas, job)
    _close(got, want)
    assert torch.equal(got, m.merge(deltas, job))  # seeded: the same bits again


def test_della_refuses_probabilities_outside_unit_interval():
    from mlxkit.engines.errors import InputError

    m, job = _job("della", model_params=[{"density": 0.1, "epsilon": 0.3}], n=1)
    with pytest.raises(InputError, match="density ± epsilon"):
        m.merge([_rand(3, 4, seed=0)], job)


# ---- model stock -------------------------------------------------------------------------------

@pytest.mark.parametrize("filter_wise", [False, True])
def test_model_stock(filter_wise):
    base = _rand(4, 6, seed=9)
    common = _rand(4, 6, seed=10)
    deltas = [common + 0.7 * _rand(4, 6, seed=s) for s in (11, 12, 13)]
    m, job = _job("model-stock", {"filter_wise": filter_wise}, n=3)
    d = np.stack([x.numpy().astype(np.float64) for x in deltas])
    rows = d if filter_wise else d.reshape(3, 1, -1)
    cos = []
    for i in range(3):
        for j in range(i + 1, 3):
            a, b = rows[i], rows[j]
            cos.append((a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)))
    c = np.mean(cos, axis=0)
    t = 3 * c / (1 + 2 * c)
    merged_weights = (t[:, None] * (base.numpy() + d).mean(0).reshape(rows.shape[1], -1)
                      + (1 - t[:, None]) * base.numpy().reshape(rows.shape[1], -1)).reshape(4, 6)
    _close(base + m.merge(deltas, job), merged_weights)


# ---- SLERP family -------------------------------------------------------------------------------

def _np_slerp(t, a, b):
    cos = a @ b / (np.linalg.norm(a) * np.linalg.norm(b))
    om = np.arccos(cos)
    return (np.sin((1 - t) * om) * a + np.sin(t * om) * b) / np.sin(om)


@pytest.mark.parametrize("flatten,row_wise", [(True, False), (False, True), (False, False)])
def test_nuslerp_with_base(flatten, row_wise):
    base, a, b = (_rand(4, 5, seed=s) for s in (20, 21, 22))
    mp = [{"weight": 3.0}, {"weight": 1.0}]
    m, job = _job("nuslerp", {"nuslerp_flatten": flatten, "nuslerp_row_wise": row_wise}, mp, base=base)
    da, db = (a - base).numpy().astype(np.float64), (b - base).numpy().astype(np.float64)
    t = 0.25
    if flatten:
        want = _np_slerp(t, da.ravel(), db.ravel()).reshape(4, 5)
    elif row_wise:  # mergekit's axes: vectors along the first dimension
        want = np.stack([_np_slerp(t, da[:, j], db[:, j]) for j in range(5)], axis=1)
    else:
        want = np.stack([_np_slerp(t, da[i], db[i]) for i in range(4)])
    _close(m.merge([a, b], job), base.numpy() + want)


def test_nuslerp_without_base_interpolates_the_weights():
    a, b = _rand(3, 7, seed=30), _rand(3, 7, seed=31)
    m, job = _job("nuslerp", model_params=[{"weight": 1.0}, {"weight": 1.0}])
    _close(m.merge([a, b], job), _np_slerp(0.5, a.numpy().ravel().astype(float), b.numpy().ravel()).reshape(3, 7))


def _np_log(m, x):
    c = np.clip(x @ m, -1, 1)
    th = np.arccos(c)
    return (th / np.sin(th))[:, None] * (x - c[:, None] * m)


def _np_exp(m, v):
    n = np.linalg.norm(v)
    return np.cos(n) * m + np.sin(n) * v / n


def test_multislerp():
    base = _rand(4, 4, seed=40)
    xs = [_rand(4, 4, seed=s) for s in (41, 42, 43)]
    mp = [{"weight": 2.0}, {"weight": 1.0}, {"weight": 1.0}]
    m, job = _job("multislerp", model_params=mp, n=3, base=base)
    x = np.stack([(t - base).numpy().ravel().astype(np.float64) for t in xs])
    w = np.array([0.5, 0.25, 0.25])
    norms = np.linalg.norm(x, axis=1)
    unit = x / (norms[:, None] + 1e-8)
    mean = (w[:, None] * unit).sum(0)
    mean /= np.linalg.norm(mean)
    tangent = (w[:, None] * (unit - (unit @ mean)[:, None] * mean)).sum(0)  # projections, not log maps
    length = np.linalg.norm(tangent) + 1e-8
    res = (mean * np.cos(length) + tangent * np.sin(length) / length) * (w * norms).sum()
    _close(m.merge(xs, job), base.numpy() + res.reshape(4, 4))


def test_karcher_two_points_is_the_geodesic_midpoint():
    a, b = _rand(3, 5, seed=50), _rand(3, 5, seed=51)
    m, job = _job("karcher", model_params=[{"weight": 1.0}, {"weight": 1.0}])
    an, bn = a.numpy().ravel().astype(float), b.numpy().ravel().astype(float)
    ua, ub = an / np.linalg.norm(an), bn / np.linalg.norm(bn)
    want = _np_slerp(0.5, ua, ub) * (np.linalg.norm(an) + np.linalg.norm(bn)) / 2
    _close(m.merge([a, b], job), want.reshape(3, 5))


def test_karcher_is_a_stationary_point_of_the_weighted_distances():
    xs = [_rand(6, seed=s) for s in (60, 61, 62, 63)]
    w = np.array([1.0, 2.0, 3.0, 4.0]) / 10
    m, job = _job("karcher", {"max_iter": 100, "tol": 1e-12}, [{"weight": float(v * 10)} for v in w], n=4)
    out = m.merge(xs, job).double().numpy()
    x = np.stack([t.numpy().astype(float) for t in xs])
    unit = x / np.linalg.norm(x, axis=1)[:, None]
    mu = out / np.linalg.norm(out)
    assert np.linalg.norm((w[:, None] * _np_log(mu, unit)).sum(0)) < 1e-5
    assert np.isclose(np.linalg.norm(out), (w * np.linalg.norm(x, axis=1)).sum(), rtol=1e-5)


# ---- SCE, Arcee Fusion, passthrough --------------------------------------------------------------

@pytest.mark.parametrize("topk", [1.0, 0.4])
def test_sce(topk):
    deltas = [_rand(5, 6, seed=s) for s in (70, 71, 72)]
    m, job = _job("sce", {"select_topk": topk}, n=3)
    d = np.stack([x.numpy().astype(np.float64) for x in deltas])
    if topk < 1:
        var = d.var(0)
        k = int(np.count_nonzero(var) * topk)
        mask = np.zeros(var.size)
        mask[np.argsort(-var.ravel(), kind="stable")[:k]] = 1
        d = d * mask.reshape(var.shape)
    energy = (d ** 2).reshape(3, -1).mean(1)
    w = (energy / energy.sum())[:, None, None]
    agree = np.sign(d) == _elect(d)
    want = (d * agree * w).sum(0) / np.maximum((w * agree).sum(0), 1e-6)
    _close(m.merge(deltas, job), want)


def test_arcee_fusion():
    base, theta = _rand(5, 7, seed=80), _rand(5, 7, seed=81)  # 35 entries: one middle value
    m, job = _job("arcee-fusion", n=1, base=base)
    b, t = base.numpy().astype(np.float64), theta.numpy().astype(np.float64)

    def softmax(x):
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    p, q = softmax(t) + 1e-8, softmax(b) + 1e-8
    score = np.abs(t - b) * (p * np.log(p / q)).sum(-1, keepdims=True)
    q1, med, q3 = np.quantile(score, [0.25, 0.5, 0.75])
    want = np.where(score >= med + 1.5 * (q3 - q1), t - b, 0.0)
    assert 0 < (want != 0).sum() < want.size
    _close(m.merge([theta - base], job), want)


def test_passthrough_scales():
    x = _rand(3, 3, seed=90)
    m, job = _job("passthrough", model_params=[{"scale": 0.5}], n=1)
    _close(m.merge([x], job), 0.5 * x.numpy())


# ---- TSV-M -------------------------------------------------------------------------------------

def _np_polar(x):
    u, _, vh = np.linalg.svd(x, full_matrices=False)
    return u @ vh


@pytest.mark.parametrize("shape", [(12, 8), (8, 12)])
def test_tsv_m(shape):
    deltas = [_rand(*shape, seed=s) for s in (100, 101, 102)]
    m, job = _job("tsv-m", n=3)
    r = min(shape)
    k = int(r * (1.0 / 3))
    us, ss, vs = [], [], []
    for d in deltas:
        u, s, vh = np.linalg.svd(d.numpy().astype(np.float64), full_matrices=False)
        us.append(u[:, :k]); ss.append(s[:k]); vs.append(vh[:k])
    want = _np_polar(np.concatenate(us, 1)) @ np.diag(np.concatenate(ss)) @ _np_polar(np.concatenate(vs, 0))
    _close(m.merge(deltas, job), want, tol=1e-4)
    _, job1 = _job("tsv-m", n=1)
    _close(m.merge(deltas[:1], job1), deltas[0].numpy(), tol=1e-4)  # one task: its own task vector
    _, vector_job = _job("tsv-m", n=3, matrix=False)
    _close(m.merge(deltas, vector_job), np.mean([d.numpy() for d in deltas], 0))


# ---- nearswap ----------------------------------------------------------------------------------

def test_nearswap():
    base, other = _rand(5, 7, seed=11), _rand(5, 7, seed=12) * 0.01
    other = base + other
    other[0, :3] = base[0, :3]  # unchanged elements swap fully
    t = 0.004
    m, job = _job("nearswap", params={"t": t})
    b, o = base.double().numpy(), other.double().numpy()
    want = np.empty_like(b)
    for idx in np.ndindex(b.shape):
        d = abs(b[idx] - o[idx])
        w = 1.0 if d == 0 else min(1.0, t / d)
        want[idx] = w * o[idx] + (1 - w) * b[idx]
    got = m.merge([base, other], job)
    _close(got, want, tol=1e-6)
    assert 0 < (np.abs(want - o) > 1e-9).sum() < want.size  # some elements swapped, some kept part of the base


def test_nearswap_needs_a_positive_threshold():
    from mlxkit.engines.errors import InputError

    with pytest.raises(InputError, match="t must be"):
        get("nearswap").all_parameters()["t"].check(0.0)


# ---- ram and ramplus-tl ------------------------------------------------------------------------

def _ram_reference(deltas, eps, plus=False, r=0.1, alpha=0.2):
    stack = np.stack([d.double().numpy() for d in deltas])
    changed = np.abs(stack) > eps
    counts = changed.sum(0)
    out = np.zeros(stack.shape[1:])
    for k in range(len(stack)):
        unique = changed[k] & (counts == 1)
        shared = changed[k] & (counts > 1)
        gain = 1.0
        if plus:
            rho = shared.sum() / max(unique.sum(), eps)
            gain = 1 + r * min(max(rho, 0.0), alpha)
        for idx in zip(*np.nonzero(unique)):
            out[idx] += stack[k][idx] * gain
        for idx in zip(*np.nonzero(shared)):
            out[idx] += stack[k][idx] / counts[idx]
    return out


@pytest.mark.parametrize("name, plus", [("ram", False), ("ramplus-tl", True)])
def test_ram(name, plus):
    rng = np.random.default_rng(5)
    deltas = []
    for s in (1, 2, 3):
        d = _rand(6, 8, seed=s).numpy()
        d[rng.random(d.shape) < 0.5] = 0.0  # sparse task vectors, so unique and shared elements both occur
        deltas.append(torch.from_numpy(d))
    m, job = _job(name, n=3, params={"epsilon": 1e-5})
    _close(m.merge(deltas, job), _ram_reference(deltas, 1e-5, plus=plus))
