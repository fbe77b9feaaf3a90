"""The step loop every trainer runs: steps, the log, held-out evaluation and checkpoints on a cadence.

A trainer supplies what differs (one optimiser step, an evaluation, how to checkpoint) and the
loop does the rest the same way for all of them:

* the log (one JSON record per step, plus a step-0 record with the evaluation before
  training) is cut back to the checkpoint's position on resume, so a resumed log equals an
  uninterrupted one;
* evaluation runs on rank 0 every `eval_every` steps and after the last;
* a checkpoint is taken every `checkpoint_every` steps, whenever `checkpoint_minutes` of wall
  time have passed since the last one (so a killed run loses at most that much, however long
  its steps), and where a time-boxed run stops (`stop_after`); never after the last step (the
  output follows at once). Rank 0's clock decides for every rank, and the others wait for the
  checkpoint at a barrier;
* each record carries the step's wall time, its throughput and the running training time,
  which is kept in the checkpoint, so a resumed run reports the time of the whole run.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from mlxkit.engines.core.progress import Reporter
from mlxkit.engines.training.checkpoint import TrainingState
from mlxkit.engines.training.distributed import Distributed
from mlxkit.engines.training.work import append_log, back_up_log, truncate_log


@dataclass
class StepOutcome:
    """What one optimiser step reports."""

    terms: dict[str, Any]                                  # logged as they are (loss terms and the like)
    units: int                                             # tokens (or examples) the step consumed
    progress: dict[str, Any] = field(default_factory=dict)  # shown beside the progress bar


@dataclass
class StepLoop:
    log: Path
    dist: Distributed
    reporter: Reporter
    state: TrainingState
    total_steps: int
    eval_every: int
    checkpoint_every: int
    stop_after: int | None = None
    unit: str = "tokens"  # what `StepOutcome.units` counts, as named in the log
    collective: bool = False  # every rank takes part in evaluation (a sharded model computes only together)
    checkpoint_minutes: float = 0.0  # 0: by step count only
    clock: Callable[[], float] = time.monotonic

    @property
    def stop(self) -> int:
        return self.total_steps if self.stop_after is None else min(self.total_steps, self.stop_after)

    @property
    def finished(self) -> bool:
        return self.state.step >= self.total_steps

    def run(self, *, title: str, step: Callable[[int], StepOutcome], evaluate: Callable[[], dict[str, Any]],
            checkpoint: Callable[[], None], optimizer: torch.optim.Optimizer,
            first_record: Callable[[], dict[str, Any]] | None = None) -> bool:
        """Run the remaining steps; True when the run reached its last step."""
        state = self.state
        state.extra.setdefault("train_seconds", 0.0)
        fresh = state.step == 0 and state.log_lines == 0
        if self.dist.is_main:
            truncate_log(self.log, state.log_lines)
        if fresh and (self.dist.is_main or self.collective):
            record = first_record() if first_record is not None else {"step": 0, self.unit: 0}
            record = {**record, "eval": evaluate()}
            if self.dist.is_main:
                append_log(self.log, record, state)
        self.dist.barrier()
        last_checkpoint = self.clock()
        with self.reporter.task(title, total=self.total_steps) as task:
            task.advance(state.step)
            for index in range(state.step, self.stop):
                started = time.perf_counter()
                outcome = step(index)
                seconds = time.perf_counter() - started
                state.step, state.tokens_seen = index + 1, state.tokens_seen + outcome.units
                state.extra["train_seconds"] += seconds
                record: dict[str, Any] = {"step": index + 1, self.unit: state.tokens_seen,
                                          "lr": optimizer.param_groups[0]["lr"], **outcome.terms, "step_s": seconds,
                                          f"{self.unit}_per_s": outcome.units / seconds,
                                          "train_s": state.extra["train_seconds"]}
                last = index + 1 == self.total_steps
                if (self.dist.is_main or self.collective) and ((index + 1) % self.eval_every == 0 or last):
                    record["eval"] = evaluate()
                if self.dist.is_main:
                    append_log(self.log, record, state)
                due = (index + 1) % self.checkpoint_every == 0 or index + 1 == self.stop or self._time_is_up(
                    last_checkpoint)
                if due and not last:
                    if self.dist.is_main:
                        back_up_log(self.log)
                    checkpoint()  # every rank: rank 0 alone writes a replicated model, each rank its shards
                    self.dist.barrier()
                    last_checkpoint = self.clock()
                task.advance()
                task.update(**outcome.progress)
        return self.finished

    def _time_is_up(self, since: float) -> bool:
        if self.checkpoint_minutes <= 0:
            return False
        return bool(self.dist.broadcast_object(None, build=lambda: self.clock() - since >= 60 * self.checkpoint_minutes))

    def records(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log.read_text().splitlines()]


def median(values: list[float]) -> float | None:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else None
