"""The simple compressions a Puzzle child has to beat, sized to the same predicted cost.

* Uniform pruning: the same KV-head count and FFN width in every layer, initialised exactly
  as BLD initialises its blocks (KV heads mean-pooled, FFN channels kept by measured
  contribution), at the largest width whose predicted throughput meets the target.
* Layer dropping: whole layers (attention and FFN) removed in order of block importance,
  the angular distance arccos(cos(h_in, h_out)) / π between a layer's input and output
  residual states, smallest first, until the predicted throughput meets the target.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import torch

from mlxkit.engines.errors import InfeasibleError
from mlxkit.engines.hardware.costs import CostModel
from mlxkit.engines.models.decilm.blocks import (AttentionVariant, BlockChoice, FFNVariant, ParentShape,
                                                 parent_attention, parent_ffn)


# Uniform pruning keeps GQA / MLP blocks only, initialised as BLD initialises them.
INIT_NAMES = {"attention": "mean_pooled_kv_heads", "ffn": "channel_contribution_pruning"}


@dataclass(frozen=True)
class BaselineChoice:
    choices: list[BlockChoice]
    predicted_speedup: float
    description: str


@torch.inference_mode()
def angular_distances(model, input_ids: torch.Tensor, batch_sequences: int = 4) -> list[float]:
    """Per layer: mean over all tokens of arccos(cos(layer input, layer output)) / π, in [0, 1].

    `model` is an mlxkit DeciLM (a converted parent or a child); the states are the raw
    residual stream, before the final norm.
    """
    from mlxkit.engines.puzzle.library.activations import position_embeddings

    base = model.model
    pos = position_embeddings(model, input_ids.shape[1])
    sums = torch.zeros(len(base.layers), dtype=torch.float64)
    for chunk in input_ids.split(batch_sequences):
        state = base.embed_tokens(chunk)
        for index, layer in enumerate(base.layers):
            out = layer(state, pos)
            cosine = torch.nn.functional.cosine_similarity(state.double(), out.double(), dim=-1).clamp(-1.0, 1.0)
            sums[index] += (torch.arccos(cosine) / math.pi).sum()
            state = out
    return (sums / input_ids.numel()).tolist()


def _speedup(cost_model: CostModel, choices: Sequence[BlockChoice], parent_runtime_ms: float) -> float:
    return parent_runtime_ms / cost_model.model(choices).runtime_ms


def layer_drop_choices(shape: ParentShape, distances: Sequence[float], cost_model: CostModel,
                       target_speedup: float) -> BaselineChoice:
    """Drop the least important layers, one at a time, until the predicted speedup reaches the target."""
    keep = BlockChoice(parent_attention(shape), parent_ffn(shape))
    dropped_block = BlockChoice(AttentionVariant("no_op"), FFNVariant("no_op"))
    parent_runtime = cost_model.parent_model().runtime_ms
    choices = [keep] * shape.num_layers
    order = sorted(range(shape.num_layers), key=lambda i: (distances[i], i))
    dropped: list[int] = []
    for layer in order:
        if _speedup(cost_model, choices, parent_runtime) >= target_speedup:
            break
        choices[layer] = dropped_block
        dropped.append(layer)
    speedup = _speedup(cost_model, choices, parent_runtime)
    if speedup < target_speedup:
        raise InfeasibleError(f"dropping every layer does not reach {target_speedup}x")
    return BaselineChoice(choices, speedup, f"dropped layers {sorted(dropped)}")


def uniform_choices(shape: ParentShape, cost_model: CostModel, target_speedup: float,
                    kv_options: Sequence[int] | None = None, width_multiple: int = 64) -> BaselineChoice:
    """One (KV heads, FFN width) for every layer: for each KV count, the widest FFN that meets the target;
    of those, the candidate that keeps the most parameters."""
    parent_runtime = cost_model.parent_model().runtime_ms
    heads = shape.num_attention_heads
    kv_options = kv_options or [k for k in range(1, shape.num_key_value_heads + 1)
                                if heads % k == 0 and k <= shape.num_key_value_heads]
    best: tuple[int, BaselineChoice] | None = None
    for kv in kv_options:
        attention = AttentionVariant("gqa", kv)
        for width in range(shape.intermediate_size // width_multiple * width_multiple, 0, -width_multiple):
            choices = [BlockChoice(attention, FFNVariant("mlp", width))] * shape.num_layers
            speedup = _speedup(cost_model, choices, parent_runtime)
            if speedup >= target_speedup:
                params = cost_model.model(choices).num_params
                if best is None or params > best[0]:
                    best = (params, BaselineChoice(choices, speedup, f"kv{kv} + ffn{width} in every layer"))
                break
    if best is None:
        raise InfeasibleError(f"no uniform KV-head / FFN-width pruning reaches {target_speedup}x")
    return best[1]


@torch.no_grad()
def build_initialised_child(parent, choices: Sequence[BlockChoice], activations_dir: Path, work_dir: Path):
    """A child whose non-parent blocks are initialised from the parent (as BLD starts), without training.

    Uses the calibration activations a block library cached in `activations_dir`; the
    blocks are written to `work_dir` as a small library and assembled from there.
    """
    from mlxkit.engines.puzzle.library import activations
    from mlxkit.engines.puzzle.search.assemble import assemble_child
    from mlxkit.engines.puzzle.library.block_init import initialise
    from mlxkit.engines.puzzle.library.store import LibraryDir
    from mlxkit.engines.puzzle.library.schema import BlockRecord, TrainingInfo
    from mlxkit.engines.puzzle.subblocks import parent_subblock

    shape = ParentShape.from_config(parent.config)
    library = LibraryDir(work_dir)
    for layer, choice in enumerate(choices):
        states = None
        for kind, variant, parent_variant in (("attention", choice.attention, parent_attention(shape)),
                                              ("ffn", choice.ffn, parent_ffn(shape))):
            if variant == parent_variant or variant.kind == "no_op" or library.has_block(layer, kind, variant.name):
                continue
            states = states or activations.load_layer(activations_dir, layer, shape.num_layers)
            if kind == "attention":
                x, y = states.train_in, states.train_mid - states.train_in
            else:
                x, y = states.train_mid, states.train_out - states.train_mid
            block = initialise(parent_subblock(parent, layer, kind), variant, parent.config, layer, x, y)
            library.save_block(block, BlockRecord(layer=layer, kind=kind, variant=asdict(variant), init=INIT_NAMES[kind],
                                                  trained=False, training=TrainingInfo(steps=0, tokens=0,
                                                                                       val_nmse_init=None,
                                                                                       val_nmse=None)))
    return assemble_child(parent, library, choices)
