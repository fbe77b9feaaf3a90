"""Resumable training state: the student, the optimiser, the step, the RNG and the log position.

A checkpoint is one directory written atomically (`atomic_output_dir`), so a kill during a
save leaves the previous checkpoint intact. The learning rate is a pure function of the
step and the data order a pure function of the seed and the step, so the step is the
scheduler's and the data loader's whole state.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model as load_weights
from safetensors.torch import save_model as save_weights

from mlxkit.engines.core.atomic import atomic_output_dir
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


def save_checkpoint(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    state: TrainingState) -> None:
    with atomic_output_dir(directory, overwrite=True) as tmp:
        save_weights(model, str(tmp / WEIGHTS))  # handles tied embeddings
        torch.save({"optimizer": optimizer.state_dict(), "torch_rng": torch.get_rng_state()}, tmp / OPTIMIZER)
        (tmp / STATE).write_text(json.dumps({"step": state.step, "tokens_seen": state.tokens_seen,
                                             "log_lines": state.log_lines, "extra": state.extra}, indent=1))


def load_checkpoint(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> TrainingState | None:
    """Restore `model` and `optimizer` in place; None when there is no checkpoint yet."""
    if not (directory / STATE).exists():
        return None
    try:
        state = json.loads((directory / STATE).read_text())
        missing, unexpected = load_weights(model, str(directory / WEIGHTS), strict=True)
        saved = torch.load(directory / OPTIMIZER, weights_only=True)
    except (OSError, ValueError, RuntimeError, json.JSONDecodeError) as exc:
        raise InputError(f"checkpoint '{directory}' cannot be resumed ({str(exc).splitlines()[0][:200]}); "
                         "delete it to start over") from None
    optimizer.load_state_dict(saved["optimizer"])
    torch.set_rng_state(saved["torch_rng"])
    return TrainingState(int(state["step"]), int(state["tokens_seen"]), int(state["log_lines"]), state["extra"])
