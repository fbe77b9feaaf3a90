"""Llama 1-3.x: the child's own layout (RoPE scaling, `rope_type: llama3` included, is carried as it is)."""

from mlxkit.engines.models.families import Family

FAMILY = Family(name="llama", model_types=("llama",))
