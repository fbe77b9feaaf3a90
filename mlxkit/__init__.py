"""mlxkit: compress and deploy language models.

Importing the package registers mlxkit's own model classes (the heterogeneous Puzzle
child, `model_type="mlx_decilm"`) with transformers' Auto classes, so a saved child loads
with a plain `AutoModelForCausalLM.from_pretrained(path)`.
"""

import os as _os
import sys as _sys

__version__ = "0.1.0"


def register_auto_classes() -> None:
    """Register mlxkit model classes with transformers (idempotent)."""
    from mlxkit.engines.models.registration import register

    register()


# The `mlx` command (and `python -m mlxkit`, whose argv[0] reads "-m" while this runs) registers
# on its first model load instead (engines/models/loading.py): importing torch and transformers
# up front would make `mlx --help` take seconds.
if _os.path.basename(_sys.argv[0] if _sys.argv else "") not in ("mlx", "mlx.exe", "-m"):
    register_auto_classes()
