"""The optimiser settings every language-model trainer reads from its recipe (`optim:`), and the optimiser they build."""

from __future__ import annotations

from typing import Iterable, Literal, Union

import torch
from pydantic import BaseModel, ConfigDict, Field

from mlxkit.engines.training.schedule import warmup_cosine

# `auto`: on when the run computes on a GPU, where activation memory is what limits the batch;
# off on a CPU, where recomputing the forward costs more time than the memory is worth.
GradientCheckpointing = Union[bool, Literal["auto"]]


class OptimSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    lr: float = Field(1e-4, gt=0, le=1, allow_inf_nan=False)
    min_lr_factor: float = Field(0.1, ge=0, le=1)
    warmup_fraction: float = Field(0.05, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0, allow_inf_nan=False)
    grad_clip: float = Field(1.0, ge=0, allow_inf_nan=False)
    batch_sequences: int = Field(4, ge=1)
    micro_batch_sequences: int = Field(2, ge=1)
    betas: tuple[float, float] = (0.9, 0.95)


    def lr_at(self, step: int, total_steps: int) -> float:
        """Linear warm-up over `warmup_fraction` of the steps, then cosine decay to `min_lr_factor` of the peak."""
        return warmup_cosine(step, total_steps, self.lr, min_factor=self.min_lr_factor,
                             warmup_steps=int(round(self.warmup_fraction * total_steps)))


def build_adamw(params: Iterable[torch.nn.Parameter], spec: OptimSpec) -> torch.optim.AdamW:
    """AdamW over `params` (float32 master weights, so its state is float32 too)."""
    return torch.optim.AdamW(list(params), lr=spec.lr, weight_decay=spec.weight_decay, betas=spec.betas)


def gradient_checkpointing_on(setting: GradientCheckpointing, device: torch.device) -> bool:
    return device.type == "cuda" if setting == "auto" else bool(setting)
