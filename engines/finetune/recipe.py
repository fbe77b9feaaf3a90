"""Fine-tuning recipes (`recipes/finetune/*.yaml`): method, objective, adapter, data, optimiser, schedule.

Every field is validated by pydantic when the recipe is read, and again after `--set`
overrides, so a typo or an out-of-range value is one error naming each bad key, before
any weights load.
"""

from __future__ import annotations

import os
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mlxkit.engines.core.yaml_config import StrictSpec, load_packaged_or_file, packaged_names, validate_model, with_overrides
from mlxkit.engines.errors import RecipeError
from mlxkit.engines.training.spec import GradientCheckpointing, OptimSpec
from mlxkit.engines.robust.recipe import CrtRecipe

RECIPE_PACKAGE = "mlxkit.recipes.finetune"

Method = Literal["htuning", "lora", "full"]
Objective = Literal["causal_lm", "classification"]


class LoraSpec(StrictSpec):
    """peft `LoraConfig` fields; scaling is alpha / r."""

    r: int = Field(8, ge=1, le=4096)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    # "all-linear" (peft's selector: every Linear but the output head) or module names / a regex.
    target_modules: Union[list[str], str] = "all-linear"


class HTuningSpec(StrictSpec):
    """The mix-order step (H-Tuning, Zhou et al., ICML 2025)."""

    zo_eps: float = Field(1e-3, gt=0, le=1)       # SPSA perturbation size ε
    mix_coef: float = Field(0.85, ge=0, le=1)                          # c: g = c·g_FO + (1−c)·‖g_FO‖·ĝ_ZO
    fo_sequences: int = Field(2, ge=1)                                 # backprop slice of each batch
    # The last `fo_layers` decoder layers (and a classification head, always) get an exact
    # first-order gradient on the full batch instead of the blend.
    fo_layers: int = Field(1, ge=0)


class FinetuneData(StrictSpec):
    seq_len: int = Field(512, ge=2, le=1 << 20)     # packed length (causal LM) or truncation (classification)
    held_out_sequences: int = Field(8, ge=1)         # validation sequences / examples
    label_field: str = Field("label", min_length=1)  # classification JSONL field holding the label


class FinetuneOptim(OptimSpec):
    betas: tuple[float, float] = (0.9, 0.999)  # torch's AdamW default, which fine-tuning has always used


class FinetuneSchedule(StrictSpec):
    steps: int = Field(100, ge=1)
    eval_every: int = Field(20, ge=1)
    checkpoint_every: int = Field(20, ge=1)
    checkpoint_minutes: float = Field(10.0, ge=0)  # also after this much wall time; 0: off


class FinetuneRecipe(StrictSpec):
    name: str = "custom"
    description: str = ""
    method: Method = "lora"
    objective: Objective = "causal_lm"
    lora: Optional[LoraSpec] = LoraSpec()
    htuning: Optional[HTuningSpec] = None
    data: FinetuneData = FinetuneData()
    optim: FinetuneOptim = FinetuneOptim()
    schedule: FinetuneSchedule = FinetuneSchedule()
    gradient_checkpointing: GradientCheckpointing = "auto"  # of the model's decoder layers

    @model_validator(mode="after")
    def _consistent(self) -> "FinetuneRecipe":
        if self.method == "full" and self.lora is not None:
            raise ValueError("method 'full' trains every weight and takes no lora section (set lora: null)")
        if self.method in ("lora", "htuning") and self.lora is None:
            raise ValueError(f"method '{self.method}' needs a lora section")
        if self.method == "htuning":
            if self.htuning is None:
                raise ValueError("method 'htuning' needs an htuning section")
            if self.htuning.fo_sequences > self.optim.batch_sequences:
                raise ValueError(f"htuning.fo_sequences ({self.htuning.fo_sequences}) cannot exceed "
                                 f"optim.batch_sequences ({self.optim.batch_sequences})")
        elif self.htuning is not None:
            raise ValueError(f"method '{self.method}' takes no htuning section (set htuning: null)")
        return self

    def with_overrides(self, overrides: dict[str, Any]) -> "FinetuneRecipe":
        """A copy with dotted keys replaced (`optim.lr=3e-4`, `htuning.mix_coef=0.9`), validated again."""
        return with_overrides(self, overrides, RecipeError)


def available_recipes() -> list[str]:
    return packaged_names(RECIPE_PACKAGE)


class _MethodOnly(BaseModel):
    """Reads a recipe's `method` and keeps the rest untouched, to pick the schema that validates it."""

    model_config = ConfigDict(extra="allow")
    method: Any = "lora"


def load_finetune_recipe(name_or_path: str | os.PathLike) -> Union[FinetuneRecipe, CrtRecipe]:
    """A packaged recipe by name (`htuning`, `lora`, `full`, `crt`) or a YAML file by path.

    `method: crt` is continual robust training of a classifier (`CrtRecipe`); every other
    method is a language-model recipe (`FinetuneRecipe`).
    """
    probe = load_packaged_or_file(_MethodOnly, name_or_path, RECIPE_PACKAGE, "recipe", RecipeError)
    schema: type[Union[FinetuneRecipe, CrtRecipe]] = CrtRecipe if probe.method == "crt" else FinetuneRecipe
    return validate_model(schema, probe.model_dump(), f"recipe {name_or_path}", RecipeError)
