"""The block library on disk: one safetensors file per trained subblock, plus `library.json`.

Every block and every score is its own file, written atomically, with a JSON sidecar
written last as the completion mark. A killed run therefore restarts where it stopped,
finished blocks are never retrained, and ranks of a distributed run never write the
same file.

`library.json` layout (format "mlxkit.block_library", version 1)::

    {"parent": {"spec", "hash", "shape"}, "recipe": {...},
     "layers": [{"layer": 0,
                 "attention": {"kv3": {"variant", "file", "source", "training", "metrics", "stats"}, ...},
                 "ffn": {...}}, ...]}
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from mlxkit.engines.core.atomic import atomic_write_text
from mlxkit.engines.errors import InputError
from mlxkit.engines.puzzle.subblocks import Subblock, SubblockKind
from mlxkit.engines.puzzle.variants import AttentionVariant, FFNVariant

LIBRARY_FORMAT = "mlxkit.block_library"
LIBRARY_VERSION = 1
INDEX_NAME = "library.json"


def variant_from_dict(kind: SubblockKind, data: dict[str, Any]) -> AttentionVariant | FFNVariant:
    return AttentionVariant(**data) if kind == "attention" else FFNVariant(**data)


class LibraryDir:
    """Paths and atomic reads/writes inside one library directory."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.blocks = self.root / "blocks"
        self.scores = self.root / "scores"
        self.work = self.root / ".work"

    def _stem(self, layer: int, kind: str, name: str) -> str:
        return f"layer{layer:03d}.{kind}.{name}"

    def block_file(self, layer: int, kind: str, name: str) -> Path:
        return self.blocks / f"{self._stem(layer, kind, name)}.safetensors"

    def block_record(self, layer: int, kind: str, name: str) -> Path:
        return self.blocks / f"{self._stem(layer, kind, name)}.json"

    def score_record(self, layer: int, kind: str, name: str, tag: str = "") -> Path:
        return self.scores / f"{self._stem(layer, kind, name)}{tag}.json"

    def has_block(self, layer: int, kind: str, name: str) -> bool:
        return self.block_record(layer, kind, name).exists() and self.block_file(layer, kind, name).exists()

    def save_block(self, block: Subblock, record: dict[str, Any]) -> None:
        name = block.variant.name
        path = self.block_file(block.layer_idx, block.kind, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        save_file(block.weights(), str(partial), metadata={"layer": str(block.layer_idx), "kind": block.kind,
                                                          "variant": name})
        partial.replace(path)
        atomic_write_text(self.block_record(block.layer_idx, block.kind, name), json.dumps(record, indent=1))

    def load_block(self, parent_config, layer: int, kind: SubblockKind,
                   variant: AttentionVariant | FFNVariant) -> Subblock:
        block = Subblock(parent_config, layer, kind, variant)
        if variant.kind != "no_op":
            path = self.block_file(layer, kind, variant.name)
            if not path.exists():
                raise InputError(f"library {self.root} has no trained block for layer {layer} {kind} {variant.name}")
            block.layer.load_state_dict(load_file(str(path)), strict=True)
        return block.eval()

    def read_record(self, layer: int, kind: str, name: str) -> dict[str, Any]:
        return json.loads(self.block_record(layer, kind, name).read_text())

    def save_score(self, layer: int, kind: str, name: str, metrics: dict[str, float], tag: str = "") -> None:
        path = self.score_record(layer, kind, name, tag)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(metrics))

    def read_score(self, layer: int, kind: str, name: str, tag: str = "") -> dict[str, float] | None:
        path = self.score_record(layer, kind, name, tag)
        return json.loads(path.read_text()) if path.exists() else None

    def write_index(self, index: dict[str, Any]) -> Path:
        path = self.root / INDEX_NAME
        atomic_write_text(path, json.dumps(index, indent=1, default=_jsonable) + "\n")
        return path


def read_library(path: str | Path) -> dict[str, Any]:
    """`library.json` from a library directory or the file itself, checked for our format."""
    path = Path(path)
    file = path / INDEX_NAME if path.is_dir() else path
    if not file.exists():
        raise InputError(f"no block library at '{path}' (expected {INDEX_NAME})")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise InputError(f"block library '{file}' is not valid JSON ({exc.msg})") from None
    if data.get("format") != LIBRARY_FORMAT:
        raise InputError(f"'{file}' is not an mlxkit block library")
    return data


def _jsonable(value: Any) -> Any:
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)
    return str(value)
