"""Pictures beside the model card: they show what the search chose and what training measured, they are
embedded in the card, skipped with a word when matplotlib is missing, and `mlx report` redraws them."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from PIL import Image
from typer.testing import CliRunner

from mlxkit.cli.main import app
from mlxkit.engines.core.figures import architecture_layers, training_series
from mlxkit.engines.models.decilm.blocks import AttentionVariant

pytestmark = pytest.mark.figures
runner = CliRunner()
GKD = ["--gkd-set", "data.seq_len=32", "--gkd-set", "data.held_out_sequences=2", "--gkd-set",
       "optim.batch_sequences=4", "--gkd-set", "schedule.eval_every=2"]


def _png_size(path: Path) -> tuple[int, int]:
    with Image.open(path) as image:
        image.verify()
        assert image.format == "PNG"
        return image.size


@pytest.fixture
def distilled_child(built_library, text_file, tmp_path) -> Path:
    out = tmp_path / "child"
    result = runner.invoke(app, ["search", "--library", str(built_library), "--throughput", "1.3x", "--data",
                                 str(text_file), "--gkd-tokens", "384", *GKD, "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    return out


def test_a_distilled_child_has_its_architecture_and_training_pictures_in_its_card(distilled_child):
    card = (distilled_child / "README.md").read_text()
    for name in ("architecture.png", "training.png"):
        assert _png_size(distilled_child / name) == (800, 500)
        assert re.search(rf"!\[[^\]]+\]\({name}\)", card), card
    assert "Pictures skipped" not in card


def test_the_architecture_picture_shows_the_blocks_the_search_chose(distilled_child):
    """The picture reads the assembled config; the MIP's choices in the manifest are the independent record."""
    config = json.loads((distilled_child / "config.json").read_text())
    choices = json.loads((distilled_child / "mlxkit.json").read_text())["settings"]["search"]["choices"]
    layers = architecture_layers(config)
    assert [layer.layer for layer in layers] == [c["layer"] for c in choices]
    parent_kv, parent_width = config["parent_num_key_value_heads"], config["parent_intermediate_size"]
    for layer, choice in zip(layers, choices):
        attention = AttentionVariant.parse(choice["attention"])
        assert layer.attention == attention.kind
        assert layer.kv_heads == (attention.n_kv_heads or 0)
        if attention.kind == "gqa":
            assert layer.attention_fraction == attention.n_kv_heads / parent_kv
        if choice["ffn"].startswith("ffn"):
            assert (layer.ffn, layer.intermediate_size) == ("mlp", int(choice["ffn"][3:]))
            assert layer.ffn_fraction == int(choice["ffn"][3:]) / parent_width
        else:
            assert layer.ffn == choice["ffn"] and layer.ffn_fraction == float(choice["ffn"] == "linear")


def test_the_training_picture_s_held_out_curve_runs_from_the_manifest_s_before_to_its_after(distilled_child):
    results = json.loads((distilled_child / "mlxkit.json").read_text())["results"]
    records = [json.loads(line) for line in (distilled_child / results["log"]).read_text().splitlines()]
    series = training_series(records)
    kl = series["eval.kl_div"]
    assert kl[0] == (0.0, pytest.approx(results["before"]["kl_div"], rel=1e-6))
    assert kl[-1] == (float(results["tokens"]), pytest.approx(results["after"]["kl_div"], rel=1e-6))
    assert len(series["loss"]) == results["steps"]
    assert series["loss"][-1][1] == pytest.approx(results["final_loss"], rel=1e-6)


def test_without_matplotlib_the_card_says_so_and_mlx_report_draws_them_later(built_library, text_file, tmp_path,
                                                                            monkeypatch):
    out = tmp_path / "child"
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
        result = runner.invoke(app, ["search", "--library", str(built_library), "--throughput", "1.3x", "--data",
                                     str(text_file), "--out", str(out), "--json"])
        assert result.exit_code == 0, result.output
        without = (out / "README.md").read_text()
        assert "Pictures skipped: matplotlib is not installed" in without and "mlx report" in without
        assert not list(out.glob("*.png"))
        refused = runner.invoke(app, ["report", str(out)])
        assert refused.exit_code == 6 and "matplotlib" in refused.output
        assert refused.output.count("\n") == 1
    drawn = runner.invoke(app, ["report", str(out), "--json"])
    assert drawn.exit_code == 0, drawn.output
    assert json.loads(drawn.stdout)["drawn"] == ["architecture.png"]  # no GKD: no training log to draw
    _png_size(out / "architecture.png")
    with_pictures = (out / "README.md").read_text()
    # Only the pictures section differs: the rest of the card is the manifest's, as before.
    strip = lambda text: re.sub(r"## Pictures\n.*?(?=## )", "", text, flags=re.S)  # noqa: E731
    assert strip(with_pictures) == strip(without) and "![" in with_pictures


def test_a_frontier_with_out_writes_a_report_that_mlx_report_redraws_byte_for_byte(built_library, tmp_path):
    out = tmp_path / "frontier"
    result = runner.invoke(app, ["search", "--library", str(built_library), "--throughput", "1.1x,1.3x,50x",
                                 "--dry-run", "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    assert printed["report"]["drawn"] == ["frontier.png"]
    saved = json.loads((out / "frontier.json").read_text())
    assert saved["frontier"] == printed["frontier"]
    assert [row["throughput"] for row in saved["frontier"]] == ["1.1x", "1.3x", "50x"]
    assert "infeasible" in saved["frontier"][2]
    assert json.loads((out / "mlxkit.json").read_text())["results"]["frontier"] == saved["frontier"]
    first = (out / "frontier.png").read_bytes()
    (out / "frontier.png").unlink()
    redrawn = runner.invoke(app, ["report", str(out)])
    assert redrawn.exit_code == 0, redrawn.output
    assert (out / "frontier.png").read_bytes() == first
    assert {p.name for p in out.iterdir()} == {"frontier.json", "frontier.png", "mlxkit.json"}


def test_mlx_report_refuses_what_mlxkit_did_not_write(text_file, tmp_path):
    for target in (tmp_path / "missing", text_file, tmp_path):
        result = runner.invoke(app, ["report", str(target)])
        assert result.exit_code == 2, result.output
        assert result.output.startswith("error:") and result.output.count("\n") == 1


def test_a_nemotron_nas_config_reads_as_the_same_blocks_vllm_builds():
    """Nemotron-NAS configs carry only n_heads_in_group and ffn_mult: KV heads are heads / group, and the width
    is int(2 * ffn_mult * hidden / 3) rounded up to a multiple of 256 (vLLM's DeciLM rule)."""
    config = {"num_attention_heads": 8, "hidden_size": 512, "num_key_value_heads": 8, "intermediate_size": 1024,
              "block_configs": [{"attention": {"n_heads_in_group": 4, "no_op": False}, "ffn": {"ffn_mult": 1.4}},
                                {"attention": {"no_op": True}, "ffn": {"ffn_mult": 3.0}},
                                {"attention": {"replace_with_linear": True}, "ffn": {"no_op": True}}]}
    layers = architecture_layers(config)
    assert [(l.attention, l.kv_heads, l.attention_fraction) for l in layers] == [
        ("gqa", 2, 0.25), ("no_op", 0, 0.0), ("linear", 0, 1.0)]
    assert [(l.ffn, l.intermediate_size, l.ffn_fraction) for l in layers] == [
        ("mlp", 512, 0.5), ("mlp", 1024, 1.0), ("no_op", 0, 0.0)]  # 2*1.4*512/3 = 477 -> 512
    assert architecture_layers({"num_attention_heads": 8, "hidden_size": 512}) is None
