"""Puzzle recipes: the search space, data, BLD and scoring settings, validated."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, field_validator

from mlxkit.engines.core.yaml_config import StrictSpec, load_packaged_or_file, packaged_names
from mlxkit.engines.errors import RecipeError

RECIPE_PACKAGE = "mlxkit.recipes.puzzle"


class SearchSpaceSpec(StrictSpec):
    attention: list[Literal["parent", "kv_divisors", "linear", "no_op"]] = ["parent", "kv_divisors", "linear", "no_op"]
    max_kv_options: int | None = None
    ffn_fractions: list[float] = [1.0, 0.875, 0.75, 0.5, 0.25, 0.2, 0.1]
    ffn_linear: bool = True
    ffn_no_op: bool = True
    width_multiple: int = Field(64, ge=1)

    @field_validator("ffn_fractions")
    @classmethod
    def _fractions_in_range(cls, value: list[float]) -> list[float]:
        if not value or any(not 0.0 < f <= 1.0 for f in value):
            raise ValueError("ffn_fractions must be a non-empty list of numbers in (0, 1]")
        return value


class PuzzleData(StrictSpec):
    seq_len: int = Field(256, ge=8)
    train_sequences: int = Field(48, ge=1)
    score_sequences: int = Field(4, ge=1)


class BLDSpec(StrictSpec):
    tokens_per_block: int = Field(32768, ge=0)
    batch_sequences: int = Field(4, ge=1)
    lr: float = Field(1e-3, gt=0)
    min_lr_factor: float = Field(0.1, ge=0, le=1)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, ge=0)  # the global gradient norm's limit; 0: no clipping
    train_linear: bool = False


class ScoringSpec(StrictSpec):
    metric: Literal["kl_div", "lm_loss"] = "kl_div"


class PuzzleRecipe(StrictSpec):
    name: str
    description: str = ""
    search_space: SearchSpaceSpec = SearchSpaceSpec()
    data: PuzzleData = PuzzleData()
    bld: BLDSpec = BLDSpec()
    scoring: ScoringSpec = ScoringSpec()


def available_recipes() -> list[str]:
    return packaged_names(RECIPE_PACKAGE)


def load_recipe(name_or_path: str | os.PathLike) -> PuzzleRecipe:
    """A packaged recipe by name (`quick`, `standard`) or a YAML file by path."""
    return load_packaged_or_file(PuzzleRecipe, name_or_path, RECIPE_PACKAGE, "recipe", RecipeError)
