"""Gemma (1) and Gemma 2: Llama's layout with Gemma's norms, embedding scale and GeGLU FFN.

Every RMSNorm scales by (1 + weight) in float32 (`norm_weight_offset`), the embeddings are scaled
by sqrt(hidden_size), and the FFN's gate goes through the parent's activation (GELU, tanh
approximation). Gemma 2 adds a norm after each subblock (`sandwich_norms`; its checkpoints call the
norm before the FFN `pre_feedforward_layernorm`, and the norms after the subblocks
`post_attention_layernorm` and `post_feedforward_layernorm`), scores scaled by
`query_pre_attn_scalar`, soft-capped attention scores and logits, and a sliding window on
alternating layers; those fields are carried from its config as they are named there.
"""

from typing import Any

from mlxkit.engines.models.families import Family


def gemma_fields(config: Any) -> dict[str, Any]:
    """The child fields every Gemma generation needs: its norm, its embedding scale, its activation."""
    return {"norm_weight_offset": 1.0, "embedding_multiplier": config.hidden_size ** 0.5,
            "hidden_act": getattr(config, "hidden_activation", None) or config.hidden_act}


FAMILY = Family(name="gemma", model_types=("gemma",), config_fields=gemma_fields)
