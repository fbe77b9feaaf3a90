"""Distillation recipes (`recipes/distill/*.yaml`): loss weights, data, optimiser, schedule."""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import Field, model_validator

from mlxkit.engines.core.yaml_config import StrictSpec, load_packaged_or_file, packaged_names, with_overrides
from mlxkit.engines.errors import RecipeError
from mlxkit.engines.training.spec import GradientCheckpointing, OptimSpec

RECIPE_PACKAGE = "mlxkit.recipes.distill"


class LossSpec(StrictSpec):
    cosine_weight: float = Field(1.0, ge=0)
    kl_weight: float = Field(1.0, ge=0)
    lm_weight: float = Field(0.0, ge=0)
    temperature: float = Field(1.0, gt=0, le=100)
    # K: the KL term compares the student with the teacher's K likeliest tokens plus one bucket for the
    # rest, read from a cache of the teacher's outputs (engines/distill/teacher_cache.py); the teacher
    # runs only on sequences no earlier run has cached. None: the teacher runs on every step, full KL.
    teacher_top_k: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _some_term(self) -> "LossSpec":
        if self.cosine_weight == self.kl_weight == self.lm_weight == 0:
            raise ValueError("at least one of cosine_weight, kl_weight, lm_weight must be positive")
        if self.teacher_top_k is not None and self.cosine_weight > 0:
            raise ValueError("teacher_top_k caches the teacher's logits, not its hidden states: it needs "
                             "cosine_weight: 0")
        return self


class DistillData(StrictSpec):
    seq_len: int = Field(512, ge=2, le=1 << 20)
    held_out_sequences: int = Field(4, ge=1)
    # Training blocks are drawn from the first this-many tokens of --data (at least the run's budget):
    # a budget far below the corpus then still sees all of it, not only its first pages. Tokenised
    # once into memory-mapped shards, so a larger span costs disk and one pass, not memory.
    corpus_tokens: int = Field(1 << 24, ge=0)


class DistillSchedule(StrictSpec):
    tokens: int = Field(65536, ge=1)
    eval_every: int = Field(8, ge=1)
    checkpoint_every: int = Field(200, ge=1)
    checkpoint_minutes: float = Field(10.0, ge=0)  # also after this much wall time; 0: off


# Which of the student's weights train. `replaced_blocks`: the decoder layers of a Puzzle child whose
# attention or FFN differs from the parent's, and `neighbours` layers either side of each; every other
# layer, the embeddings, the final norm and the head stay as the parent left them.
Trainable = Literal["all", "replaced_blocks"]


class DistillRecipe(StrictSpec):
    name: str = "custom"
    description: str = ""
    loss: LossSpec = LossSpec()
    data: DistillData = DistillData()
    optim: OptimSpec = OptimSpec()
    schedule: DistillSchedule = DistillSchedule()
    gradient_checkpointing: GradientCheckpointing = "auto"  # of the student's decoder layers
    trainable: Trainable = "all"
    neighbours: int = Field(1, ge=0)

    def with_overrides(self, overrides: dict[str, Any]) -> "DistillRecipe":
        """A copy with dotted keys replaced (`optim.lr=3e-4`), validated again."""
        return with_overrides(self, overrides, RecipeError)


def available_recipes() -> list[str]:
    return packaged_names(RECIPE_PACKAGE)


def load_distill_recipe(name_or_path: str | os.PathLike) -> DistillRecipe:
    """A packaged recipe by name (`gkd`, `kd`) or a YAML file by path."""
    return load_packaged_or_file(DistillRecipe, name_or_path, RECIPE_PACKAGE, "recipe", RecipeError)
