"""`mlx export --format hf | nemotron-nas`: the public Nemotron-NAS layout; loading where mlxkit is not installed."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from safetensors import safe_open

from test_export_support import MIXED, make_child_dir, make_parent_dir, token_ids, torch_logits, logits_without_mlxkit

from mlxkit.engines.errors import InputError
from mlxkit.engines.export import export_model

NAS_CHILD = ("kv2+ffn256", "no_op+ffn512", "linear+linear", "kv1+no_op", "no_op+no_op", "kv2+ffn256")
# Tensor names of NVIDIA's released Nemotron-NAS checkpoints (Llama-3_1-Nemotron-51B and later).
_PUBLIC_NAME = re.compile(r"^(model\.embed_tokens\.weight|model\.norm\.weight|lm_head\.weight|"
                          r"model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight|"
                          r"model\.layers\.\d+\.self_attn\.([qkvo]_proj|linear_attn)\.weight|"
                          r"model\.layers\.\d+\.mlp\.((gate|up|down)_proj|linear_mlp)\.weight)$")


def _tensors(directory) -> dict[str, tuple[tuple[int, ...], str]]:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    out = {}
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(directory / file, "pt") as handle:
            for name in handle.keys():
                tensor = handle.get_slice(name)
                out[name] = (tuple(tensor.get_shape()), tensor.get_dtype())
    return out


def test_nemotron_nas_names_shapes_and_block_configs(tmp_path):
    child = make_child_dir(tmp_path / "child", names=NAS_CHILD, intermediate_size=512)
    result = export_model(child, "nemotron-nas", tmp_path / "nas")
    out = tmp_path / "nas"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DeciLMForCausalLM"] and config["model_type"] == "nemotron-nas"
    assert config["auto_map"] == {"AutoConfig": "configuration_decilm.DeciLMConfig",
                                  "AutoModelForCausalLM": "modeling_decilm.DeciLMForCausalLM"}
    assert config["rope_theta"] == 100000.0 and config["rope_scaling"] is None
    blocks = config["block_configs"]
    assert [set(b["attention"]) >= {"n_heads_in_group", "no_op", "replace_with_linear"} for b in blocks] == [True] * 6
    assert [b["attention"]["n_heads_in_group"] for b in blocks] == [2, None, None, 4, None, 2]
    assert [b["attention"]["no_op"] for b in blocks] == [False, True, False, False, True, False]
    assert [b["attention"]["replace_with_linear"] for b in blocks] == [False, False, True, False, False, False]
    assert [b["ffn"]["no_op"] for b in blocks] == [False, False, False, True, True, False]
    assert [b["ffn"]["replace_with_linear"] for b in blocks] == [False, False, True, False, False, False]
    # no mlxkit-only fields: a reader of the public layout sees only what NVIDIA's configs carry
    assert not any("num_key_value_heads" in b["attention"] or "intermediate_size" in b["ffn"] for b in blocks)

    tensors = _tensors(out)
    assert all(_PUBLIC_NAME.match(name) for name in tensors), [n for n in tensors if not _PUBLIC_NAME.match(n)]
    h, hd = 64, 16
    for i, block in enumerate(blocks):
        p = f"model.layers.{i}."
        att, ffn = block["attention"], block["ffn"]
        assert (p + "input_layernorm.weight" in tensors) is not att["no_op"]
        assert (p + "post_attention_layernorm.weight" in tensors) is not ffn["no_op"]
        if att["n_heads_in_group"]:
            kv = 4 // att["n_heads_in_group"]
            assert tensors[p + "self_attn.q_proj.weight"][0] == (4 * hd, h)
            assert tensors[p + "self_attn.k_proj.weight"][0] == (kv * hd, h)
            assert tensors[p + "self_attn.v_proj.weight"][0] == (kv * hd, h)
            assert tensors[p + "self_attn.o_proj.weight"][0] == (h, 4 * hd)
        if att["replace_with_linear"]:
            assert tensors[p + "self_attn.linear_attn.weight"][0] == (h, h)
        if ffn["ffn_mult"] is not None:
            # DeciLM's reading of ffn_mult gives back the stored width exactly
            width = int(2 * ffn["ffn_mult"] * h / 3)
            width = -(-width // 256) * 256
            assert tensors[p + "mlp.gate_proj.weight"][0] == tensors[p + "mlp.up_proj.weight"][0] == (width, h)
            assert tensors[p + "mlp.down_proj.weight"][0] == (h, width)
        if ffn["replace_with_linear"]:
            assert tensors[p + "mlp.linear_mlp.weight"][0] == (h, h)
    assert not any(name.startswith("model.layers.4.") for name in tensors)
    assert {dtype for _, dtype in tensors.values()} == {"F32"}
    assert (out / "tokenizer.json").exists() and (out / "mlxkit.json").exists()
    assert result["remote_code"] and (out / "modeling_decilm.py").exists()


def test_nemotron_nas_loads_without_mlxkit_and_matches(tmp_path):
    child = make_child_dir(tmp_path / "child", names=NAS_CHILD, intermediate_size=512)
    export_model(child, "nemotron-nas", tmp_path / "nas")
    ids = token_ids()
    remote, info = logits_without_mlxkit(tmp_path / "nas", ids, tmp_path)
    assert info["class"] == "DeciLMForCausalLM" and not info["mlxkit_loaded"]
    assert info["module"].startswith("transformers_modules.")
    np.testing.assert_allclose(remote, torch_logits(child, ids).numpy(), rtol=0, atol=1e-5)


def test_widths_nemotron_nas_cannot_express_are_refused_with_the_layers(tmp_path):
    child = make_child_dir(tmp_path / "child", names=("kv2+ffn128", "kv1+ffn256", "no_op+ffn192"))
    with pytest.raises(InputError, match=r"layers 0 \(width 128\), 2 \(width 192\) cannot be expressed"):
        export_model(child, "nemotron-nas", tmp_path / "nas")
    assert not (tmp_path / "nas").exists() and not list(tmp_path.glob(".nas*"))


def test_hf_export_loads_without_mlxkit_and_matches(tmp_path):
    """Every block kind, linear FFN included: remote code copied from this installation, mlxkit blocked."""
    child = make_child_dir(tmp_path / "child", names=MIXED[:5] + ("no_op+linear",))
    result = export_model(child, "hf", tmp_path / "hf")
    out = tmp_path / "hf"
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "mlx_decilm"
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_mlx_decilm.MlxDeciLMForCausalLM"
    for name in ("modeling_mlx_decilm.py", "configuration_mlx_decilm.py", "blocks.py"):
        assert "mlxkit" not in "".join(l for l in (out / name).read_text().splitlines()
                                       if l.lstrip().startswith(("import ", "from ")))
    assert set(result["files"]) >= {"modeling_mlx_decilm.py", "tokenizer.json", "generation_config.json"}
    ids = token_ids()
    remote, info = logits_without_mlxkit(out, ids, tmp_path)
    assert info["class"] == "MlxDeciLMForCausalLM" and not info["mlxkit_loaded"]
    np.testing.assert_allclose(remote, torch_logits(child, ids).numpy(), rtol=0, atol=1e-5)


def test_hf_parent_stays_plain_transformers_and_f16_halves_the_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    parent = make_parent_dir(tmp_path / "parent", num_hidden_layers=2)
    result = export_model(parent, "hf", tmp_path / "hf16", "f16")
    config = json.loads((tmp_path / "hf16" / "config.json").read_text())
    assert config["model_type"] == "llama" and "auto_map" not in config and config["dtype"] == "float16"
    assert not result["remote_code"] and not list((tmp_path / "hf16").glob("*.py"))
    assert {dtype for _, dtype in _tensors(tmp_path / "hf16").values()} == {"F16"}
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf16", dtype=torch.float32).eval()
    ids = token_ids()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    reference = torch_logits(parent, ids)
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() > 0.95
    assert (logits - reference).abs().max() / reference.abs().max() < 1e-2


def test_parent_exports_to_nemotron_nas_when_its_width_is_a_multiple_of_256(tmp_path):
    parent = make_parent_dir(tmp_path / "parent", num_hidden_layers=2, intermediate_size=512)
    export_model(parent, "nemotron-nas", tmp_path / "nas")
    blocks = json.loads((tmp_path / "nas" / "config.json").read_text())["block_configs"]
    assert [b["attention"]["n_heads_in_group"] for b in blocks] == [2, 2]
    assert [b["ffn"]["ffn_mult"] for b in blocks] == [12.0, 12.0]  # 3 * 512 / (2 * 64)


def test_q8_0_is_a_gguf_type(tmp_path):
    child = make_child_dir(tmp_path / "child", names=("kv2+ffn256", "kv1+ffn256"))
    with pytest.raises(InputError, match="q8_0 is a GGUF type"):
        export_model(child, "hf", tmp_path / "hf", "q8_0")
