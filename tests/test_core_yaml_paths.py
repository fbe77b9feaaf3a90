"""Recipe and profile names stay inside their package: no `..`, no symlink out of it."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from mlxkit.cli.main import app
from mlxkit.engines.core.yaml_config import packaged_names, packaged_yaml


@pytest.fixture
def package_with_escape(tmp_path, monkeypatch):
    """An importable package `yamlpkg` holding good.yaml and evil.yaml, a symlink to a file outside it."""
    (tmp_path / "outside.yaml").write_text("name: outside\n")
    package = tmp_path / "yamlpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "good.yaml").write_text("name: good\n")
    (package / "evil.yaml").symlink_to(tmp_path / "outside.yaml")
    monkeypatch.syspath_prepend(str(tmp_path))
    return package


def test_a_symlink_out_of_the_package_is_neither_listed_nor_loaded(package_with_escape):
    assert packaged_yaml("yamlpkg", "good") == (package_with_escape / "good.yaml").resolve()
    assert packaged_yaml("yamlpkg", "evil") is None
    assert packaged_names("yamlpkg") == ["good"]


@pytest.mark.parametrize("name", ["../yamlpkg/good", "good/../good", ".good", "good.yaml/..", "", "/good"])
def test_names_with_separators_or_dots_are_not_package_names(package_with_escape, name):
    assert packaged_yaml("yamlpkg", name) is None


def test_a_recipe_name_cannot_climb_out_of_the_recipes(tmp_path):
    """`--recipe ../../x` names no packaged recipe even when x.yaml exists up there: one clean error.

    With a separator it is a path, read as given; only a packaged lookup (name + ".yaml") could reach planted.yaml.
    """
    from pathlib import Path

    import mlxkit.recipes.finetune as finetune_recipes

    recipes_dir = Path(next(iter(finetune_recipes.__path__)))
    # No file `planted` exists, so only a packaged lookup (name + ".yaml") could reach planted.yaml.
    (tmp_path / "planted.yaml").write_text("name: planted\nmethod: full\nlora: null\n")
    climb = "/".join([".."] * len(recipes_dir.resolve().parts)) + str(tmp_path / "planted")
    result = CliRunner().invoke(app, ["finetune", "--recipe", climb, "--data", str(tmp_path / "planted.yaml"),
                                      "--out", str(tmp_path / "out")])
    assert result.exit_code != 0
    assert "does not exist" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()
