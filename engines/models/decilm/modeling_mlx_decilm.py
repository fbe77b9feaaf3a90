"""The heterogeneous Puzzle child model, top to bottom in one file.

Each decoder layer has its own attention subblock (GQA with its own KV-head count, one
hidden x hidden linear map, or nothing) and its own FFN subblock (SwiGLU of its own
width, one linear map, or nothing). Weight names follow the public DeciLM layout:
a no-op subblock has no weights and no norm, linear attention lives at
`self_attn.linear_attn`, linear FFN at `mlp.linear_mlp`. With every layer at the
parent's shape this is exactly a Llama, logit for logit. With `config.qk_norm` each head's
query and key are RMS-normed before RoPE (`self_attn.q_norm`, `self_attn.k_norm`), as in
Qwen3, and the same holds for a Qwen3 parent. With `config.sliding_window` every attention
layer sees only that many positions back, as in Mistral v0.1 and Phi-3-mini-4k.

Decoder layers are `GradientCheckpointingLayer`s, as in transformers' Llama:
`model.gradient_checkpointing_enable()` recomputes each layer in the backward pass.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import logging
from transformers.models.llama.modeling_llama import (LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb,
                                                      eager_attention_forward)

from mlxkit.engines.models.decilm.configuration_mlx_decilm import MlxDeciLMConfig

logger = logging.get_logger(__name__)


class MlxDeciLMGQAAttention(nn.Module):
    """Grouped-query attention with this layer's own number of KV heads (and Qwen3's q/k norms if configured)."""

    def __init__(self, config: MlxDeciLMConfig, layer_idx: int, num_key_value_heads: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.num_key_value_groups = config.num_attention_heads // num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        # Over head_dim, so one weight serves every head and a variant with fewer KV heads keeps it.
        self.q_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps) if config.qk_norm else None
        self.sliding_window = config.sliding_window

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None, cache: Cache | None = None, **kwargs) -> torch.Tensor:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query = self.q_proj(hidden_states).view(hidden_shape)
        key = self.k_proj(hidden_states).view(hidden_shape)
        if self.q_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        query, key = query.transpose(1, 2), key.transpose(1, 2)
        value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        if attention_mask is None and self.sliding_window is not None and key.shape[-2] > self.sliding_window:
            # A layer run on its own (a BLD subblock) gets no mask from the model; past the window a
            # causal mask alone would let it see more than the parent's layer does.
            attention_mask = _sliding_window_mask(query.shape[-2], key.shape[-2], self.sliding_window, query)
        attention: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                     eager_attention_forward)
        output, _ = attention(self, query, key, value, attention_mask, scaling=self.scaling,
                              dropout=0.0 if not self.training else self.attention_dropout,
                              sliding_window=self.sliding_window, **kwargs)
        return self.o_proj(output.reshape(*input_shape, -1).contiguous())


def _sliding_window_mask(query_length: int, key_length: int, window: int, like: torch.Tensor) -> torch.Tensor:
    """Additive [1, 1, q, k] mask: the last `query_length` positions each see themselves and the
    `window - 1` positions before them."""
    query_pos = torch.arange(key_length - query_length, key_length, device=like.device)[:, None]
    key_pos = torch.arange(key_length, device=like.device)[None, :]
    visible = (key_pos <= query_pos) & (query_pos - key_pos < window)
    mask = torch.zeros(visible.shape, dtype=like.dtype, device=like.device)
    return mask.masked_fill(~visible, torch.finfo(like.dtype).min)[None, None]


class MlxDeciLMLinearAttention(nn.Module):
    """Attention replaced by one hidden x hidden map: every token attends only to itself."""

    def __init__(self, config: MlxDeciLMConfig):
        super().__init__()
        self.linear_attn = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self.linear_attn(hidden_states)


class MlxDeciLMMLP(nn.Module):
    """SwiGLU FFN of this layer's own width."""

    def __init__(self, config: MlxDeciLMConfig, intermediate_size: int):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class MlxDeciLMLinearMLP(nn.Module):
    """FFN replaced by one hidden x hidden map."""

    def __init__(self, config: MlxDeciLMConfig):
        super().__init__()
        self.linear_mlp = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_mlp(x)


def build_attention(config: MlxDeciLMConfig, layer_idx: int, block: dict) -> nn.Module | None:
    """The attention subblock a `block_configs` entry asks for (None for no-op)."""
    attention = block["attention"]
    if attention["no_op"]:
        return None
    if attention["replace_with_linear"]:
        return MlxDeciLMLinearAttention(config)
    return MlxDeciLMGQAAttention(config, layer_idx, attention["num_key_value_heads"])


def build_ffn(config: MlxDeciLMConfig, block: dict) -> nn.Module | None:
    """The FFN subblock a `block_configs` entry asks for (None for no-op)."""
    ffn = block["ffn"]
    if ffn["no_op"]:
        return None
    if ffn["replace_with_linear"]:
        return MlxDeciLMLinearMLP(config)
    return MlxDeciLMMLP(config, ffn["intermediate_size"])


class MlxDeciLMDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm residual layer; a no-op subblock has neither weights nor norm.

    Under gradient checkpointing `forward` is recomputed in the backward pass, so the
    hidden states and position embeddings are passed positionally (the convention of
    `GradientCheckpointingLayer`); `attention_delta` and `ffn_delta` are never checkpointed.
    """

    def __init__(self, config: MlxDeciLMConfig, layer_idx: int):
        super().__init__()
        block = config.block_configs[layer_idx]
        self.self_attn = build_attention(config, layer_idx, block)
        self.mlp = build_ffn(config, block)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps) if self.self_attn else None
        self.post_attention_layernorm = (LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
                                         if self.mlp else None)

    def attention_delta(self, hidden_states: torch.Tensor, position_embeddings, attention_mask=None, cache=None,
                        **kwargs) -> torch.Tensor | None:
        """What the attention subblock adds to the residual stream (None for no-op)."""
        if self.self_attn is None:
            return None
        return self.self_attn(self.input_layernorm(hidden_states), position_embeddings=position_embeddings,
                              attention_mask=attention_mask, cache=cache, **kwargs)

    def ffn_delta(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """What the FFN subblock adds to the residual stream (None for no-op)."""
        if self.mlp is None:
            return None
        return self.mlp(self.post_attention_layernorm(hidden_states))

    def forward(self, hidden_states: torch.Tensor, position_embeddings, attention_mask=None, cache=None,
                **kwargs) -> torch.Tensor:
        delta = self.attention_delta(hidden_states, position_embeddings, attention_mask, cache, **kwargs)
        if delta is not None:
            hidden_states = hidden_states + delta
        delta = self.ffn_delta(hidden_states)
        if delta is not None:
            hidden_states = hidden_states + delta
        return hidden_states


class MlxDeciLMPreTrainedModel(PreTrainedModel):
    config_class = MlxDeciLMConfig
    config: MlxDeciLMConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["MlxDeciLMDecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_attention_backend = True


class MlxDeciLMModel(MlxDeciLMPreTrainedModel):
    def __init__(self, config: MlxDeciLMConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([MlxDeciLMDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cache: Cache | None = None,
                inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None,
                output_hidden_states: bool | None = None, past_key_values: Cache | None = None,
                **kwargs) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        cache = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            # A checkpointed layer runs twice; a cache would be updated twice (transformers drops it the same way).
            logger.warning_once("`use_cache=True` is incompatible with gradient checkpointing. "
                                "Setting `use_cache=False`.")
            use_cache = False
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if position_ids is None:
            # Measured on the first layer that caches keys: a layer without attention keeps no sequence.
            attending = [i for i, kind in enumerate(self.config.layer_types) if kind != "linear_attention"]
            past_seen = cache.get_seq_length(attending[0]) if cache is not None and attending else 0
            position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen).unsqueeze(0)
        windowed = self.config.sliding_window is not None
        if isinstance(attention_mask, dict):
            attention_mask = attention_mask.get("sliding_attention" if windowed else "full_attention")
        make_mask = create_sliding_window_causal_mask if windowed else create_causal_mask
        causal_mask = make_mask(config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                                cache=cache, position_ids=position_ids)
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        all_hidden = [hidden_states] if output_hidden_states else None
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings, attention_mask=causal_mask, cache=cache)
            if all_hidden is not None:
                all_hidden.append(hidden_states)
        hidden_states = self.norm(hidden_states)
        if all_hidden is not None:
            all_hidden[-1] = hidden_states
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, cache=cache if use_cache else None,
                                       hidden_states=tuple(all_hidden) if all_hidden is not None else None)


class MlxDeciLMForCausalLM(MlxDeciLMPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: MlxDeciLMConfig):
        super().__init__(config)
        self.model = MlxDeciLMModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cache: Cache | None = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.LongTensor | None = None,
                use_cache: bool | None = None, logits_to_keep: int | torch.Tensor = 0,
                output_hidden_states: bool | None = None, past_key_values: Cache | None = None,
                **kwargs) -> CausalLMOutputWithPast:
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             cache=cache if cache is not None else past_key_values, inputs_embeds=inputs_embeds,
                             use_cache=use_cache, output_hidden_states=output_hidden_states)
        hidden_states = outputs.last_hidden_state
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            hidden_states = hidden_states[:, -logits_to_keep:]
        elif isinstance(logits_to_keep, torch.Tensor):
            hidden_states = hidden_states[:, logits_to_keep]
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=outputs.cache,
                                      hidden_states=outputs.hidden_states)
