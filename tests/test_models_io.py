"""Model specs in and checkpoints out: round trips, sharding, GGUF, safety, offline hub ids."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import make_char_tokenizer, make_tiny_llama
from mlxkit.engines.core.manifest import Manifest
from mlxkit.engines.errors import InputError, ModelLoadError, OfflineError
from mlxkit.engines.models.loading import load_model, resolve_spec
from mlxkit.engines.models.saving import save_model

IDS = torch.tensor([[1, 5, 9, 33, 70, 2, 100, 4]])


def test_load_save_load_round_trip_keeps_logits(tiny_llama_dir, tmp_path):
    first = load_model(str(tiny_llama_dir))
    out = save_model(first.model, first.tokenizer, tmp_path / "copy", Manifest(verb="test"), max_shard_size="20KB")
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1, "a small shard size must produce several shards"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    assert (out / "config.json").exists() and (out / "generation_config.json").exists()
    assert (out / "tokenizer.json").exists() and (out / "mlxkit.json").exists()
    second = load_model(str(out))
    with torch.no_grad():
        torch.testing.assert_close(first.model(IDS).logits, second.model(IDS).logits, rtol=0, atol=0)


def test_single_file_save_also_gets_an_index(tiny_llama_dir, tmp_path):
    loaded = load_model(str(tiny_llama_dir))
    out = save_model(loaded.model, loaded.tokenizer, tmp_path / "one", Manifest(verb="test"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model.safetensors"}
    manifest = json.loads((out / "mlxkit.json").read_text())
    assert manifest["tool"] == "mlxkit" and manifest["verb"] == "test" and "wall_time_s" in manifest


def test_existing_output_is_not_overwritten_and_failure_leaves_nothing(tiny_llama_dir, tmp_path):
    loaded = load_model(str(tiny_llama_dir))
    target = tmp_path / "out"
    target.mkdir()
    with pytest.raises(InputError, match="already exists"):
        save_model(loaded.model, loaded.tokenizer, target, Manifest(verb="test"))

    class Boom(Manifest):
        def write(self, directory):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        save_model(loaded.model, loaded.tokenizer, tmp_path / "never", Boom(verb="test"))
    assert not (tmp_path / "never").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".never")]


def test_pickle_weights_are_refused_without_the_flag(tmp_path):
    model = make_tiny_llama()
    (tmp_path / "pkl").mkdir()
    model.config.save_pretrained(tmp_path / "pkl")
    torch.save(model.state_dict(), tmp_path / "pkl" / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="pickle"):
        load_model(str(tmp_path / "pkl"))


def test_hub_id_offline_names_the_spec(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OfflineError, match="someorg/some-model"):
        load_model("someorg/some-model")


def test_unknown_spec_is_an_input_error():
    with pytest.raises(InputError, match="not a local path"):
        resolve_spec("./does/not/exist")


def _llama_cpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp stores q/k rows interleaved for its RoPE; transformers undoes this on load."""
    return weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def write_tiny_gguf(model, tokenizer, path) -> None:
    """A float32 GGUF of a tiny Llama, written with the `gguf` package the way llama.cpp lays it out."""
    import gguf

    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    vocab = tokenizer.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    tokens += [f"<extra_{i}>" for i in range(cfg.vocab_size - len(tokens))]  # GGUF vocab = embedding rows
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t.startswith("<") else 1 for t in tokens])
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for name, tensor in model.state_dict().items():
        array = tensor.detach().float().numpy()
        if name in names:
            target = names[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            module = rest.rsplit(".", 1)[0]
            target = f"blk.{layer}.{per_layer[module]}.weight"
            if module == "self_attn.q_proj":
                array = _llama_cpp_permute(array, cfg.num_attention_heads)
            elif module == "self_attn.k_proj":
                array = _llama_cpp_permute(array, cfg.num_key_value_heads)
        writer.add_tensor(target, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_file_loads_with_the_same_logits(tmp_path):
    model = make_tiny_llama()
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(model, make_char_tokenizer(), path)
    loaded = load_model(str(path))
    assert loaded.source.kind == "gguf"
    assert getattr(loaded.model.config, "quantization_config", None) is None
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(IDS).logits, model(IDS).logits, rtol=1e-4, atol=1e-4)
    assert loaded.tokenizer.decode(loaded.tokenizer("hello")["input_ids"]) == "hello"


class _WritesAMarker:
    """A pickle payload that, if unpickled with full pickle, creates the file named by `path`."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_pickle_weights_with_the_flag_load_weights_only(tmp_path):
    """--allow-pickle reads plain tensors from a .bin, and never runs code hidden in one."""
    model = make_tiny_llama()
    (tmp_path / "plain").mkdir()
    model.config.save_pretrained(tmp_path / "plain")
    torch.save(model.state_dict(), tmp_path / "plain" / "pytorch_model.bin")
    loaded = load_model(str(tmp_path / "plain"), allow_pickle=True, with_tokenizer=False)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[name], tensor), name

    marker = tmp_path / "pwned"
    (tmp_path / "evil").mkdir()
    model.config.save_pretrained(tmp_path / "evil")
    torch.save({**model.state_dict(), "payload": _WritesAMarker(marker)}, tmp_path / "evil" / "pytorch_model.bin")
    with pytest.raises(ModelLoadError):
        load_model(str(tmp_path / "evil"), allow_pickle=True, with_tokenizer=False)
    assert not marker.exists()


def test_a_checkpoints_own_code_never_runs(tmp_path):
    """A config whose auto_map points at modeling code in the checkpoint: refused, the code not imported."""
    import json

    model = make_tiny_llama()
    model.save_pretrained(tmp_path / "custom")
    marker = tmp_path / "imported"
    (tmp_path / "custom" / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    config = json.loads((tmp_path / "custom" / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "modeling_evil.EvilConfig",
                          "AutoModelForCausalLM": "modeling_evil.EvilModel"}
    (tmp_path / "custom" / "config.json").write_text(json.dumps(config))
    try:
        load_model(str(tmp_path / "custom"), with_tokenizer=False)
    except ModelLoadError:
        pass  # refusing is fine; loading as the plain Llama the model_type names is fine too
    assert not marker.exists()
