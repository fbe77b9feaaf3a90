"""Resumable training state: the model, the optimiser, the step, the RNG and the log position.

A checkpoint is one directory written atomically (`atomic_output_dir`), so a kill during a
save leaves the previous checkpoint intact. The learning rate is a pure function of the
step and the data order a pure function of the seed and the step, so the step is the
scheduler's and the data loader's whole state. Shared by `mlx distill` and `mlx finetune`;
an adapter run saves only the tensors that train (`trainable_only`), not the frozen base.

Around the checkpoint: a run key (`run.json`) in the work directory stops a rerun with other
settings from resuming silently, and the training log is cut back to the checkpoint's
position on resume, so a resumed log equals an uninterrupted one.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from safetensors.torch import load_model as load_weights
from safetensors.torch import save_model as save_weights

from mlxkit.engines.core.atomic import atomic_output_dir, atomic_write_json, atomic_write_text
from mlxkit.engines.training.distributed import Distributed
from mlxkit.engines.errors import InputError

WEIGHTS = "student.safetensors"
OPTIMIZER = "optimizer.pt"
STATE = "state.json"


@dataclass
class TrainingState:
    step: int
    tokens_seen: int
    log_lines: int
    extra: dict[str, Any]


def _trainable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().contiguous() for name, p in model.named_parameters() if p.requires_grad}


def save_checkpoint(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    state: TrainingState, *, trainable_only: bool = False) -> None:
    with atomic_output_dir(directory, overwrite=True) as tmp:
        if trainable_only:
            save_file(_trainable(model), str(tmp / WEIGHTS))
        else:
            save_weights(model, str(tmp / WEIGHTS))  # handles tied embeddings
        torch.save({"optimizer": optimizer.state_dict(), "torch_rng": torch.get_rng_state()}, tmp / OPTIMIZER)
        (tmp / STATE).write_text(json.dumps({"step": state.step, "tokens_seen": state.tokens_seen,
                                             "log_lines": state.log_lines, "extra": state.extra}, indent=1))


def load_checkpoint(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                    trainable_only: bool = False) -> TrainingState | None:
    """Restore `model` and `optimizer` in place; None when there is no checkpoint yet."""
    if not (directory / STATE).exists():
        return None
    try:
        state = json.loads((directory / STATE).read_text())
        if trainable_only:
            _load_trainable(model, load_file(str(directory / WEIGHTS)))
        else:
            load_weights(model, str(directory / WEIGHTS), strict=True)
        saved = torch.load(directory / OPTIMIZER, weights_only=True)
    except (OSError, ValueError, RuntimeError, json.JSONDecodeError) as exc:
        raise InputError(f"checkpoint '{directory}' cannot be resumed ({str(exc).splitlines()[0][:200]}); "
                         "delete it to start over") from None
    optimizer.load_state_dict(saved["optimizer"])
    torch.set_rng_state(saved["torch_rng"])
    return TrainingState(int(state["step"]), int(state["tokens_seen"]), int(state["log_lines"]), state["extra"])


def _load_trainable(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    if params.keys() != tensors.keys():
        raise ValueError(f"the checkpoint holds other tensors than the model trains "
                         f"({len(tensors)} saved, {len(params)} trainable)")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(tensors[name])


RUN_KEY = "run.json"


def work_dir_beside(out: Path, kind: str) -> Path:
    """Where a run keeps its work in progress: `.<out>.<kind>-work/` beside its output."""
    out = Path(out).expanduser().resolve()
    return out.parent / f".{out.name}.{kind}-work"


def check_run_key(work: Path, key: dict[str, Any], dist: Distributed) -> None:
    """Refuse to resume a run in `work` that was started with other settings; record the key of a new one."""
    key_file = work / RUN_KEY
    key = json.loads(json.dumps(key, default=str))
    if key_file.exists():
        previous = json.loads(key_file.read_text())
        changed = sorted(k for k in key if previous.get(k) != key[k])
        if changed:
            raise InputError(f"'{work}' holds an unfinished run with other settings ({', '.join(changed)}); "
                             "delete it to start over, or rerun with the same settings to resume")
    elif dist.is_main:
        work.mkdir(parents=True, exist_ok=True)
        atomic_write_json(key_file, key)
    dist.barrier()


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


def truncate_log(log: Path, lines: int) -> None:
    """Drop log records written after the checkpoint we resume from, so a resumed log equals an uninterrupted one."""
    if not log.exists():
        return
    kept = log.read_text().splitlines()[:lines]
    atomic_write_text(log, "".join(line + "\n" for line in kept))


def append_log(log: Path, record: dict[str, Any], state: TrainingState) -> None:
    """Append one JSON record to the training log and count it, so a checkpoint knows where the log stood."""
    with open(log, "a") as handle:
        handle.write(json.dumps(record) + "\n")
    state.log_lines += 1
