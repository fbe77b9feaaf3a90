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
from pathlib import Path

from mlxkit.engines.core.atomic import atomic_write_text
from mlxkit.engines.core.sizes import parse_bytes
from mlxkit.engines.errors import InputError


class TensorWriter:
    """Accumulate tensors into shards of at most `max_shard_bytes` (a tensor larger than that gets its own).

    `max_shard_bytes` is a byte count or a size string read by `core.sizes.parse_bytes`
    (`5GB` = 5·10⁹ bytes, `2GiB` = 2·2³⁰ bytes, a bare number = bytes).
    """

    def __init__(self, directory: str | os.PathLike, max_shard_bytes: int | str = "5GB",
                 prefix: str = "model", metadata: dict[str, str] | None = None) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = parse_bytes(max_shard_bytes, "max shard size")
        self.prefix = prefix
        self.metadata = {"format": "pt", **(metadata or {})}
        self._current: dict = {}
        self._current_bytes = 0
        self._shards: list[list[str]] = []  # tensor names per flushed shard
        self._names: set[str] = set()       # every name saved so far, to refuse a second copy
        self.total_bytes = 0
        self._finalized = False

    def save(self, name: str, tensor) -> None:
        if self._finalized:
            raise RuntimeError("TensorWriter.save after finalize")
        if name in self._names:
            raise InputError(f"tensor '{name}' written twice")
        size = tensor.numel() * tensor.element_size()
        if self._current and self._current_bytes + size > self.max_shard_bytes:
            self._flush()
        tensor = tensor.detach().to("cpu").contiguous()
        if tensor.untyped_storage().nbytes() != size:
            tensor = tensor.clone()  # a view into a larger buffer: safetensors refuses shared storage
        self._current[name] = tensor
        self._names.add(name)
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
            # safetensors writes through a private (0600) temporary; the shards are ordinary files
            # like the config beside them.
            os.chmod(self.directory / final, 0o644)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        atomic_write_text(self.directory / f"{self.prefix}.safetensors.index.json", json.dumps(index, indent=2) + "\n")
        return index
