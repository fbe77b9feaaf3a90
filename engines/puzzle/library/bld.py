"""Blockwise local distillation: train one child subblock alone to imitate the parent's.

Decoupled BLD (Puzzle, section 3): the subblock sees the parent's own residual-stream
states and is fitted to what the parent subblock adds to them, under the normalised MSE
||child - parent||^2 / ||parent||^2. No gradient crosses a block boundary, so every
(layer, variant) trains independently and in any order.

Precision: the block's weights and AdamW state stay in float32 (master weights); the
forward runs under the placement's autocast (bfloat16 on a GPU by default), and the
loss is computed in float32. In float32 on the CPU nothing is cast.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

import torch

from mlxkit.engines.puzzle.library.schema import TrainingInfo
from mlxkit.engines.puzzle.recipe import BLDSpec
from mlxkit.engines.puzzle.subblocks import Subblock
from mlxkit.engines.training.device import Placement
from mlxkit.engines.training.schedule import warmup_cosine
from mlxkit.engines.training.step import clip_and_step, set_learning_rate

EPS = 1e-12
MAX_CURVE_POINTS = 40


def normalized_mse(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """||prediction - target||^2 / ||target||^2, in float32 whatever the inputs' dtype."""
    prediction, target = prediction.float(), target.float()
    return (prediction - target).pow(2).sum() / (target.pow(2).sum() + EPS)


@torch.no_grad()
def held_out_nmse(block: Subblock, inputs: torch.Tensor, targets: torch.Tensor, pos,
                  placement: Placement | None = None) -> float:
    with _autocast(placement):
        prediction = block(inputs, pos)
    return normalized_mse(prediction, targets).item()


def _autocast(placement: Placement | None):
    return placement.autocast() if placement is not None else contextlib.nullcontext()


@dataclass
class TrainingRecord:
    steps: int
    tokens: int
    val_nmse_before: float
    val_nmse_after: float
    curve: list[tuple[int, float]] = field(default_factory=list)
    seconds: float = 0.0
    reverted: bool = False

    def to_info(self) -> TrainingInfo:
        """The record as stored in the library (NaN or infinite losses of a diverged run become null)."""
        return TrainingInfo(steps=self.steps, tokens=self.tokens, val_nmse_init=_finite(self.val_nmse_before),
                            val_nmse=_finite(self.val_nmse_after),
                            curve=[(step, _finite(loss)) for step, loss in self.curve],
                            seconds=round(self.seconds, 3), loss="normalized_mse", reverted_to_init=self.reverted)


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def train_subblock(block: Subblock, inputs: torch.Tensor, targets: torch.Tensor, val_inputs: torch.Tensor,
                   val_targets: torch.Tensor, pos, spec: BLDSpec, seed: int,
                   placement: Placement | None = None) -> TrainingRecord:
    """AdamW with cosine decay for `spec.tokens_per_block` tokens, over shuffled cached sequences.

    Returns the training curve and the held-out normalised MSE before and after. If
    training made the held-out error worse (tiny budgets can), the initial weights are
    restored: a library block is never worse than its initialisation on held-out data.

    `block` holds the float32 master weights, on the device of the states; `placement`
    (default: none, plain float32) gives the forward's autocast. The shuffle is drawn on
    the CPU from `seed`, so every device sees the same order.
    """
    start = time.perf_counter()
    before = held_out_nmse(block, val_inputs, val_targets, pos, placement)
    n, seq_len = inputs.shape[:2]
    batch = min(spec.batch_sequences, n)
    steps = spec.tokens_per_block // (batch * seq_len)
    params = [p for p in block.parameters() if p.requires_grad]
    if steps == 0 or not params:
        return TrainingRecord(0, 0, before, before, seconds=time.perf_counter() - start)
    initial = {k: v.clone() for k, v in block.state_dict().items()}
    optimizer = torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(seed)
    order = torch.empty(0, dtype=torch.long)
    curve = []
    every = max(1, steps // MAX_CURVE_POINTS)
    block.train()
    for step in range(steps):
        if order.numel() < batch:
            order = torch.cat([order, torch.randperm(n, generator=generator)])
        index, order = order[:batch], order[batch:]
        index = index.to(inputs.device)
        with _autocast(placement):
            prediction = block(inputs[index], pos)
        loss = normalized_mse(prediction, targets[index])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        set_learning_rate(optimizer, warmup_cosine(step, steps, spec.lr, min_factor=spec.min_lr_factor))
        clip_and_step(optimizer, params, spec.grad_clip)
        if step % every == 0 or step == steps - 1:
            curve.append((step, round(loss.item(), 6)))
    block.eval()
    after = held_out_nmse(block, val_inputs, val_targets, pos, placement)
    reverted = not after <= before
    if reverted:
        block.load_state_dict(initial)
        after = before
    return TrainingRecord(steps, steps * batch * seq_len, before, after, curve, time.perf_counter() - start, reverted)
