"""`mlx distill --bld` end to end on a tiny parent: library, resume, scoring against a full-model reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from typer.testing import CliRunner

from mlxkit.cli.main import app
from mlxkit.engines.models.decilm.convert import from_parent
from mlxkit.engines.models.loading import load_model
from mlxkit.engines.puzzle.assemble import assemble_child
from mlxkit.engines.puzzle.library import LibraryDir, read_library
from mlxkit.engines.puzzle.variants import AttentionVariant, BlockChoice, FFNVariant, ParentShape

runner = CliRunner()


def _distill(model_dir, tiny_recipe_file, text_file, out, *extra):
    result = runner.invoke(app, ["distill", "--bld", "--model", str(model_dir), "--recipe", str(tiny_recipe_file),
                                 "--data", str(text_file), "--out", str(out), "--json", *extra])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_library_is_built_scored_and_resumable(tiny_llama_dir, tiny_recipe_file, text_file, tmp_path):
    out = tmp_path / "lib"
    summary = _distill(tiny_llama_dir, tiny_recipe_file, text_file, out)
    library = read_library(out)
    layer0 = library["layers"][0]
    assert set(layer0["attention"]) == {"kv2", "kv1", "linear", "no_op"}
    assert set(layer0["ffn"]) == {"ffn64", "ffn32", "linear", "no_op"}
    assert layer0["attention"]["kv2"]["metrics"]["kl_div"] == 0.0
    for kind in ("attention", "ffn"):
        for name, item in layer0[kind].items():
            assert {"kl_div", "lm_loss", "top1_agreement"} <= item["metrics"].keys(), (kind, name)
    kv1 = layer0["attention"]["kv1"]
    assert kv1["source"] == "bld" and kv1["training"]["steps"] == 8 and kv1["training"]["curve"]
    assert kv1["training"]["val_nmse"] <= kv1["training"]["val_nmse_init"]
    assert layer0["attention"]["no_op"]["metrics"]["kl_div"] > 0
    assert summary["subblocks_trained"] == 4 and summary["variants_scored"] == 8
    assert (out / "mlxkit.json").exists()

    # Kill-and-restart: drop one finished block and its score; only that one is redone.
    lib = LibraryDir(out)
    victim = lib.block_file(1, "ffn", "ffn32")
    kept = lib.block_file(0, "attention", "kv1")
    kept_mtime = kept.stat().st_mtime_ns
    before = load_file(str(victim))
    victim.unlink()
    lib.block_record(1, "ffn", "ffn32").unlink()
    lib.score_record(1, "ffn", "ffn32").unlink()
    (out / "library.json").unlink()
    _distill(tiny_llama_dir, tiny_recipe_file, text_file, out)
    assert kept.stat().st_mtime_ns == kept_mtime, "finished blocks must never be retrained"
    after = load_file(str(victim))
    for key in before:  # seeded per block: the redone block is the same block
        torch.testing.assert_close(after[key], before[key])
    assert read_library(out)["layers"][1]["ffn"]["ffn32"]["metrics"]["kl_div"] > 0

    # --score-only rescoring reproduces the scores.
    for path in lib.scores.glob("*.json"):
        path.unlink()
    rescored = _distill(tiny_llama_dir, tiny_recipe_file, text_file, out, "--score-only")
    assert rescored["median_kl_nontrivial"] == pytest.approx(summary["median_kl_nontrivial"], rel=1e-5)


def test_streamed_score_equals_full_model_with_the_block_swapped_in(tiny_llama_dir, tiny_recipe_file, text_file,
                                                                     tmp_path):
    out = tmp_path / "lib"
    _distill(tiny_llama_dir, tiny_recipe_file, text_file, out)
    library = read_library(out)
    parent = from_parent(load_model(str(tiny_llama_dir)).model)
    parent.config._attn_implementation = "sdpa"
    shape = ParentShape.from_config(parent.config)
    val = torch.load(out / ".work" / "tokens.pt", weights_only=True)["val"]
    base = [BlockChoice(AttentionVariant("gqa", 2), FFNVariant("mlp", 64))] * shape.num_layers
    for layer, kind, name, swap in ((0, "attention", "kv1", AttentionVariant("gqa", 1)),
                                    (1, "ffn", "linear", FFNVariant("linear")),
                                    (0, "ffn", "no_op", FFNVariant("no_op"))):
        choices = list(base)
        choices[layer] = BlockChoice(swap, base[layer].ffn) if kind == "attention" else BlockChoice(base[layer].attention, swap)
        child = assemble_child(parent, LibraryDir(out), choices)
        with torch.no_grad():
            # every position that predicts a next token (all but the last)
            p = F.log_softmax(parent(val).logits[:, :-1], -1)
            q = F.log_softmax(child(val).logits[:, :-1], -1)
        kl = (p.exp() * (p - q)).sum(-1).mean().item()
        assert library["layers"][layer][kind][name]["metrics"]["kl_div"] == pytest.approx(kl, rel=1e-4, abs=1e-6)


def test_distill_refuses_a_directory_built_with_other_settings(tiny_llama_dir, tiny_recipe_file, text_file, tmp_path):
    out = tmp_path / "lib"
    _distill(tiny_llama_dir, tiny_recipe_file, text_file, out, "--no-score")
    result = runner.invoke(app, ["distill", "--bld", "--model", str(tiny_llama_dir), "--recipe", str(tiny_recipe_file),
                                 "--data", str(text_file), "--out", str(out), "--seed", "7"])
    assert result.exit_code != 0 and "other settings" in result.output and "Traceback" not in result.output
    missing = runner.invoke(app, ["distill", "--bld", "--recipe", "nope", "--out", str(tmp_path / "x")])
    assert missing.exit_code != 0 and "unknown recipe" in missing.output


@pytest.mark.distributed
def test_two_process_torchrun_matches_single_process(tiny_llama_dir, tiny_recipe_file, text_file, tmp_path):
    single = tmp_path / "single"
    _distill(tiny_llama_dir, tiny_recipe_file, text_file, single)
    multi = tmp_path / "multi"
    env = {**os.environ, "MLXKIT_BACKEND": "gloo", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29517",
           "-m", "mlxkit", "distill", "--bld", "--model", str(tiny_llama_dir), "--recipe", str(tiny_recipe_file),
           "--data", str(text_file), "--out", str(multi), "--quiet"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    a, b = read_library(single), read_library(multi)
    for la, lb in zip(a["layers"], b["layers"]):
        for kind in ("attention", "ffn"):
            for name in la[kind]:
                assert la[kind][name]["metrics"]["kl_div"] == pytest.approx(lb[kind][name]["metrics"]["kl_div"],
                                                                            rel=1e-4, abs=1e-7)
    for path in LibraryDir(single).blocks.glob("*.safetensors"):
        other = load_file(str(LibraryDir(multi).blocks / path.name))
        for key, tensor in load_file(str(path)).items():
            torch.testing.assert_close(other[key], tensor)
