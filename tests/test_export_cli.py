"""`mlx export` on the command line; the recipe settings that keep a search's children exportable."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from test_export_support import make_child_dir

from mlxkit.cli.main import app
from mlxkit.engines.export import gguf_manifest_path

runner = CliRunner()


def test_cli_exports_with_json_and_refuses_to_overwrite(tmp_path):
    child = make_child_dir(tmp_path / "child", names=("kv2+ffn256", "no_op+ffn128"))
    out = tmp_path / "child.gguf"
    result = runner.invoke(app, ["export", str(child), "--format", "gguf", "--out", str(out), "--encoding", "q8_0",
                                 "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["out"] == str(out.resolve()) and payload["dtype"] == "q8_0"
    assert payload["gguf"]["head_count"] == [4, 0] and payload["gguf"]["feed_forward_length"] == [256, 128]
    assert out.exists() and gguf_manifest_path(out).exists()

    again = runner.invoke(app, ["export", str(child), "--format", "gguf", "--out", str(out)])
    assert again.exit_code == 2 and "already exists" in again.output and "Traceback" not in again.output
    replaced = runner.invoke(app, ["export", str(child), "--format", "gguf", "--out", str(out), "--overwrite",
                                   "--quiet"])
    assert replaced.exit_code == 0 and replaced.stdout.strip() == str(out.resolve())


def test_cli_dry_run_prints_the_gguf_encoding_and_writes_nothing(tmp_path):
    child = make_child_dir(tmp_path / "child", names=("no_op+ffn128", "kv1+no_op"))
    result = runner.invoke(app, ["export", str(child), "--format", "gguf", "--out", str(tmp_path / "c.gguf"),
                                 "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["dry_run"] and payload["gguf"]["head_count"] == [4, 4] and payload["gguf"]["head_count_kv"] == [0, 1]
    assert payload["gguf"]["feed_forward_length"] == [128, 1]
    assert any("zero FFN" in note for note in payload["notes"])
    assert not list(tmp_path.glob("*.gguf*")) and not list(tmp_path.glob(".c.gguf*"))


def test_cli_errors_are_one_line_and_write_nothing(tmp_path):
    child = make_child_dir(tmp_path / "child", names=("kv2+linear", "kv1+ffn128"))
    result = runner.invoke(app, ["export", str(child), "--format", "gguf", "--out", str(tmp_path / "c.gguf")])
    assert result.exit_code == 2
    assert "error: llama.cpp's deci architecture has no linear FFN; layers 0 use one" in " ".join(result.output.split())
    assert not list(tmp_path.glob("*.gguf*")) and not list(tmp_path.glob(".c.gguf*"))

    result = runner.invoke(app, ["export", str(child), "--format", "onnx", "--out", str(tmp_path / "x"), "--json"])
    assert result.exit_code == 2
    assert json.loads(result.stdout.splitlines()[0])["error"]["type"] == "InputError"

    result = runner.invoke(app, ["export", str(child), "--format", "gguf", "--out", str(tmp_path / "c.bin")])
    assert result.exit_code == 2 and "ending in .gguf" in result.output


def test_recipe_settings_keep_every_child_exportable():
    """`ffn_linear: false` leaves linear FFN out (GGUF); `width_multiple: 256` keeps widths Nemotron-NAS exact."""
    from mlxkit.engines.export.plan import nas_width_ok
    from mlxkit.engines.models.decilm.blocks import ParentShape
    from mlxkit.engines.puzzle.recipe import load_recipe
    from mlxkit.engines.puzzle.search_space import build_search_space

    smollm2 = ParentShape(hidden_size=576, num_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                          intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True)
    for name in ("quick", "standard"):
        recipe = load_recipe(name)
        space = build_search_space(smollm2, recipe.search_space)
        assert any(f.kind == "linear" for f in space.ffn)  # as packaged: the search may pick a linear FFN
        exportable = recipe.search_space.model_copy(update={"ffn_linear": False, "width_multiple": 256})
        space = build_search_space(smollm2, exportable)
        assert not any(f.kind == "linear" for f in space.ffn)
        widths = [f.intermediate_size for f in space.ffn if f.kind == "mlp"]
        assert len(widths) > 1 and all(nas_width_ok(w, 576) for w in widths), widths
