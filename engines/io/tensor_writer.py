"""Write tensors to HF-style sharded safetensors, one shard buffered at a time.

`save(name, tensor)` appends to the current shard and flushes it to disk once the next tensor
would push it past `max_shard_bytes`. `finalize()` renames the shards to
`model-0000k-of-0000n.safetensors` and writes `model.safetensors.index.json` (always, even for
one shard, so readers never special-case small models). Peak memory: one shard plus the tensor
being added. Write into a temporary directory (see `core.atomic.atomic_output_dir`) to get an
all-or-nothing output.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from mlxkit.engines.errors import InputError

_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9,
          "T": 10**12, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: str | int) -> int:
    """'5GB', '500M', '2GiB' or a plain byte count -> bytes."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(size))
    if not match or match.group(2).upper() not in _UNITS:
        raise InputError(f"cannot read size '{size}' (use e.g. 2GB, 500MB, 1GiB or a byte count)")
    value = float(match.group(1)) * _UNITS[match.group(2).upper()]
    if value < 1:
        raise InputError(f"size '{size}' must be at least one byte")
    return int(value)


class TensorWriter:
    """Accumulate tensors into shards of at most `max_shard_bytes` (a tensor larger than that gets its own)."""

    def __init__(self, directory: str | os.PathLike, max_shard_bytes: int | str = "5GB",
                 prefix: str = "model", metadata: dict[str, str] | None = None) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = parse_size(max_shard_bytes)
        self.prefix = prefix
        self.metadata = {"format": "pt", **(metadata or {})}
        self._current: dict = {}
        self._current_bytes = 0
        self._shards: list[list[str]] = []  # tensor names per flushed shard
        self.total_bytes = 0
        self._finalized = False

    def save(self, name: str, tensor) -> None:
        if self._finalized:
            raise RuntimeError("TensorWriter.save after finalize")
        if name in self._current or any(name in shard for shard in self._shards):
            raise InputError(f"tensor '{name}' written twice")
        size = tensor.numel() * tensor.element_size()
        if self._current and self._current_bytes + size > self.max_shard_bytes:
            self._flush()
        tensor = tensor.detach().to("cpu").contiguous()
        if tensor.untyped_storage().nbytes() != size:
            tensor = tensor.clone()  # a view into a larger buffer: safetensors refuses shared storage
        self._current[name] = tensor
        self._current_bytes += size
        self.total_bytes += size

    def _temp_name(self, i: int) -> str:
        return f"{self.prefix}-{i + 1:05d}.safetensors.part"

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if not self._current:
            return
        index = len(self._shards)
        save_file(self._current, str(self.directory / self._temp_name(index)), metadata=self.metadata)
        self._shards.append(list(self._current))
        self._current, self._current_bytes = {}, 0

    def finalize(self) -> dict:
        """Flush, give the shards their final names and write the index. Returns the index dict."""
        self._flush()
        self._finalized = True
        n = len(self._shards)
        weight_map: dict[str, str] = {}
        for i, names in enumerate(self._shards):
            final = f"{self.prefix}.safetensors" if n == 1 else f"{self.prefix}-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.directory / self._temp_name(i), self.directory / final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.directory / f"{self.prefix}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return index
