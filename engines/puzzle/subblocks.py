"""Stand-alone attention and FFN subblocks of one layer, with the child model's weight names.

A subblock is an `MlxDeciLMDecoderLayer` whose other half is a no-op, so its state dict
uses exactly the per-layer names of a saved child (`input_layernorm.weight`,
`self_attn.k_proj.weight`, `mlp.linear_mlp.weight`, ...) and assembling a child is a
matter of prefixing `model.layers.{i}.`.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from mlxkit.engines.models.attention import prefer_sdpa
from mlxkit.engines.models.decilm.blocks import (AttentionVariant, BlockChoice, FFNVariant, ParentShape,
                                                 parent_attention, parent_ffn)
from mlxkit.engines.models.decilm.convert import child_config
from mlxkit.engines.models.decilm.modeling_mlx_decilm import SUBBLOCK_MODULES, MlxDeciLMDecoderLayer

SubblockKind = Literal["attention", "ffn"]


class Subblock(nn.Module):
    """One layer's attention or FFN subblock: maps a residual-stream state to what it adds."""

    def __init__(self, parent_config, layer_idx: int, kind: SubblockKind,
                 variant: AttentionVariant | FFNVariant):
        super().__init__()
        self.kind, self.variant, self.layer_idx = kind, variant, layer_idx
        if kind == "attention":
            choice = BlockChoice(variant, FFNVariant("no_op"))  # type: ignore[arg-type]
        else:
            choice = BlockChoice(AttentionVariant("no_op"), variant)  # type: ignore[arg-type]
        config = child_config(parent_config, [choice] * parent_config.num_hidden_layers)
        prefer_sdpa(config)
        self.layer = MlxDeciLMDecoderLayer(config, layer_idx)

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None) -> torch.Tensor:
        """The subblock's contribution; zeros for a no-op. Causal attention, no padding."""
        if self.kind == "attention":
            delta = self.layer.attention_delta(hidden_states, position_embeddings)
        else:
            delta = self.layer.ffn_delta(hidden_states)
        return torch.zeros_like(hidden_states) if delta is None else delta

    def weights(self) -> dict[str, torch.Tensor]:
        """Per-layer-named tensors (empty for a no-op)."""
        return {k: v.detach().contiguous() for k, v in self.layer.state_dict().items()}


def parent_subblock(parent_model, layer_idx: int, kind: SubblockKind) -> Subblock:
    """The parent's own subblock at `layer_idx`, as a `Subblock` sharing the parent's tensors.

    Built on the meta device: every module that holds a tensor is replaced by the parent's,
    so the block is wherever (and in whatever dtype) the parent is, and nothing is allocated.
    """
    shape = ParentShape.from_config(parent_model.config)
    variant = parent_attention(shape) if kind == "attention" else parent_ffn(shape)
    with torch.device("meta"):
        block = Subblock(parent_model.config, layer_idx, kind, variant)
    source = parent_model.model.layers[layer_idx]
    for name in SUBBLOCK_MODULES[kind]:
        setattr(block.layer, name, getattr(source, name))
    return block.eval()
