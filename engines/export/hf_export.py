"""Write HF directories: the public Nemotron-NAS layout, or a self-contained copy of the model.

Both stream the weights tensor by tensor into HF-named shards (the child's tensor names are
already the public DeciLM ones, so no tensor is renamed) and copy the tokenizer and
generation config. A child ships its architecture's source (`remote_code`) and an
`auto_map`; a parent is a plain transformers architecture and needs none.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from mlxkit.engines.core.progress import Reporter
from mlxkit.engines.errors import InputError
from mlxkit.engines.export.description import ExportPlan, ModelDescription
from mlxkit.engines.models.decilm.blocks import nas_ffn_mult
from mlxkit.engines.export.remote_code import remote_code_files
from mlxkit.engines.io.lazy_loader import LazyTensorLoader
from mlxkit.engines.io.tensor_writer import TensorWriter

SHARD_SIZE = "2GB"
_TORCH_DTYPES = {"f32": "float32", "f16": "float16"}
# Files of a checkpoint that describe the tokenizer or generation, copied as they are.
_AUX_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
              "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
              "generation_config.json")
# Fields the public Nemotron-NAS block_configs carry beside the three mlxkit sets (NVIDIA's defaults).
_NAS_ATTENTION_DEFAULTS = {"sparsify": None, "num_sink_tokens": None, "use_prefill_window_in_sink_attention": False,
                           "unshifted_sink": False, "window_length": None}
_NAS_FFN_DEFAULTS = {"sparsify": None}
_CARRIED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "hidden_act",
            "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "attention_bias", "mlp_bias",
            "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id", "use_cache")


def nas_block_configs(model: ModelDescription) -> list[dict[str, Any]]:
    """`block_configs` in the public layout: n_heads_in_group / ffn_mult, None where a subblock has no size."""
    heads, h = model.num_heads, model.hidden_size
    blocks = []
    for layer in model.layers:
        att, ffn = layer.attention, layer.ffn
        group = heads // att.n_kv_heads if att.kind == "gqa" else None  # type: ignore[operator]
        mult = nas_ffn_mult(ffn.intermediate_size, h) if ffn.kind == "mlp" else None  # type: ignore[arg-type]
        blocks.append({
            "attention": {"n_heads_in_group": group, "no_op": att.kind == "no_op",
                          "replace_with_linear": att.kind == "linear", **_NAS_ATTENTION_DEFAULTS},
            "ffn": {"ffn_mult": mult, "no_op": ffn.kind == "no_op", "replace_with_linear": ffn.kind == "linear",
                    **_NAS_FFN_DEFAULTS},
        })
    return blocks


def nas_config(model: ModelDescription, encoding: str) -> dict[str, Any]:
    """config.json in the layout of NVIDIA's Nemotron-NAS checkpoints (RoPE as rope_theta + rope_scaling)."""
    config = model.config
    rope = model.rope
    scaling = None if rope.rope_type == "default" else \
        {k: v for k, v in rope.parameters.items() if k != "rope_theta"} | {"rope_type": rope.rope_type}
    fields = {k: getattr(config, k) for k in _CARRIED if hasattr(config, k)}
    return {
        "architectures": ["DeciLMForCausalLM"],
        "model_type": "nemotron-nas",
        **fields,
        "block_configs": nas_block_configs(model),
        "rope_theta": rope.theta,
        "rope_scaling": scaling,
        "attention_dropout": 0.0,
        "pretraining_tp": 1,
        # NVIDIA writes null here; transformers 5's typed config refuses null, and every reader of this
        # layout takes the per-layer sizes from block_configs, so the parent's values stand in.
        "intermediate_size": int(config.parent_intermediate_size),
        "num_key_value_heads": int(config.parent_num_key_value_heads),
        "torch_dtype": _TORCH_DTYPES[encoding],
    }


def _tensor_names(plan: ExportPlan) -> list[str]:
    model = plan.model
    names = [n for n in model.expected if n in model.index]
    if plan.format == "nemotron-nas":
        names += [n for n in sorted(model.optional) if n not in model.index]  # written as zeros
    return names


def _write_weights(plan: ExportPlan, directory: Path, reporter: Reporter) -> dict[str, Any]:
    import torch

    dtype = getattr(torch, _TORCH_DTYPES[plan.encoding])
    model = plan.model
    names = _tensor_names(plan)
    writer = TensorWriter(directory, SHARD_SIZE)
    with LazyTensorLoader(model.index) as loader:
        for name in reporter.track(names, "writing tensors", total=len(names)):
            tensor = loader.get_tensor(name) if name in model.index else torch.zeros(model.expected[name])
            if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                raise InputError(f"tensor {name} holds NaN or infinite values")
            writer.save(name, tensor.to(dtype))
    index = writer.finalize()
    return {"tensors": len(names), "tensor_bytes": index["metadata"]["total_size"]}


def _copy_aux(model: ModelDescription, directory: Path) -> list[str]:
    copied = []
    for name in _AUX_FILES:
        if (model.directory / name).is_file():
            shutil.copy2(model.directory / name, directory / name)
            copied.append(name)
    return copied


def write_hf_dir(plan: ExportPlan, directory: Path, reporter: Reporter) -> dict[str, Any]:
    """Fill `directory` (a temporary one the caller renames) with config, code, weights and tokenizer."""
    model = plan.model
    code: dict[str, str] = {}
    if plan.format == "nemotron-nas":
        config = nas_config(model, plan.encoding)
        code, config["auto_map"] = remote_code_files("nemotron-nas")
    else:
        config = dict(model.source_config)
        config["dtype"] = _TORCH_DTYPES[plan.encoding]
        config.pop("torch_dtype", None)
        if model.is_child:
            code, config["auto_map"] = remote_code_files("mlx_decilm")
    for name, text in code.items():
        (directory / name).write_text(text)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    result = _write_weights(plan, directory, reporter)
    result["files"] = sorted(code) + _copy_aux(model, directory)
    result["remote_code"] = bool(code)
    return result
