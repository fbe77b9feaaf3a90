"""What every training run shares around its recipe: the options common to all, and setup → train → save.

A trainer (GKD/KD, finetune, crt) subclasses `TrainingRun` and supplies `setup`, `train` and
`save`; the run resolves its device and dtype, joins the launch's process group, and keeps its
work in progress in `.<out>.<work_kind>-work/` beside the output.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mlxkit.engines.core.progress import Reporter
from mlxkit.engines.errors import InputError
from mlxkit.engines.training.device import Placement, training_placement
from mlxkit.engines.training.distributed import Distributed
from mlxkit.engines.training.work import work_dir_beside


@dataclass(frozen=True, kw_only=True)
class TrainingOptions:
    seed: int = 0
    overwrite: bool = False
    device: str = "auto"                 # see engines/training/device.py for the device and dtype rule
    dtype: str = "auto"
    save_dtype: str | None = None
    sharding: str = "auto"               # see engines/training/sharding.py
    stop_after_steps: int | None = None  # leave a resumable checkpoint and stop (tests, time-boxed runs)
    manifest_extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.sharding not in ("auto", "fsdp", "none"):
            raise InputError(f"--sharding must be auto, fsdp or none (got '{self.sharding}')")


class TrainingRun(ABC):
    """Setup, train, save: one readable recipe over the shared building blocks."""

    work_kind = "train"

    def __init__(self, options: Any, reporter: Reporter | None = None):
        self.options = options
        self.recipe = options.recipe
        self.reporter = reporter or Reporter()
        self.placement = self.resolve_placement()
        self.dist = self.join_processes()
        for note in self.dist.notes:
            self.reporter.notice(note)
        self.out = Path(options.out).expanduser().resolve()
        self.work = work_dir_beside(self.out, self.work_kind)
        self.started = time.time()

    def resolve_placement(self) -> Placement:
        return training_placement(self.options.device, self.options.dtype)

    def join_processes(self) -> Distributed:
        return Distributed.from_env(self.placement.device)

    @abstractmethod
    def setup(self) -> None:
        """Check the inputs, load and place the models, resume from a checkpoint if there is one."""

    @abstractmethod
    def train(self) -> dict[str, Any] | None:
        """The summary once every step ran; None when stopped early or on a rank other than 0."""

    @abstractmethod
    def save(self, summary: dict[str, Any]) -> Path:
        """Write the output (rank 0) and return where it is."""

    def execute(self) -> dict[str, Any]:
        """Train (or resume) and save; the summary, or {} on other ranks or when stopped early."""
        try:
            self.setup()
            summary = self.train()
            if summary is None:
                return {}
            out = self.save(summary)
            return {**summary, "out": str(out), "wall_time_s": round(time.time() - self.started, 1)}
        finally:
            self.cleanup()

    def cleanup(self) -> None:
        """Drop the run's models and optimiser, then leave the process group (when this run joined it);
        every rank meets the others here. The models go first: sharded ones hold the group."""
        for name, value in list(vars(self).items()):
            if isinstance(value, (torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler)):
                delattr(self, name)
        self.dist.close()
