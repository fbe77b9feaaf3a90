"""Resolve a model spec and load it as a float32 transformers model plus tokenizer.

A spec is one of:
  * a local HF directory (single or sharded safetensors),
  * a `.gguf` file (dequantised through transformers' `gguf_file=`),
  * a hub id such as `HuggingFaceTB/SmolLM2-135M-Instruct`,
  * the alias `smollm2-135m`, the embedded default (see `default_model`).
"""

from __future__ import annotations

import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from mlxkit import register_auto_classes
from mlxkit.engines.core.progress import Reporter
from mlxkit.engines.errors import InputError, ModelLoadError, NonFiniteError, OfflineError
from mlxkit.engines.io.safetensors_header import validate_safetensors_dir
from mlxkit.engines.models import default_model
from mlxkit.engines.models.hub import hub_offline_by_env, hub_reachable
from mlxkit.engines.models.saving import forget_gguf_quantization

if TYPE_CHECKING:
    import torch

SpecKind = Literal["directory", "gguf", "hub", "alias"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


@dataclass(frozen=True)
class ModelSource:
    """Where a spec points. `path` is a local directory or a `.gguf` file; hub specs have none."""

    spec: str
    kind: SpecKind
    path: Path | None = None
    hub_id: str | None = None

    @property
    def load_args(self) -> tuple[str, dict[str, Any]]:
        """The `(name_or_path, kwargs)` pair for transformers' `from_pretrained`."""
        if self.kind == "gguf":
            assert self.path is not None
            return str(self.path.parent), {"gguf_file": self.path.name}
        if self.kind == "hub":
            assert self.hub_id is not None
            return self.hub_id, {}
        return str(self.path), {}


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    source: ModelSource


def resolve_spec(spec: str, reporter: Reporter | None = None) -> ModelSource:
    """Turn a user's model spec into a `ModelSource`, fetching the default alias if needed."""
    reporter = reporter or Reporter()
    if spec.lower() in default_model.ALIASES:
        return ModelSource(spec, "alias", path=default_model.ensure_default_model(reporter))
    path = Path(spec).expanduser()
    if path.exists():
        if path.is_file() and path.suffix == ".gguf":
            return ModelSource(spec, "gguf", path=path.resolve())
        if path.is_file() and path.name == "config.json":
            return ModelSource(spec, "directory", path=path.parent.resolve())
        if path.is_dir():
            if not (path / "config.json").exists():
                raise ModelLoadError(f"model directory '{spec}' has no config.json")
            return ModelSource(spec, "directory", path=path.resolve())
        raise InputError(f"model spec '{spec}' is a file but neither a .gguf nor a config.json")
    if _HUB_ID.match(spec) and not spec.startswith((".", "/")):
        return ModelSource(spec, "hub", hub_id=spec)
    raise InputError(f"model spec '{spec}' is not a local path, a .gguf file, a hub id or a known alias "
                     f"({', '.join(sorted(default_model.ALIASES))})")


def check_hub_reachable(source: ModelSource) -> None:
    if source.kind != "hub":
        return
    if hub_offline_by_env():
        raise OfflineError(f"model '{source.spec}' is a hub id, but HF_HUB_OFFLINE is set; "
                           "pass a local directory or .gguf file instead")
    if not hub_reachable():
        raise OfflineError(f"model '{source.spec}' is a hub id, but the Hugging Face hub cannot be reached; "
                           "pass a local directory or .gguf file instead")


def _check_weights_format(source: ModelSource, allow_pickle: bool) -> None:
    if source.kind != "directory" or allow_pickle:
        return
    assert source.path is not None
    files = [p.name for p in source.path.iterdir()]
    if any(name.endswith(".safetensors") for name in files):
        return
    if any(name.endswith(_PICKLE_SUFFIXES) for name in files):
        raise ModelLoadError(f"model '{source.spec}' has only pickle weights, which can run arbitrary code; "
                             "convert it to safetensors or pass --allow-pickle if you trust it")
    raise ModelLoadError(f"model directory '{source.spec}' has no weight files")


def check_gguf_file(path: Path) -> None:
    """Parse a GGUF file's header, metadata and tensor table before transformers reads it.

    gguf's reader trusts the lengths and offsets it reads, so a truncated or corrupt file fails
    inside it with struct, overflow or numpy errors; here any failure is one `ModelLoadError`.
    The reader maps the file, so this reads no tensor data.
    """
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
        size = path.stat().st_size
        for tensor in reader.tensors:
            end = int(tensor.data_offset) + int(tensor.n_bytes)
            if end > size or tensor.data.nbytes != int(tensor.n_bytes):
                raise ValueError(f"tensor '{tensor.name}' ends at byte {end}, past the file's {size}")
    except Exception as exc:  # noqa: BLE001 - a third-party parser on untrusted bytes: every failure is the file's
        raise ModelLoadError(f"GGUF file '{path}' is truncated or corrupt ({_first_line(exc)})") from None


def check_local_weights(source: ModelSource, allow_pickle: bool = False) -> None:
    """Refuse a local checkpoint whose weights are pickle-only, missing, truncated or corrupt (reads no tensors)."""
    _check_weights_format(source, allow_pickle)
    if source.kind == "gguf" and source.path is not None:
        check_gguf_file(source.path)
    elif source.path is not None:  # a truncated or corrupt shard becomes one clean error, not a Rust traceback
        validate_safetensors_dir(source.path)


def load_config(spec: str, *, trust_remote_code: bool = False, reporter: Reporter | None = None):
    """Load only a model's config: from a config.json, a directory, a hub id or a .gguf file."""
    from transformers import AutoConfig

    register_auto_classes()

    from huggingface_hub.errors import StrictDataclassError

    source = resolve_spec(spec, reporter)
    check_hub_reachable(source)
    if source.kind == "gguf" and source.path is not None:
        check_gguf_file(source.path)
    name, kwargs = source.load_args
    try:
        return AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code, **kwargs)
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError, StrictDataclassError) as exc:
        raise ModelLoadError(f"could not read the config of '{spec}': {_first_line(exc)}") from exc


def load_tokenizer(source: ModelSource, *, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    name, kwargs = source.load_args
    try:
        return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code, **kwargs)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"could not load the tokenizer of '{source.spec}': {_first_line(exc)}") from exc


def load_model(spec: str | ModelSource, *, dtype: "str | torch.dtype" = "float32", device: "str | torch.device | None" = None,
               allow_pickle: bool = False, trust_remote_code: bool = False, with_tokenizer: bool = True,
               reporter: Reporter | None = None) -> LoadedModel:
    """Load a causal LM (in `dtype`, float32 by default) and its tokenizer, in eval mode, on `device` (CPU by default).

    The weights are read on the CPU and then moved, so a GPU holds one copy in the target dtype.
    """
    import torch
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoModelForCausalLM

    register_auto_classes()

    source = spec if isinstance(spec, ModelSource) else resolve_spec(spec, reporter)
    check_hub_reachable(source)
    check_local_weights(source, allow_pickle)
    name, kwargs = source.load_args
    if source.kind in ("directory", "alias", "hub") and not allow_pickle:
        kwargs["use_safetensors"] = True
    try:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=getattr(torch, dtype) if isinstance(dtype, str) else dtype,
                                                     trust_remote_code=trust_remote_code, **kwargs)
    except pickle.UnpicklingError as exc:
        # transformers reads pickle weights with torch.load(weights_only=True): anything but tensors stops it.
        raise ModelLoadError(f"model '{source.spec}' has pickle weights holding objects other than tensors, "
                             "which could run code; refused even with --allow-pickle") from exc
    except (OSError, ValueError, KeyError, RuntimeError, TypeError, ZeroDivisionError, StrictDataclassError) as exc:
        raise ModelLoadError(f"could not load model '{source.spec}': {_first_line(exc)}") from exc
    model.eval()
    forget_gguf_quantization(model)
    if device is not None and torch.device(device).type != "cpu":
        model.to(device)
    tokenizer = load_tokenizer(source, trust_remote_code=trust_remote_code) if with_tokenizer else None
    return LoadedModel(model, tokenizer, source)


def source_dtype(source: ModelSource) -> "torch.dtype":
    """The dtype a checkpoint is stored in, from its config.json (float32 for GGUF, which is dequantised,
    and when the config does not say)."""
    import json

    import torch

    if source.kind in ("directory", "alias") and source.path is not None and source.path.is_dir():
        try:
            config = json.loads((source.path / "config.json").read_text())
        except (OSError, ValueError):
            return torch.float32
        name = config.get("dtype") or config.get("torch_dtype") if isinstance(config, dict) else None
        if isinstance(name, str) and name.removeprefix("torch.") in ("float32", "bfloat16", "float16"):
            return getattr(torch, name.removeprefix("torch."))
    return torch.float32


def check_finite_weights(model, spec: str) -> None:
    """Refuse a model with a NaN or infinite weight: every score or loss computed from it would be NaN."""
    from mlxkit.engines.core.finite import first_non_finite

    name = first_non_finite(model.state_dict().items())
    if name is not None:
        raise NonFiniteError(f"model '{spec}' has NaN or infinite values in '{name}'")


def check_finite_files(directory: Path, spec: str) -> None:
    """`check_finite_weights` for a checkpoint on disk, reading one tensor at a time (nothing is kept).

    For a parent that is streamed layer by layer: a NaN found only when its layer is reached would
    fail a run after it had started writing.
    """
    import torch
    from safetensors import safe_open

    for file in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            for name in handle.keys():
                tensor = handle.get_tensor(name)
                if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                    raise NonFiniteError(f"model '{spec}' has NaN or infinite values in '{name}'")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    # huggingface_hub's validation errors put the reason on the line after "... validation error for ...:"
    if len(lines) > 1 and lines[0].endswith(":"):
        return f"{lines[0]} {lines[1]}"[:300]
    return lines[0][:300]


def describe_source(source: ModelSource) -> str:
    return {"alias": f"{source.spec} (cached at {source.path})", "gguf": f"{source.path} (GGUF, dequantised)",
            "hub": f"{source.hub_id} (hub)", "directory": str(source.path)}[source.kind]

