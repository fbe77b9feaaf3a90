"""What an export knows of a model before reading a tensor, and the checked plan of how it is written:
the data every writer shares, apart from the planning that fills it (plan.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxkit.engines.io.lazy_loader import ShardedTensorIndex
from mlxkit.engines.models.decilm.blocks import AttentionVariant, FFNVariant


@dataclass(frozen=True)
class Layer:
    """One decoder layer of the model: its attention and FFN variants."""

    index: int
    attention: AttentionVariant
    ffn: FFNVariant


@dataclass(frozen=True)
class Rope:
    """The model's RoPE, as transformers 5 keeps it in `config.rope_parameters`."""

    rope_type: str
    theta: float
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ModelDescription:
    """Everything an export needs to know before reading a tensor."""

    spec: str
    directory: Path
    config: Any                      # the MlxDeciLMConfig (a parent's is its uniform child config)
    source_config: dict[str, Any]    # config.json as stored
    is_child: bool
    layers: tuple[Layer, ...]
    rope: Rope
    index: ShardedTensorIndex
    expected: dict[str, tuple[int, ...]]   # tensor name -> shape, every tensor the layers need
    optional: frozenset[str]               # expected names that may be absent (then zeros)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def num_heads(self) -> int:
        return int(self.config.num_attention_heads)

    @property
    def head_dim(self) -> int:
        return int(self.config.head_dim)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def tied(self) -> bool:
        return bool(self.config.tie_word_embeddings)


@dataclass(frozen=True)
class ExportPlan:
    """A checked export: the model, the format, the encoding, and how each layer is written."""

    model: ModelDescription
    format: str
    encoding: str  # one of plan.ENCODINGS
    out: Path
    notes: list[str] = field(default_factory=list)
    gguf_layers: tuple[Any, ...] = ()   # gguf_layers.GGUFLayer per layer (gguf only)
    vocab: Any = None                   # gguf_vocab.GGUFVocab (gguf only)


def layer_list(indices: list[int]) -> str:
    return ", ".join(str(i) for i in indices)
