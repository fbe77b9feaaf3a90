"""Turn model specs into tensor providers: full checkpoints or PEFT LoRA adapters.

A full checkpoint provides its weights as stored. A LoRA adapter provides, for each targeted
weight, the task vector B·A·scale (scale = lora_alpha / r, or / sqrt(r) with rsLoRA) and zero
elsewhere; it needs the base model. Hub ids are resolved with the project's loader (fast offline
detection) and fetched with `snapshot_download`, safetensors, JSON and tokenizer files only.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

import torch

from mlxkit.engines.core.progress import Reporter
from mlxkit.engines.errors import InputError, ModelLoadError
from mlxkit.engines.io.lazy_loader import LazyTensorLoader, ShardedTensorIndex, TensorInfo

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_HUB_PATTERNS = ["*.safetensors", "*.json", "tokenizer*", "*.model", "*.txt", "*.jinja", "README.md"]


@dataclass
class LoraModule:
    target: str          # weight name in the base checkpoint, e.g. model.layers.0.self_attn.q_proj.weight
    a_key: str
    b_key: str
    scale: float
    embedding: bool      # lora_embedding_A/B: delta is (B·A)ᵀ
    fan_in_fan_out: bool


@dataclass
class MergeInput:
    """One resolved input model."""

    spec: str
    kind: Literal["model", "lora"]
    path: Path
    base_hint: Optional[str] = None
    modules: dict[str, LoraModule] = field(default_factory=dict)   # LoRA only, by target weight name
    replaced: dict[str, str] = field(default_factory=dict)         # LoRA modules_to_save: target -> key
    _loader: Optional[LazyTensorLoader] = None

    @property
    def loader(self) -> LazyTensorLoader:
        if self._loader is None:
            name = ADAPTER_WEIGHTS if self.kind == "lora" else "model.safetensors"
            self._loader = LazyTensorLoader(ShardedTensorIndex.from_path(self.path, weights_name=name))
        return self._loader

    @property
    def tensors(self) -> dict[str, TensorInfo]:
        return self.loader.index.tensors

    def read_config(self) -> Optional[dict]:
        """The parsed `config.json` of a full model (None when it has none); `InputError` if malformed."""
        file = self.path / "config.json"
        if self.kind != "model" or not file.is_file():
            return None
        try:
            config = json.loads(file.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InputError(f"'{file}' is not valid JSON: {exc}") from None
        if not isinstance(config, dict):
            raise InputError(f"'{file}' must hold a JSON object, not a {type(config).__name__}")
        return config

    def targets(self) -> set[str]:
        """Weight names this input changes (all of them for a full model)."""
        return set(self.tensors) if self.kind == "model" else set(self.modules) | set(self.replaced)

    def weight(self, name: str, base: Optional[torch.Tensor]) -> torch.Tensor:
        """θ for tensor `name` in float32 (LoRA: base + delta)."""
        if self.kind == "model":
            return self.loader.get_tensor(name).float()
        assert base is not None
        return base + self.delta(name, base)

    def delta(self, name: str, base: Optional[torch.Tensor]) -> torch.Tensor:
        """Δ = θ − θ_base for tensor `name` in float32."""
        if self.kind == "model":
            assert base is not None
            # the loader returns a fresh buffer we own, so subtract in place (no second allocation)
            return self.loader.get_tensor(name).float().sub_(base)
        assert base is not None
        if name in self.replaced:
            return self.loader.get_tensor(self.replaced[name]).float() - base
        mod = self.modules.get(name)
        if mod is None:
            return torch.zeros_like(base)
        a = self.loader.get_tensor(mod.a_key).float()
        b = self.loader.get_tensor(mod.b_key).float()
        d = (b @ a) * mod.scale
        if mod.embedding or mod.fan_in_fan_out:
            d = d.T
        if d.shape != base.shape:
            raise InputError(f"LoRA adapter '{self.spec}': B·A for '{name}' has shape {tuple(d.shape)}, "
                             f"the base weight {tuple(base.shape)}")
        return d

    def close(self) -> None:
        if self._loader is not None:
            self._loader.close()


def resolve_input(spec: str, reporter: Optional[Reporter] = None) -> MergeInput:
    """A local directory (full model or adapter), the default alias, or a hub id."""
    path = Path(spec).expanduser()
    if path.is_dir() and (path / ADAPTER_CONFIG).exists():
        return _lora_input(spec, path.resolve())
    from mlxkit.engines.models.loading import check_hub_reachable, resolve_spec

    source = resolve_spec(spec, reporter)
    if source.kind == "gguf":
        raise InputError(f"'{spec}' is a GGUF file; merge reads safetensors checkpoints "
                         "(convert it first, e.g. with `mlx fetch`)")
    if source.kind == "hub":
        check_hub_reachable(source)  # raises OfflineError quickly when the hub is out of reach
        path = _download(spec, reporter)
        if (path / ADAPTER_CONFIG).exists():
            return _lora_input(spec, path)
    else:
        assert source.path is not None
        path = source.path
    if not any(path.glob("*.safetensors")):
        raise ModelLoadError(f"model '{spec}' has no safetensors weights (merge reads safetensors only)")
    return MergeInput(spec, "model", path, base_hint=_readme_base_model(path))


def _download(hub_id: str, reporter: Optional[Reporter]) -> Path:
    from huggingface_hub import snapshot_download

    (reporter or Reporter()).notice(f"fetching {hub_id} from the hub (safetensors, config and tokenizer only)")
    try:
        return Path(snapshot_download(hub_id, allow_patterns=_HUB_PATTERNS))
    except Exception as exc:  # hub errors come in many types; one line is enough
        raise ModelLoadError(f"could not download '{hub_id}': {str(exc).splitlines()[0][:300]}") from exc


def _readme_base_model(path: Path) -> Optional[str]:
    """`base_model:` from a model card's YAML front matter (a string or the first list entry)."""
    readme = path / "README.md"
    if not readme.exists():
        return None
    text = readme.read_text(errors="replace")
    match = re.match(r"^---\s*\n(.*?)\n---\s*(\n|$)", text, re.S)
    if not match:
        return None
    from mlxkit.engines.core.yaml_config import load_yaml

    try:
        front = load_yaml(match.group(1), f"{readme} front matter") or {}
    except InputError:
        return None  # a model card's front matter only suggests a base; without it --base is asked for
    base = front.get("base_model") if isinstance(front, dict) else None
    if isinstance(base, list):
        base = base[0] if base else None
    return str(base) if base else None


def _lora_input(spec: str, path: Path) -> MergeInput:
    try:
        cfg = json.loads((path / ADAPTER_CONFIG).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"'{path / ADAPTER_CONFIG}' is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise InputError(f"'{path / ADAPTER_CONFIG}' must hold a JSON object, not a {type(cfg).__name__}")
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise InputError(f"adapter '{spec}' is {cfg.get('peft_type')}; only LoRA adapters can be merged")
    if not (path / ADAPTER_WEIGHTS).exists():
        raise InputError(f"adapter '{spec}' has no {ADAPTER_WEIGHTS} (pickle adapters are not read)")
    inp = MergeInput(spec, "lora", path, base_hint=cfg.get("base_model_name_or_path") or _readme_base_model(path))
    r_default, alpha_default = int(cfg.get("r", 8)), float(cfg.get("lora_alpha", cfg.get("r", 8)))
    rank_pattern, alpha_pattern = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    rslora, fan = bool(cfg.get("use_rslora", False)), bool(cfg.get("fan_in_fan_out", False))
    keys = list(inp.tensors)
    for key in keys:
        m = re.match(r"^(?:base_model\.model\.)?(.*)\.(lora_A|lora_embedding_A)(?:\.[\w-]+)?(?:\.weight)?$", key)
        if m:
            module, kind = m.group(1), m.group(2)
            b_kind = "lora_B" if kind == "lora_A" else "lora_embedding_B"
            b_key = next((k for k in keys if k == key.replace(f".{kind}", f".{b_kind}")), None)
            if b_key is None:
                raise InputError(f"adapter '{spec}': '{key}' has no matching {b_kind}")
            r = int(_pattern_value(rank_pattern, module, r_default))
            alpha = float(_pattern_value(alpha_pattern, module, alpha_default))
            scale = alpha / (math.sqrt(r) if rslora else r)
            target = f"{module}.weight"
            inp.modules[target] = LoraModule(target, key, b_key, scale, kind == "lora_embedding_A", fan)
            continue
        m = re.match(r"^(?:base_model\.model\.)?(.*)\.modules_to_save(?:\.[\w-]+)?\.(weight|bias)$", key)
        if m:
            inp.replaced[f"{m.group(1)}.{m.group(2)}"] = key
        elif "lora_B" not in key and "lora_embedding_B" not in key:
            raise InputError(f"adapter '{spec}': cannot interpret tensor '{key}'")
    if not inp.modules and not inp.replaced:
        raise InputError(f"adapter '{spec}' holds no LoRA weights")
    return inp


def _pattern_value(patterns: dict, module: str, default):
    for pattern, value in patterns.items():
        if re.search(rf"(^|\.){pattern}$", module):
            return value
    return default


def infer_base(inputs: list[MergeInput]) -> Optional[str]:
    """The base named by the inputs (adapter config or model card); error if they disagree."""
    hints = {inp.base_hint for inp in inputs if inp.base_hint}
    if len(hints) > 1:
        raise InputError(f"the inputs name different base models ({', '.join(sorted(hints))}); pass --base")
    return hints.pop() if hints else None
