"""Turn a Llama-family parent into the heterogeneous class, and describe children of it."""

from __future__ import annotations

from typing import Sequence

import torch

from mlxkit.engines.errors import InputError
from mlxkit.engines.models.decilm.blocks import BlockChoice, ParentShape
from mlxkit.engines.models.decilm.configuration_mlx_decilm import MlxDeciLMConfig
from mlxkit.engines.models.decilm.modeling_mlx_decilm import MlxDeciLMForCausalLM

# Llama-shaped families: pre-norm, RoPE, SwiGLU, separate q/k/v/o projections.
SUPPORTED_PARENTS = {"llama", "mistral", "qwen2", "qwen3", "mlx_decilm"}
_CARRIED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
                   "tie_word_embeddings", "rope_parameters", "attention_bias", "mlp_bias", "bos_token_id",
                   "eos_token_id", "pad_token_id", "initializer_range", "use_cache")


def check_parent(config) -> None:
    if config.model_type not in SUPPORTED_PARENTS:
        raise InputError(f"Puzzle needs a Llama-family parent ({', '.join(sorted(SUPPORTED_PARENTS))}); "
                         f"got model_type '{config.model_type}'")
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", False):
        raise InputError("parents with sliding-window attention are not supported yet")


def child_config(parent_config, choices: Sequence[BlockChoice] | None = None) -> MlxDeciLMConfig:
    """The heterogeneous config of a child of `parent_config` (the parent itself when `choices` is None)."""
    check_parent(parent_config)
    if parent_config.model_type == "mlx_decilm":
        fields = {k: getattr(parent_config, k) for k in _CARRIED_FIELDS if hasattr(parent_config, k)}
        fields["num_key_value_heads"] = parent_config.parent_num_key_value_heads
        fields["intermediate_size"] = parent_config.parent_intermediate_size
    else:
        fields = {k: getattr(parent_config, k) for k in _CARRIED_FIELDS if hasattr(parent_config, k)}
    if parent_config.model_type == "qwen2":
        # Qwen2 has q/k/v biases but no o bias; our GQA block uses one flag for all four.
        fields["attention_bias"] = True
    fields["head_dim"] = getattr(parent_config, "head_dim", None) or \
        parent_config.hidden_size // parent_config.num_attention_heads
    shape = ParentShape.from_config(parent_config)
    if choices is not None:
        if len(choices) != shape.num_layers:
            raise InputError(f"{len(choices)} block choices for a parent of {shape.num_layers} layers")
        for choice in choices:
            choice.attention.validate(shape)
            choice.ffn.validate(shape)
        fields["block_configs"] = [c.to_block_config(shape) for c in choices]
    fields["parent_num_key_value_heads"] = shape.num_key_value_heads
    fields["parent_intermediate_size"] = shape.intermediate_size
    return MlxDeciLMConfig(**fields)


def from_parent(parent_model) -> MlxDeciLMForCausalLM:
    """The parent as an `MlxDeciLMForCausalLM` with every layer at the parent's shape (same weights)."""
    config = child_config(parent_model.config)
    if parent_model.config.model_type == "qwen2":
        _add_zero_o_proj_bias(parent_model)
    config._attn_implementation = getattr(parent_model.config, "_attn_implementation", None) or "sdpa"
    with torch.device("meta"):
        model = MlxDeciLMForCausalLM(config)
    state = parent_model.state_dict()
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    unexpected = [k for k in unexpected if "rotary_emb" not in k]
    if missing or unexpected:
        raise InputError(f"parent weights do not match the Llama layout: missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    weight = next(parent_model.parameters())
    model = model.to(weight.dtype)
    # The RoPE buffers were on meta. They are computed on the CPU and kept in float32 whatever
    # the weights' dtype, as transformers keeps them: bfloat16 frequencies would turn the
    # angles of late positions into noise.
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config).to(weight.device)
    return model.eval()


def _add_zero_o_proj_bias(parent_model) -> None:
    for layer in parent_model.model.layers:
        o_proj = layer.self_attn.o_proj
        if o_proj.bias is None:
            o_proj.bias = torch.nn.Parameter(torch.zeros(o_proj.out_features, dtype=o_proj.weight.dtype,
                                                         device=o_proj.weight.device))
