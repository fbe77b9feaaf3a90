"""Convert block libraries in the public NVlabs/puzzle demo JSON format into the typed schema.

Layout (as shipped in NVlabs/puzzle `examples/data/<model>/block_library.json`)::

    {"layer_0": {"attention = 8 kv heads (parent * 100%)\\t&&\\tffn = intermediate size 29e3 (parent * 100%)":
                    {"stats": {"memory_mib": ..., "runtime_ms": ..., "num_params": ..., "num_kv_heads": 8,
                               "ffn_intermediate_size": 28672, "attention_memory_mib": ..., "ffn_runtime_ms": ...},
                     "metrics": {"kl_div": 0.0, "lm_loss": 1.64}},
                 ...},
     "layer_1": {...}}

Each variant is a whole block (attention and FFN together), scored and measured as one, so
it becomes a `blocks` entry of the typed library and the MIP gets one group per layer. The
demo's stats were measured on an H100 (batch 256, 1200 tokens, FP8) and have no non-block
part.
"""

from __future__ import annotations

import re
from dataclasses import asdict
from typing import Any, Mapping

from mlxkit.engines.core.yaml_config import validate_model
from mlxkit.engines.errors import InputError
from mlxkit.engines.models.decilm.blocks import AttentionVariant, BlockChoice, FFNVariant
from mlxkit.engines.puzzle.library.schema import BlockLibrary

_LAYER_KEY = re.compile(r"^(?:layer|block)_(\d+)$")
_KV_HEADS = re.compile(r"(\d+)\s*kv\s*heads?", re.IGNORECASE)
_WIDTH = re.compile(r"intermediate\s*size\s*(\d+)\b(?!e)", re.IGNORECASE)


def is_nvlabs_library(data: Any) -> bool:
    """True when `data` looks like the demo format: `layer_N` keys mapping variant names to stats/metrics."""
    if not isinstance(data, dict) or not data or data.get("format"):
        return False
    key, value = next(iter(data.items()))
    if not (isinstance(key, str) and _LAYER_KEY.match(key) and isinstance(value, dict) and value):
        return False
    first = next(iter(value.values()))
    return isinstance(first, dict) and ("stats" in first or "metrics" in first)


def from_nvlabs(data: Mapping[str, Any], origin: str = "library") -> BlockLibrary:
    """Convert a demo library into the typed `BlockLibrary` (one `blocks` entry per demo variant).

    Each layer lists the attention and FFN variants its blocks use (with no stats of their
    own: the demo measured whole blocks) and, under `blocks`, every block keyed by its
    mlxkit name (`kv8+ffn28672`) with the demo's name, metrics and stats.

    Raises
    ------
    InputError
        When layers are missing or out of order, a variant lacks stats or metrics, its name
        cannot be read, or the stats and metrics do not validate (NaN scores, negative costs).
    """
    if not is_nvlabs_library(data):
        raise InputError(f"{origin} is not an NVlabs/puzzle block library (expected layer_N → variant → stats/metrics)")
    indexed: dict[int, dict[str, Any]] = {}
    for key, variants in data.items():
        match = _LAYER_KEY.match(str(key))
        if not match or not isinstance(variants, dict):
            raise InputError(f"{origin}: unexpected top-level key '{key}'")
        for name, entry in variants.items():
            if not isinstance(entry, dict) or not isinstance(entry.get("stats"), dict) \
                    or not isinstance(entry.get("metrics"), dict):
                raise InputError(f"{origin}: {key} variant '{name}' needs both 'stats' and 'metrics' (mappings)")
        indexed[int(match.group(1))] = variants
    missing = sorted(set(range(max(indexed) + 1)) - set(indexed))
    if missing:
        raise InputError(f"{origin}: layers {missing} are missing")
    layers = []
    for index in range(len(indexed)):
        attention: dict[str, Any] = {}
        ffn: dict[str, Any] = {}
        blocks: dict[str, Any] = {}
        for original, entry in indexed[index].items():
            choice = block_choice(original, entry["stats"])
            if choice.name in blocks:
                raise InputError(f"{origin}: layer_{index} has two variants that both read as {choice.name}")
            attention.setdefault(choice.attention.name, {"variant": asdict(choice.attention), "source": "nvlabs"})
            ffn.setdefault(choice.ffn.name, {"variant": asdict(choice.ffn), "source": "nvlabs"})
            blocks[choice.name] = {"attention": choice.attention.name, "ffn": choice.ffn.name,
                                   "original_name": original, "metrics": entry["metrics"], "stats": entry["stats"]}
        layers.append({"layer": index, "attention": attention, "ffn": ffn, "blocks": blocks})
    # The demo's stats are NVIDIA's own H100 measurements, with no non-block part.
    return validate_model(BlockLibrary, {"converted_from": "NVlabs/puzzle demo library", "layers": layers}, origin)


def split_variant_name(name: str) -> tuple[str, str]:
    """`"attention = X && ffn = Y"` → `("X", "Y")` (tabs and spacing as in the demo)."""
    parts = [p.strip() for p in name.split("&&")]
    if len(parts) != 2:
        raise InputError(f"variant name '{name}' is not of the form 'attention = ... && ffn = ...'")
    out = []
    for part, label in zip(parts, ("attention", "ffn")):
        head, sep, rest = part.partition("=")
        if not sep or head.strip().lower() != label:
            raise InputError(f"variant name '{name}': expected '{label} = ...'")
        out.append(rest.strip())
    return out[0], out[1]


def block_choice(name: str, stats: Mapping[str, Any] | None = None) -> BlockChoice:
    """Map a demo variant to our types, using `num_kv_heads`/`ffn_intermediate_size` stats when present."""
    stats = stats or {}
    attention_text, ffn_text = split_variant_name(name)
    if "no_op" in attention_text:
        attention = AttentionVariant("no_op")
    elif "linear" in attention_text:
        attention = AttentionVariant("linear")
    else:
        kv = stats.get("num_kv_heads")
        if not kv:
            match = _KV_HEADS.search(attention_text)
            if not match:
                raise InputError(f"cannot read the KV heads of '{attention_text}'")
            kv = int(match.group(1))
        attention = AttentionVariant("gqa", _positive_count(kv, f"num_kv_heads of '{name}'"))
    if "no_op" in ffn_text:
        ffn = FFNVariant("no_op")
    elif "linear" in ffn_text:
        ffn = FFNVariant("linear")
    else:
        width = stats.get("ffn_intermediate_size")
        if not width:
            match = _WIDTH.search(ffn_text)
            if not match:
                raise InputError(f"cannot read the FFN width of '{ffn_text}' (no ffn_intermediate_size stat)")
            width = int(match.group(1))
        ffn = FFNVariant("mlp", _positive_count(width, f"ffn_intermediate_size of '{name}'"))
    return BlockChoice(attention, ffn)


def _positive_count(value: Any, what: str) -> int:
    """A stat that counts heads or channels: a positive whole number (JSON may spell it 8.0)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value \
            or not 0 < value <= 2**31 or value != int(value):
        raise InputError(f"{what} must be a positive whole number, not {value!r}")
    return int(value)
