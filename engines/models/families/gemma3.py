"""Gemma 3: refused up front, naming what the child lacks for it."""

from mlxkit.engines.models.families import Family

FAMILY = Family(name="gemma3", model_types=("gemma3", "gemma3_text"), refused=(
    "the child has one RoPE for every layer, and Gemma 3's sliding-window layers have their own "
    "(rope_local_base_freq) beside the full-attention layers' scaled one"))
