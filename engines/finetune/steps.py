"""One optimiser step's gradients: first-order (LoRA, full fine-tuning) and mix-order (H-Tuning).

Both fill `.grad` of the trainable tensors and return the step's loss terms; the caller sets
the learning rate, clips and steps the optimiser. A global batch is split over processes
(rank r takes sequences r, r+W, ...) and then into micro-batches; every piece's loss is its
sum over loss terms divided by the global batch's count, and gradients are summed over
ranks, so W processes compute what one process computes for the same global batch.

Backprop forwards run under the placement's autocast (float32 master weights, lower-precision
compute). The two SPSA forwards of H-Tuning do not: their loss difference at ε = 1e-3 is far
below what bfloat16 resolves, so they run in float32.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from mlxkit.engines.finetune.data import Batch
from mlxkit.engines.finetune.model import FinetuneModel
from mlxkit.engines.finetune.recipe import HTuningSpec
from mlxkit.engines.finetune.zeroth_order import mix_gradient, spsa_losses, zo_gradients
from mlxkit.engines.training.device import Placement
from mlxkit.engines.training.distributed import Distributed, gradients
from mlxkit.engines.training.sharding import is_sharded
from mlxkit.engines.training.step import release_freed_host_memory, term_sums


@contextlib.contextmanager
def frozen(params: Sequence[torch.nn.Parameter]) -> Iterator[None]:
    """Turn off requires_grad for `params` inside the block.

    Autograd records an operation only when one of its inputs requires grad, so with the
    lower layers' tensors frozen a forward keeps no activations until the first layer that
    still has trainable tensors: the part below runs as if under no_grad.
    """
    flags = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)


def first_order_step(model: FinetuneModel, params: Sequence[torch.nn.Parameter], pieces: Sequence[Batch],
                     units: int, dist: Distributed, placement: Placement | None = None) -> dict[str, torch.Tensor]:
    """Backprop on this rank's micro-batches; `units` is the global batch's loss-term count."""
    placement = placement or Placement.cpu()
    model.train()
    loss_sum = term_sums(1, placement.device)
    for piece in pieces:
        with placement.autocast():
            loss = model.loss_sum(piece)
        (loss / units).backward()
        loss_sum += loss.detach().double()
        release_freed_host_memory(placement.device)
    # A sharded model's gradients were already summed over ranks by FSDP.
    dist.all_reduce_sum([*gradients([p for p in params if not is_sharded(p)]), loss_sum])
    return {"loss": loss_sum[0] / units}  # a device tensor: the step loop reads it back at logged steps


@dataclass(frozen=True)
class MixOrderSplit:
    zo: list[torch.nn.Parameter]    # blended gradient: SPSA on the batch + backprop on a slice
    fo: list[torch.nn.Parameter]    # exact backprop on the batch (top layers, classification head)


def mix_order_step(model: FinetuneModel, split: MixOrderSplit, pieces: Sequence[Batch], fo_pieces: Sequence[Batch],
                   units: int, fo_units: int, spec: HTuningSpec, seed: int, dist: Distributed,
                   placement: Placement | None = None) -> dict[str, float]:
    """H-Tuning's gradient for one step (`seed` fixes the SPSA direction z).

    1. SPSA on the whole batch: loss at θ_ZO + εz with no autograd at all; then at θ_ZO − εz
       with the ZO tensors frozen, so the backward that follows runs through the top
       layers only and gives the FO set its exact full-batch gradient (at θ_ZO − εz, as the
       reference implementation does: one forward serves both).
    2. Backprop on the slice `fo_pieces` (the first `fo_sequences` of the global batch) for
       the ZO set, with the FO set frozen.
    3. ZO set: g = c·g_FO + (1−c)·‖g_FO‖·g_ZO/‖g_ZO‖ per tensor, g_ZO = p·z.
    """
    placement = placement or Placement.cpu()
    zo, fo = split.zo, split.fo
    for p in zo + fo:
        p.grad = None

    def loss_at(sign: int) -> float:
        total = 0.0
        if sign > 0 or not fo:
            with torch.no_grad():
                for piece in pieces:
                    total += model.loss_sum(piece).item()
            return total
        with frozen(zo):
            for piece in pieces:
                loss = model.loss_sum(piece)
                (loss / units).backward()
                total += loss.item()
        return total

    model.eval()  # the estimate needs two forwards of the same function: no dropout
    plus, minus = spsa_losses(zo, loss_at, spec.zo_eps, seed)
    model.train()
    fo_loss = 0.0
    with frozen(fo):
        for piece in fo_pieces:
            with placement.autocast():
                loss = model.loss_sum(piece)
            (loss / fo_units).backward()
            fo_loss += loss.item()
    sums = torch.tensor([plus, minus, fo_loss], dtype=torch.float64, device=placement.device)
    dist.all_reduce_sum([*gradients(zo), *gradients(fo), sums])
    plus, minus, fo_loss = sums.tolist()
    projected = (plus - minus) / units / (2.0 * spec.zo_eps)
    for p, g_zo in zip(zo, zo_gradients(zo, seed, projected)):
        p.grad = mix_gradient(p.grad, g_zo, spec.mix_coef)
    return {"loss": 0.5 * (plus + minus) / units, "fo_slice_loss": fo_loss / fo_units, "projected_grad": projected}
