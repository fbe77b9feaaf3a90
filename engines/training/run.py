"""What every training run shares around its recipe: the options common to all, and setup → train → save.

A trainer (GKD/KD, finetune, crt) subclasses `TrainingRun` and supplies `setup`, `train` and
`save`; the run resolves its device and dtype, joins the launch's process group, and keeps its
work in progress in `.<out>.<work_kind>-work/` beside the output: the log (`log_name`) and the
checkpoint, which its `Checkpointer` saves and loads. What every trainer does the same way lives
here: the start or resume from the checkpoint, the step loop on the recipe's cadence, the end of
training, the summary's common part, and the output written atomically with the log and the
manifest before the work directory goes.
"""

from __future__ import annotations

import shutil
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from mlxkit.engines.core.atomic import atomic_output_dir
from mlxkit.engines.core.manifest import Manifest
from mlxkit.engines.core.progress import Reporter
from mlxkit.engines.errors import InputError
from mlxkit.engines.training.budget import peak_rss_mib
from mlxkit.engines.training.checkpoint import TrainingState
from mlxkit.engines.training.checkpointer import Checkpointer
from mlxkit.engines.training.device import Placement, training_placement
from mlxkit.engines.training.distributed import Distributed
from mlxkit.engines.training.loop import StepLoop, median
from mlxkit.engines.training.step import release_training_state
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
    log_name = "train_log.jsonl"
    checkpointer: Checkpointer  # built in `setup`, once the run knows whether its model is sharded
    optimizer: torch.optim.Optimizer
    state: TrainingState

    def __init__(self, options: Any, reporter: Reporter | None = None):
        self.options = options
        self.recipe = options.recipe
        self.reporter = reporter or Reporter()
        self.placement = self.resolve_placement()
        self.dist = self.join_processes()
        for note in self.dist.notes:
            self.reporter.notice(note)
        self.out = Path(options.out).expanduser().resolve()
        self.work = self.work_dir_for(self.out)
        self.log = self.work / self.log_name
        self.started = time.time()

    @classmethod
    def work_dir_for(cls, out: Path) -> Path:
        """Where this kind of run keeps its work in progress for output `out`."""
        return work_dir_beside(out, cls.work_kind)

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

    def start_or_resume(self, model: torch.nn.Module, what: str, total_steps: int) -> TrainingState | None:
        """Start at step 0, or restore `model` and the optimiser from the checkpoint; the state resumed, if any."""
        self.state = TrainingState(0, 0, 0, {"train_seconds": 0.0})
        resumed = self.checkpointer.load(model, self.optimizer)
        if resumed is not None:
            self.state = resumed
            self.reporter.notice(f"resuming {what} at step {resumed.step} of {total_steps} "
                                 f"from {self.checkpointer.directory}")
        return resumed

    def step_loop(self, total_steps: int, schedule: Any, **settings: Any) -> StepLoop:
        """The loop over the run's steps, on the recipe's cadence (`schedule`: eval_every, checkpoint_every,
        checkpoint_minutes); `settings` are the loop's other fields."""
        return StepLoop(self.log, self.dist, self.reporter, self.state, total_steps, schedule.eval_every,
                        schedule.checkpoint_every, self.options.stop_after_steps,
                        checkpoint_minutes=schedule.checkpoint_minutes, **settings)

    def finish_training(self, finished: bool, model: torch.nn.Module) -> bool:
        """After the loop, on every rank: a finished run drops the optimiser's moments and gathers `model` onto
        rank 0 when it is sharded. True where this rank goes on to write the output."""
        if finished:
            release_training_state(self.optimizer)
            self.checkpointer.gather(model)
        return finished and self.dist.is_main

    def common_summary(self, records: list[dict[str, Any]], unit: str = "tokens") -> dict[str, Any]:
        """What every trainer reports: the evaluations before and after, the last loss, the step count, the
        `unit`s consumed, where and in what precision it ran, its training time, throughput and peak memory."""
        evals = [r["eval"] for r in records if "eval" in r]
        return {"steps": self.state.step, unit: self.state.tokens_seen, "world_size": self.dist.world_size,
                "device": str(self.placement.device),
                "compute_dtype": str(self.placement.dtype).removeprefix("torch."),
                "before": evals[0], "after": evals[-1], "final_loss": records[-1].get("loss"),
                "train_seconds": round(self.state.extra["train_seconds"], 3),
                "median_step_s": median([r["step_s"] for r in records if "step_s" in r]),
                f"median_{unit}_per_s": median([r[f"{unit}_per_s"] for r in records if f"{unit}_per_s" in r]),
                "peak_rss_mib": round(peak_rss_mib(), 1)}

    def write_output(self, manifest: Manifest, summary: dict[str, Any],
                     write_files: Callable[[Path], dict[str, Any] | None], *, card: bool = True) -> Path:
        """Rank 0, once: put the output in place atomically, then remove the work directory. The output holds
        what `write_files` writes into the fresh directory (the entries it returns join `summary`), a copy of
        the log, and `manifest` with `summary` as its results (`card`: with a model card beside it)."""
        with atomic_output_dir(self.out, overwrite=self.options.overwrite) as tmp:
            summary.update(write_files(tmp) or {})
            manifest.results = {**summary, "log": self.log_name}
            shutil.copyfile(self.log, tmp / self.log_name)
            manifest.write(tmp, card=card)
        shutil.rmtree(self.work, ignore_errors=True)
        return self.out

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
