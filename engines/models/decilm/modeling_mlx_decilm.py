"""The heterogeneous Puzzle child model, top to bottom in one file.

Each decoder layer has its own attention subblock (GQA with its own KV-head count, one
hidden x hidden linear map, or nothing) and its own FFN subblock (SwiGLU of its own
width, one linear map, or nothing). Weight names follow the public DeciLM layout:
a no-op subblock has no weights and no norm, linear attention lives at
`self_attn.linear_attn`, linear FFN at `mlp.linear_mlp`. With every layer at the
parent's shape this is exactly a Llama, logit for logit. With `config.qk_norm` each head's
query and key are RMS-normed before RoPE (`self_attn.q_norm`, `self_attn.k_norm`), as in
Qwen3, and the same holds for a Qwen3 parent. With `config.sliding_window` the attention
layers (all, or those `config.windowed_layers` marks) see only that many positions back, as in
Mistral v0.1, Phi-3-mini-4k and Gemma 2's alternating layers. Gemma's own features (norms that
scale by 1 + weight, the embedding scale, the norm after each subblock, soft-capped scores and
logits) are config fields too; see `configuration_mlx_decilm.py`.

Decoder layers are `GradientCheckpointingLayer`s, as in transformers' Llama:
`model.gradient_checkpointing_enable()` recomputes each layer in the backward pass.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import logging

from mlxkit.engines.models.decilm.configuration_mlx_decilm import MlxDeciLMConfig

logger = logging.get_logger(__name__)


# Rotary embeddings and eager attention are copied in from transformers' Llama module (Apache-2.0,
# Copyright The HuggingFace Team) rather than imported: Llama's internals are not a public API and
# change between releases, and this file ships inside exported models, where it runs on whatever
# transformers the reader has. mlxkit's tests check each copy against the
# installed transformers, ignoring docstrings, type annotations and hub-kernel decorators.


# Copied from transformers.models.llama.modeling_llama.rotate_half
def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


# Copied from transformers.models.llama.modeling_llama.apply_rotary_pos_emb
def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


# Copied from transformers.models.llama.modeling_llama.repeat_kv
def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


# Copied from transformers.models.llama.modeling_llama.eager_attention_forward
def eager_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0, **kwargs):
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)

    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask

    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value_states)
    attn_output = attn_output.transpose(1, 2).contiguous()

    return attn_output, attn_weights


# Copied from transformers.models.llama.modeling_llama.LlamaRotaryEmbedding with Llama->MlxDeciLM
class MlxDeciLMRotaryEmbedding(nn.Module):
    def __init__(self, config: MlxDeciLMConfig):
        super().__init__()
        self.max_seq_len_cached = config.max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings

        self.config = config

        self.rope_type = self.config.rope_parameters["rope_type"]
        rope_init_fn: Callable = self.compute_default_rope_parameters
        if self.rope_type != "default":
            rope_init_fn = ROPE_INIT_FUNCTIONS[self.rope_type]
        inv_freq, self.attention_scaling = rope_init_fn(self.config)

        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        self.original_inv_freq = nn.Buffer(inv_freq.clone(), persistent=False)

    @staticmethod
    def compute_default_rope_parameters(config: MlxDeciLMConfig, **kwargs) -> tuple[torch.Tensor, float]:
        base = config.rope_parameters["rope_theta"]
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

        attention_factor = 1.0  # Unused in this type of RoPE
        # Compute the inverse frequencies
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, attention_factor

    @dynamic_rope_update
    def forward(self, x, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling

        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


class MlxDeciLMRMSNorm(nn.Module):
    """RMSNorm over the last dimension, normalised in float32.

    With `offset` 0 it is Llama's: cast back to the input's dtype, then scaled by `weight`. With
    `offset` 1 it is Gemma's: scaled by (1 + weight) in float32, then cast back; its weight starts
    at zeros. The two round differently in low precision, so each family keeps its own.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0):
        super().__init__()
        self.offset = float(offset)
        self.weight = nn.Parameter(torch.zeros(hidden_size) if self.offset else torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        hidden = hidden_states.to(torch.float32)
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        if self.offset:
            return (hidden * (self.offset + self.weight.float())).to(dtype)
        return self.weight * hidden.to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, offset={self.offset}"


def make_norm(config: MlxDeciLMConfig, size: int | None = None) -> MlxDeciLMRMSNorm:
    return MlxDeciLMRMSNorm(size or config.hidden_size, eps=config.rms_norm_eps, offset=config.norm_weight_offset)


class MlxDeciLMEmbedding(nn.Embedding):
    """Token embeddings, scaled by `multiplier` (Gemma's sqrt(hidden_size)) when it is set.

    The factor is rounded to the weights' dtype before it multiplies, as Gemma rounds it; a Python
    number, so the scaling costs no tensor creation or host transfer per call.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None,
                 multiplier: float | None = None):
        super().__init__(num_embeddings, embedding_dim, padding_idx)
        self.multiplier = multiplier
        self._rounded: dict[torch.dtype, float] = {}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        embeds = super().forward(input_ids)
        if self.multiplier is None:
            return embeds
        dtype = self.weight.dtype
        if dtype not in self._rounded:
            self._rounded[dtype] = float(torch.tensor(self.multiplier, dtype=torch.float32).to(dtype))
        return embeds * self._rounded[dtype]


def soft_capped_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                  attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0,
                                  softcap: float | None = None, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention whose scores are squashed to softcap·tanh(score / softcap) before the mask
    (Gemma 2); SDPA and flash attention cannot cap scores, so capped layers always run this."""
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores = scores + attention_mask[:, :, :, : key.shape[-2]]
    weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    output = torch.matmul(weights, value).transpose(1, 2).contiguous()
    return output, weights


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
        self.scaling = (config.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.softcap = config.attn_logit_softcapping
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        # Over head_dim, so one weight serves every head and a variant with fewer KV heads keeps it.
        self.q_norm = make_norm(config, self.head_dim) if config.qk_norm else None
        self.k_norm = make_norm(config, self.head_dim) if config.qk_norm else None
        self.sliding_window = config.sliding_window if config.layer_windowed(layer_idx) else None

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
            attention_mask = _causal_mask(query.shape[-2], key.shape[-2], self.sliding_window, query)
        if self.softcap is not None:
            # Capped scores run eagerly, which needs an additive mask whatever the model made: none (SDPA's
            # causal fast path, or a layer run on its own) or SDPA's boolean one.
            if attention_mask is None:
                attention_mask = _causal_mask(query.shape[-2], key.shape[-2], self.sliding_window, query)
            elif attention_mask.dtype == torch.bool:
                attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                    ~attention_mask, torch.finfo(query.dtype).min)
            attention: Callable = soft_capped_attention_forward
            kwargs["softcap"] = self.softcap
        else:
            attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                              eager_attention_forward)
        output, _ = attention(self, query, key, value, attention_mask, scaling=self.scaling,
                              dropout=0.0 if not self.training else self.attention_dropout,
                              sliding_window=self.sliding_window, **kwargs)
        return self.o_proj(output.reshape(*input_shape, -1).contiguous())


def _causal_mask(query_length: int, key_length: int, window: int | None, like: torch.Tensor) -> torch.Tensor:
    """Additive [1, 1, q, k] mask: the last `query_length` positions each see themselves and the
    positions before them (with a `window`, only the `window - 1` before them)."""
    query_pos = torch.arange(key_length - query_length, key_length, device=like.device)[:, None]
    key_pos = torch.arange(key_length, device=like.device)[None, :]
    visible = key_pos <= query_pos
    if window is not None:
        visible = visible & (query_pos - key_pos < window)
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


# Each subblock's modules in a decoder layer, in the order they run: the norm in front, the block, and
# (with sandwich norms) the norm after it. Everything that moves one subblock between models reads this.
SUBBLOCK_MODULES = {"attention": ("input_layernorm", "self_attn", "attention_output_norm"),
                    "ffn": ("post_attention_layernorm", "mlp", "ffn_output_norm")}


class MlxDeciLMDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm residual layer; a no-op subblock has neither weights nor norms.

    Under gradient checkpointing `forward` is recomputed in the backward pass, so the
    hidden states and position embeddings are passed positionally (the convention of
    `GradientCheckpointingLayer`); `attention_delta` and `ffn_delta` are never checkpointed.
    """

    def __init__(self, config: MlxDeciLMConfig, layer_idx: int):
        super().__init__()
        block = config.block_configs[layer_idx]
        self.self_attn = build_attention(config, layer_idx, block)
        self.mlp = build_ffn(config, block)
        self.input_layernorm = make_norm(config) if self.self_attn else None
        self.post_attention_layernorm = make_norm(config) if self.mlp else None
        # Gemma 2 norms each subblock's output too (its post_attention/post_feedforward_layernorm).
        self.attention_output_norm = make_norm(config) if self.self_attn and config.sandwich_norms else None
        self.ffn_output_norm = make_norm(config) if self.mlp and config.sandwich_norms else None

    def attention_delta(self, hidden_states: torch.Tensor, position_embeddings, attention_mask=None, cache=None,
                        **kwargs) -> torch.Tensor | None:
        """What the attention subblock adds to the residual stream (None for no-op)."""
        if self.self_attn is None:
            return None
        delta = self.self_attn(self.input_layernorm(hidden_states), position_embeddings=position_embeddings,
                               attention_mask=attention_mask, cache=cache, **kwargs)
        return delta if self.attention_output_norm is None else self.attention_output_norm(delta)

    def ffn_delta(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """What the FFN subblock adds to the residual stream (None for no-op)."""
        if self.mlp is None:
            return None
        delta = self.mlp(self.post_attention_layernorm(hidden_states))
        return delta if self.ffn_output_norm is None else self.ffn_output_norm(delta)

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

    # Soft-capped scores run in this file's eager attention, as Gemma 2's do in transformers. It turns
    # SDPA's masks (none, or boolean) into its own; flash attention's padding masks it does not read.
    @property
    def _supports_flash_attn(self) -> bool:
        return getattr(self.config, "attn_logit_softcapping", None) is None

    _supports_attention_backend = True

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        # A norm that scales by (offset + weight) is the identity at weight zero, not one.
        if isinstance(module, MlxDeciLMRMSNorm) and module.offset:
            init.zeros_(module.weight)


class MlxDeciLMModel(MlxDeciLMPreTrainedModel):
    def __init__(self, config: MlxDeciLMConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.embed_tokens = MlxDeciLMEmbedding(config.vocab_size, config.hidden_size, self.padding_idx,
                                               config.embedding_multiplier)
        self.layers = nn.ModuleList([MlxDeciLMDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = make_norm(config)
        self.rotary_emb = MlxDeciLMRotaryEmbedding(config=config)
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
        masks = self._causal_masks(inputs_embeds, attention_mask, cache, position_ids)
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        all_hidden = [hidden_states] if output_hidden_states else None
        for layer, kind in zip(self.layers, self.config.layer_types):
            hidden_states = layer(hidden_states, position_embeddings, attention_mask=masks.get(kind), cache=cache)
            if all_hidden is not None:
                all_hidden.append(hidden_states)
        hidden_states = self.norm(hidden_states)
        if all_hidden is not None:
            all_hidden[-1] = hidden_states
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, cache=cache if use_cache else None,
                                       hidden_states=tuple(all_hidden) if all_hidden is not None else None)


    def _causal_masks(self, inputs_embeds: torch.Tensor, attention_mask, cache: Cache | None,
                      position_ids: torch.Tensor) -> dict[str, torch.Tensor | None]:
        """The mask of each kind of attention layer the model has (a mapping `generate` may have made)."""
        kinds = set(self.config.layer_types) - {"linear_attention"}
        if isinstance(attention_mask, dict):
            return attention_mask
        makers = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
        return {kind: makers[kind](config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                                   cache=cache, position_ids=position_ids) for kind in sorted(kinds)}


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
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=outputs.cache,
                                      hidden_states=outputs.hidden_states)
