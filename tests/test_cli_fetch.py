"""`mlx fetch`: resolve a model spec and report what it is; bad specs fail with one line."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from mlxkit.cli.main import app

runner = CliRunner()


def test_fetch_a_local_directory_reports_its_shape(tiny_llama_dir):
    result = runner.invoke(app, ["fetch", str(tiny_llama_dir), "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert info == {"spec": str(tiny_llama_dir), "kind": "directory", "path": str(tiny_llama_dir.resolve()),
                    "model_type": "llama", "layers": 2, "hidden_size": 32}
    # its config.json names the same directory
    again = json.loads(runner.invoke(app, ["fetch", str(tiny_llama_dir / "config.json"), "--json"]).stdout)
    assert again["path"] == info["path"] and again["kind"] == "directory"


def test_fetch_prints_one_ready_line(tiny_llama_dir):
    result = runner.invoke(app, ["fetch", str(tiny_llama_dir)])
    assert result.exit_code == 0, result.output
    # one line however long the path: a log must not get it wrapped at 80 columns
    assert result.stdout.startswith("ready ") and result.stdout.endswith(": llama, 2 layers, hidden 32\n")
    assert str(tiny_llama_dir.resolve()) in result.stdout and result.stdout.count("\n") == 1
    assert not runner.invoke(app, ["fetch", str(tiny_llama_dir), "--quiet"]).stdout


@pytest.mark.parametrize("spec,exit_code,words", [
    ("not a spec!", 2, "is not a local path, a .gguf file, a hub id or a known alias"),
    ("{tmp}", 3, "has no config.json"),
    ("some-org/some-model", 3, "HF_HUB_OFFLINE"),  # the conftest keeps the hub off
])
def test_fetch_refuses_a_bad_spec_in_one_line(tmp_path, spec, exit_code, words):
    spec = spec.format(tmp=tmp_path)
    result = runner.invoke(app, ["fetch", spec])
    assert result.exit_code == exit_code
    assert result.stderr.startswith("error:") and words in result.stderr and spec in result.stderr
    assert "Traceback" not in result.output and result.stdout == ""
