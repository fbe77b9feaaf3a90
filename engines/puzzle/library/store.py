"""The block library on disk: one safetensors file per trained subblock, plus `library.json`.

This is the one module that reads and writes a library directory. Every block and every
score is its own file, written atomically, with a JSON sidecar written last as the
completion mark. A killed run therefore restarts where it stopped, finished blocks are
never retrained, and ranks of a distributed run never write the same file.

    blocks/layer000.attention.kv1.safetensors   the trained (or initialised) subblock
    blocks/layer000.attention.kv1.json          its `BlockRecord` (written last)
    scores/layer000.attention.kv1.json          its replace-1-block metrics
    .work/run.json                              the `RunKey` the directory was started with (its stage key)
    library.json                                the `BlockLibrary` index (written at the end)

`read_library` also reads the public NVlabs/puzzle demo format, converted into the same
typed `BlockLibrary` (see `nvlabs.py`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from mlxkit.engines.core.atomic import atomic_file, atomic_write_json
from mlxkit.engines.core.yaml_config import validate_model
from mlxkit.engines.errors import InputError
from mlxkit.engines.models.decilm.blocks import AttentionVariant, FFNVariant
from mlxkit.engines.puzzle.library.schema import LIBRARY_FORMAT, LIBRARY_VERSION, BlockLibrary, BlockRecord, Metrics
from mlxkit.engines.puzzle.library.nvlabs import from_nvlabs, is_nvlabs_library
from mlxkit.engines.puzzle.subblocks import Subblock, SubblockKind
from mlxkit.engines.training.device import build_on

INDEX_NAME = "library.json"


class LibraryDir:
    """Paths and atomic reads/writes inside one library directory."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.blocks = self.root / "blocks"
        self.scores = self.root / "scores"
        self.work = self.root / ".work"

    @property
    def index_file(self) -> Path:
        return self.root / INDEX_NAME

    @property
    def run_key_file(self) -> Path:
        return self.work / "run.json"

    def _stem(self, layer: int, kind: str, name: str) -> str:
        return f"layer{layer:03d}.{kind}.{name}"

    def block_file(self, layer: int, kind: str, name: str) -> Path:
        return self.blocks / f"{self._stem(layer, kind, name)}.safetensors"

    def block_record(self, layer: int, kind: str, name: str) -> Path:
        return self.blocks / f"{self._stem(layer, kind, name)}.json"

    def score_record(self, layer: int, kind: str, name: str) -> Path:
        return self.scores / f"{self._stem(layer, kind, name)}.json"

    # ---- blocks

    def has_block(self, layer: int, kind: str, name: str) -> bool:
        return self.block_record(layer, kind, name).exists() and self.block_file(layer, kind, name).exists()

    def save_block(self, block: Subblock, record: BlockRecord, dtype: torch.dtype | None = None) -> None:
        """Write the block's tensors (in `dtype`, default their own), then its record (the completion mark)."""
        name = block.variant.name
        tensors = {k: v.to(device="cpu", dtype=dtype if v.is_floating_point() else v.dtype)
                   for k, v in block.weights().items()}
        with atomic_file(self.block_file(block.layer_idx, block.kind, name)) as tmp:
            save_file(tensors, str(tmp), metadata={"layer": str(block.layer_idx), "kind": block.kind, "variant": name})
        atomic_write_json(self.block_record(block.layer_idx, block.kind, name), record.model_dump(mode="json"))

    def load_block(self, parent_config, layer: int, kind: SubblockKind, variant: AttentionVariant | FFNVariant,
                   *, device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> Subblock:
        """The stored block on `device`, in `dtype` (default torch's default dtype), whatever dtype the file holds."""
        dtype = dtype or torch.get_default_dtype()
        path = self.block_file(layer, kind, variant.name)
        if variant.kind != "no_op" and not path.exists():
            raise InputError(f"library {self.root} has no trained block for layer {layer} {kind} {variant.name}")
        # strict loading sets every parameter, so the block is built without initialising any.
        block = build_on(device, lambda: Subblock(parent_config, layer, kind, variant).to(dtype))
        if variant.kind != "no_op":
            block.layer.load_state_dict(load_file(str(path), device=str(device)), strict=True)
        return block.eval()

    def read_record(self, layer: int, kind: str, name: str) -> BlockRecord:
        path = self.block_record(layer, kind, name)
        return validate_model(BlockRecord, _read_json(path), str(path))

    # ---- scores

    def save_score(self, layer: int, kind: str, name: str, metrics: Metrics) -> None:
        atomic_write_json(self.score_record(layer, kind, name), metrics)

    def read_score(self, layer: int, kind: str, name: str) -> Metrics | None:
        path = self.score_record(layer, kind, name)
        return _read_json(path) if path.exists() else None


def write_library(root: str | Path, library: BlockLibrary) -> Path:
    """Write `library.json` into the library directory `root` (atomically)."""
    path = LibraryDir(root).index_file
    atomic_write_json(path, library.model_dump(mode="json", exclude_none=True))
    return path


def read_library(path: str | Path) -> BlockLibrary:
    """The block library at `path` (a library directory or its JSON file), in either format.

    Raises
    ------
    InputError
        No such file, not JSON, neither format, an unknown format version, or a library
        that does not validate (missing layers or subblocks, NaN scores, negative costs, ...).
    """
    path = Path(path)
    file = path / INDEX_NAME if path.is_dir() else path
    if not file.exists():
        raise InputError(f"no block library at '{path}' (expected {INDEX_NAME})")
    data = _read_json(file)
    if isinstance(data, dict) and data.get("format") == LIBRARY_FORMAT:
        if data.get("version") != LIBRARY_VERSION:
            raise InputError(f"block library '{file}' has format version {data.get('version')!r}; "
                             f"this mlxkit reads version {LIBRARY_VERSION}")
        return validate_model(BlockLibrary, data, f"block library '{file}'")
    if is_nvlabs_library(data):
        return from_nvlabs(data, str(file))
    raise InputError(f"'{file}' is neither an mlxkit block library nor an NVlabs/puzzle demo library")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise InputError(f"'{path}' is not valid JSON ({exc.msg}, line {exc.lineno})") from None
