"""The optimiser settings the trainers read from their recipes (`optim:`), the learning-rate schedule, and the
optimiser they build."""

from __future__ import annotations

from typing import Iterable, Literal, Union

import torch
from pydantic import Field

from mlxkit.engines.core.yaml_config import StrictSpec
from mlxkit.engines.training.schedule import warmup_cosine

# `auto`: on when the run computes on a GPU, where activation memory is what limits the batch;
# off on a CPU, where recomputing the forward costs more time than the memory is worth.
GradientCheckpointing = Union[bool, Literal["auto"]]


class LrSchedule(StrictSpec):
    """The learning rate as a pure function of the step: a linear warm-up over `warmup_fraction` of the steps,
    then cosine decay from `lr` to `min_lr_factor · lr`. A factor of 1 holds the rate at `lr` (no warm-up then
    means a constant rate), a factor of 0 decays it to zero."""

    lr: float = Field(1e-4, gt=0)
    min_lr_factor: float = Field(0.1, ge=0, le=1)
    warmup_fraction: float = Field(0.05, ge=0, lt=1)

    def lr_at(self, step: int, total_steps: int) -> float:
        return warmup_cosine(step, total_steps, self.lr, min_factor=self.min_lr_factor,
                             warmup_steps=int(round(self.warmup_fraction * total_steps)))


class OptimSpec(LrSchedule):
    lr: float = Field(1e-4, gt=0, le=1)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, ge=0)
    batch_sequences: int = Field(4, ge=1)
    micro_batch_sequences: int = Field(2, ge=1)
    betas: tuple[float, float] = (0.9, 0.95)


def build_optimizer(params: Iterable[torch.nn.Parameter], kind: Literal["adamw", "sgd"], *, lr: float,
                    weight_decay: float, betas: tuple[float, float] = (0.9, 0.999),
                    momentum: float = 0.0) -> torch.optim.Optimizer:
    """AdamW (with `betas`) or SGD (with `momentum`) over `params`; the step's rate is set by `LrSchedule`."""
    if kind == "adamw":
        return torch.optim.AdamW(list(params), lr=lr, weight_decay=weight_decay, betas=betas)
    return torch.optim.SGD(list(params), lr=lr, momentum=momentum, weight_decay=weight_decay)


def build_adamw(params: Iterable[torch.nn.Parameter], spec: OptimSpec) -> torch.optim.Optimizer:
    """AdamW over `params` (float32 master weights, so its state is float32 too)."""
    return build_optimizer(params, "adamw", lr=spec.lr, weight_decay=spec.weight_decay, betas=spec.betas)


def gradient_checkpointing_on(setting: GradientCheckpointing, device: torch.device) -> bool:
    return device.type == "cuda" if setting == "auto" else bool(setting)
