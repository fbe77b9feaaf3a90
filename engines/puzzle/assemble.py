"""Assemble a child checkpoint from the parent and the library's trained blocks.

The child is built where the parent is: on its device and, unless asked otherwise, in its
dtype. It is constructed on the meta device and given storage there (`build_on`), since
every weight is then set from the parent or from a library block; only the RoPE
frequencies, which are computed rather than stored, are copied from the parent's.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from safetensors.torch import load_file

from mlxkit.engines.errors import InputError
from mlxkit.engines.models.decilm.blocks import BlockChoice, ParentShape, parent_attention, parent_ffn
from mlxkit.engines.models.decilm.convert import child_config
from mlxkit.engines.models.decilm.modeling_mlx_decilm import MlxDeciLMForCausalLM
from mlxkit.engines.puzzle.library import LibraryDir
from mlxkit.engines.training.device import build_on, module_device, module_dtype

_ATTENTION_PREFIXES = ("input_layernorm.", "self_attn.")
_FFN_PREFIXES = ("post_attention_layernorm.", "mlp.")

BlockKey = tuple[int, str]  # (layer, "attention" | "ffn")


def _library_subblocks(parent, choices: Sequence[BlockChoice]) -> list[tuple[int, str, str]]:
    """(layer, kind, variant name) of every subblock the child takes from the library."""
    shape = ParentShape.from_config(parent.config)
    wanted = []
    for i, choice in enumerate(choices):
        for kind, variant, parent_variant in (("attention", choice.attention, parent_attention(shape)),
                                              ("ffn", choice.ffn, parent_ffn(shape))):
            if variant.kind != "no_op" and variant != parent_variant:
                wanted.append((i, kind, variant.name))
    return wanted


@torch.no_grad()
def assemble_child(parent, library: LibraryDir, choices: Sequence[BlockChoice], *,
                   dtype: torch.dtype | None = None) -> MlxDeciLMForCausalLM:
    """A child with `choices[i]` at layer i: parent tensors for parent variants, library blocks otherwise.

    On the parent's device, in `dtype` (default: the parent's dtype).
    """
    device = module_device(parent)
    blocks = {}
    for layer, kind, name in _library_subblocks(parent, choices):
        path = library.block_file(layer, kind, name)
        if not path.exists():
            raise InputError(f"the library has no block for layer {layer} {kind} {name}")
        blocks[(layer, kind)] = load_file(str(path), device=str(device))
    return child_from_blocks(parent, choices, blocks, dtype=dtype)


@torch.no_grad()
def child_from_blocks(parent, choices: Sequence[BlockChoice], blocks: Mapping[BlockKey, Mapping[str, torch.Tensor]],
                      *, dtype: torch.dtype | None = None) -> MlxDeciLMForCausalLM:
    """The child of `assemble_child`, from block tensors already read (per-layer names, any dtype).

    `blocks[(layer, kind)]` holds each subblock the child takes from the library.
    """
    shape = ParentShape.from_config(parent.config)
    device, dtype = module_device(parent), dtype or module_dtype(parent)
    config = child_config(parent.config, choices)
    config._attn_implementation = getattr(parent.config, "_attn_implementation", None) or "sdpa"
    child = build_on(device, lambda: MlxDeciLMForCausalLM(config).to(dtype))
    _copy_rotary(parent, child)
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
            elif (i, kind) in blocks:
                tensors = dict(blocks[(i, kind)])
            else:
                raise InputError(f"the library has no block for layer {i} {kind} {variant.name}")
            state.update({f"model.layers.{i}.{k}": v for k, v in tensors.items()})
    missing, unexpected = child.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise InputError(f"assembled child does not match its config: missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]}")
    if config.tie_word_embeddings:
        child.tie_weights()
    return child.eval()


def _copy_rotary(parent, child: MlxDeciLMForCausalLM) -> None:
    """The child's RoPE buffers (left empty by `build_on`) from the parent's: same config, same values.

    They stay in float32, as transformers keeps them whatever the weights' dtype.
    """
    source = dict(parent.model.rotary_emb.named_buffers())
    rotary = child.model.rotary_emb
    for name, buffer in list(rotary.named_buffers()):
        if name not in source or source[name].shape != buffer.shape:
            raise InputError(f"the parent's rotary embedding has no buffer '{name}' of shape {tuple(buffer.shape)}")
        rotary.register_buffer(name, torch.empty_like(buffer, dtype=torch.float32).copy_(source[name]),
                               persistent=False)
