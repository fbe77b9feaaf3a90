"""Streaming I/O: the lazy loader reads across shards; the writer shards and indexes."""

from __future__ import annotations

import json

import pytest
import torch

from mlxkit.engines.errors import InputError
from mlxkit.engines.io import LazyTensorLoader, ShardedTensorIndex, TensorWriter


def test_writer_reads_sizes_with_the_shared_rule(tmp_path):
    # core.sizes.parse_bytes: bare number = bytes, KB/MB/GB decimal, KiB/MiB/GiB binary
    assert TensorWriter(tmp_path / "a", "2GB").max_shard_bytes == 2 * 10**9
    assert TensorWriter(tmp_path / "b", "1GiB").max_shard_bytes == 2**30
    assert TensorWriter(tmp_path / "c", "500M").max_shard_bytes == 500 * 10**6
    assert TensorWriter(tmp_path / "d", 1234).max_shard_bytes == 1234
    assert TensorWriter(tmp_path / "e", "1234").max_shard_bytes == 1234
    with pytest.raises(InputError, match="max shard size"):
        TensorWriter(tmp_path / "f", "lots")


def test_writer_shards_index_and_loader_roundtrip(tmp_path):
    tensors = {f"layer.{i}.weight": torch.randn(16, 16) for i in range(5)}
    tensors["buf"] = torch.arange(4)
    writer = TensorWriter(tmp_path, max_shard_bytes=2 * 16 * 16 * 4)  # two matrices per shard
    for name, t in tensors.items():
        writer.save(name, t)
    index = writer.finalize()
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert not list(tmp_path.glob("*.part"))
    on_disk = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert on_disk == index and set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    idx = ShardedTensorIndex.from_path(tmp_path)
    assert idx.tensors["layer.0.weight"].shape == (16, 16) and idx.tensors["buf"].dtype == "int64"
    with LazyTensorLoader(idx) as loader:
        for name, t in tensors.items():
            assert torch.equal(loader.get_tensor(name), t)
    with pytest.raises(InputError):
        LazyTensorLoader(idx).get_tensor("missing")


def test_single_shard_is_named_model_safetensors(tmp_path):
    writer = TensorWriter(tmp_path, "1GB")
    writer.save("a", torch.zeros(3)[1:])  # a view: must be copied out, not saved with its whole storage
    writer.finalize()
    assert (tmp_path / "model.safetensors").exists()
    assert LazyTensorLoader.from_path(tmp_path).get_tensor("a").shape == (2,)


def test_shards_are_readable_like_the_files_beside_them(tmp_path):
    writer = TensorWriter(tmp_path, max_shard_bytes=2 * 16 * 16 * 4)
    for i in range(3):
        writer.save(f"layer.{i}.weight", torch.randn(16, 16))
    writer.finalize()
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) == 2
    index_mode = (tmp_path / "model.safetensors.index.json").stat().st_mode & 0o777
    assert index_mode == 0o644
    assert [s.stat().st_mode & 0o777 for s in shards] == [index_mode] * 2
