"""Assemble a child checkpoint from the parent and the library's trained blocks.

`assemble_child` builds the child in memory from a loaded parent; `write_child` writes the
same weights straight from the parent's and the library's files to a checkpoint directory,
holding one tensor at a time.

The child is built where the parent is: on its device and, unless asked otherwise, in its
dtype. It is constructed on the meta device and given storage there (`build_on`), since
every weight is then set from the parent or from a library block; only the RoPE
frequencies, which are computed rather than stored, are copied from the parent's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Sequence

import torch
from safetensors.torch import load_file

from mlxkit.engines.errors import InputError
from mlxkit.engines.models.attention import prefer_sdpa
from mlxkit.engines.models.decilm.blocks import BlockChoice, ParentShape, parent_attention, parent_ffn
from mlxkit.engines.models.decilm.convert import child_config
from mlxkit.engines.models.decilm.modeling_mlx_decilm import SUBBLOCK_MODULES, MlxDeciLMForCausalLM
from mlxkit.engines.models.saving import DEFAULT_SHARD_SIZE
from mlxkit.engines.puzzle.library.store import LibraryDir
from mlxkit.engines.training.device import build_on, module_device, module_dtype

_ATTENTION_PREFIXES = tuple(f"{name}." for name in SUBBLOCK_MODULES["attention"])
_FFN_PREFIXES = tuple(f"{name}." for name in SUBBLOCK_MODULES["ffn"])

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
    config._attn_implementation = getattr(parent.config, "_attn_implementation", None) or \
        prefer_sdpa(config)._attn_implementation
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


def write_child(parent_dir: str | os.PathLike, library: LibraryDir, choices: Sequence[BlockChoice],
                out_dir: str | os.PathLike, *, dtype: torch.dtype | None = None, tokenizer=None,
                max_shard_bytes: int | str = DEFAULT_SHARD_SIZE) -> Path:
    """Write the child of `assemble_child` into `out_dir` as an HF directory, one tensor at a time.

    Kept parent tensors are read from the parent's safetensors files at `parent_dir` and
    library blocks from their files, each cast straight to `dtype` (default: the dtype the
    parent's embedding is stored in) and appended to shards of at most `max_shard_bytes`; no
    child is ever built in memory, so memory is one shard plus one tensor. Writes the shards
    and their index, config.json (whose dtype is `dtype`), generation_config.json (the
    parent's, else one derived from the config) and, when given, the tokenizer.

    The weights equal `assemble_child(parent, library, choices, dtype=dtype).state_dict()` for
    a parent held in a dtype that keeps its stored values (its own, or float32); a parent
    held in a narrower dtype rounds there first. `out_dir` should be a fresh directory: wrap
    the call in `atomic_output_dir` and write the manifest beside it for an all-or-nothing output.

    Raises
    ------
    InputError
        The library lacks a chosen block, a block's tensors do not match its variant, or the
        parent's files do not hold the Llama-layout tensors the child keeps.
    """
    from transformers import GenerationConfig

    from mlxkit.engines.io.lazy_loader import LazyTensorLoader
    from mlxkit.engines.io.tensor_writer import TensorWriter
    from mlxkit.engines.models.loading import load_config

    parent_dir, out_dir = Path(parent_dir), Path(out_dir)
    parent_config = load_config(str(parent_dir))
    config = child_config(parent_config, choices)
    shape = ParentShape.from_config(parent_config)
    with torch.device("meta"):
        expected = MlxDeciLMForCausalLM(config).state_dict()
    with LazyTensorLoader.from_path(parent_dir) as parent:
        dtype = dtype or getattr(torch, parent.info("model.embed_tokens.weight").dtype)
        writer = TensorWriter(out_dir, max_shard_bytes)
        blocks: dict[BlockKey, LazyTensorLoader] = {}  # the open block files of the layer being written
        try:
            for name, meta in expected.items():
                if blocks and not name.startswith(f"model.layers.{next(iter(blocks))[0]}."):
                    _close_blocks(blocks, expected)
                if name == "lm_head.weight" and config.tie_word_embeddings:
                    continue  # tied to the embedding: from_pretrained ties it again
                tensor = _child_tensor(name, choices, shape, parent, parent_config, library, blocks)
                if tensor is None:  # Qwen2's o_proj bias, which its checkpoints lack: zeros, as from_parent adds
                    tensor = torch.zeros(meta.shape)
                if tuple(tensor.shape) != tuple(meta.shape):
                    raise InputError(f"'{name}' has shape {tuple(tensor.shape)}; the child's config asks for "
                                     f"{tuple(meta.shape)}")
                writer.save(name, tensor.to(dtype) if tensor.is_floating_point() else tensor)
            _close_blocks(blocks, expected)
        finally:
            for loader in blocks.values():
                loader.close()
        writer.finalize()
    config.dtype = dtype
    config.save_pretrained(out_dir)
    if (parent_dir / "generation_config.json").exists():
        GenerationConfig.from_pretrained(parent_dir).save_pretrained(out_dir)
    else:
        GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir


def _child_tensor(name: str, choices: Sequence[BlockChoice], shape: ParentShape, parent, parent_config,
                  library: LibraryDir, blocks: dict) -> torch.Tensor | None:
    """One tensor of the child, by its name: the parent's (from its files; None for a tensor the
    converted parent holds as zeros) or a library block's (its loader kept open in `blocks`)."""
    from mlxkit.engines.io.lazy_loader import LazyTensorLoader
    from mlxkit.engines.models.decilm.convert import parent_file_name

    if name.startswith("model.layers."):
        index, rest = name[len("model.layers."):].split(".", 1)
        i = int(index)
        kind = "attention" if rest.startswith(_ATTENTION_PREFIXES) else "ffn"
        variant = choices[i].attention if kind == "attention" else choices[i].ffn
        if variant != (parent_attention(shape) if kind == "attention" else parent_ffn(shape)):
            if (i, kind) not in blocks:
                path = library.block_file(i, kind, variant.name)
                if not path.exists():
                    raise InputError(f"the library has no block for layer {i} {kind} {variant.name}")
                blocks[(i, kind)] = LazyTensorLoader.from_path(path)
            if rest not in blocks[(i, kind)].index:
                raise InputError(f"the library's block for layer {i} {kind} {variant.name} has no '{rest}'")
            return blocks[(i, kind)].get_tensor(rest)
    file_name = parent_file_name(name, parent_config, parent.index)
    if file_name is None:
        return None
    if file_name not in parent.index:
        raise InputError(f"the parent's files have no '{file_name}'")
    return parent.get_tensor(file_name)


def _close_blocks(blocks: dict, expected: Mapping[str, torch.Tensor]) -> None:
    """Close the block files of a finished layer, refusing one that holds a tensor the child has no place
    for (it was built for another variant)."""
    for (i, kind), loader in list(blocks.items()):
        extra = sorted(k for k in loader.keys() if f"model.layers.{i}.{k}" not in expected)
        loader.close()
        del blocks[(i, kind)]
        if extra:
            raise InputError(f"the library's block for layer {i} {kind} has tensors the child does not use: "
                             f"{extra[:4]}")
