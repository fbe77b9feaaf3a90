"""Pieces of one optimiser step that every trainer shares: models placed for training, the update, the sums."""

from __future__ import annotations

import gc
from typing import Sequence

import torch

from mlxkit.engines.core.memory import release_freed_memory
from mlxkit.engines.errors import InputError
from mlxkit.engines.training.device import Placement


def place_trainable(model: torch.nn.Module, placement: Placement) -> None:
    """Float32 master weights on the run's device, in training mode; autocast lowers the compute."""
    model.to(device=placement.device, dtype=torch.float32)
    model.train()


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in the backward instead of keeping them (a transformers model)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise InputError(f"{type(model).__name__} does not support gradient checkpointing "
                         "(--set gradient_checkpointing=false)")
    # Non-reentrant checkpointing needs no input that requires grad, so frozen embeddings (LoRA) work.
    # transformers 5.25 renamed the switch; older releases know only the first name.
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def place_frozen(model: torch.nn.Module, placement: Placement) -> None:
    """An inference-only model (a teacher) in the compute dtype on the run's device, without gradients."""
    model.to(device=placement.device, dtype=placement.dtype)
    model.eval().requires_grad_(False)


def term_sums(count: int, device: torch.device) -> torch.Tensor:
    """Float64 accumulators for a step's loss terms, on the device the losses are computed on."""
    return torch.zeros(count, dtype=torch.float64, device=device)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_and_step(optimizer: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter], grad_clip: float) -> None:
    """Clip the global gradient norm (when `grad_clip` > 0), update, then drop the gradients.

    Dropping them here, not at the next step's start, keeps a gradient-sized buffer out of the
    held-out evaluations and checkpoints that run between steps.
    """
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def release_freed_host_memory(device: torch.device) -> None:
    """On a CPU, hand the free pages inside the heap back to the kernel (`core.memory.release_freed_memory`).

    Called where a step has just dropped a micro-batch's activations or the gradients, it keeps their pages
    from staying resident beside the next micro-batch's: in a CPU GKD run at 135M this took the peak from
    3,889 to 3,589 MiB (BENCHMARKS.md, "GKD's peak memory"). A GPU's memory is its allocator's business.
    """
    if device.type == "cpu":
        release_freed_memory()


def release_training_state(optimizer: torch.optim.Optimizer) -> None:
    """After the last step: drop the optimiser's moments and the gradients, so that gathering and writing
    the output do not add to training's peak memory."""
    optimizer.zero_grad(set_to_none=True)
    optimizer.state.clear()
    gc.collect()


def check_global_batch(batch: int, world_size: int, setting: str, override: str = "--set") -> None:
    """A global batch must split evenly over the processes; say which setting to change, and to what."""
    if batch % world_size:
        fits = -(-batch // world_size) * world_size
        raise InputError(f"{setting}={batch} sequences do not split evenly over {world_size} processes: use a "
                         f"multiple of {world_size}, e.g. {override} {setting}={fits}")


def decoder_states(model: torch.nn.Module, ids: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """(each decoder layer's output, the final normalised state) from one forward of a transformers causal LM.

    The forward goes through the model's own `forward`, so the hooks of a sharded model gather its
    root weights; only the last position's logits are computed (`logits_to_keep=1`), since the
    losses compute theirs in chunks.
    """
    out = model(input_ids=ids, use_cache=False, output_hidden_states=True, logits_to_keep=1)
    return out.hidden_states[1:], out.hidden_states[-1]
