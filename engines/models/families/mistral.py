"""Mistral: Llama's layout; a sliding window shorter than the model's positions is refused (not in the child)."""

from mlxkit.engines.models.families import Family

FAMILY = Family(name="mistral", model_types=("mistral",))
