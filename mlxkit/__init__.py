"""mlxkit: compress and deploy language models.

Importing the package registers mlxkit's own model classes (the heterogeneous Puzzle
child, `model_type="mlx_decilm"`) with transformers' Auto classes, so a saved child loads
with a plain `AutoModelForCausalLM.from_pretrained(path)`.
"""

__version__ = "0.1.0"


def register_auto_classes() -> None:
    """Register mlxkit model classes with transformers (idempotent)."""
    from mlxkit.engines.models.registration import register

    register()


try:
    register_auto_classes()
except ImportError:  # the heterogeneous model lands with Puzzle I; keep the package importable
    pass
