"""Write a model as a standard HF directory, atomically, with its manifest."""

from __future__ import annotations

import os
from pathlib import Path

from mlxkit.engines.core.atomic import atomic_output_dir
from mlxkit.engines.core.manifest import Manifest

DEFAULT_SHARD_SIZE = "2GB"


def forget_gguf_quantization(model) -> None:
    """A dequantised GGUF is a plain float model: drop the quantiser so it saves like one."""
    quant = getattr(model.config, "quantization_config", None)
    if quant is not None and dict(quant).get("quant_method") == "gguf":
        del model.config.quantization_config
        model.hf_quantizer = None


def save_model_files(model, tokenizer, directory: str | os.PathLike, max_shard_size: str = DEFAULT_SHARD_SIZE) -> None:
    """Sharded safetensors with an index, config.json, generation_config.json and the tokenizer.

    transformers writes `model.safetensors.index.json` only when there is more than one
    shard; we always write one, so readers never have to special-case small models.
    """
    import json

    from mlxkit.engines.core.finite import first_non_finite
    from mlxkit.engines.errors import NonFiniteError

    # after any cast to the saved dtype: a float32 weight past 65504 is infinite in float16
    bad = first_non_finite(model.state_dict().items())
    if bad is not None:
        raise NonFiniteError(f"the model to be saved has NaN or infinite values in '{bad}'; nothing was written")
    directory = Path(directory)
    config = model.config
    model.save_pretrained(directory, safe_serialization=True, max_shard_size=max_shard_size)
    if not (directory / "generation_config.json").exists():
        from transformers import GenerationConfig

        GenerationConfig.from_model_config(config).save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    index = directory / "model.safetensors.index.json"
    single = directory / "model.safetensors"
    if not index.exists() and single.exists():
        from safetensors import safe_open

        with safe_open(single, "pt") as handle:
            keys = list(handle.keys())
        weight_map = {key: single.name for key in keys}
        index.write_text(json.dumps({"metadata": {"total_size": single.stat().st_size}, "weight_map": weight_map},
                                    indent=2) + "\n")


def save_model(model, tokenizer, out: str | os.PathLike, manifest: Manifest, *, overwrite: bool = False,
               max_shard_size: str = DEFAULT_SHARD_SIZE, dtype=None) -> Path:
    """Save atomically: everything is written to a temporary sibling, then renamed into place.

    With `dtype` (a torch dtype) the model is cast to it first, in place: the weights and
    config.json then say the same dtype.
    """
    if dtype is not None:
        model.to(dtype)
        model.config.dtype = dtype
    with atomic_output_dir(out, overwrite=overwrite) as tmp:
        save_model_files(model, tokenizer, tmp, max_shard_size=max_shard_size)
        manifest.write(tmp)
    return Path(out).resolve()
