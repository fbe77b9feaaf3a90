"""Streaming checkpoint I/O shared by every verb that rewrites weights.

`LazyTensorLoader` reads one tensor at a time from a (sharded) safetensors checkpoint and
keeps a single shard open; `TensorWriter` fills output shards up to a size limit and writes
HF-named shards plus `model.safetensors.index.json` when finalized. Neither ever holds a
whole model in memory.
"""

from mlxkit.engines.io.lazy_loader import LazyTensorLoader, ShardedTensorIndex, TensorInfo
from mlxkit.engines.io.tensor_writer import TensorWriter, parse_size

__all__ = ["LazyTensorLoader", "ShardedTensorIndex", "TensorInfo", "TensorWriter", "parse_size"]
