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
  which is kept in the checkpoint, so a resumed run reports the time of the whole run;
* a step's loss terms may stay on the device: they are read back every `log_every` steps (and
  at every evaluation, checkpoint and the last step) in one transfer, checked for finiteness, and
  logged, one record per step, so the steps between queue on the GPU without waiting for the host.
  A checkpoint is only ever taken of checked steps. A CPU run reads every step.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from mlxkit.engines.core.progress import Reporter
from mlxkit.engines.errors import NonFiniteError
from mlxkit.engines.training.checkpoint import TrainingState
from mlxkit.engines.training.distributed import Distributed
from mlxkit.engines.training.work import append_log, back_up_log, truncate_log

# Steps between two reads of the loss terms on a GPU: logging, the non-finite check and the step times
# of the steps between wait for these reads.
LOG_EVERY_CUDA = 10


@dataclass
class StepOutcome:
    """What one optimiser step reports."""

    terms: dict[str, Any]                                  # logged (loss terms and the like); tensors are read back
                                                           # to the host at logged steps only
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
    log_every: int = 1  # steps between reads of the loss terms back to the host (see `log_interval`)
    loss_name: str = "the training loss"  # in the error when a term becomes non-finite

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
            with self.reporter.task(f"{title}: held-out evaluation before the first step"):
                record = {**record, "eval": evaluate()}
            if self.dist.is_main:
                append_log(self.log, record, state)
        self.dist.barrier()
        last_checkpoint = self.clock()
        pending: list[tuple[int, StepOutcome, float]] = []
        with self.reporter.task(title, total=self.total_steps) as task:
            task.advance(state.step)
            window_started = time.perf_counter()
            for index in range(state.step, self.stop):
                outcome = step(index)
                pending.append((index, outcome, optimizer.param_groups[0]["lr"]))
                task.advance()
                done = index + 1
                last = done == self.total_steps
                evaluates = (self.dist.is_main or self.collective) and (done % self.eval_every == 0 or last)
                counted = done % self.checkpoint_every == 0 or done == self.stop
                if not (last or evaluates or counted or done % self.log_every == 0):
                    continue
                self._publish(pending, time.perf_counter() - window_started, evaluate if evaluates else None, task)
                pending.clear()
                # The wall-clock rule is read at logged steps only: under several ranks it is a collective.
                if (counted or self._time_is_up(last_checkpoint)) and not last:
                    if self.dist.is_main:
                        back_up_log(self.log)
                    checkpoint()  # every rank: rank 0 alone writes a replicated model, each rank its shards
                    self.dist.barrier()
                    last_checkpoint = self.clock()
                window_started = time.perf_counter()
        return self.finished

    def _publish(self, pending: list[tuple[int, StepOutcome, float]], seconds: float,
                 evaluate: Callable[[], dict[str, Any]] | None, task: Any) -> None:
        """Read the pending steps' terms back to the host (one wait for the device), check them and log them.

        Steps between two logged ones are timed together: each gets the window's mean step time.
        """
        state = self.state
        values = read_back([outcome.terms for _, outcome, _ in pending] + [pending[-1][1].progress])
        terms_of, progress = values[:-1], values[-1]
        step_s = seconds / len(pending)
        for (index, outcome, lr), terms in zip(pending, terms_of):
            bad = sorted(k for k, v in terms.items() if isinstance(v, float) and not math.isfinite(v))
            if bad:
                raise NonFiniteError(f"{self.loss_name} became non-finite at step {index} ({', '.join(bad)}; "
                                     "try a lower optim.lr)")
            state.step, state.tokens_seen = index + 1, state.tokens_seen + outcome.units
            state.extra["train_seconds"] += step_s
            record: dict[str, Any] = {"step": index + 1, self.unit: state.tokens_seen, "lr": lr, **terms,
                                      "step_s": step_s, f"{self.unit}_per_s": outcome.units / step_s,
                                      "train_s": state.extra["train_seconds"]}
            if evaluate is not None and index == pending[-1][0]:
                record["eval"] = evaluate()
            if self.dist.is_main:
                append_log(self.log, record, state)
        task.update(**progress)

    def _time_is_up(self, since: float) -> bool:
        if self.checkpoint_minutes <= 0:
            return False
        return bool(self.dist.broadcast_object(None, build=lambda: self.clock() - since >= 60 * self.checkpoint_minutes))

    def records(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log.read_text().splitlines()]


def log_interval(device: torch.device) -> int:
    """Steps between two reads of the loss terms on `device`.

    Reading a CUDA tensor's value waits for every kernel queued before it, so a read each step keeps
    the GPU idle while the host catches up; on a CPU the value is already there.
    """
    return LOG_EVERY_CUDA if device.type == "cuda" else 1


def read_back(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`rows` with every tensor value replaced by its Python number, read in one transfer."""
    places = [(i, key) for i, row in enumerate(rows) for key, value in row.items() if isinstance(value, torch.Tensor)]
    if not places:
        return [dict(row) for row in rows]
    numbers = torch.stack([rows[i][key].detach().reshape(()).double() for i, key in places]).tolist()
    out = [dict(row) for row in rows]
    for (i, key), number in zip(places, numbers):
        out[i][key] = number
    return out


def median(values: list[float]) -> float | None:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else None
