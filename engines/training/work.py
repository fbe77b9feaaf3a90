"""A training run's work directory beside its output: the run key, the log, and what a finished run left.

A run key (`run.json`) in the work directory is the run's stage key: a rerun with the same settings
resumes, one with other settings discards the unfinished run with a notice. The finished output's
manifest records the same key, so a later run can tell that a leftover work directory belongs to a
run that already finished. The training log is cut
back to the checkpoint's position on resume, so a resumed log equals an uninterrupted one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Optional

from mlxkit.engines.core.atomic import atomic_write_text
from mlxkit.engines.core.progress import Reporter
from mlxkit.engines.core.stage_key import StageKey, StageState, StageWork
from mlxkit.engines.errors import InputError
from mlxkit.engines.training.checkpoint import TrainingState
from mlxkit.engines.training.distributed import Distributed

RUN_KEY = "run.json"


def work_dir_beside(out: Path, kind: str) -> Path:
    """Where a run keeps its work in progress: `.<out>.<kind>-work/` beside its output."""
    out = Path(out).expanduser().resolve()
    return out.parent / f".{out.name}.{kind}-work"


def check_run_key(work: Path, key: dict[str, Any], dist: Distributed, *, what: str = "an unfinished run",
                  reporter: Optional[Reporter] = None) -> StageState:
    """Resume the run in `work` when it was started with these settings; otherwise discard it with a
    notice and record this run's key (the stage-key rule, `engines/core/stage_key.py`)."""
    stage = StageWork(work, work / RUN_KEY, what=what, is_main=dist.is_main, barrier=dist.barrier)
    return stage.open(StageKey.of(key), reporter)


def finished_run_key(work: Path) -> dict[str, Any]:
    """The run key to record in the finished output's manifest, so a later run can tell whose work is left."""
    return json.loads((work / RUN_KEY).read_text())


def refuse_existing_output(out: Path, work: Path, dist: Distributed) -> None:
    """An existing `out` is an error. A work directory that the run which wrote `out` left behind
    (killed between putting `out` in place and removing its work) is removed first."""
    if not out.exists():
        return
    finished = ""
    if dist.is_main and (work / RUN_KEY).is_file() and (out / "mlxkit.json").is_file():
        try:
            recorded = json.loads((out / "mlxkit.json").read_text()).get("settings", {}).get("run_key")
            if recorded is not None and recorded == json.loads((work / RUN_KEY).read_text()):
                shutil.rmtree(work, ignore_errors=True)
                finished = "; an earlier run of this command finished it"
        except (OSError, ValueError, AttributeError):
            pass  # not ours to judge: leave the work directory alone
    raise InputError(f"output '{out}' already exists{finished} (pass --overwrite to replace it)")


def log_backup(log: Path) -> Path:
    """The copy of the log taken with each checkpoint: an append can be torn by a kill, a whole-file copy cannot."""
    return log.with_name(log.name + ".at-checkpoint")


def back_up_log(log: Path) -> None:
    """Keep a whole copy of the log as it stands, before the checkpoint that will count its lines."""
    if log.exists():
        atomic_write_text(log_backup(log), log.read_text())


def truncate_log(log: Path, lines: int) -> None:
    """Cut the log back to the `lines` records the checkpoint we resume from counted, so a resumed log equals an
    uninterrupted one. A log damaged below that (a kill that tore an append) is restored from its copy."""
    if not log.exists() and lines == 0:
        return
    kept = _whole_records(log)
    if len(kept) < lines:
        kept = _whole_records(log_backup(log))
        if len(kept) < lines:
            raise InputError(f"the training log '{log}' lost records its checkpoint counted ({len(kept)} of {lines}); "
                             "delete the work directory to start over")
    atomic_write_text(log, "".join(line + "\n" for line in kept[:lines]))


def _whole_records(log: Path) -> list[str]:
    """The log's lines up to the first that is not a whole JSON record."""
    if not log.exists():
        return []
    records = []
    for line in log.read_text(errors="replace").splitlines():
        try:
            json.loads(line)
        except ValueError:
            break
        records.append(line)
    return records


def append_log(log: Path, record: dict[str, Any], state: TrainingState) -> None:
    """Append one JSON record to the training log and count it, so a checkpoint knows where the log stood."""
    with open(log, "a") as handle:
        handle.write(json.dumps(record) + "\n")
    state.log_lines += 1
