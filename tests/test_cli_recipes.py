"""`mlx recipes`: every packaged recipe YAML, by verb, as a table or as JSON."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from typer.testing import CliRunner

from conftest import REPO
from mlxkit.cli.main import app

runner = CliRunner()


def _packaged() -> set[tuple[str, str]]:
    """(verb, name) of every recipes/<verb>/<name>.yaml in the source tree."""
    return {(p.parent.name, p.stem) for p in (REPO / "recipes").glob("*/*.yaml") if not p.parent.name.startswith("_")}


def test_recipes_json_lists_every_packaged_recipe():
    result = runner.invoke(app, ["recipes", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert {(row["verb"], row["name"]) for row in rows} == _packaged()
    assert {("puzzle", "quick"), ("puzzle", "standard")} <= _packaged()
    for row in rows:
        assert set(row) == {"verb", "name", "description", "path"}
        path = Path(row["path"])
        assert path.name == f"{row['name']}.yaml" and path.parent.name == row["verb"]
        assert isinstance(yaml.safe_load(path.read_text()), dict)  # each one parses
    assert [(r["verb"], r["name"]) for r in rows] == sorted((r["verb"], r["name"]) for r in rows)


def test_recipes_table_names_each_recipe():
    result = runner.invoke(app, ["recipes"])
    assert result.exit_code == 0, result.output
    assert "packaged recipes" in result.stdout
    for verb, name in _packaged():
        assert name in result.stdout


# mergekit's methods (its README's table), by the names its configs use.
MERGEKIT_METHODS = ["linear", "slerp", "nuslerp", "multislerp", "karcher", "task_arithmetic", "ties", "dare_ties",
                    "dare_linear", "breadcrumbs", "breadcrumbs_ties", "della", "della_linear", "sce", "model_stock",
                    "arcee_fusion", "passthrough", "nearswap", "ram", "ramplus_tl"]


def test_methods_lists_every_mergekit_method_with_a_name_the_config_accepts():
    result = runner.invoke(app, ["recipes", "--methods", "--json"])
    assert result.exit_code == 0, result.output
    rows = {row["mergekit_name"]: row for row in json.loads(result.output)}
    assert set(MERGEKIT_METHODS) <= set(rows)
    # Each listed name and parameter is accepted by the config schema a merge validates.
    from mlxkit.engines.merge.config import validate_config

    for name in ("ties", "nearswap", "ramplus_tl"):
        params = {p["name"]: (p["default"] if not p["required"] else 0.5) for p in rows[name]["parameters"]
                  if not p["per_model"]}
        config = validate_config({"merge_method": name, "base_model": "b", "models": [{"model": "a"}],
                                  "parameters": params})
        assert config.merge_method
    for args in (["recipes", "--methods"], ["recipes"]):
        table = runner.invoke(app, args)
        assert table.exit_code == 0 and "nearswap" in table.output and "regmean" in table.output
