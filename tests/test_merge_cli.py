"""`mlx merge` through typer's CliRunner: happy path, dry run, JSON and one-line errors."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from mlxkit.cli.main import app
from test_merge_common import make_base, make_finetune

runner = CliRunner()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    base = make_base(root / "base")
    return base, [make_finetune(base, root / f"ft{i}", seed=30 + i) for i in range(2)]


def test_isotropic_json(tmp_path, models):
    base, fts = models
    out = tmp_path / "out"
    res = runner.invoke(app, ["merge", "--isotropic", *map(str, fts), "--base", str(base), "-o", str(out), "--json"])
    assert res.exit_code == 0, res.output
    payload = json.loads(res.stdout)
    assert payload["method"] == "iso-cts" and payload["alpha"] == 1.0 and (out / "config.json").exists()
    again = runner.invoke(app, ["merge", "--isotropic", *map(str, fts), "--base", str(base), "-o", str(out)])
    assert again.exit_code == 2 and "already exists" in again.output


def test_dry_run_reads_no_weights(tmp_path, models):
    base, fts = models
    res = runner.invoke(app, ["merge", "--method", "ties", *map(str, fts), "--base", str(base), "--dry-run",
                              "--param", "density=0.3"])
    assert res.exit_code == 0, res.output
    assert "model.layers.0.mlp.down_proj.weight" in res.output and "density" in res.output
    assert not list(tmp_path.iterdir())


def test_recipe(tmp_path, models):
    base, fts = models
    recipe = tmp_path / "merge.yaml"
    recipe.write_text(f"models:\n  - model: {fts[0]}\n  - model: {fts[1]}\nbase_model: {base}\n"
                      "merge_method: task_arithmetic\nalpha: 0.5\ndtype: float16\n")
    res = runner.invoke(app, ["merge", "--recipe", str(recipe), "-o", str(tmp_path / "o"), "-q"])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "o" / "config.json").read_text())["dtype"] == "float16"


@pytest.mark.parametrize("args,message", [
    (["--method", "nope"], "unknown merge method 'nope'"),
    (["--method", "ties", "--isotropic"], "conflicts"),
    (["--method", "slerp"], "takes 2 models"),
    (["--param", "density"], "key=value"),
    (["--param", "bogus=1"], "has no parameter 'bogus'"),
    (["--alpha", "auto"], "one text file per model"),
    (["--alpha", "big"], "number or 'auto'"),
    (["--max-shard-size", "huge"], "cannot read size"),
])
def test_errors_are_one_line(tmp_path, models, args, message):
    base, fts = models
    res = runner.invoke(app, ["merge", *map(str, fts), str(fts[0]), "--base", str(base), "-o",
                              str(tmp_path / "o"), *args])
    assert res.exit_code != 0
    assert message in res.output and "Traceback" not in res.output
    assert not (tmp_path / "o").exists()


def test_missing_base_and_missing_model(tmp_path, models):
    _, fts = models
    res = runner.invoke(app, ["merge", "--method", "ties", *map(str, fts), "-o", str(tmp_path / "o")])
    assert res.exit_code == 2 and "needs a base model" in res.output
    res = runner.invoke(app, ["merge", str(tmp_path / "nowhere"), "--base", str(fts[0]), "-o", str(tmp_path / "o")])
    assert res.exit_code != 0 and "nowhere" in res.output
