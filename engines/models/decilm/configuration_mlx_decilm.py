"""Config of the heterogeneous Puzzle child: a Llama whose every layer has its own blocks.

`block_configs` follows the public Nemotron-NAS / DeciLM layout (one entry per layer,
`attention.{n_heads_in_group, no_op, replace_with_linear}` and
`ffn.{ffn_mult, no_op, replace_with_linear}`), plus the exact `num_key_value_heads` and
`intermediate_size` of every layer, so no shape depends on ffn_mult rounding.

Fields a parent family needs beyond Llama's live here too, so an exported child loads with
nothing but this file and the modeling file beside it:

* `qk_norm` (Qwen3): an RMSNorm over each head's query and key, before RoPE, in every layer
  that keeps attention (one weight of `head_dim` each, shared by the heads).
* `sliding_window` (Mistral v0.1, Phi-3-mini-4k): every attention layer sees only the last
  `sliding_window` positions, itself included (transformers' convention); None: full attention.
"""

from __future__ import annotations

from typing import Any

from transformers import LlamaConfig

from mlxkit.engines.models.decilm.blocks import AttentionVariant, FFNVariant, ParentShape


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


class MlxDeciLMConfig(LlamaConfig):
    """Llama fields plus `block_configs` and the family fields (`qk_norm`, `sliding_window`); `num_key_value_heads` and
    `intermediate_size` keep the parent's."""

    model_type = "mlx_decilm"

    def __post_init__(self, **kwargs):
        block_configs = kwargs.pop("block_configs", None)
        kwargs.pop("layer_types", None)  # derived below, never taken from the file
        qk_norm = kwargs.pop("qk_norm", False)
        sliding_window = kwargs.pop("sliding_window", None)
        super().__post_init__(**kwargs)
        self.qk_norm = bool(qk_norm)
        self.sliding_window = int(sliding_window) if sliding_window is not None else None
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
        attention = "sliding_attention" if self.sliding_window is not None else "full_attention"
        self.layer_types = ["linear_attention" if b["attention"]["no_op"] or b["attention"]["replace_with_linear"]
                            else attention for b in self.block_configs]
        self.architectures = ["MlxDeciLMForCausalLM"]
