"""The block vocabulary of the heterogeneous DeciLM-style child: per-layer attention and FFN variants.

A child layer is an attention variant (GQA with its own KV-head count, one linear map, or
nothing) plus an FFN variant (SwiGLU of its own width, one linear map, or nothing). These
types belong to the architecture: the child's config (`block_configs`) is written and read
through them, and the Puzzle search, the cost model and calibration all speak in them.
Names are short and stable (`kv1`, `linear`, `no_op`, `ffn768`) because they key files and
JSON; `to_block_config` emits the public Nemotron-NAS / DeciLM layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from mlxkit.engines.errors import InputError

AttentionKind = Literal["gqa", "linear", "no_op"]
FFNKind = Literal["mlp", "linear", "no_op"]


@dataclass(frozen=True)
class ParentShape:
    """The dimensions of a Llama-family parent that the search space is built from."""

    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool

    @classmethod
    def from_config(cls, config: Any) -> "ParentShape":
        check_shape_fields(config)
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        block_configs = getattr(config, "block_configs", None)
        if block_configs:  # already a heterogeneous child: its parent widths are recorded
            return cls(config.hidden_size, config.num_hidden_layers, heads, config.parent_num_key_value_heads,
                       head_dim, config.parent_intermediate_size, config.vocab_size,
                       bool(getattr(config, "tie_word_embeddings", False)))
        return cls(
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )


def check_shape_fields(config: Any) -> None:
    """Refuse a config whose widths are missing, non-integer, non-positive or do not divide (no ZeroDivisionError)."""
    def count(name: str, required: bool = True) -> int | None:
        value = getattr(config, name, None)
        if value is None and not required:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InputError(f"config field {name} must be a positive integer (got {value!r})")
        return value

    for name in ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size"):
        count(name)
    heads, kv_heads = count("num_attention_heads"), count("num_key_value_heads", required=False)
    head_dim = count("head_dim", required=False)
    if head_dim is None and config.hidden_size % heads:
        raise InputError(f"config hidden_size {config.hidden_size} is not divisible by "
                         f"num_attention_heads {heads}")
    if kv_heads is not None and heads % kv_heads:
        raise InputError(f"config num_attention_heads {heads} is not divisible by num_key_value_heads {kv_heads}")


@dataclass(frozen=True, order=True)
class AttentionVariant:
    kind: AttentionKind
    n_kv_heads: int | None = None  # only for "gqa"

    def __post_init__(self) -> None:
        if (self.kind == "gqa") != (self.n_kv_heads is not None):
            raise InputError(f"attention variant {self.kind!r} {'needs' if self.kind == 'gqa' else 'takes no'} n_kv_heads")

    @property
    def name(self) -> str:
        return f"kv{self.n_kv_heads}" if self.kind == "gqa" else self.kind

    @classmethod
    def parse(cls, name: str) -> "AttentionVariant":
        if name in ("linear", "no_op"):
            return cls(name)  # type: ignore[arg-type]
        if name.startswith("kv") and name[2:].isdigit():
            return cls("gqa", int(name[2:]))
        raise InputError(f"unknown attention variant '{name}' (expected kvN, linear or no_op)")

    def validate(self, parent: ParentShape) -> None:
        if self.kind == "gqa":
            n = self.n_kv_heads
            if not n or n < 1 or parent.num_attention_heads % n:
                raise InputError(f"attention variant {self.name}: KV heads must divide the "
                                 f"{parent.num_attention_heads} query heads")

    def to_block_config(self, parent: ParentShape) -> dict[str, Any]:
        group = parent.num_attention_heads // self.n_kv_heads if self.kind == "gqa" else None
        return {"n_heads_in_group": group, "no_op": self.kind == "no_op", "replace_with_linear": self.kind == "linear",
                "num_key_value_heads": self.n_kv_heads if self.kind == "gqa" else 0}

    @classmethod
    def from_block_config(cls, block: dict[str, Any], parent_heads: int) -> "AttentionVariant":
        if block.get("no_op"):
            return cls("no_op")
        if block.get("replace_with_linear"):
            return cls("linear")
        kv = block.get("num_key_value_heads") or parent_heads // int(block["n_heads_in_group"])
        return cls("gqa", int(kv))

    def num_params(self, parent: ParentShape) -> int:
        """Weights of the subblock, including its RMSNorm."""
        h = parent.hidden_size
        if self.kind == "no_op":
            return 0
        if self.kind == "linear":
            return h * h + h
        q = parent.num_attention_heads * parent.head_dim
        kv = self.n_kv_heads * parent.head_dim  # type: ignore[operator]
        return h * q + 2 * h * kv + q * h + h


@dataclass(frozen=True, order=True)
class FFNVariant:
    kind: FFNKind
    intermediate_size: int | None = None  # only for "mlp"

    def __post_init__(self) -> None:
        if (self.kind == "mlp") != (self.intermediate_size is not None):
            raise InputError(f"FFN variant {self.kind!r} {'needs' if self.kind == 'mlp' else 'takes no'} a width")

    @property
    def name(self) -> str:
        return f"ffn{self.intermediate_size}" if self.kind == "mlp" else self.kind

    @classmethod
    def parse(cls, name: str) -> "FFNVariant":
        if name in ("linear", "no_op"):
            return cls(name)  # type: ignore[arg-type]
        if name.startswith("ffn") and name[3:].isdigit():
            return cls("mlp", int(name[3:]))
        raise InputError(f"unknown FFN variant '{name}' (expected ffnN, linear or no_op)")

    def validate(self, parent: ParentShape) -> None:
        if self.kind == "mlp" and not (self.intermediate_size and self.intermediate_size > 0):
            raise InputError(f"FFN variant {self.name}: width must be positive")

    def to_block_config(self, parent: ParentShape) -> dict[str, Any]:
        size = self.intermediate_size if self.kind == "mlp" else None
        # ffn_mult is DeciLM's width encoding (width = 2*mult*hidden/3, rounded up to 256 there);
        # the exact width is recorded beside it so nothing depends on that rounding.
        mult = round(3 * size / (2 * parent.hidden_size), 6) if size else None
        return {"ffn_mult": mult, "no_op": self.kind == "no_op", "replace_with_linear": self.kind == "linear",
                "intermediate_size": size or 0}

    @classmethod
    def from_block_config(cls, block: dict[str, Any], hidden_size: int) -> "FFNVariant":
        if block.get("no_op"):
            return cls("no_op")
        if block.get("replace_with_linear"):
            return cls("linear")
        size = block.get("intermediate_size") or _decilm_ffn_width(float(block["ffn_mult"]), hidden_size)
        return cls("mlp", int(size))

    def num_params(self, parent: ParentShape) -> int:
        h = parent.hidden_size
        if self.kind == "no_op":
            return 0
        if self.kind == "linear":
            return h * h + h
        return 3 * h * self.intermediate_size + h  # type: ignore[operator]


def _decilm_ffn_width(ffn_mult: float, hidden_size: int) -> int:
    """DeciLM's rule for configs that carry only ffn_mult: 2/3 * mult * hidden, rounded up to 256."""
    width = int(2 * ffn_mult * hidden_size / 3)
    return int(math.ceil(width / 256) * 256)


def nas_ffn_mult(width: int, hidden_size: int) -> float:
    """The `ffn_mult` that Nemotron-NAS readers turn back into `width` (checked by `nas_width_ok`)."""
    return round(3 * width / (2 * hidden_size), 6)


def nas_width_ok(width: int, hidden_size: int) -> bool:
    """Whether DeciLM's rule, ceil_256(int(2·mult·hidden/3)), gives back exactly `width`."""
    mult = nas_ffn_mult(width, hidden_size)
    decoded = FFNVariant.from_block_config({"ffn_mult": mult}, hidden_size).intermediate_size
    # llama.cpp's converter applies the same rule in its own words; both must agree.
    llama_cpp = int(2 * mult * hidden_size / 3)
    llama_cpp = llama_cpp if llama_cpp % 256 == 0 else llama_cpp + 256 - llama_cpp % 256
    return decoded == width == llama_cpp


def parent_attention(parent: ParentShape) -> AttentionVariant:
    return AttentionVariant("gqa", parent.num_key_value_heads)


def parent_ffn(parent: ParentShape) -> FFNVariant:
    return FFNVariant("mlp", parent.intermediate_size)


@dataclass(frozen=True)
class BlockChoice:
    """One child layer: an attention variant and an FFN variant."""

    attention: AttentionVariant
    ffn: FFNVariant

    @property
    def name(self) -> str:
        return f"{self.attention.name}+{self.ffn.name}"

    def to_block_config(self, parent: ParentShape) -> dict[str, Any]:
        return {"attention": self.attention.to_block_config(parent), "ffn": self.ffn.to_block_config(parent)}


def replaced_layers(child_config: Any) -> list[int] | None:
    """Indices of the layers whose attention or FFN differs from the parent's; None for a config without
    `block_configs` (a plain Llama, which replaces nothing)."""
    block_configs = getattr(child_config, "block_configs", None)
    if not block_configs:
        return None
    shape = ParentShape.from_config(child_config)
    return [index for index, block in enumerate(block_configs)
            if AttentionVariant.from_block_config(block["attention"], shape.num_attention_heads)
            != parent_attention(shape)
            or FFNVariant.from_block_config(block["ffn"], shape.hidden_size) != parent_ffn(shape)]
