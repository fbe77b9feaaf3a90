"""Qwen3 (dense): Llama's layout with an RMSNorm over each head's query and key, before RoPE."""

from mlxkit.engines.models.families import Family

FAMILY = Family(name="qwen3", model_types=("qwen3",), child_fields={"qk_norm": True})
