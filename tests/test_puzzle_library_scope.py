"""A library built for one engine's search trains and scores only what that engine builds, each block and
score the same as a full build's; a later search that needs more extends the cached library in place."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file
from typer.testing import CliRunner

from conftest import make_char_tokenizer, make_tiny_llama, recording_reporter, write_text_corpus
from mlxkit.cli.main import app
from mlxkit.engines.puzzle.library.build import LibraryBuildOptions, ensure_library, run_library_build
from mlxkit.engines.puzzle.library.store import LibraryDir, read_library
from mlxkit.engines.puzzle.recipe import load_recipe
from mlxkit.engines.puzzle.search.serving_fit import search_variants
from mlxkit.engines.serving.capabilities import ENGINES

# Hidden 64 with an FFN of 256: vLLM holds the parent, and not the recipe's 128-wide FFN (ffn_mult reads
# it back as 256), nor the linear attention and FFN.
RECIPE = """
name: scope-test
search_space: {ffn_fractions: [1.0, 0.5], width_multiple: 8}
data: {seq_len: 32, train_sequences: 8, score_sequences: 2}
bld: {tokens_per_block: 512, batch_sequences: 4, lr: 1.0e-3}
"""
NOT_IN_VLLM = {("attention", "linear"), ("ffn", "ffn128"), ("ffn", "linear")}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """The parent, text, recipe, and a full library built without any filter: the reference."""
    root = tmp_path_factory.mktemp("scope")
    parent = root / "parent"
    make_tiny_llama(hidden_size=64, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                    num_hidden_layers=3).save_pretrained(parent)
    make_char_tokenizer().save_pretrained(parent)
    recipe = root / "scope-test.yaml"
    recipe.write_text(RECIPE)
    text = write_text_corpus(root / "text.txt")
    full = root / "full"
    run_library_build(LibraryBuildOptions(model=str(parent), out=full, recipe=load_recipe(str(recipe)), data=text,
                                          device="cpu"), recording_reporter())
    return {"parent": parent, "recipe": recipe, "text": text, "full": full}


def _variants(path) -> set[tuple[str, str]]:
    names = set()
    for layer in read_library(path).layers:
        names |= {("attention", n) for n in layer.attention} | {("ffn", n) for n in layer.ffn}
    return names


def _same_as_reference(path, reference) -> None:
    """Every variant `path` lists has the reference's metrics and block tensors, bit for bit."""
    ours, full = read_library(path), read_library(reference)
    for layer, ref_layer in zip(ours.layers, full.layers, strict=True):
        for kind in ("attention", "ffn"):
            for name, entry in layer.entries(kind).items():
                ref = ref_layer.entries(kind)[name]
                assert entry.metrics == ref.metrics, (layer.layer, kind, name)
                assert entry.source == ref.source
                if entry.file is not None:
                    mine, theirs = load_file(str(path / entry.file)), load_file(str(reference / ref.file))
                    assert mine.keys() == theirs.keys()
                    assert all(mine[k].equal(theirs[k]) for k in mine), (layer.layer, kind, name)


def _build_for_vllm(workspace, out) -> None:
    run_library_build(LibraryBuildOptions(model=str(workspace["parent"]), out=out,
                                          recipe=load_recipe(str(workspace["recipe"])), data=workspace["text"],
                                          device="cpu", variants=search_variants(ENGINES["vllm"], None)),
                      recording_reporter())


def test_a_vllm_build_trains_and_scores_only_what_vllm_builds_each_as_a_full_build_does(workspace, tmp_path):
    out = tmp_path / "vllm"
    _build_for_vllm(workspace, out)
    assert _variants(workspace["full"]) - _variants(out) == NOT_IN_VLLM
    assert not _variants(out) & NOT_IN_VLLM
    library = LibraryDir(out)
    for layer in range(3):
        for kind, name in NOT_IN_VLLM:
            assert not library.block_file(layer, kind, name).exists()
            assert library.read_score(layer, kind, name) is None
    _same_as_reference(out, workspace["full"])


def test_a_cached_library_is_extended_in_place_for_a_search_that_needs_more(workspace, tmp_path, monkeypatch):
    monkeypatch.setenv("MLXKIT_CACHE", str(tmp_path / "cache"))
    args = (str(workspace["parent"]), str(workspace["recipe"]))
    first = recording_reporter()
    path = ensure_library(*args, data=workspace["text"], device="cpu",
                          variants=search_variants(ENGINES["vllm"], None), reporter=first)
    assert any("building" in line and "the variants that vLLM builds" in line for line in first.lines)
    assert not _variants(path) & NOT_IN_VLLM
    blocks = {p.name: p.stat().st_mtime_ns for p in (path / "blocks").glob("*.safetensors")}

    second = recording_reporter()
    assert ensure_library(*args, data=workspace["text"], device="cpu",
                          variants=search_variants(ENGINES["transformers"], None), reporter=second) == path
    [line] = [line for line in second.lines if "extending" in line]
    assert "attention linear, FFN ffn128, FFN linear" in line
    assert _variants(path) == _variants(workspace["full"])
    # the first run's blocks were kept, not trained again
    assert {p.name: p.stat().st_mtime_ns for p in (path / "blocks").glob("*.safetensors") if p.name in blocks} \
        == blocks
    _same_as_reference(path, workspace["full"])

    third = recording_reporter()
    ensure_library(*args, data=workspace["text"], device="cpu", variants=search_variants(ENGINES["vllm"], None),
                   reporter=third)
    assert any("reusing" in line for line in third.lines)


def test_a_search_for_vllm_reports_what_it_left_out_of_its_cached_library(workspace, tmp_path, monkeypatch):
    monkeypatch.setenv("MLXKIT_CACHE", str(tmp_path / "cache"))
    result = CliRunner().invoke(app, ["search", "--target", "h100", "--model", str(workspace["parent"]),
                                      "--recipe", str(workspace["recipe"]), "--data", str(workspace["text"]),
                                      "--throughput", "1.2x", "--dry-run", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["engine"]["excluded"] == {"attention": ["linear"], "ffn": ["ffn128", "linear"]}
    [cached] = (tmp_path / "cache" / "libraries").iterdir()
    assert not _variants(cached) & NOT_IN_VLLM
    # the child the search chose from the reference library, given whole
    reference = CliRunner().invoke(app, ["search", "--target", "h100", "--library", str(workspace["full"]),
                                         "--throughput", "1.2x", "--dry-run", "--json"])
    assert reference.exit_code == 0, reference.output
    assert payload["choices"] == json.loads(reference.stdout)["choices"]


def test_library_build_for_an_engine_builds_what_it_builds_as_a_full_build_does(workspace, tmp_path):
    out = tmp_path / "lib"
    result = CliRunner().invoke(app, ["library", "build", "--model", str(workspace["parent"]), "--recipe",
                                      str(workspace["recipe"]), "--data", str(workspace["text"]), "--out", str(out),
                                      "--engine", "vllm", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["built_for"] == "the variants that vLLM builds"
    assert _variants(workspace["full"]) - _variants(out) == NOT_IN_VLLM
    _same_as_reference(out, workspace["full"])
    manifest = json.loads((out / "mlxkit.json").read_text())
    assert manifest["settings"]["built_for"] == "the variants that vLLM builds"


def test_library_build_refuses_an_unknown_engine_before_writing_anything(workspace, tmp_path):
    out = tmp_path / "lib"
    result = CliRunner().invoke(app, ["library", "build", "--model", str(workspace["parent"]), "--out", str(out),
                                      "--engine", "tensorrt", "--device", "cpu"])
    assert result.exit_code != 0
    assert "unknown serving engine 'tensorrt'" in result.output
    assert "Traceback" not in result.output
    assert not out.exists()


def test_a_search_on_a_library_built_for_fewer_variants_says_what_it_lacks(workspace, tmp_path):
    out = tmp_path / "lib"
    _build_for_vllm(workspace, out)
    args = ["search", "--library", str(out), "--throughput", "1.2x", "--dry-run", "--json"]
    for_transformers = CliRunner().invoke(app, [*args, "--target", "cpu"])
    assert for_transformers.exit_code == 0, for_transformers.output
    assert "has no attention linear, FFN ffn128, FFN linear of its recipe's search space" in for_transformers.stderr
    assert f"--out {out} --engine transformers" in for_transformers.stderr
    for_vllm = CliRunner().invoke(app, [*args, "--target", "h100"])
    assert for_vllm.exit_code == 0, for_vllm.output
    assert "has no" not in for_vllm.stderr
