"""Gemma 2: Gemma's norms, embedding scale and GeGLU, plus the norms after each subblock (see gemma.py)."""

from mlxkit.engines.models.families import Family
from mlxkit.engines.models.families.gemma import gemma_fields

FAMILY = Family(name="gemma2", model_types=("gemma2",), config_fields=gemma_fields,
                child_fields={"sandwich_norms": True},
                renamed={"post_attention_layernorm.weight": "pre_feedforward_layernorm.weight",
                         "attention_output_norm.weight": "post_attention_layernorm.weight",
                         "ffn_output_norm.weight": "post_feedforward_layernorm.weight"})
