"""`mlx merge` through typer's CliRunner: happy path, dry run, JSON and one-line errors."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from mlxkit.cli.main import app
from test_merge_common import make_base, make_finetune

runner = CliRunner()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    base = make_base(root / "base")
    return base, [make_finetune(base, root / f"ft{i}", seed=30 + i) for i in range(3)]


def test_isotropic_json(tmp_path, models):
    base, fts = models
    out = tmp_path / "out"
    res = runner.invoke(app, ["merge", "--isotropic", *map(str, fts), "--base", str(base), "-o", str(out), "--json"])
    assert res.exit_code == 0, res.output
    payload = json.loads(res.stdout)
    assert payload["method"] == "iso-cts" and payload["alpha"] == 1.0 and (out / "config.json").exists()
    again = runner.invoke(app, ["merge", "--isotropic", *map(str, fts), "--base", str(base), "-o", str(out)])
    assert again.exit_code == 2 and "already exists" in again.output


def _poison_weights(model):
    """Overwrite every tensor byte (not the header) with 0xFF, which reads as NaN in every float dtype."""
    from mlxkit.engines.io import read_safetensors_header

    for file in model.glob("*.safetensors"):
        start = read_safetensors_header(file).data_start
        raw = bytearray(file.read_bytes())
        raw[start:] = b"\xff" * (len(raw) - start)
        file.write_bytes(bytes(raw))


def test_dry_run_reads_no_weights(tmp_path, models, monkeypatch):
    base, fts = models
    poisoned = []
    for ft in fts[:2]:
        shutil.copytree(ft, tmp_path / ft.name)
        _poison_weights(tmp_path / ft.name)
        poisoned.append(tmp_path / ft.name)
    from mlxkit.engines.io.lazy_loader import LazyTensorLoader

    reads = []
    original = LazyTensorLoader.get_tensor
    monkeypatch.setattr(LazyTensorLoader, "get_tensor", lambda self, name: reads.append(name) or original(self, name))
    args = ["merge", "--method", "ties", *map(str, poisoned), "--base", str(base), "--param", "density=0.3"]
    res = runner.invoke(app, [*args, "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "model.layers.0.mlp.down_proj.weight" in res.output and "density" in res.output
    assert reads == []
    # the same command for real does read the poisoned bytes, and refuses them
    res = runner.invoke(app, [*args, "-o", str(tmp_path / "out")])
    assert res.exit_code != 0 and reads
    assert "has NaN or infinite values" in res.output and str(poisoned[0]) in res.output
    assert not (tmp_path / "out").exists()


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
    (["--alpha", "big"], "alpha must be a number in [-100, 100] or 'auto' (got 'big')"),
    (["--alpha", "nan"], "alpha must be a number in [-100, 100] or 'auto' (got 'nan')"),
    (["--alpha", "inf"], "alpha must be a number in [-100, 100]"),
    (["--alpha", "1e308"], "alpha must be a number in [-100, 100]"),
    (["--method", "ties", "--param", "density=abc"], "parameters.density: density must be a number in [0, 1] (got 'abc')"),
    (["--method", "ties", "--param", "density=2"], "density must be a number in [0, 1] (got 2)"),
    (["--method", "ties", "--param", "density=-1"], "density must be a number in [0, 1] (got -1)"),
    (["--method", "ties", "--param", "density=nan"], "density must be a number in [0, 1] (got 'nan')"),
    (["--method", "ties", "--param", "density=.nan"], "density must be a number in [0, 1] (got nan)"),
    (["--method", "ties", "--param", "weight=abc"], "parameters.weight: weight must be a finite number (got 'abc')"),
    (["--method", "ties", "--param", "weight=.inf"], "weight must be a finite number (got inf)"),
    (["--method", "ties", "--param", "normalize=maybe"], "normalize must be true or false"),
    (["--method", "ties", "--param", "density=[{filter: mlp, value: 7}]"],
     "parameters.density.0.value: density must be a number in [0, 1] (got 7)"),
    (["--method", "dare-ties", "--param", "drop_rate=1.5"], "drop_rate must be a number in [0, 1]"),
    (["--method", "iso-cts", "--common-frac", "nan"], "common_frac must be a number in (0, 1]"),
    (["--method", "iso-cts", "--common-frac", "0"], "common_frac must be a number in (0, 1] (got '0')"),
    (["--method", "iso-cts", "--common-frac", "most"], "common_frac must be a number in (0, 1] (got 'most')"),
    (["--method", "iso-cts", "--param", "power_iters=2.5"], "power_iters must be an integer in [0, 100]"),
    # Neither spelling of one parameter wins silently, and a value YAML cannot read is refused as it is read.
    (["--method", "iso-cts", "--common-frac", "0.5", "--param", "common_frac=0.6"],
     "--common-frac and --set common_frac= both set common_frac"),
    (["--method", "iso-cts", "--param", "common-frac=0.5", "--param", "common_frac=0.6"],
     "--set common_frac= is given twice"),
    (["--method", "ties", "--param", "density=[[["], "--set density: cannot read the value '[[['"),
    (["--max-shard-size", "huge"], "cannot read max_shard_size 'huge'"),
])
def test_errors_are_one_line(tmp_path, models, args, message):
    base, fts = models
    res = runner.invoke(app, ["merge", *map(str, fts), "--base", str(base), "-o", str(tmp_path / "o"), *args])
    assert res.exit_code != 0
    assert message in res.output and "Traceback" not in res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), res.output
    assert not (tmp_path / "o").exists()


def test_every_bad_parameter_is_reported_at_once(tmp_path, models):
    base, fts = models
    recipe = tmp_path / "merge.yaml"
    recipe.write_text(f"models:\n  - model: {fts[0]}\n    parameters: {{density: 3}}\n  - model: {fts[1]}\n"
                      f"    parameters: {{weight: x}}\nbase_model: {base}\nmerge_method: ties\n"
                      "parameters: {normalize: 2}\nalpha: .nan\n")
    res = runner.invoke(app, ["merge", "--recipe", str(recipe), "-o", str(tmp_path / "o")])
    assert res.exit_code == 2 and len(res.output.strip().splitlines()) == 1
    for part in ("alpha: alpha must be", "models.0.parameters.density: density must be a number in [0, 1] (got 3)",
                 "models.1.parameters.weight: weight must be a finite number (got 'x')",
                 "parameters.normalize: normalize must be true or false (got 2)"):
        assert part in res.output
    assert not (tmp_path / "o").exists()


def test_duplicate_inputs_are_an_error(tmp_path, models):
    base, fts = models
    res = runner.invoke(app, ["merge", str(fts[0]), str(fts[1]), f"{fts[0]}/", "--base", str(base),
                              "-o", str(tmp_path / "o")])
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "models.2.model" in res.output and "same model as models.0" in res.output
    assert not (tmp_path / "o").exists()


def test_base_with_malformed_config_is_a_clean_error(tmp_path, models):
    base, fts = models
    broken = tmp_path / "base"
    shutil.copytree(base, broken)
    for text, phrase in [("{not json", "is not valid JSON"), ("[1, 2]", "must hold a JSON object")]:
        (broken / "config.json").write_text(text)
        res = runner.invoke(app, ["merge", *map(str, fts[:2]), "--base", str(broken), "-o", str(tmp_path / "o")])
        assert res.exit_code == 2 and phrase in res.output and str(broken / "config.json") in res.output
        assert len(res.output.strip().splitlines()) == 1 and not (tmp_path / "o").exists()


@pytest.mark.parametrize("verb", ["merge", "eval"])
def test_truncated_safetensors_is_one_error_line(tmp_path, models, verb):
    base, fts = models
    broken = tmp_path / "ft"
    shutil.copytree(fts[0], broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    if verb == "merge":
        args = ["merge", str(broken), str(fts[1]), "--base", str(base), "-o", str(tmp_path / "o")]
    else:
        args = ["eval", str(broken), "--max-tokens", "16", "--seq-len", "8"]
    res = runner.invoke(app, args)
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in res.output
    assert str(weights) in res.output and "not a valid safetensors file" in res.output
    assert not (tmp_path / "o").exists()


def test_missing_base_and_missing_model(tmp_path, models):
    _, fts = models
    res = runner.invoke(app, ["merge", "--method", "ties", *map(str, fts), "-o", str(tmp_path / "o")])
    assert res.exit_code == 2 and "needs a base model" in res.output
    res = runner.invoke(app, ["merge", str(tmp_path / "nowhere"), "--base", str(fts[0]), "-o", str(tmp_path / "o")])
    assert res.exit_code != 0 and "nowhere" in res.output
