"""A Puzzle child as a parent: its own layout; its family fields and parent widths are carried by `child_config`."""

from mlxkit.engines.models.families import Family

FAMILY = Family(name="mlx_decilm", model_types=("mlx_decilm",))
