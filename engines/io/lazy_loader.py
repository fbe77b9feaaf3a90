"""Read tensors one at a time from a safetensors checkpoint, single file or sharded.

Modelled on mergekit's `ShardedTensorIndex` / `LazyTensorLoader`: the index maps each tensor
name to its shard, shapes, dtypes and byte ranges come from the shard headers (no tensor data is
read to plan), and at most one shard is open per loader, so peak memory is the tensors you hold.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from mlxkit.engines.errors import InputError, ModelLoadError
from mlxkit.engines.io.safetensors_header import read_safetensors_header

SINGLE_NAME = "model.safetensors"


@dataclass(frozen=True)
class TensorInfo:
    """What the header says about one tensor; reading it costs no tensor data."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name, e.g. "bfloat16"
    file: str   # shard file name, relative to the checkpoint directory
    start: int = 0  # byte range of the data within the file (absolute offsets)
    end: int = 0

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


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
            weight_map: dict[str, str] | None = None
        else:
            directory = path
            index = path / (weights_name.replace(".safetensors", ".safetensors.index.json"))
            weight_map = _read_weight_map(index) if index.exists() else None
            if weight_map is not None:
                files = sorted(set(weight_map.values()))
            elif (path / weights_name).exists():
                files = [weights_name]
            else:
                files = sorted(p.name for p in path.glob("*.safetensors"))
            if not files:
                raise ModelLoadError(f"'{path}' holds no safetensors weights")
        tensors: dict[str, TensorInfo] = {}
        for file in files:
            if not (directory / file).is_file():
                raise ModelLoadError(f"'{directory}' is missing shard '{file}' named in its index")
            for name, entry in read_safetensors_header(directory / file).tensors.items():
                if name in tensors:
                    raise InputError(f"tensor '{name}' is stored twice, in '{directory / tensors[name].file}' "
                                     f"and '{directory / file}'")
                tensors[name] = TensorInfo(name, entry.shape, entry.torch_dtype, file, entry.begin, entry.end)
        if weight_map is not None:
            # the index is what transformers trusts: a name it sends to a shard that lacks it fails there
            for name, file in weight_map.items():
                if tensors.get(name) is None or tensors[name].file != file:
                    raise InputError(f"'{directory}' index places tensor '{name}' in '{file}', which does not hold it")
        return cls(directory, tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


class LazyTensorLoader:
    """`get_tensor(name)` reads exactly one tensor; one shard file stays open at a time.

    Tensors are read with positioned reads (`os.pread`) into fresh memory rather than through a
    memory map: a mapped shard keeps every page it touched counted in the process's resident set
    until it is closed, so streaming a whole model through mmap makes RSS grow to the model's
    size. Here memory is only what the caller holds. Thread-safe (one lock per loader). Use as a
    context manager, or call `close()`.
    """

    def __init__(self, index: ShardedTensorIndex, device: str = "cpu") -> None:
        self.index = index
        self.device = device
        self._lock = threading.Lock()
        self._file: str | None = None
        self._fd: int | None = None

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
        """The tensor `name`, as stored (dtype of the checkpoint), on `device`."""
        import torch

        info = self.info(name)
        size = info.end - info.start
        buf = bytearray(size)
        with self._lock:
            self._open(info.file)
            view, done = memoryview(buf), 0
            while done < size:
                got = os.preadv(self._fd, [view[done:]], info.start + done)
                if got <= 0:
                    raise ModelLoadError(f"'{self.index.directory / info.file}' ends inside tensor '{name}'")
                done += got
        dtype = getattr(torch, info.dtype)
        if size == 0:
            tensor = torch.empty(info.shape, dtype=dtype)
        else:
            tensor = torch.frombuffer(buf, dtype=dtype).reshape(info.shape)
        return tensor if self.device == "cpu" else tensor.to(self.device)

    def get_elements(self, name: str, indices: Sequence[int]):
        """The elements at flat positions `indices` of tensor `name`, as a 1-D CPU tensor of the stored dtype.

        Reads only those elements' bytes (one positioned read each), so sampling a few values of
        a large tensor costs no more than the values.
        """
        import torch

        info = self.info(name)
        dtype = getattr(torch, info.dtype)
        width = torch.empty((), dtype=dtype).element_size()
        numel = info.numel
        buf = bytearray(width * len(indices))
        with self._lock:
            self._open(info.file)
            for k, index in enumerate(indices):
                if not 0 <= index < numel:
                    raise InputError(f"element {index} is outside tensor '{name}' of {numel} elements")
                got = os.preadv(self._fd, [memoryview(buf)[k * width:(k + 1) * width]], info.start + index * width)
                if got != width:
                    raise ModelLoadError(f"'{self.index.directory / info.file}' ends inside tensor '{name}'")
        if not buf:
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).clone()

    def _open(self, file: str) -> None:
        """Make `file` the open shard (the caller holds the lock)."""
        if self._file != file:
            self._close_fd()
            self._fd = os.open(self.index.directory / file, os.O_RDONLY)
            self._file = file

    def _close_fd(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self._file = None, None

    def close(self) -> None:
        with self._lock:
            self._close_fd()

    def __enter__(self) -> "LazyTensorLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self._close_fd()
        except Exception:
            pass


def _read_weight_map(index: Path) -> dict[str, str]:
    """The `weight_map` of a sharded checkpoint's index: tensor name -> shard file name."""
    try:
        data = json.loads(index.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"'{index}' is not valid JSON: {exc}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str) and v
                                                   for k, v in weight_map.items()):
        raise InputError(f"'{index}' has no weight_map of tensor names to shard files")
    if any(Path(v).name != v for v in weight_map.values()):
        # a shard path with a directory part could point outside the checkpoint
        raise InputError(f"'{index}' names shard files outside its own directory")
    return weight_map
