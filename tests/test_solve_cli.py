"""`mlx solve` through typer's CliRunner: every input format, the fallback, nullspace, and bad inputs."""

from __future__ import annotations

import json

import numpy as np
import pytest
import scipy.io
import scipy.sparse as sp
from typer.testing import CliRunner

from mlxkit.cli.main import app
from mlxkit.engines.solve.grid import stencil_mask, stencil_to_csr

runner = CliRunner()


def _stencil(height, width, seed=0, shift=0.2):
    rng = np.random.default_rng(seed)
    s = -(1.0 + rng.random((height, width, 3, 3))) * stencil_mask(height, width)
    s[..., 1, 1] = 0.0
    s[..., 1, 1] = -s.sum((-1, -2)) + shift  # variable-coefficient 9-point, nonsymmetric
    return s


def _sparse_npz(path, a, **extra):
    sp.save_npz(path, sp.csr_matrix(a))
    arrays = dict(np.load(path))
    arrays.update(extra)
    np.savez(path, **arrays)
    return path


def _solve(*args):
    return runner.invoke(app, ["solve", *map(str, args)])


def _report(res):
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_npz_grid_inferred_json_and_out(tmp_path):
    a = stencil_to_csr(_stencil(13, 17))
    b = np.random.default_rng(1).standard_normal((a.shape[0], 2))
    out = tmp_path / "x.npz"
    report = _report(_solve(_sparse_npz(tmp_path / "a.npz", a, b=b), "--out", out, "--json"))
    assert report["method"] == "ssi" and report["grid"] == [13, 17] and report["residual"] <= 1e-10
    assert any("inferred" in n for n in report["notices"])
    with np.load(out) as saved:
        assert np.linalg.norm(a @ saved["x"] - b) <= 1e-10 * np.linalg.norm(b)
        assert str(saved["method"]) == "ssi" and float(saved["residual"]) <= 1e-10
        assert {"factor_s", "solve_s", "report"} <= set(saved.files)


def test_grid_shape_key_and_plain_output(tmp_path):
    a = stencil_to_csr(_stencil(8, 9))
    path = _sparse_npz(tmp_path / "a.npz", a, b=np.ones(72), grid_shape=np.array([8, 9]))
    res = _solve(path)
    assert res.exit_code == 0, res.output
    assert "relative residual" in res.stdout and "ssi" in res.stdout


def test_mtx_with_rhs_and_grid_flag(tmp_path):
    a = stencil_to_csr(_stencil(10, 6, seed=3))
    scipy.io.mmwrite(tmp_path / "a.mtx", a)
    np.save(tmp_path / "b.npy", np.arange(60.0))
    report = _report(_solve(tmp_path / "a.mtx", "--rhs", tmp_path / "b.npy", "--grid", "10x6", "--json"))
    assert report["method"] == "ssi" and report["residual"] <= 1e-10


def test_stencil_form_both_layouts(tmp_path):
    s = np.stack([_stencil(9, 11, seed=k) for k in range(3)])
    b = np.random.default_rng(2).standard_normal((3, 9, 11, 2))
    np.savez(tmp_path / "s.npz", stencil=s, b=b)
    out = tmp_path / "x.npz"
    report = _report(_solve(tmp_path / "s.npz", "--json", "--out", out))
    assert report["systems"] == 3 and report["rhs_columns"] == 2 and report["residual"] <= 1e-10
    with np.load(out) as saved:
        assert saved["x"].shape == b.shape
    one = s[0]
    named = {"c": one[..., 1, 1], "n": one[..., 0, 1], "s": one[..., 2, 1], "w": one[..., 1, 0], "e": one[..., 1, 2],
             "nw": one[..., 0, 0], "ne": one[..., 0, 2], "sw": one[..., 2, 0], "se": one[..., 2, 2], "b": b[0, ..., 0]}
    np.savez(tmp_path / "named.npz", **named)
    assert _report(_solve(tmp_path / "named.npz", "--json"))["residual"] <= 1e-10


def test_float32_option(tmp_path):
    np.savez(tmp_path / "s.npz", stencil=_stencil(33, 33), b=np.ones((33, 33)))
    report = _report(_solve(tmp_path / "s.npz", "--precision", "float32", "--json"))
    assert report["dtype"] == "float32" and report["residual"] <= 1e-4


def test_fallback_for_non_grid_matrix(tmp_path):
    rng = np.random.default_rng(4)
    a = sp.random(60, 60, density=0.1, random_state=5) + sp.eye(60) * 10
    path = _sparse_npz(tmp_path / "a.npz", a, b=rng.standard_normal(60))
    res = _solve(path, "--json")
    report = _report(res)
    assert report["method"] in ("superlu", "pardiso") and report["residual"] <= 1e-10
    assert any("general sparse direct solver" in n for n in report["notices"])
    plain = _solve(path)  # without --json the notice goes to stderr
    assert plain.exit_code == 0 and "general sparse direct solver" in plain.stderr


def test_method_ssi_refuses_non_grid(tmp_path):
    a = sp.random(30, 30, density=0.2, random_state=1) + sp.eye(30) * 10
    res = _solve(_sparse_npz(tmp_path / "a.npz", a, b=np.ones(30)), "--method", "ssi")
    assert res.exit_code == 2 and "9-point" in res.stderr


def _neumann(height, width):
    s = _stencil(height, width, shift=0.0)
    return s


def test_singular_detected_then_nullspace_constant(tmp_path):
    s = _neumann(12, 15)
    b = np.random.default_rng(6).standard_normal((12, 15))
    np.savez(tmp_path / "s.npz", stencil=s, b=b)
    out = tmp_path / "x.npz"
    res = _solve(tmp_path / "s.npz", "--out", out)
    assert res.exit_code == 5 and "singular" in res.stderr and "Traceback" not in res.output
    assert not out.exists()
    report = _report(_solve(tmp_path / "s.npz", "--nullspace", "constant", "--json", "--out", out))
    assert report["nullspace"] == "constant" and report["compatible_residual"] <= 1e-10
    with np.load(out) as saved:
        assert abs(saved["x"].sum()) <= 1e-8


def test_nullspace_needs_constant_kernel(tmp_path):
    np.savez(tmp_path / "s.npz", stencil=_stencil(6, 6), b=np.ones((6, 6)))
    res = _solve(tmp_path / "s.npz", "--nullspace", "constant")
    assert res.exit_code == 2 and "A·1 = 0" in res.stderr


def _bad_inputs(tmp_path):
    good = stencil_to_csr(_stencil(5, 5))
    cases = {}
    cases["non-square"] = (_sparse_npz(tmp_path / "ns.npz", sp.random(4, 6, density=0.5, random_state=0),
                                       b=np.ones(4)), "square")
    cases["mismatched b"] = (_sparse_npz(tmp_path / "mb.npz", good, b=np.ones(7)), "25 rows")
    nan = good.copy()
    nan.data[3] = np.nan
    cases["nan matrix"] = (_sparse_npz(tmp_path / "nan.npz", nan, b=np.ones(25)), "NaN")
    cases["inf rhs"] = (_sparse_npz(tmp_path / "inf.npz", good, b=np.full(25, np.inf)), "NaN or Inf")
    (tmp_path / "empty.npz").write_bytes(b"")
    cases["empty file"] = (tmp_path / "empty.npz", "empty")
    (tmp_path / "corrupt.npz").write_bytes(b"PK\x03\x04 this is not a zip archive at all")
    cases["corrupt npz"] = (tmp_path / "corrupt.npz", "not a readable .npz")
    (tmp_path / "a.csv").write_text("1,2\n3,4\n")
    cases["unsupported format"] = (tmp_path / "a.csv", "unsupported format")
    np.savez(tmp_path / "keys.npz", foo=np.ones(3))
    cases["unknown npz layout"] = (tmp_path / "keys.npz", "neither")
    cases["missing rhs"] = (_sparse_npz(tmp_path / "norhs.npz", good), "no right-hand side")
    (tmp_path / "bad.mtx").write_text("%%MatrixMarket matrix coordinate real general\n3 3 2\n1 1\n")
    cases["corrupt mtx"] = (tmp_path / "bad.mtx", "Matrix Market")
    cases["missing file"] = (tmp_path / "nope.npz", "no such file")
    return cases


def test_bad_inputs_one_line_error_no_output(tmp_path):
    for name, (path, message) in _bad_inputs(tmp_path).items():
        out = tmp_path / f"out-{name.replace(' ', '_')}.npz"
        res = _solve(path, "--out", out)
        assert res.exit_code != 0, name
        assert "Traceback" not in res.output and res.stderr.startswith("error:"), (name, res.output)
        assert message in res.stderr, (name, res.stderr)
        assert len(res.stderr.strip().splitlines()) <= 2, (name, res.stderr)  # rich may wrap a long line
        assert not out.exists(), name
        assert not list(tmp_path.glob(f".{out.name}*")), name


def test_bad_flags(tmp_path):
    np.savez(tmp_path / "s.npz", stencil=_stencil(5, 5), b=np.ones((5, 5)))
    assert "HxW" in _solve(tmp_path / "s.npz", "--grid", "5by5").stderr
    assert "--method" in _solve(tmp_path / "s.npz", "--method", "cholmod").stderr
    out = tmp_path / "x.npz"
    out.write_bytes(b"keep me")
    res = _solve(tmp_path / "s.npz", "--out", out)
    assert res.exit_code == 2 and "already exists" in res.stderr and out.read_bytes() == b"keep me"


def test_a_factor_beyond_memory_exits_7_in_one_line_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr("mlxkit.engines.training.budget.machine_memory_bytes", lambda: 2**20)
    a = stencil_to_csr(_stencil(40, 40))
    out = tmp_path / "x.npz"
    res = _solve(_sparse_npz(tmp_path / "a.npz", a, b=np.ones(1600), grid_shape=np.array([40, 40])), "--out", out)
    assert res.exit_code == 7, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "40x40 grid" in lines[0] and "--precision float32" in lines[0]
    assert "Traceback" not in res.output and not out.exists()


@pytest.mark.parametrize("room, kept", [(10.0, True), (0.9, False)])
def test_the_cli_keeps_freed_memory_only_when_the_factor_leaves_room(tmp_path, monkeypatch, room, kept):
    import mlxkit.engines.solve.runner as runner_module
    from mlxkit.engines.solve.ssi import factor_bytes

    stored, levels = factor_bytes(40, 40, symmetric=False)
    share = runner_module._KEEP_FREED_SHARE
    monkeypatch.setattr(runner_module, "machine_memory_bytes", lambda: int(room * (stored + levels) / share))
    calls = []
    monkeypatch.setattr(runner_module, "keep_freed_memory", lambda: calls.append(1))
    a = stencil_to_csr(_stencil(40, 40))
    report = _report(_solve(_sparse_npz(tmp_path / "a.npz", a, b=np.ones(1600)), "--json"))
    assert report["residual"] <= 1e-10
    assert bool(calls) == kept
