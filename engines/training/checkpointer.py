"""A run's checkpoint client: saves and loads `<work>/checkpoint`, plain or sharded, and un-shards the result.

A trainer decides once whether its model is sharded and builds one `Checkpointer` with that choice; its
saves, its resume and, after the last step, the gathering of the trained weights all go through it, so no
trainer picks between the two formats itself. A plain checkpoint (`checkpoint.py`) is written by rank 0
alone, from a model every rank holds whole; a sharded one (`sharding.py`, torch.distributed.checkpoint)
by every rank, each its own shards, and it resumes only under as many processes. The finished output is
never sharded: the trained weights are gathered onto rank 0 and loaded into a plain copy of the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, TypeVar

import torch

from mlxkit.engines.training.checkpoint import TrainingState, load_checkpoint, save_checkpoint
from mlxkit.engines.training.distributed import Distributed
from mlxkit.engines.training.sharding import full_state_dict, load_sharded_checkpoint, save_sharded_checkpoint

CHECKPOINT_DIR = "checkpoint"

Trained = TypeVar("Trained")


class Checkpointer:
    """Where and how one run keeps its resumable state; every call is made on every rank."""

    def __init__(self, work: Path, dist: Distributed, *, sharded: bool, trainable_only: bool = False):
        self.directory = Path(work) / CHECKPOINT_DIR
        self.dist = dist
        self.sharded = sharded
        self.trainable_only = trainable_only  # an adapter run keeps only what trains, not the frozen base
        self._gathered: dict[str, torch.Tensor] = {}

    def load(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> TrainingState | None:
        """Restore `model` and `optimizer` in place from the latest checkpoint; None when there is none yet."""
        if self.sharded:
            return load_sharded_checkpoint(self.directory, model, optimizer, self.dist)
        return load_checkpoint(self.directory, model, optimizer, trainable_only=self.trainable_only)

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: TrainingState) -> None:
        """Replace the latest checkpoint with this state: each rank its shards, or rank 0 the whole model."""
        if self.sharded:
            save_sharded_checkpoint(self.directory, model, optimizer, state, self.dist)
        elif self.dist.is_main:
            save_checkpoint(self.directory, model, optimizer, state, trainable_only=self.trainable_only)

    def gather(self, model: torch.nn.Module) -> None:
        """After the last step, on every rank: a sharded model's whole weights, received by rank 0 on the CPU."""
        if self.sharded:
            self._gathered = full_state_dict(model)

    def unsharded(self, trained: Trained, rebuild: Callable[[], tuple[Trained, torch.nn.Module]]) -> Trained:
        """What rank 0 writes: `trained` itself when it was never sharded; otherwise the plain copy that `rebuild`
        makes, returned with the module the gathered weights load into."""
        if not self.sharded:
            return trained
        plain, weights = rebuild()
        weights.load_state_dict(self._gathered, strict=True)
        self._gathered = {}
        return plain
