"""Learning-rate schedules and the data order: pure functions of the step, so the step is their whole state."""

from __future__ import annotations

import math

import torch

from mlxkit.engines.core.seeds import seeded_generator


def warmup_cosine(step: int, total_steps: int, peak: float, *, min_factor: float = 0.0,
                  warmup_steps: int = 0) -> float:
    """Linear warm-up over `warmup_steps`, then cosine decay from `peak` to `min_factor · peak`."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return peak * (min_factor + (1 - min_factor) * 0.5 * (1 + math.cos(math.pi * progress)))


def batch_indices(step: int, batch: int, n_items: int, seed: int) -> list[int]:
    """The items of a step's global batch: a seeded permutation per pass over the data."""
    indices = []
    for position in range(step * batch, (step + 1) * batch):
        epoch, offset = divmod(position, n_items)
        order = torch.randperm(n_items, generator=seeded_generator(seed, "distill-epoch", epoch))
        indices.append(int(order[offset]))
    return indices
