"""`mlx search` end to end on a tiny parent, and `--costs-only` from a config alone."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

import mlxkit  # noqa: F401
from mlxkit.cli.main import app
from mlxkit.engines.puzzle.library import read_library

runner = CliRunner()


@pytest.fixture
def built_library(tiny_llama_dir, text_file, tiny_recipe_file, tmp_path):
    out = tmp_path / "lib"
    result = runner.invoke(app, ["distill", "--bld", "--model", str(tiny_llama_dir), "--recipe", str(tiny_recipe_file),
                                 "--data", str(text_file), "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    return out


def test_search_saves_a_child_that_loads_and_generates(built_library, tmp_path):
    out = tmp_path / "child"
    result = runner.invoke(app, ["search", "--target", "h100", "--library", str(built_library), "--throughput", "1.3x",
                                 "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["predicted"]["speedup"] >= 1.3 - 1e-6
    assert len(payload["choices"]) == 2 and payload["objective"] > 0
    library = read_library(built_library)
    expected = sum(library["layers"][c["layer"]][kind][c[kind]]["metrics"]["kl_div"]
                   for c in payload["choices"] for kind in ("attention", "ffn"))
    assert payload["objective"] == pytest.approx(expected, rel=1e-6)
    child = AutoModelForCausalLM.from_pretrained(out).eval()
    config = json.loads((out / "config.json").read_text())
    for row, block in zip(payload["choices"], config["block_configs"]):
        assert (row["attention"] == "no_op") == block["attention"]["no_op"]
        assert (row["ffn"] == "linear") == block["ffn"]["replace_with_linear"]
    assert sum(p.numel() for p in child.parameters()) == payload["num_params"]
    generated = child.generate(torch.tensor([[1, 40, 50]]), max_new_tokens=4, do_sample=False, pad_token_id=2)
    assert generated.shape == (1, 7)
    manifest = json.loads((out / "mlxkit.json").read_text())
    assert manifest["verb"] == "search" and manifest["results"]["choices"] == payload["choices"]
    assert "evaluation" in payload and payload["evaluation"]["perplexity"] > 1


def test_infeasible_budget_explains_the_best_reachable(built_library, tmp_path):
    result = runner.invoke(app, ["search", "--library", str(built_library), "--memory", "1KiB",
                                 "--out", str(tmp_path / "never")])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "memory" in result.output and "smallest" in result.output
    assert not (tmp_path / "never").exists()


def test_diverse_solutions_and_batch_sweep(built_library, tmp_path):
    result = runner.invoke(app, ["search", "--library", str(built_library), "--throughput", "1.2x", "--solutions", "2",
                                 "--min-distance", "1", "--batch-sweep", "1,64", "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert set(payload["batch_sweep"]) == {"1", "64"} or set(payload["batch_sweep"]) == {1, 64}
    assert payload["alternatives"] and payload["alternatives"][0]["distance_from_best"] >= 1
    assert "out" not in payload


def test_costs_only_prices_from_a_config_without_weights(tiny_llama_dir, tmp_path):
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_text((tiny_llama_dir / "config.json").read_text())
    result = runner.invoke(app, ["search", "--costs-only", "--model", str(config_only / "config.json"),
                                 "--target", "a100-80gb", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert set(report["attention"]) == {"kv2", "kv1", "linear", "no_op"}
    assert report["attention"]["kv2"]["num_params"] > report["attention"]["kv1"]["num_params"]
    assert report["ffn"]["no_op"]["num_params"] == 0


def test_search_builds_the_missing_library_then_reuses_it(tiny_llama_dir, text_file, tiny_recipe_file, tmp_path):
    args = ["search", "--model", str(tiny_llama_dir), "--recipe", str(tiny_recipe_file), "--data", str(text_file),
            "--throughput", "1.2x", "--json"]
    first = runner.invoke(app, [*args, "--out", str(tmp_path / "a")])
    assert first.exit_code == 0, first.output
    library = json.loads(first.stdout)["library"]
    assert (tmp_path / "a" / "config.json").exists()
    from mlxkit.engines.puzzle.library import LibraryDir

    block = next(LibraryDir(library).blocks.glob("*.safetensors"))
    stamp = block.stat().st_mtime_ns
    second = runner.invoke(app, [*args, "--out", str(tmp_path / "b")])
    assert second.exit_code == 0, second.output
    assert json.loads(second.stdout)["library"] == library and block.stat().st_mtime_ns == stamp
