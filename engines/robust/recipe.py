"""The continual-robust-training recipe (`recipes/finetune/crt.yaml`, `method: crt`).

Every field is validated by pydantic when the recipe is read and again after `--set`
overrides: an unknown key (a typo) or an out-of-range or non-finite value is one error
naming each bad key, before any data or weights load. Each attack has its own block with
its budget, its training steps and its evaluation steps; which attacks a run uses comes
from the command line (`--attacks`, `--new-attack`), not from the recipe.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field, model_validator

from mlxkit.engines.core.yaml_config import StrictSpec, with_overrides
from mlxkit.engines.errors import RecipeError
from mlxkit.engines.training.spec import LrSchedule


class AttackSpec(StrictSpec):
    """One threat model: the budget (a norm radius; for stadv, pixels of displacement) and its search."""

    budget: float = Field(gt=0, le=1e6)
    steps: int = Field(10, ge=1, le=10_000)                                  # ascent steps while training
    step_size: Optional[float] = Field(None, gt=0, le=1e6)  # default 2.5·budget/steps
    eval_steps: int = Field(20, ge=1, le=100_000)                             # a stronger attack to evaluate

    def step_size_for(self, steps: int) -> float:
        # 2.5·ε/steps (Madry et al.) lets the search cross the whole ball and come back.
        return self.step_size if self.step_size is not None else 2.5 * self.budget / steps


class AttacksSpec(StrictSpec):
    """Budgets for every attack mlxkit has; a run picks its attacks by name."""

    linf: AttackSpec = AttackSpec(budget=0.15)
    l2: AttackSpec = AttackSpec(budget=0.75)
    l1: AttackSpec = AttackSpec(budget=2.0)
    stadv: AttackSpec = AttackSpec(budget=0.3)

    def get(self, name: str) -> AttackSpec:
        return getattr(self, name)


class RegularizerSpec(StrictSpec):
    """λ·E‖f(x′) − f(x)‖₂ on the logits; `alr` searches x′ in the attack's threat model, `ur` draws it."""

    kind: Literal["none", "alr", "ur"] = "alr"
    weight: float = Field(1.0, ge=0, le=1e6)   # λ
    sigma: float = Field(2.0, gt=0, le=1e6)    # ur: ℓ2 radius of the noise


class SamplerSpec(StrictSpec):
    momentum: float = Field(0.9, ge=0, lt=1)   # running accuracy: weight of the history
    probe_examples: int = Field(128, ge=1)                          # training examples that set its start


class CrtData(StrictSpec):
    low: float = Field(0.0)    # the valid input range every attack stays inside
    high: float = Field(1.0)
    held_out_examples: int = Field(200, ge=1)       # evaluation examples (split off --data without --eval-data)

    @model_validator(mode="after")
    def _ordered(self) -> "CrtData":
        if not self.low < self.high:
            raise ValueError(f"data.low ({self.low}) must be below data.high ({self.high})")
        return self


class CrtOptim(StrictSpec):
    optimizer: Literal["sgd", "adamw"] = "sgd"
    momentum: float = Field(0.9, ge=0, lt=1)   # sgd only
    weight_decay: float = Field(5e-4, ge=0, le=1)
    batch_size: int = Field(64, ge=1, le=1 << 20)
    grad_clip: float = Field(0.0, ge=0)         # 0: no clipping


class PhaseSpec(StrictSpec):
    """Steps and learning rate of one phase: initial training, or fine-tuning on a new attack."""

    steps: int = Field(ge=1, le=10_000_000)
    lr: float = Field(gt=0, le=10)
    schedule: Literal["constant", "cosine"] = "constant"

    def lr_schedule(self) -> LrSchedule:
        """The phase's rate on the trainers' shared schedule: `lr` throughout, or cosine from `lr` to 0; no warm-up."""
        return LrSchedule(lr=self.lr, min_lr_factor=1.0 if self.schedule == "constant" else 0.0, warmup_fraction=0.0)


class CrtSchedule(StrictSpec):
    eval_every: int = Field(100, ge=1)
    checkpoint_every: int = Field(50, ge=1)
    checkpoint_minutes: float = Field(10.0, ge=0)  # also after this much wall time; 0: off


class CrtRecipe(StrictSpec):
    name: str = "custom"
    description: str = ""
    method: Literal["crt"] = "crt"
    attacks: AttacksSpec = AttacksSpec()
    regularizer: RegularizerSpec = RegularizerSpec()
    sampler: SamplerSpec = SamplerSpec()
    data: CrtData = CrtData()
    optim: CrtOptim = CrtOptim()
    train: PhaseSpec = PhaseSpec(steps=400, lr=0.05, schedule="cosine")
    finetune: PhaseSpec = PhaseSpec(steps=150, lr=0.005, schedule="constant")
    schedule: CrtSchedule = CrtSchedule()

    def with_overrides(self, overrides: dict[str, Any]) -> "CrtRecipe":
        """A copy with dotted keys replaced (`attacks.l2.budget=0.5`, `regularizer.kind=ur`), validated again."""
        return with_overrides(self, overrides, RecipeError)
