"""`mlx library build` end to end on a tiny parent: library, resume, scoring against a full-model reference;
and BLD training itself (it lowers the loss; a run that makes things worse is undone)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from conftest import tiny_layer0_states
from mlxkit.cli.main import app
from mlxkit.engines.models.decilm.blocks import AttentionVariant, BlockChoice, FFNVariant, ParentShape
from mlxkit.engines.models.decilm.convert import from_parent
from mlxkit.engines.models.loading import load_model
from mlxkit.engines.puzzle.library import activations
from mlxkit.engines.puzzle.search.assemble import assemble_child
from mlxkit.engines.puzzle.library.block_init import initialise
from mlxkit.engines.puzzle.library.bld import normalized_mse, train_subblock
from mlxkit.engines.puzzle.library.store import LibraryDir, read_library
from mlxkit.engines.puzzle.recipe import BLDSpec
from mlxkit.engines.puzzle.subblocks import parent_subblock

runner = CliRunner()


def _build_library(model_dir, tiny_recipe_file, text_file, out, *extra):
    result = runner.invoke(app, ["library", "build", "--model", str(model_dir), "--recipe", str(tiny_recipe_file),
                                 "--data", str(text_file), "--out", str(out), "--json", *extra])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_library_is_built_scored_and_resumable(tiny_llama_dir, tiny_recipe_file, text_file, tmp_path):
    out = tmp_path / "lib"
    summary = _build_library(tiny_llama_dir, tiny_recipe_file, text_file, out)
    library = read_library(out)
    layer0 = library.layers[0]
    assert set(layer0.attention) == {"kv2", "kv1", "linear", "no_op"}
    assert set(layer0.ffn) == {"ffn64", "ffn32", "linear", "no_op"}
    for kind in ("attention", "ffn"):
        for name, item in layer0.entries(kind).items():
            assert {"kl_div", "lm_loss", "top1_agreement"} <= item.metrics.keys(), (kind, name)
            assert item.stats is None, "a library stores no costs: they depend on the target"
    kv1 = layer0.attention["kv1"]
    assert kv1.source == "bld" and kv1.training.steps == 8 and kv1.training.curve
    assert kv1.file == "blocks/layer000.attention.kv1.safetensors"
    assert layer0.attention["no_op"].metrics["kl_div"] > 0
    assert library.run_key is not None and library.run_key.train and library.parent.spec == str(tiny_llama_dir)
    assert summary["subblocks_trained"] == 4 and summary["variants_scored"] == 8
    assert (out / "mlxkit.json").exists()

    # The parent's own variants record the parent's metrics as computed: checked here against
    # the plain transformers parent (reference) and mlxkit's converted parent on the held-out tokens.
    val = torch.load(out / ".work" / "tokens.pt", weights_only=True)["val"]
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    converted = from_parent(load_model(str(tiny_llama_dir)).model)
    with torch.no_grad():
        ref_logits = reference(val).logits[:, :-1].float()
        logits = converted(val).logits[:, :-1].float()
    ref_logp, logp = F.log_softmax(ref_logits, -1), F.log_softmax(logits, -1)
    lm_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), val[:, 1:].reshape(-1)).item()
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1).mean().item()
    agreement = (ref_logits.argmax(-1) == logits.argmax(-1)).float().mean().item()
    for item in (layer0.attention["kv2"], layer0.ffn["ffn64"], library.layers[1].attention["kv2"]):
        assert item.source == "parent" and item.file is None
        assert item.metrics["lm_loss"] == pytest.approx(lm_loss, rel=1e-5)
        assert item.metrics["kl_div"] == pytest.approx(kl, abs=1e-6)
        assert item.metrics["top1_agreement"] == pytest.approx(agreement)
    # Replacing a block costs LM loss relative to the parent's own.
    assert layer0.attention["no_op"].metrics["lm_loss"] != pytest.approx(lm_loss, rel=1e-5)

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
    _build_library(tiny_llama_dir, tiny_recipe_file, text_file, out)
    assert kept.stat().st_mtime_ns == kept_mtime, "finished blocks must never be retrained"
    after = load_file(str(victim))
    for key in before:  # seeded per block: the redone block is the same block
        torch.testing.assert_close(after[key], before[key])
    assert read_library(out).layers[1].ffn["ffn32"].metrics["kl_div"] > 0

    # --score-only rescoring reproduces the scores.
    for path in lib.scores.glob("*.json"):
        path.unlink()
    rescored = _build_library(tiny_llama_dir, tiny_recipe_file, text_file, out, "--score-only")
    assert rescored["median_kl_nontrivial"] == pytest.approx(summary["median_kl_nontrivial"], rel=1e-5)


def test_streamed_score_equals_full_model_with_the_block_swapped_in(tiny_llama_dir, tiny_recipe_file, text_file,
                                                                     tmp_path):
    out = tmp_path / "lib"
    _build_library(tiny_llama_dir, tiny_recipe_file, text_file, out)
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
        assert library.layers[layer].entries(kind)[name].metrics["kl_div"] == pytest.approx(kl, rel=1e-4, abs=1e-6)


def test_library_build_has_its_own_help():
    result = runner.invoke(app, ["library", "build", "--help"])
    assert result.exit_code == 0 and "--score-only" in result.output and "--keep-activations" in result.output


def test_distill_bld_is_the_same_build_with_a_notice(tiny_llama_dir, tiny_recipe_file, text_file, tmp_path):
    args = ["--model", str(tiny_llama_dir), "--recipe", str(tiny_recipe_file), "--data", str(text_file),
            "--init-only", "--json"]
    built = _build_library(tiny_llama_dir, tiny_recipe_file, text_file, tmp_path / "new", "--init-only")
    aliased = runner.invoke(app, ["distill", "--bld", *args, "--out", str(tmp_path / "old")])
    assert aliased.exit_code == 0, aliased.output
    notices = [line for line in aliased.stderr.splitlines() if line.startswith("note:")]
    assert len(notices) == 1 and "--bld is now `mlx library build`" in notices[0]
    old = json.loads(aliased.stdout)
    for summary in (built, old):
        summary.pop("library"), summary.pop("wall_time_s")
    assert old == built
    for name in ("new", "old"):
        assert json.loads((tmp_path / name / "mlxkit.json").read_text())["verb"] == "library build"
    refused = runner.invoke(app, ["distill", "--bld", *args, "--out", str(tmp_path / "x"), "--tokens", "8"])
    assert refused.exit_code == 2 and "--tokens means nothing for distill --bld" in refused.stderr


def test_distill_refuses_a_directory_built_with_other_settings(tiny_llama_dir, tiny_recipe_file, text_file, tmp_path):
    out = tmp_path / "lib"
    _build_library(tiny_llama_dir, tiny_recipe_file, text_file, out, "--no-score")
    result = runner.invoke(app, ["library", "build", "--model", str(tiny_llama_dir), "--recipe", str(tiny_recipe_file),
                                 "--data", str(text_file), "--out", str(out), "--seed", "7"])
    assert result.exit_code != 0 and "other settings" in result.output and "Traceback" not in result.output
    missing = runner.invoke(app, ["library", "build", "--recipe", "nope", "--out", str(tmp_path / "x")])
    assert missing.exit_code != 0 and "unknown recipe" in missing.output


def test_an_unfinished_library_with_other_settings_is_discarded_with_a_notice(tiny_llama_dir, tiny_recipe_file,
                                                                               text_file, tmp_path):
    straight = tmp_path / "straight"
    _build_library(tiny_llama_dir, tiny_recipe_file, text_file, straight, "--no-score", "--seed", "7")
    out = tmp_path / "lib"
    _build_library(tiny_llama_dir, tiny_recipe_file, text_file, out, "--no-score")
    LibraryDir(out).index_file.unlink()  # as a run killed before its index is written leaves it
    rerun = runner.invoke(app, ["library", "build", "--model", str(tiny_llama_dir), "--recipe", str(tiny_recipe_file),
                                "--data", str(text_file), "--out", str(out), "--no-score", "--seed", "7"])
    assert rerun.exit_code == 0, rerun.output
    notices = [line for line in rerun.stderr.splitlines() if "discarded an unfinished block library" in line]
    assert len(notices) == 1 and "other settings: seed" in notices[0], rerun.stderr
    # Every block is the seed-7 run's: none of the discarded run's blocks was kept.
    blocks = sorted(p.name for p in LibraryDir(straight).blocks.glob("*.safetensors"))
    assert blocks == sorted(p.name for p in LibraryDir(out).blocks.glob("*.safetensors")) and blocks
    for name in blocks:
        a, b = load_file(LibraryDir(straight).blocks / name), load_file(LibraryDir(out).blocks / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def test_init_only_writes_the_initialised_blocks_untrained(tiny_llama_dir, tiny_recipe_file, text_file, tmp_path):
    out = tmp_path / "lib"
    summary = _build_library(tiny_llama_dir, tiny_recipe_file, text_file, out, "--init-only", "--keep-activations")
    assert summary["subblocks_trained"] == 0 and summary["variants_scored"] == 8
    library = read_library(out)
    assert library.run_key.train is False
    for layer in library.layers:
        for kind in ("attention", "ffn"):
            for item in layer.entries(kind).values():
                if item.source not in ("parent", "no_op"):
                    assert item.source == "init" and item.training.steps == 0 and item.metrics["kl_div"] >= 0
    # Each block is exactly the initialisation computed from the cached parent activations.
    parent = from_parent(load_model(str(tiny_llama_dir)).model)
    parent.config._attn_implementation = "sdpa"
    states = activations.load_layer(out / ".work" / "activations", 1, 2)
    for kind, variant, x, y in (("ffn", FFNVariant("mlp", 32), states.train_mid, states.train_out - states.train_mid),
                                ("attention", AttentionVariant("gqa", 1), states.train_in,
                                 states.train_mid - states.train_in)):
        expected = initialise(parent_subblock(parent, 1, kind), variant, parent.config, 1, x, y).weights()
        stored = load_file(str(LibraryDir(out).block_file(1, kind, variant.name)))
        assert stored.keys() == expected.keys()
        for key in expected:
            torch.testing.assert_close(stored[key], expected[key], rtol=0, atol=0)
    # Rescoring keeps the record of how the blocks were built; resuming it as a trained run is refused.
    _build_library(tiny_llama_dir, tiny_recipe_file, text_file, out, "--score-only")
    assert read_library(out).run_key.train is False
    trained = runner.invoke(app, ["library", "build", "--model", str(tiny_llama_dir), "--recipe", str(tiny_recipe_file),
                                  "--data", str(text_file), "--out", str(out)])
    assert trained.exit_code != 0 and "other settings (train)" in trained.output


def _layer0_states(n: int = 8, seq_len: int = 24):
    parent, pos, _, mid, out = tiny_layer0_states(n, seq_len)
    return parent, pos, mid, out - mid


def test_bld_training_lowers_the_training_loss():
    # Half the FFN channels, pruned from a random parent, start far from the parent's output;
    # 40 AdamW steps on the very sequences the loss is measured on must bring it down.
    parent, pos, x, y = _layer0_states()
    block = initialise(parent_subblock(parent, 0, "ffn"), FFNVariant("mlp", 16), parent.config, 0, x, y)
    with torch.no_grad():
        before = normalized_mse(block(x), y).item()
    spec = BLDSpec(tokens_per_block=40 * 4 * x.shape[1], batch_sequences=4, lr=1e-2)
    record = train_subblock(block, x, y, x, y, pos, spec, seed=0)
    with torch.no_grad():
        after = normalized_mse(block(x), y).item()
    assert record.steps == 40 and not record.reverted
    assert after < 0.8 * before
    assert record.val_nmse_after == pytest.approx(after) and record.val_nmse_before == pytest.approx(before)
    assert record.curve[-1][1] < record.curve[0][1]


def test_bld_restores_the_initial_weights_when_training_makes_the_block_worse():
    # A learning rate of 1e4 blows the weights up: the held-out error rises, so the block must
    # come back bit for bit as it was initialised.
    parent, pos, x, y = _layer0_states()
    block = initialise(parent_subblock(parent, 0, "ffn"), FFNVariant("mlp", 16), parent.config, 0, x, y)
    initial = {k: v.clone() for k, v in block.state_dict().items()}
    spec = BLDSpec(tokens_per_block=10 * 4 * x.shape[1], batch_sequences=4, lr=1e4)
    record = train_subblock(block, x[:6], y[:6], x[6:], y[6:], pos, spec, seed=0)
    assert record.steps == 10 and record.reverted
    assert record.val_nmse_after == record.val_nmse_before
    for key, tensor in block.state_dict().items():
        assert torch.equal(tensor, initial[key]), key
    info = record.to_info()  # a diverged curve holds NaN losses; the stored record holds nulls instead
    json.dumps(info.model_dump(mode="json"), allow_nan=False)
    assert info.reverted_to_init


@pytest.mark.parametrize("grad_clip", [None, 0.25, 0.0])
def test_bld_clips_the_gradient_at_the_recipe_s_limit(grad_clip, monkeypatch):
    # Each step's clip must use bld.grad_clip (1.0 when the recipe leaves it out); 0 clips nothing.
    limits = []
    clip = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_",
                        lambda params, max_norm, *a, **k: limits.append(max_norm) or clip(params, max_norm, *a, **k))
    parent, pos, x, y = _layer0_states()
    block = initialise(parent_subblock(parent, 0, "ffn"), FFNVariant("mlp", 16), parent.config, 0, x, y)
    settings = {} if grad_clip is None else {"grad_clip": grad_clip}
    spec = BLDSpec(tokens_per_block=3 * 4 * x.shape[1], batch_sequences=4, lr=1e-2, **settings)
    record = train_subblock(block, x, y, x, y, pos, spec, seed=0)
    assert record.steps == 3
    assert limits == ([] if grad_clip == 0.0 else [1.0 if grad_clip is None else grad_clip] * 3)


@pytest.mark.distributed
def test_two_process_torchrun_matches_single_process(tiny_llama_dir, tiny_recipe_file, text_file, tmp_path):
    single = tmp_path / "single"
    _build_library(tiny_llama_dir, tiny_recipe_file, text_file, single)
    multi = tmp_path / "multi"
    env = {**os.environ, "MLXKIT_BACKEND": "gloo", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29517",
           "-m", "mlxkit", "library", "build", "--model", str(tiny_llama_dir), "--recipe", str(tiny_recipe_file),
           "--data", str(text_file), "--out", str(multi), "--quiet"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    a, b = read_library(single), read_library(multi)
    for la, lb in zip(a.layers, b.layers):
        for kind in ("attention", "ffn"):
            for name, item in la.entries(kind).items():
                assert item.metrics["kl_div"] == pytest.approx(lb.entries(kind)[name].metrics["kl_div"],
                                                               rel=1e-4, abs=1e-7)
    for path in LibraryDir(single).blocks.glob("*.safetensors"):
        other = load_file(str(LibraryDir(multi).blocks / path.name))
        for key, tensor in load_file(str(path)).items():
            torch.testing.assert_close(other[key], tensor)


def test_a_finished_library_drops_its_activation_cache_and_rescoring_recomputes_it(tiny_llama_dir, tiny_recipe_file,
                                                                                   text_file, tmp_path):
    kept, dropped = tmp_path / "kept", tmp_path / "dropped"
    _build_library(tiny_llama_dir, tiny_recipe_file, text_file, kept, "--keep-activations")
    _build_library(tiny_llama_dir, tiny_recipe_file, text_file, dropped)
    assert any((kept / ".work" / "activations").iterdir())
    assert not (dropped / ".work" / "activations").exists()
    assert (dropped / ".work" / "tokens.pt").exists()  # the held-out tokens stay for the search's evaluation

    def scores(path):
        library = read_library(path)
        return {(layer.layer, kind, name): entry.metrics for layer in library.layers
                for kind in ("attention", "ffn") for name, entry in layer.entries(kind).items()}

    assert scores(dropped) == scores(kept)
    _build_library(tiny_llama_dir, tiny_recipe_file, text_file, dropped, "--score-only")
    assert scores(dropped) == scores(kept) and not (dropped / ".work" / "activations").exists()
