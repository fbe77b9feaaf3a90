"""`mlx search --engine`: the engine table, the profiles' engines, the filter at solve time, the refusals;
and the Nemotron-NAS config read as objects, the way serving engines read it."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from conftest import make_char_tokenizer, make_tiny_llama
from test_export_support import choices, make_child_dir, save_dir

from mlxkit.cli.main import app
from mlxkit.engines.errors import InputError
from mlxkit.engines.export import export_model
from mlxkit.engines.hardware.profile import available_profiles, load_profile
from mlxkit.engines.models.decilm.blocks import AttentionVariant, FFNVariant
from mlxkit.engines.puzzle.library.store import read_library
from mlxkit.engines.serving.capabilities import ENGINES, check_engine_holds_parent, get_engine

runner = CliRunner()
# Hidden 64 with an FFN of 256: ffn_mult 6.0 reads back as exactly 256, so vLLM can hold the parent,
# and the recipe's 128-wide variant (ceil_256 gives 256) is one it cannot.
ENGINE_RECIPE = """
name: engine-test
search_space: {ffn_fractions: [1.0, 0.5], width_multiple: 8}
data: {seq_len: 32, train_sequences: 8, score_sequences: 2}
bld: {tokens_per_block: 512, batch_sequences: 4, lr: 1.0e-3}
"""


@pytest.fixture
def servable_parent(tmp_path):
    out = tmp_path / "parent"
    make_tiny_llama(hidden_size=64, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                    num_hidden_layers=3).save_pretrained(out)
    make_char_tokenizer().save_pretrained(out)
    return out


@pytest.fixture
def servable_library(servable_parent, text_file, tmp_path):
    recipe = tmp_path / "engine.yaml"
    recipe.write_text(ENGINE_RECIPE)
    out = tmp_path / "lib"
    result = runner.invoke(app, ["library", "build", "--model", str(servable_parent), "--recipe", str(recipe),
                                 "--data", str(text_file), "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    return out


def _search(*args: str):
    return runner.invoke(app, ["search", *args, "--json"])


def test_every_gpu_profile_serves_with_vllm_and_the_cpu_profiles_with_their_own_engine():
    engines = {name: load_profile(name).serving_engine for name in available_profiles()}
    assert engines.pop("cpu") == "transformers" and engines.pop("cpu-llamacpp") == "llamacpp"
    assert set(engines.values()) == {"vllm"}, engines


def test_the_table_matches_what_vllm_and_trtllm_build():
    vllm, trtllm = get_engine("vllm"), get_engine("trtllm")
    assert not vllm.holds_attention(AttentionVariant("linear")) and trtllm.holds_attention(AttentionVariant("linear"))
    assert not vllm.holds_ffn(FFNVariant("linear"), 576) and trtllm.holds_ffn(FFNVariant("linear"), 576)
    # SmolLM2 (hidden 576): 768 = ceil_256(int(2 * 2.0 * 576 / 3)); 384 comes back as 512
    assert vllm.holds_ffn(FFNVariant("mlp", 768), 576) and not vllm.holds_ffn(FFNVariant("mlp", 384), 576)
    assert ENGINES["transformers"].holds_ffn(FFNVariant("mlp", 384), 576)
    assert ENGINES["llamacpp"].holds_ffn(FFNVariant("mlp", 384), 576)
    assert not ENGINES["llamacpp"].holds_ffn(FFNVariant("linear"), 576)
    with pytest.raises(InputError, match="unknown serving engine 'tgi'"):
        get_engine("tgi")


def test_vllm_searches_without_what_it_cannot_build_from_the_same_library(servable_library):
    index_before = (servable_library / "block_library.json").read_bytes() \
        if (servable_library / "block_library.json").exists() else None
    common = ["--target", "h100", "--library", str(servable_library), "--throughput", "1.2x", "--dry-run"]
    served = _search(*common, "--engine", "vllm")
    assert served.exit_code == 0, served.output
    payload = json.loads(served.stdout)
    assert payload["engine"]["name"] == "vllm" and payload["engine"]["export_format"] == "nemotron-nas"
    assert payload["engine"]["excluded"] == {"attention": ["linear"], "ffn": ["ffn128", "linear"]}
    chosen = {c["attention"] for c in payload["choices"]} | {c["ffn"] for c in payload["choices"]}
    assert not chosen & {"linear", "ffn128"}, payload["choices"]
    shown = runner.invoke(app, ["search", *common, "--engine", "vllm"])
    assert ("--engine vllm: searching without attention linear and FFN ffn128, linear, which vLLM cannot build"
            in " ".join(shown.output.split()))

    # TensorRT-LLM builds linear attention and FFN, but reads widths from ffn_mult too
    trtllm = json.loads(_search(*common, "--engine", "trtllm").stdout)
    assert trtllm["engine"]["excluded"] == {"attention": [], "ffn": ["ffn128"]}
    full = json.loads(_search(*common, "--engine", "transformers").stdout)
    assert full["engine"]["excluded"] == {"attention": [], "ffn": []}
    # the default engine of the h100 profile is vLLM's
    default = json.loads(_search(*common).stdout)
    assert default["engine"]["name"] == "vllm" and default["choices"] == payload["choices"]
    library = read_library(servable_library)
    assert {"linear", "ffn128"} <= {n for layer in library.layers for n in (*layer.attention, *layer.ffn)}
    if index_before is not None:
        assert (servable_library / "block_library.json").read_bytes() == index_before


def test_the_search_records_its_engine_in_the_child_manifest(servable_library, tmp_path):
    out = tmp_path / "child"
    result = _search("--target", "h100", "--library", str(servable_library), "--throughput", "1.2x", "--out",
                     str(out), "--refine", "0", "--engine", "vllm", "--export", "nemotron-nas")
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "mlxkit.json").read_text())
    assert manifest["settings"]["engine"] == "vllm"
    config = json.loads((out / "export-nemotron-nas" / "config.json").read_text())
    assert not any(b["attention"]["replace_with_linear"] or b["ffn"]["replace_with_linear"]
                   for b in config["block_configs"])


@pytest.mark.parametrize("args, message", [
    (["--engine", "vllm", "--export", "gguf"], "--engine vllm loads the nemotron-nas layout, not gguf"),
    (["--engine", "tgi"], "unknown serving engine 'tgi'"),
])
def test_engine_and_format_mismatches_are_one_line_errors(servable_library, args, message):
    result = _search("--target", "h100", "--library", str(servable_library), "--dry-run", *args)
    assert result.exit_code == 2
    error = json.loads(result.stdout)["error"]
    assert message in error["message"] and "\n" not in error["message"]


def test_an_engine_that_cannot_hold_the_parent_is_refused_before_any_work(tmp_path):
    parent = tmp_path / "parent"
    # head_dim 32 with 4 heads and hidden 64: Nemotron-NAS derives head_dim as hidden/heads = 16
    make_tiny_llama(hidden_size=64, intermediate_size=256, head_dim=32).save_pretrained(parent)
    make_char_tokenizer().save_pretrained(parent)
    out = tmp_path / "child"
    result = _search("--model", str(parent), "--target", "h100", "--engine", "vllm", "--out", str(out))
    assert result.exit_code == 2
    message = json.loads(result.stdout)["error"]["message"]
    assert "vLLM cannot serve this model" in message and "head_dim" in message
    assert "--engine llamacpp or transformers can hold it" in message
    assert not out.exists() and not list(tmp_path.glob(".child*"))


def test_qwen3_is_refused_by_vllm_for_its_q_k_norms_and_held_by_transformers():
    from transformers import Qwen3Config

    config = Qwen3Config(hidden_size=64, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, num_hidden_layers=2, vocab_size=128)
    with pytest.raises(InputError, match="q/k RMSNorm"):
        check_engine_holds_parent(get_engine("vllm"), config, "default")
    check_engine_holds_parent(get_engine("transformers"), config, "default")


def test_the_profile_engine_gives_way_with_a_notice_when_it_cannot_hold_the_parent(built_library):
    # the tiny parent's FFN (64 at hidden 32) has no exact ffn_mult
    result = _search("--target", "h100", "--library", str(built_library), "--dry-run")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["engine"]["name"] == "transformers"
    shown = " ".join(runner.invoke(app, ["search", "--target", "h100", "--library", str(built_library),
                                         "--dry-run"]).output.split())
    assert "vLLM cannot serve this model" in shown and "searching for transformers instead" in shown


def test_nemotron_nas_block_configs_read_as_attributes_and_serialise_to_the_public_json(tmp_path):
    from transformers import AutoConfig

    child = make_child_dir(tmp_path / "child", names=("kv2+ffn256", "no_op+no_op", "kv1+ffn512"),
                           intermediate_size=512)
    export_model(child, "nemotron-nas", tmp_path / "nas")
    written = json.loads((tmp_path / "nas" / "config.json").read_text())["block_configs"]
    config = AutoConfig.from_pretrained(tmp_path / "nas", trust_remote_code=True)
    blocks = config.block_configs
    # what vLLM's DeciLM reads (vllm/model_executor/models/nemotron_nas.py)
    assert [b.attention.no_op for b in blocks] == [False, True, False]
    assert [b.attention.n_heads_in_group for b in blocks] == [2, None, 4]
    assert [b.ffn.no_op for b in blocks] == [False, True, False]
    assert hasattr(blocks[0].ffn, "ffn_mult") and not hasattr(blocks[0].ffn, "hidden_act")
    assert blocks[2].ffn.ffn_mult == written[2]["ffn"]["ffn_mult"]
    # and still the public JSON when the config is written again
    again = json.loads(json.dumps(config.to_dict()))["block_configs"]
    for public, rewritten in zip(written, again):
        for part in ("attention", "ffn"):
            assert {k: rewritten[part][k] for k in public[part]} == public[part]


def test_a_nemotron_nas_export_says_which_engines_cannot_build_its_linear_layers(tmp_path):
    child = make_child_dir(tmp_path / "child", names=("kv2+ffn256", "linear+ffn256", "kv1+linear"))
    result = export_model(child, "nemotron-nas", tmp_path / "nas")
    notes = [n for n in result["notes"] if "cannot serve this export" in n]
    assert notes == ["vLLM cannot serve this export: it builds no linear attention or FFN (layers 1, 2)",
                     "SGLang cannot serve this export: it builds no linear attention or FFN (layers 1, 2)"]
    served = make_child_dir(tmp_path / "served", names=("kv2+ffn256", "no_op+ffn256", "kv1+no_op"))
    assert not [n for n in export_model(served, "nemotron-nas", tmp_path / "nas2")["notes"] if "cannot" in n]


@pytest.mark.parametrize("fmt", ["gguf", "nemotron-nas"])
def test_children_with_q_k_norms_or_a_window_are_refused_where_the_layout_cannot_hold_them(tmp_path, fmt):
    from mlxkit.engines.models.decilm.convert import child_config
    from mlxkit.engines.models.decilm.modeling_mlx_decilm import MlxDeciLMForCausalLM

    for field, value, words in (("qk_norm", True, "q/k RMSNorms"), ("sliding_window", 16, "sliding attention window")):
        config = child_config(make_tiny_llama(hidden_size=64, intermediate_size=256).config,
                              choices(("kv2+ffn256", "kv1+ffn256")))
        setattr(config, field, value)
        child = save_dir(MlxDeciLMForCausalLM(config), tmp_path / f"{field}-child")
        out = tmp_path / (f"{field}.gguf" if fmt == "gguf" else f"{field}-nas")
        with pytest.raises(InputError, match=words):
            export_model(child, fmt, out)
        assert not out.exists()


def test_costs_only_prices_what_the_engine_builds(servable_parent):
    def priced(*args: str) -> tuple[str, set[str]]:
        result = _search("--costs-only", "--model", str(servable_parent), "--target", "h100", *args)
        assert result.exit_code == 0, result.output
        payload = json.loads(result.stdout)
        return payload["engine"], set(payload["attention"]) | set(payload["ffn"])

    engine, names = priced()
    assert engine == "vllm" and "linear" not in names and "ffn256" in names and "no_op" in names
    engine, names = priced("--engine", "transformers")
    assert engine == "transformers" and "linear" in names
