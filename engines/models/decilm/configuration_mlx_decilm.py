"""Config of the heterogeneous Puzzle child: a Llama whose every layer has its own blocks.

`block_configs` follows the public Nemotron-NAS / DeciLM layout (one entry per layer,
`attention.{n_heads_in_group, no_op, replace_with_linear}` and
`ffn.{ffn_mult, no_op, replace_with_linear}`), plus the exact `num_key_value_heads` and
`intermediate_size` of every layer, so no shape depends on ffn_mult rounding.

Fields a parent family needs beyond Llama's live here too, so an exported child loads with
nothing but this file and the modeling file beside it. Each is off by default, which is Llama:

* `qk_norm` (Qwen3): an RMSNorm over each head's query and key, before RoPE, in every layer
  that keeps attention (one weight of `head_dim` each, shared by the heads).
* `sliding_window` (Mistral v0.1, Phi-3-mini-4k, Gemma 2): an attention layer sees only the last
  `sliding_window` positions, itself included (transformers' convention); None: full attention.
  `windowed_layers` says which layers keep the window (Gemma 2 alternates); None: all of them.
* `norm_weight_offset` (Gemma): every RMSNorm scales by (offset + weight), in float32, before the
  cast back to the activations' dtype; 0 is Llama's norm, which casts first and scales by weight.
* `embedding_multiplier` (Gemma): the token embeddings are scaled by it (sqrt(hidden_size)), the
  factor rounded to the activations' dtype first.
* `sandwich_norms` (Gemma 2): each subblock's output is normed (`attention_output_norm`,
  `ffn_output_norm`) before it joins the residual stream.
* `query_pre_attn_scalar` (Gemma 2): attention scores are scaled by its inverse square root
  instead of head_dim's.
* `attn_logit_softcapping`, `final_logit_softcapping` (Gemma 2): scores (before the mask) and
  logits are squashed to cap·tanh(x / cap).
"""

from __future__ import annotations

from typing import Any

from transformers import LlamaConfig

from mlxkit.engines.models.decilm.blocks import AttentionVariant, FFNVariant, ParentShape

# Family fields, each with the value that leaves the model a Llama.
FAMILY_DEFAULTS: dict[str, Any] = {"qk_norm": False, "sliding_window": None, "windowed_layers": None,
                                   "norm_weight_offset": 0.0, "embedding_multiplier": None, "sandwich_norms": False,
                                   "query_pre_attn_scalar": None, "attn_logit_softcapping": None,
                                   "final_logit_softcapping": None}


def _uniform_block(num_heads: int, num_kv_heads: int, hidden: int, intermediate: int) -> dict[str, Any]:
    return {
        "attention": {"n_heads_in_group": num_heads // num_kv_heads, "no_op": False, "replace_with_linear": False,
                      "num_key_value_heads": num_kv_heads},
        "ffn": {"ffn_mult": round(3 * intermediate / (2 * hidden), 6), "no_op": False, "replace_with_linear": False,
                "intermediate_size": intermediate},
    }


def _normalise_block(block: dict[str, Any], num_heads: int, hidden: int) -> dict[str, Any]:
    """Fill the exact sizes from DeciLM's own fields when a config carries only those."""
    attention = AttentionVariant.from_block_config(block["attention"], num_heads)
    ffn = FFNVariant.from_block_config(block["ffn"], hidden)
    shape = ParentShape(hidden, 0, num_heads, 0, 0, 0, 0, False)
    return {"attention": {**block["attention"], **attention.to_block_config(shape)},
            "ffn": {**block["ffn"], **ffn.to_block_config(shape)}}


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


class MlxDeciLMConfig(LlamaConfig):
    """Llama fields plus `block_configs` and the family fields (`FAMILY_DEFAULTS`); `num_key_value_heads` and
    `intermediate_size` keep the parent's."""

    model_type = "mlx_decilm"

    def __post_init__(self, **kwargs):
        block_configs = kwargs.pop("block_configs", None)
        kwargs.pop("layer_types", None)  # derived below, never taken from the file
        family = {name: kwargs.pop(name, default) for name, default in FAMILY_DEFAULTS.items()}
        super().__post_init__(**kwargs)
        self.qk_norm = bool(family["qk_norm"])
        self.sliding_window = int(family["sliding_window"]) if family["sliding_window"] is not None else None
        self.norm_weight_offset = float(family["norm_weight_offset"])
        self.embedding_multiplier = _optional_float(family["embedding_multiplier"])
        self.sandwich_norms = bool(family["sandwich_norms"])
        self.query_pre_attn_scalar = _optional_float(family["query_pre_attn_scalar"])
        self.attn_logit_softcapping = _optional_float(family["attn_logit_softcapping"])
        self.final_logit_softcapping = _optional_float(family["final_logit_softcapping"])
        windowed = family["windowed_layers"]
        if windowed is not None and len(windowed) != self.num_hidden_layers:
            raise ValueError(f"windowed_layers has {len(windowed)} entries for {self.num_hidden_layers} layers")
        # Every layer windowed is spelled None, so a config reads the same however it was made.
        self.windowed_layers = None if windowed is None or all(windowed) else [bool(w) for w in windowed]
        self.parent_num_key_value_heads = getattr(self, "parent_num_key_value_heads", None) or self.num_key_value_heads
        self.parent_intermediate_size = getattr(self, "parent_intermediate_size", None) or self.intermediate_size
        if block_configs is None:
            block_configs = [_uniform_block(self.num_attention_heads, self.num_key_value_heads, self.hidden_size,
                                            self.intermediate_size)] * self.num_hidden_layers
        if len(block_configs) != self.num_hidden_layers:
            raise ValueError(f"block_configs has {len(block_configs)} entries for {self.num_hidden_layers} layers")
        self.block_configs = [_normalise_block(b, self.num_attention_heads, self.hidden_size) for b in block_configs]
        # Layers without attention keep no per-token KV cache. transformers gives "linear_attention"
        # layers a state-only cache entry and measures the sequence length on the first real
        # attention layer, so positions stay right even when layer 0 has no attention.
        self.layer_types = ["linear_attention" if b["attention"]["no_op"] or b["attention"]["replace_with_linear"]
                            else "sliding_attention" if self.layer_windowed(i) else "full_attention"
                            for i, b in enumerate(self.block_configs)]
        self.architectures = ["MlxDeciLMForCausalLM"]

    def layer_windowed(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx`'s attention keeps the sliding window."""
        if self.sliding_window is None:
            return False
        return self.windowed_layers is None or self.windowed_layers[layer_idx]
