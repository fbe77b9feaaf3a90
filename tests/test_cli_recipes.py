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
