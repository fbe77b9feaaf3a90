"""Streaming checkpoint I/O shared by every verb that rewrites weights.

`LazyTensorLoader` reads one tensor at a time from a (sharded) safetensors checkpoint and
keeps a single shard open; `TensorWriter` fills output shards up to a size limit and writes
HF-named shards plus `model.safetensors.index.json` when finalized. Neither ever holds a
whole model in memory. `read_safetensors_header` validates a file's header against its size
(every verb that reads local safetensors calls it first).
"""

from mlxkit.engines.io.lazy_loader import LazyTensorLoader, ShardedTensorIndex, TensorInfo
from mlxkit.engines.io.safetensors_header import (SafetensorsHeader, read_safetensors_header,
                                                  validate_safetensors_dir)
from mlxkit.engines.io.tensor_writer import TensorWriter

__all__ = ["LazyTensorLoader", "SafetensorsHeader", "ShardedTensorIndex", "TensorInfo", "TensorWriter",
           "read_safetensors_header", "validate_safetensors_dir"]
