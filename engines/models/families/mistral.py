"""Mistral: Llama's layout; v0.1's sliding window becomes the child's `sliding_window`."""

from mlxkit.engines.models.families import Family

FAMILY = Family(name="mistral", model_types=("mistral",))
