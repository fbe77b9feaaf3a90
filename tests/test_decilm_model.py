"""The heterogeneous child class: exact parent conversion, save/load, generation, shapes."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

import mlxkit  # noqa: F401  (registers the Auto classes)
from conftest import make_tiny_llama
from mlxkit.engines.models.decilm.blocks import AttentionVariant, BlockChoice, FFNVariant, ParentShape
from mlxkit.engines.models.decilm.convert import child_config, from_parent
from mlxkit.engines.models.decilm.modeling_mlx_decilm import MlxDeciLMForCausalLM

IDS = torch.tensor([[1, 7, 30, 99, 4, 12, 64, 3, 3, 90]])


def _tiny(family: str):
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128, max_position_embeddings=128)
    torch.manual_seed(0)
    if family == "llama":
        return make_tiny_llama()
    if family == "mistral":
        return MistralForCausalLM(MistralConfig(**common, sliding_window=None)).eval()
    return Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True)).eval()


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_parent_converts_with_identical_logits(family):
    parent = _tiny(family)
    with torch.no_grad():
        expected = parent(IDS).logits
        converted = from_parent(parent)
        torch.testing.assert_close(converted(IDS).logits, expected, rtol=0, atol=1e-6)
    greedy = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert converted.generate(IDS, **greedy).tolist() == parent.generate(IDS, **greedy).tolist()


CHOICES = [
    BlockChoice(AttentionVariant("no_op"), FFNVariant("mlp", 24)),
    BlockChoice(AttentionVariant("gqa", 1), FFNVariant("linear")),
]


def test_child_saves_loads_generates_and_counts_parameters(tmp_path):
    parent = make_tiny_llama()
    config = child_config(parent.config, CHOICES)
    torch.manual_seed(1)
    child = MlxDeciLMForCausalLM(config).eval()
    shape = ParentShape.from_config(parent.config)
    block_params = sum(c.attention.num_params(shape) + c.ffn.num_params(shape) for c in CHOICES)
    embed = 2 * shape.vocab_size * shape.hidden_size + shape.hidden_size  # untied head + final norm
    assert sum(p.numel() for p in child.parameters()) == block_params + embed
    layer0, layer1 = child.model.layers
    assert layer0.self_attn is None and layer0.input_layernorm is None and layer0.mlp.intermediate_size == 24
    assert layer1.self_attn.k_proj.out_features == 8 and hasattr(layer1.mlp, "linear_mlp")

    child.save_pretrained(tmp_path / "child")
    saved = json.loads((tmp_path / "child" / "config.json").read_text())
    assert saved["model_type"] == "mlx_decilm"
    assert saved["block_configs"][0]["attention"]["no_op"] is True
    assert saved["block_configs"][1]["attention"]["n_heads_in_group"] == 4
    assert saved["block_configs"][1]["ffn"]["replace_with_linear"] is True
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "child").eval()
    assert type(reloaded).__name__ == "MlxDeciLMForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(reloaded(IDS).logits, child(IDS).logits, rtol=0, atol=0)
    out = reloaded.generate(IDS, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert out.shape == (1, IDS.shape[1] + 5)


def test_kv_cache_matches_full_recompute_when_layer0_has_no_attention():
    config = child_config(make_tiny_llama().config, CHOICES)
    torch.manual_seed(2)
    child = MlxDeciLMForCausalLM(config).eval()
    with torch.no_grad():
        full = child(IDS).logits[:, -1]
        first = child(IDS[:, :-1], use_cache=True)
        step = child(IDS[:, -1:], cache=first.past_key_values, use_cache=True)
    torch.testing.assert_close(step.logits[:, -1], full, rtol=1e-5, atol=1e-5)


def test_decilm_ffn_mult_only_configs_get_exact_widths():
    parent = make_tiny_llama(hidden_size=384, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=2)
    config = child_config(parent.config)
    blocks = [{"attention": {"n_heads_in_group": 4, "no_op": False, "replace_with_linear": False},
               "ffn": {"ffn_mult": 2.0, "no_op": False, "replace_with_linear": False}}] * 2
    from mlxkit.engines.models.decilm.configuration_mlx_decilm import MlxDeciLMConfig

    decilm = MlxDeciLMConfig(**{**config.to_dict(), "block_configs": blocks})
    # DeciLM rule: ceil_256(int(2 * 2.0 * 384 / 3)) = ceil_256(512) = 512; n_heads_in_group 4 -> 1 KV head
    assert decilm.block_configs[0]["ffn"]["intermediate_size"] == 512
    assert decilm.block_configs[0]["attention"]["num_key_value_heads"] == 1


def test_invalid_kv_heads_are_rejected():
    from mlxkit.engines.errors import InputError

    with pytest.raises(InputError, match="divide"):
        child_config(make_tiny_llama().config, [BlockChoice(AttentionVariant("gqa", 3), FFNVariant("no_op"))] * 2)


def test_gradient_checkpointing_gives_the_same_loss_and_gradients():
    # A heterogeneous child (no-op, narrow, linear and GQA subblocks) in training mode: recomputing
    # every layer in the backward pass must change nothing but memory.
    config = child_config(make_tiny_llama().config, CHOICES)
    torch.manual_seed(3)
    child = MlxDeciLMForCausalLM(config).train()
    assert child.supports_gradient_checkpointing

    def loss_and_grads():
        child.zero_grad(set_to_none=True)
        loss = child(IDS, labels=IDS).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in child.named_parameters() if p.grad is not None}

    plain_loss, plain_grads = loss_and_grads()
    checkpointed_calls = []

    def counting(inner):
        def checkpoint(function, *args, **kwargs):
            checkpointed_calls.append(function)
            return inner(function, *args, **kwargs)
        return checkpoint

    # transformers 5 names it activation_checkpointing_enable; gradient_checkpointing_enable is its alias.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        child.gradient_checkpointing_enable()
        assert all(layer.gradient_checkpointing for layer in child.model.layers)
        child.gradient_checkpointing_disable()
    assert not any(layer.gradient_checkpointing for layer in child.model.layers)
    enable = getattr(child, "activation_checkpointing_enable", child.gradient_checkpointing_enable)
    enable()
    for layer in child.model.layers:  # the layers received the checkpointing function; count its calls
        assert layer.gradient_checkpointing
        layer._gradient_checkpointing_func = counting(layer._gradient_checkpointing_func)
    checkpointed_loss, checkpointed_grads = loss_and_grads()
    assert len(checkpointed_calls) == config.num_hidden_layers
    torch.testing.assert_close(checkpointed_loss, plain_loss, rtol=0, atol=0)
    assert checkpointed_grads.keys() == plain_grads.keys() and plain_grads
    for name, grad in plain_grads.items():
        torch.testing.assert_close(checkpointed_grads[name], grad, rtol=0, atol=0, msg=name)
    assert child(IDS, use_cache=True).past_key_values is None, "a checkpointed layer must not fill a cache"
    # Generation (no gradients) is never checkpointed and keeps its cache.
    child.eval()
    with torch.no_grad():
        assert child(IDS, use_cache=True).past_key_values is not None
