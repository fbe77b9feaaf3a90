"""Assemble a child checkpoint from the parent and the library's trained blocks."""

from __future__ import annotations

from typing import Sequence

import torch
from safetensors.torch import load_file

from mlxkit.engines.errors import InputError
from mlxkit.engines.models.decilm.blocks import BlockChoice, ParentShape, parent_attention, parent_ffn
from mlxkit.engines.models.decilm.convert import child_config
from mlxkit.engines.models.decilm.modeling_mlx_decilm import MlxDeciLMForCausalLM
from mlxkit.engines.puzzle.library import LibraryDir

_ATTENTION_PREFIXES = ("input_layernorm.", "self_attn.")
_FFN_PREFIXES = ("post_attention_layernorm.", "mlp.")


@torch.no_grad()
def assemble_child(parent, library: LibraryDir, choices: Sequence[BlockChoice]) -> MlxDeciLMForCausalLM:
    """A child with `choices[i]` at layer i: parent tensors for parent variants, library blocks otherwise."""
    shape = ParentShape.from_config(parent.config)
    config = child_config(parent.config, choices)
    config._attn_implementation = getattr(parent.config, "_attn_implementation", None) or "sdpa"
    child = MlxDeciLMForCausalLM(config)
    parent_state = parent.state_dict()
    state = {k: v for k, v in parent_state.items() if not k.startswith("model.layers.")}
    for i, choice in enumerate(choices):
        for kind, variant, is_parent, prefixes in (
                ("attention", choice.attention, choice.attention == parent_attention(shape), _ATTENTION_PREFIXES),
                ("ffn", choice.ffn, choice.ffn == parent_ffn(shape), _FFN_PREFIXES)):
            if variant.kind == "no_op":
                continue
            if is_parent:
                layer_prefix = f"model.layers.{i}."
                tensors = {k[len(layer_prefix):]: v for k, v in parent_state.items()
                           if k.startswith(layer_prefix) and k[len(layer_prefix):].startswith(prefixes)}
            else:
                path = library.block_file(i, kind, variant.name)
                if not path.exists():
                    raise InputError(f"the library has no block for layer {i} {kind} {variant.name}")
                tensors = load_file(str(path))
            state.update({f"model.layers.{i}.{k}": v for k, v in tensors.items()})
    missing, unexpected = child.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise InputError(f"assembled child does not match its config: missing {missing[:4]}, unexpected {unexpected[:4]}")
    if config.tie_word_embeddings:
        child.tie_weights()
    return child.eval()
