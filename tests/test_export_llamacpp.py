"""Exported GGUFs run in llama.cpp itself (llama-cpp-python), against the torch child; and llama.cpp's own
converter reads the Nemotron-NAS export.

Marker `llamacpp`; every test skips with a reason where llama-cpp-python is not importable
(`pip install -e .[llamacpp]`). The converter test also needs llama.cpp's
`convert_hf_to_gguf.py`, which ships in llama-cpp-python's sdist under `vendor/llama.cpp/`:
point MLXKIT_LLAMA_CPP_DIR at that folder (or place it at ../shared/llama.cpp beside the repo).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO
from test_export_support import (TEXT, agreement, export_literal_and_faithful, llama_cpp_logits, make_bpe_tokenizer,
                                 make_child, make_child_dir, make_parent_dir, make_qwen2_parent_dir, make_sentencepiece_style_tokenizer,
                                 token_ids, torch_logits)

from mlxkit.engines.export import export_model

pytestmark = pytest.mark.llamacpp

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install -e .[llamacpp])")


def _llama_cpp_dir() -> Path | None:
    for candidate in (os.environ.get("MLXKIT_LLAMA_CPP_DIR"), REPO.parent / "shared" / "llama.cpp"):
        if candidate and (Path(candidate) / "convert_hf_to_gguf.py").is_file():
            return Path(candidate)
    return None


def _compare(child_dir: Path, gguf: Path, ids) -> tuple[float, float]:
    return agreement(torch_logits(child_dir, ids).double(), torch.from_numpy(llama_cpp_logits(gguf, ids)))


@pytest.mark.parametrize("dtype,top1_min,rel_max", [("f32", 0.99, 1e-4), ("f16", 0.97, 1e-2), ("q8_0", 0.85, 0.1)])
def test_llama_cpp_logits_match_the_torch_child(tmp_path, dtype, top1_min, rel_max):
    """Every block kind llama.cpp's deci graph treats differently, at once (see test_export_support.MIXED)."""
    child = make_child_dir(tmp_path / "child")
    export_model(child, "gguf", tmp_path / "child.gguf", dtype)
    ids = token_ids()
    top1, rel = _compare(child, tmp_path / "child.gguf", ids)
    print(f"llama.cpp {dtype}: top-1 agreement {top1:.4f}, max relative logit error {rel:.2e}")
    assert top1 >= top1_min and rel <= rel_max, (top1, rel)


def test_last_position_only_goes_through_the_last_layer(tmp_path):
    """Generation asks for the last row only; its selection happens inside the last layer (no FFN there)."""
    child = make_child_dir(tmp_path / "child", names=("kv2+ffn256", "kv1+ffn128", "no_op+no_op"))
    export_model(child, "gguf", tmp_path / "child.gguf")
    ids = token_ids()
    expected = torch_logits(child, ids)[-1].double()
    last = torch.from_numpy(llama_cpp_logits(tmp_path / "child.gguf", ids, all_positions=False))
    assert last.argmax() == expected.argmax()
    assert ((last - expected).abs().max() / expected.abs().max()).item() < 1e-4


def test_literal_ffn_free_encoding_loses_attention_in_llama_cpp(tmp_path):
    """The reason for the zero FFN, shown in llama.cpp itself: FFN length 0 drops the layer's attention."""
    child = export_literal_and_faithful(tmp_path)
    ids = token_ids()
    top1_literal, rel_literal = _compare(child, tmp_path / "literal.gguf", ids)
    top1, rel = _compare(child, tmp_path / "faithful.gguf", ids)
    assert top1 == 1.0 and rel < 1e-4
    assert rel_literal > 0.05 and top1_literal < 0.95


def test_parent_with_tied_embeddings_and_tokenizer(tmp_path):
    parent = make_parent_dir(tmp_path / "parent", num_hidden_layers=2, tie_word_embeddings=True)
    export_model(parent, "gguf", tmp_path / "parent.gguf", "f32")
    ids = token_ids()
    top1, rel = _compare(parent, tmp_path / "parent.gguf", ids)
    assert top1 >= 0.99 and rel < 1e-4
    llm = llama_cpp.Llama(str(tmp_path / "parent.gguf"), n_ctx=64, n_threads=1, verbose=False)
    try:
        assert llm.tokenize(TEXT.encode(), add_bos=False, special=False) == make_bpe_tokenizer()(TEXT)["input_ids"]
    finally:
        llm.close()


def test_qwen2_parent_with_biases(tmp_path):
    parent = make_qwen2_parent_dir(tmp_path / "qwen2")
    export_model(parent, "gguf", tmp_path / "qwen2.gguf")
    top1, rel = _compare(parent, tmp_path / "qwen2.gguf", token_ids())
    assert top1 >= 0.99 and rel < 1e-4


def test_llama_cpp_converter_reads_the_nemotron_nas_export(tmp_path):
    """llama.cpp's own converter (DeciModel) on our Nemotron-NAS directory: it converts, loads and agrees.

    The child avoids what that converter cannot express faithfully (an attention layer without
    FFN, an attention-free layer 0, a linear FFN); the direct GGUF export handles the first two.
    """
    root = _llama_cpp_dir()
    if root is None:
        pytest.skip("llama.cpp's convert_hf_to_gguf.py not found: set MLXKIT_LLAMA_CPP_DIR to the vendor/llama.cpp "
                    "folder of llama-cpp-python's sdist (pip download --no-deps --no-binary :all: llama-cpp-python)")
    tokenizer, vocab_size = make_sentencepiece_style_tokenizer()  # its DeciLM route reads Llama-2 style BPE
    names = ("kv2+ffn256", "no_op+ffn512", "no_op+no_op", "linear+ffn256", "kv1+ffn512")
    model = make_child(names, intermediate_size=512, vocab_size=vocab_size)
    model.save_pretrained(tmp_path / "child")
    tokenizer.save_pretrained(tmp_path / "child")
    export_model(tmp_path / "child", "nemotron-nas", tmp_path / "nas")
    result = subprocess.run([sys.executable, str(root / "convert_hf_to_gguf.py"), str(tmp_path / "nas"),
                             "--outfile", str(tmp_path / "converted.gguf"), "--outtype", "f32"],
                            capture_output=True, text=True, timeout=600,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    ids = ([1] + tokenizer("the quick fox then the fox")["input_ids"][1:]) * 4
    top1, rel = _compare(tmp_path / "child", tmp_path / "converted.gguf", ids[:40])
    print(f"llama.cpp converter, f32: top-1 agreement {top1:.4f}, max relative logit error {rel:.2e}")
    assert top1 >= 0.99 and rel < 1e-4


@pytest.mark.slow
def test_real_smollm2_and_a_child_of_it_agree_in_llama_cpp(tmp_path, real_cache):
    """The embedded default and a hand-made child of it (attention and FFNs dropped), f32, on real text."""
    from mlxkit.engines.models.decilm.blocks import AttentionVariant, BlockChoice, FFNVariant, ParentShape
    from mlxkit.engines.models.decilm.convert import child_config, from_parent
    from mlxkit.engines.models.decilm.modeling_mlx_decilm import MlxDeciLMForCausalLM
    from mlxkit.engines.models.default_model import ensure_default_model
    from mlxkit.engines.models.loading import load_model

    parent_dir = ensure_default_model()
    text = ("The history of the city goes back to the Roman period, when a small settlement grew up beside the "
            "river crossing. In the Middle Ages it became a market town, and its cathedral was finished in 1250. ")
    export_model(parent_dir, "gguf", tmp_path / "parent.gguf", "f32")
    llm = llama_cpp.Llama(str(tmp_path / "parent.gguf"), n_ctx=256, n_threads=2, verbose=False)
    ids = llm.tokenize(text.encode(), add_bos=False)
    llm.close()
    top1, rel = _compare(parent_dir, tmp_path / "parent.gguf", ids)
    print(f"SmolLM2-135M parent, f32: top-1 {top1:.4f}, max relative logit error {rel:.2e} on {len(ids)} tokens")
    assert top1 >= 0.99 and rel < 1e-4

    loaded = load_model(str(parent_dir), with_tokenizer=True)
    parent = from_parent(loaded.model)
    shape = ParentShape.from_config(parent.config)
    full = BlockChoice(AttentionVariant("gqa", shape.num_key_value_heads), FFNVariant("mlp", shape.intermediate_size))
    choices = [full] * shape.num_layers
    choices[3] = BlockChoice(AttentionVariant("no_op"), full.ffn)
    choices[7] = BlockChoice(full.attention, FFNVariant("no_op"))
    choices[12] = BlockChoice(AttentionVariant("no_op"), FFNVariant("no_op"))
    choices[20] = BlockChoice(AttentionVariant("gqa", 1), FFNVariant("mlp", 768))
    config = child_config(parent.config, choices)
    child = MlxDeciLMForCausalLM(config).eval()
    state = parent.state_dict()
    kept = {k: v for k, v in state.items() if k in child.state_dict() and child.state_dict()[k].shape == v.shape}
    with torch.no_grad():  # the slimmer layer 20 keeps the first KV head's and the first 768 FFN rows' weights
        for name, value in child.state_dict().items():
            if name not in kept and name in state:
                kept[name] = state[name][tuple(slice(0, n) for n in value.shape)]
    child.load_state_dict(kept, strict=False)
    child.tie_weights()
    child.save_pretrained(tmp_path / "child")
    loaded.tokenizer.save_pretrained(tmp_path / "child")
    result = export_model(tmp_path / "child", "gguf", tmp_path / "child.gguf", "f32")
    assert "copied" in " ".join(result["notes"])
    top1, rel = _compare(tmp_path / "child", tmp_path / "child.gguf", ids)
    print(f"SmolLM2-135M child, f32: top-1 {top1:.4f}, max relative logit error {rel:.2e} on {len(ids)} tokens")
    assert top1 >= 0.99 and rel < 1e-4


def test_calibrate_engine_llamacpp_times_gguf_exports_and_fits_a_profile(tmp_path):
    """`mlx calibrate --engine llamacpp`: every small model exported and timed in llama.cpp, the fit written."""
    import json
    import tempfile

    from typer.testing import CliRunner

    from mlxkit.cli.main import app
    from mlxkit.engines.hardware.profile import load_profile

    parent = make_parent_dir(tmp_path / "parent")
    out = tmp_path / "tiny-llamacpp.yaml"
    before = set(Path(tempfile.gettempdir()).glob("mlx-calibrate-*"))
    result = CliRunner().invoke(app, ["calibrate", "--engine", "llamacpp", "--model", str(parent), "--out", str(out),
                                      "--seq", "8,16", "--copies", "2", "--repeats", "1", "--decode-steps", "2",
                                      "--threads", "1", "--json"])
    assert result.exit_code == 0, result.output
    profile = load_profile(out)
    assert profile.calibration["engine"] == "llamacpp" and "llama.cpp" in profile.calibration["device"]
    report = json.loads(out.with_name("tiny-llamacpp.report.json").read_text())
    # llama.cpp has no linear FFN: that variant is left out; the others are all timed at batch 1.
    timed = {(row["variant"], row["kind"]) for row in report["variants"]}
    assert ("linear", "ffn") not in timed and ("linear", "attention") in timed
    assert {row["batch"] for row in report["variants"]} == {1}
    assert [(row["batch"], row["seq"]) for row in report["whole_model"]] == [(1, 8), (1, 16)]
    for row in report["whole_model"]:
        assert row["prefill_ms"]["measured"] > 0 and row["decode_step_ms"]["measured"] > 0
        assert "kv_cache_mib" not in row["memory"]  # llama.cpp does not report it; nothing is made up
    assert set(Path(tempfile.gettempdir()).glob("mlx-calibrate-*")) == before  # the exports are gone
