"""Parent families: how each architecture's checkpoint becomes the heterogeneous child.

Each family is one small declarative file in this package that defines `FAMILY`. It names the
`model_type`s it covers, the child config fields it implies (`qk_norm`, ...) or reads off the
parent's config (`config_fields`), the stored tensors that stack several of the child's along their
rows (read as row slices, tensor by tensor, when a layer is read), the per-layer tensors stored
under other names (`renamed`), and the child tensors its checkpoints may lack (held as zeros). A family the child
cannot reproduce says which feature is missing, and is refused before any work. Adding a family is
adding a file here and its identity test (tests/test_families.py).

Only conversion reads this package: the child's config and modeling files never import it, so an
exported child loads without mlxkit.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Any, Callable, Container, Mapping

from mlxkit.engines.errors import InputError

LAYER_PREFIX = "model.layers."


@dataclass(frozen=True)
class Fused:
    """One stored tensor of each layer holding several child tensors, stacked along dim 0 in this order."""

    stored: str              # per-layer name in the parent's checkpoint, e.g. "self_attn.qkv_proj.weight"
    parts: tuple[str, ...]   # per-layer child names, e.g. ("self_attn.q_proj.weight", ...)


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    child_fields: Mapping[str, Any] = field(default_factory=dict)
    config_fields: Callable[[Any], Mapping[str, Any]] | None = None  # child fields read off the parent's config
    renamed: Mapping[str, str] = field(default_factory=dict)  # per-layer child name -> the checkpoint's name
    fused: tuple[Fused, ...] = ()
    absent_as_zeros: tuple[str, ...] = ()   # per-layer child names a checkpoint may lack
    refused: str = ""                       # what the child lacks for this family; empty when it is supported

    def fields_for(self, config: Any) -> dict[str, Any]:
        """The child config fields this family sets for the parent `config`."""
        return {**self.child_fields, **(self.config_fields(config) if self.config_fields else {})}

    def fused_part(self, rest: str) -> tuple[Fused, int] | None:
        """The fused tensor holding the per-layer child tensor `rest`, and its position there."""
        for fused in self.fused:
            if rest in fused.parts:
                return fused, fused.parts.index(rest)
        return None


@dataclass(frozen=True)
class Source:
    """Where one tensor of the converted parent is in the parent's checkpoint."""

    name: str | None                      # None: the checkpoint does not store it; zeros
    rows: tuple[int, int] | None = None   # a row range of a fused tensor; None: the whole tensor


def _discover() -> dict[str, Family]:
    families: dict[str, Family] = {}
    for module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
        family = importlib.import_module(f"{__name__}.{module}").FAMILY
        for model_type in family.model_types:
            families[model_type] = family
    return families


_FAMILIES = _discover()


def all_families() -> list[Family]:
    """Every family, supported or refused, once each, by name."""
    return sorted({id(f): f for f in _FAMILIES.values()}.values(), key=lambda f: f.name)


def supported_model_types() -> set[str]:
    return {t for t, f in _FAMILIES.items() if not f.refused}


def family_of(config: Any) -> Family:
    """The family of a parent config; an unknown model_type is an InputError naming the supported ones."""
    family = _FAMILIES.get(getattr(config, "model_type", None))
    if family is None:
        raise InputError(f"Puzzle needs a parent of a supported family ({', '.join(sorted(supported_model_types()))}); "
                         f"got model_type '{getattr(config, 'model_type', None)}'")
    return family


def check_parent(config: Any) -> Family:
    """The family of `config`, refusing with the missing feature a parent the child cannot reproduce."""
    family = family_of(config)
    if family.refused:
        raise InputError(f"{family.name} parents are not supported: {family.refused}")
    missing = _missing_feature(config)
    if missing:
        raise InputError(f"this {family.name} parent is not supported: {missing}")
    return family


def sliding_window(config: Any) -> int | None:
    """The window every attention layer of the parent keeps, None for full attention.

    A window at least as long as any sequence the model takes is full attention (Phi-3.5's 262144
    over 131072 positions), so it is dropped: the child then exports where windows cannot go.
    """
    window = getattr(config, "sliding_window", None)
    positions = getattr(config, "max_position_embeddings", None)
    if window is None or (positions is not None and window >= positions):
        return None
    return int(window)


def windowed_layers(config: Any) -> list[bool] | None:
    """Which layers keep the sliding window (from the config's `layer_types`); None: all of them, or no window."""
    if sliding_window(config) is None:
        return None
    if getattr(config, "model_type", None) == "mlx_decilm":
        return config.windowed_layers
    kinds = getattr(config, "layer_types", None)
    if not kinds or all(kind == "sliding_attention" for kind in kinds):
        return None
    return [kind == "sliding_attention" for kind in kinds]


def _missing_feature(config: Any) -> str | None:
    """A feature, possible in any family's config, that the child's blocks do not have."""
    kinds = set(getattr(config, "layer_types", None) or ()) - {"full_attention", "sliding_attention"}
    if kinds and getattr(config, "model_type", None) != "mlx_decilm":
        return f"attention layers of kind {', '.join(sorted(kinds))} are not part of the child"
    rope = getattr(config, "rope_parameters", None) or {}
    partial = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) \
        if isinstance(rope, dict) else 1.0
    if partial not in (None, 1, 1.0):
        return f"partial rotary embeddings (partial_rotary_factor {partial}) are not part of the child's attention"
    return None


def parent_sources(parent_config: Any, shapes: Mapping[str, tuple[int, ...]], stored: Container[str]) -> dict[str, Source]:
    """For each tensor of the converted parent (`shapes`: its names and shapes), where the parent's
    checkpoint (whose tensor names are `stored`) holds it."""
    family = family_of(parent_config)
    tied = bool(getattr(parent_config, "tie_word_embeddings", False))
    sources: dict[str, Source] = {}
    for name in shapes:
        if name == "lm_head.weight" and tied:
            sources[name] = Source("model.embed_tokens.weight")
            continue
        prefix, rest = _split_layer_name(name)
        part = family.fused_part(rest) if prefix else None
        if part is not None:
            fused, position = part
            sizes = [shapes[prefix + p][0] for p in fused.parts]
            start = sum(sizes[:position])
            sources[name] = Source(prefix + fused.stored, (start, start + sizes[position]))
        elif prefix and rest in family.renamed:
            sources[name] = Source(prefix + family.renamed[rest])
        elif prefix and rest in family.absent_as_zeros and name not in stored:
            sources[name] = Source(None)
        else:
            sources[name] = Source(name)
    return sources


def _split_layer_name(name: str) -> tuple[str, str]:
    """("model.layers.3.", "self_attn.q_proj.weight") for a layer tensor; ("", name) otherwise."""
    if not name.startswith(LAYER_PREFIX):
        return "", name
    index, rest = name[len(LAYER_PREFIX):].split(".", 1)
    return f"{LAYER_PREFIX}{index}.", rest
