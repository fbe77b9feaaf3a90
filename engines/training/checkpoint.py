"""Resumable training state: the model, the optimiser, the step, the RNG and the log position.

A checkpoint is one directory written atomically (`atomic_output_dir`), so a kill during a
save leaves the previous checkpoint intact. The learning rate is a pure function of the
step and the data order a pure function of the seed and the step, so the step is the
scheduler's and the data loader's whole state. The RNG state is the CPU generator's and,
when the run computes on a GPU, that device's. Shared by every trainer; an adapter run saves
only the tensors that train (`trainable_only`), not the frozen base.

Weights are saved from the device they live on (safetensors copies them to the host), and
loaded back into the model's own tensors, so a checkpoint resumes on the device it is given.
"""

from __future__ import annotations

import json
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from safetensors import SafetensorError
from safetensors.torch import load_model as load_weights
from safetensors.torch import save_model as save_weights

from mlxkit.engines.core.atomic import atomic_output_dir
from mlxkit.engines.errors import InputError, NonFiniteError

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
    from mlxkit.engines.core.finite import first_non_finite

    # a checkpoint with a NaN weight would be resumed from: the run that made it stops instead
    bad = first_non_finite((n, p.detach()) for n, p in model.named_parameters()
                           if p.requires_grad or not trainable_only)
    if bad is not None:
        raise NonFiniteError(f"the weights at step {state.step} have NaN or infinite values in '{bad}'; "
                             "no checkpoint was written (try a lower learning rate)")
    with atomic_output_dir(directory, overwrite=True) as tmp:
        if trainable_only:
            save_file(_trainable(model), str(tmp / WEIGHTS))
        else:
            save_weights(model, str(tmp / WEIGHTS))  # handles tied embeddings
        torch.save({"optimizer": optimizer.state_dict(), **rng_state()}, tmp / OPTIMIZER)
        (tmp / STATE).write_text(json.dumps({"step": state.step, "tokens_seen": state.tokens_seen,
                                             "log_lines": state.log_lines, "extra": state.extra}, indent=1))


def load_checkpoint(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                    trainable_only: bool = False) -> TrainingState | None:
    """Restore `model` and `optimizer` in place; None when there is no checkpoint yet."""
    if not (directory / STATE).exists():
        return None
    try:
        state = json.loads((directory / STATE).read_text())
        if not isinstance(state, dict) or not all(isinstance(state.get(k), int) and not isinstance(state.get(k), bool)
                                                  and state[k] >= 0 for k in ("step", "tokens_seen", "log_lines")):
            raise ValueError(f"{STATE} does not hold a step, tokens_seen and log_lines")
        if "world_size" in state:  # only sharded checkpoints record it: their weights are split over the ranks
            raise InputError(f"checkpoint '{directory}' was written by {state['world_size']} processes in shards; "
                             "resume it with as many under torchrun, or delete it to start over")
        if trainable_only:
            _load_trainable(model, load_file(str(directory / WEIGHTS)))
        else:
            load_weights(model, str(directory / WEIGHTS), strict=True)
        saved = torch.load(directory / OPTIMIZER, weights_only=True, map_location="cpu")
        if not isinstance(saved, dict) or "optimizer" not in saved:
            raise ValueError(f"{OPTIMIZER} does not hold an optimizer state")
        optimizer.load_state_dict(saved["optimizer"])
        set_rng_state(saved)
    except InputError:
        raise
    except (OSError, ValueError, RuntimeError, KeyError, TypeError, EOFError, pickle.UnpicklingError,
            SafetensorError) as exc:
        raise InputError(f"checkpoint '{directory}' cannot be resumed ({str(exc).splitlines()[0][:200]}); "
                         "delete it to start over") from None
    return TrainingState(state["step"], state["tokens_seen"], state["log_lines"], state.get("extra") or {})


def _load_trainable(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    if params.keys() != tensors.keys():
        raise ValueError(f"the checkpoint holds other tensors than the model trains "
                         f"({len(tensors)} saved, {len(params)} trainable)")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(tensors[name])


def rng_state() -> dict[str, object]:
    """The CPU generator's state, and every visible GPU's when CUDA is initialised."""
    state: dict[str, object] = {"torch_rng": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda_rng"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(saved: dict[str, object]) -> None:
    torch.set_rng_state(saved["torch_rng"])  # type: ignore[arg-type]
    cuda = saved.get("cuda_rng")
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)  # type: ignore[arg-type]
