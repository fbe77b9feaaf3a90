"""Read tensors one at a time from a safetensors checkpoint, single file or sharded.

Modelled on mergekit's `ShardedTensorIndex` / `LazyTensorLoader`: the index maps each tensor
name to its shard, shapes and dtypes come from the shard headers (no tensor data is read to
plan), and at most one shard is open per loader, so peak memory is the tensors you hold.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from mlxkit.engines.errors import InputError, ModelLoadError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

# safetensors header dtype codes -> torch dtype names
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
           "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
           "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


@dataclass(frozen=True)
class TensorInfo:
    """What the header says about one tensor; reading it costs no tensor data."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name, e.g. "bfloat16"
    file: str   # shard file name, relative to the checkpoint directory

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def read_header(path: str | os.PathLike) -> dict[str, dict]:
    """The JSON header of a safetensors file (8-byte little-endian length, then JSON)."""
    with open(path, "rb") as handle:
        raw = handle.read(8)
        if len(raw) != 8:
            raise ModelLoadError(f"'{path}' is not a safetensors file (too short)")
        (length,) = struct.unpack("<Q", raw)
        if length > 100 * 1024 * 1024:
            raise ModelLoadError(f"'{path}' has an implausible safetensors header ({length} bytes)")
        try:
            header = json.loads(handle.read(length))
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"'{path}' has a corrupt safetensors header: {exc}") from exc
    header.pop("__metadata__", None)
    return header


@dataclass
class ShardedTensorIndex:
    """Tensor name -> `TensorInfo` for one checkpoint directory (or a single .safetensors file)."""

    directory: Path
    tensors: dict[str, TensorInfo]

    @classmethod
    def from_path(cls, path: str | os.PathLike, weights_name: str = SINGLE_NAME) -> "ShardedTensorIndex":
        """Read the index (if any) and every shard header under `path`.

        `weights_name` lets adapters reuse this for e.g. `adapter_model.safetensors`.
        """
        path = Path(path)
        if path.is_file():
            directory, files = path.parent, [path.name]
        else:
            directory = path
            index = path / (weights_name.replace(".safetensors", ".safetensors.index.json"))
            if index.exists():
                weight_map = json.loads(index.read_text()).get("weight_map", {})
                files = sorted(set(weight_map.values()))
            elif (path / weights_name).exists():
                files = [weights_name]
            else:
                files = sorted(p.name for p in path.glob("*.safetensors"))
            if not files:
                raise ModelLoadError(f"'{path}' holds no safetensors weights")
        tensors: dict[str, TensorInfo] = {}
        for file in files:
            if not (directory / file).exists():
                raise ModelLoadError(f"'{directory}' is missing shard '{file}' named in its index")
            for name, entry in read_header(directory / file).items():
                tensors[name] = TensorInfo(name, tuple(entry["shape"]), _DTYPES.get(entry["dtype"], entry["dtype"]),
                                           file)
        return cls(directory, tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def largest_bytes(self) -> int:
        import torch

        return max((t.numel * torch.empty((), dtype=getattr(torch, t.dtype)).element_size()
                    for t in self.tensors.values()), default=0)


class LazyTensorLoader:
    """`get_tensor(name)` reads exactly one tensor; one shard handle stays open at a time.

    Thread-safe (one lock per loader). Use as a context manager, or call `close()`.
    """

    def __init__(self, index: ShardedTensorIndex, device: str = "cpu") -> None:
        self.index = index
        self.device = device
        self._lock = threading.Lock()
        self._file: str | None = None
        self._handle = None

    @classmethod
    def from_path(cls, path: str | os.PathLike, **kwargs) -> "LazyTensorLoader":
        return cls(ShardedTensorIndex.from_path(path), **kwargs)

    def keys(self) -> list[str]:
        return list(self.index.tensors)

    def info(self, name: str) -> TensorInfo:
        try:
            return self.index.tensors[name]
        except KeyError:
            raise InputError(f"tensor '{name}' is not in '{self.index.directory}'") from None

    def get_tensor(self, name: str):
        """The tensor `name`, as stored (dtype and device of the checkpoint)."""
        from safetensors import safe_open

        info = self.info(name)
        with self._lock:
            if self._file != info.file:
                self._handle = None  # safe_open handles close when dropped
                self._handle = safe_open(str(self.index.directory / info.file), framework="pt", device=self.device)
                self._file = info.file
            return self._handle.get_tensor(name)

    def close(self) -> None:
        with self._lock:
            self._handle, self._file = None, None

    def __enter__(self) -> "LazyTensorLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
