"""The shared safetensors header validator: every kind of corruption is one InputError naming the file."""

from __future__ import annotations

import json
import random
import struct

import pytest
import torch

from mlxkit.engines.errors import InputError
from mlxkit.engines.io import LazyTensorLoader, ShardedTensorIndex, read_safetensors_header, validate_safetensors_dir
from mlxkit.engines.io.safetensors_header import MAX_HEADER_BYTES


def _file(path, header, data: bytes = b"", length: int | None = None, raw_header: bytes | None = None):
    """Write a safetensors-shaped file: the length prefix, the header (a dict, or raw bytes), the data."""
    body = raw_header if raw_header is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body) if length is None else length) + body + data)
    return path


def _valid_parts():
    """A two-tensor header (F32 [2] then I64 [1]) and its 16 data bytes."""
    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              "b": {"dtype": "I64", "shape": [1], "data_offsets": [8, 16]}}
    return header, bytes(16)


def _with(**changes):
    header, data = _valid_parts()
    for name, entry in changes.items():
        header[name] = entry
    return header, data


_GOOD_A = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}

# (id, how to build the file, a phrase the error must contain)
CORRUPTIONS = [
    ("empty", lambda p: p.write_bytes(b""), "shorter than the 8-byte header length"),
    ("truncated-prefix", lambda p: p.write_bytes(b"\x10\x00\x00"), "shorter than the 8-byte header length"),
    ("header-length-huge", lambda p: _file(p, {}, length=MAX_HEADER_BYTES + 1), "above the"),
    ("header-length-past-end", lambda p: _file(p, {}, length=4096), "only 2 follow"),
    ("not-utf8", lambda p: _file(p, None, raw_header=b'{"\xff\xfe": 1}'), "not UTF-8"),
    ("not-json", lambda p: _file(p, None, raw_header=b'{"a": '), "not valid JSON"),
    ("non-string-key", lambda p: _file(p, None, raw_header=b'{1: {"dtype": "F32", "shape": [], '
                                                           b'"data_offsets": [0, 4]}}', data=bytes(4)),
     "not valid JSON"),
    ("header-is-list", lambda p: _file(p, [1, 2]), "not an object of tensor names"),
    ("header-is-string", lambda p: _file(p, "tensors"), "not an object of tensor names"),
    ("deeply-nested", lambda p: _file(p, None, raw_header=b"[" * 100_000 + b"]" * 100_000), "nests JSON too deeply"),
    ("duplicate-key", lambda p: _file(p, None, raw_header=b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": '
                                                          b'[0, 4]}, "a": {"dtype": "F32", "shape": [1], '
                                                          b'"data_offsets": [4, 8]}}', data=bytes(8)),
     "names 'a' twice"),
    ("metadata-not-strings", lambda p: _file(p, {"__metadata__": {"format": 1}, "a": _GOOD_A}, bytes(8)),
     "must map strings to strings"),
    ("entry-not-object", lambda p: _file(p, *_with(b=5)), "the entry for 'b' is a int"),
    ("missing-offsets", lambda p: _file(p, *_with(b={"dtype": "I64", "shape": [1]})), "has no data_offsets"),
    ("unknown-dtype", lambda p: _file(p, *_with(b={"dtype": "F7", "shape": [1], "data_offsets": [8, 16]})),
     "unknown dtype 'F7'"),
    ("dtype-not-string", lambda p: _file(p, *_with(b={"dtype": 64, "shape": [1], "data_offsets": [8, 16]})),
     "unknown dtype 64"),
    ("negative-shape", lambda p: _file(p, *_with(b={"dtype": "I64", "shape": [-1], "data_offsets": [8, 16]})),
     "shape [-1]"),
    ("float-shape", lambda p: _file(p, *_with(b={"dtype": "I64", "shape": [1.0], "data_offsets": [8, 16]})),
     "shape [1.0]"),
    ("bool-shape", lambda p: _file(p, *_with(b={"dtype": "I64", "shape": [True], "data_offsets": [8, 16]})),
     "shape [True]"),
    ("shape-not-list", lambda p: _file(p, *_with(b={"dtype": "I64", "shape": 1, "data_offsets": [8, 16]})),
     "a shape is a list"),
    ("offsets-wrong-length", lambda p: _file(p, *_with(b={"dtype": "I64", "shape": [1], "data_offsets": [8]})),
     "two non-negative integers"),
    ("negative-offset", lambda p: _file(p, *_with(a={"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]})),
     "two non-negative integers"),
    ("offsets-reversed", lambda p: _file(p, *_with(b={"dtype": "I64", "shape": [1], "data_offsets": [16, 8]})),
     "end before they begin"),
    ("offsets-past-end", lambda p: _file(p, *_with(b={"dtype": "I64", "shape": [1], "data_offsets": [16, 24]})),
     "has only 16 bytes"),
    ("span-mismatch", lambda p: _file(p, *_with(a={"dtype": "F32", "shape": [3], "data_offsets": [0, 8]})),
     "needs 12"),
    ("overlap", lambda p: _file(p, {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                    "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12)),
     "overlap"),
    ("gap", lambda p: _file(p, {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                                "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}, bytes(12)),
     "bytes 4..8 of the data region belong to no tensor"),
    ("trailing-bytes", lambda p: _file(p, *_valid_parts()[:1], bytes(20)), "last 4 bytes"),
    ("truncated-data", lambda p: _file(p, _valid_parts()[0], bytes(10)), "truncated"),
]


@pytest.mark.parametrize("build,phrase", [c[1:] for c in CORRUPTIONS], ids=[c[0] for c in CORRUPTIONS])
def test_each_corruption_is_one_input_error(tmp_path, build, phrase):
    path = tmp_path / "model.safetensors"
    build(path)
    with pytest.raises(InputError) as info:
        read_safetensors_header(path)
    message = str(info.value)
    assert str(path) in message and phrase in message and "\n" not in message


def test_valid_file_matches_the_reference_writer(tmp_path):
    from safetensors.torch import save_file

    tensors = {"w": torch.randn(3, 4), "h": torch.zeros(5, dtype=torch.float16), "empty": torch.zeros(0, 7),
               "i": torch.arange(6, dtype=torch.int32).reshape(2, 3), "scalar": torch.tensor(2.5, dtype=torch.bfloat16)}
    path = tmp_path / "ok.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    header = read_safetensors_header(path)
    assert header.metadata == {"format": "pt"} and set(header.tensors) == set(tensors)
    raw = path.read_bytes()
    for name, tensor in tensors.items():
        entry = header.tensors[name]
        assert entry.shape == tuple(tensor.shape) and entry.torch_dtype == str(tensor.dtype).removeprefix("torch.")
        assert entry.end - entry.begin == tensor.numel() * tensor.element_size()
        if tensor.numel():
            stored = torch.frombuffer(bytearray(raw[entry.begin:entry.end]), dtype=tensor.dtype)
            assert torch.equal(stored.reshape(tensor.shape), tensor)


def test_every_truncation_of_a_valid_file_is_refused(tmp_path):
    # a deterministic stand-in for a property test: no cut point gets past the validator
    header, data = _valid_parts()
    full = _file(tmp_path / "full.safetensors", header, data).read_bytes()
    cut = tmp_path / "cut.safetensors"
    for size in range(len(full)):
        cut.write_bytes(full[:size])
        with pytest.raises(InputError):
            read_safetensors_header(cut)


def test_random_header_bytes_give_input_error_or_a_consistent_header(tmp_path):
    # single-byte mutations of the header: either refused cleanly, or still a header that tiles the file
    header, data = _valid_parts()
    full = bytearray(_file(tmp_path / "full.safetensors", header, data).read_bytes())
    (length,) = struct.unpack("<Q", full[:8])
    rng = random.Random(0)
    path = tmp_path / "mutated.safetensors"
    for _ in range(300):
        mutated = bytearray(full)
        mutated[rng.randrange(0, 8 + length)] = rng.randrange(256)
        path.write_bytes(bytes(mutated))
        try:
            parsed = read_safetensors_header(path)
        except InputError:
            continue
        spans = sorted((e.begin, e.end) for e in parsed.tensors.values() if e.end > e.begin)
        assert spans[0][0] == parsed.data_start and spans[-1][1] == len(mutated)
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def test_loader_and_directory_validation_use_it(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    header, data = _valid_parts()
    _file(model / "model.safetensors", header, data[:12])  # truncated: a tensor runs past the end
    with pytest.raises(InputError, match="truncated"):
        ShardedTensorIndex.from_path(model)
    with pytest.raises(InputError, match="truncated"):
        validate_safetensors_dir(model)
    _file(model / "model.safetensors", header, data)
    validate_safetensors_dir(model)
    with LazyTensorLoader.from_path(model) as loader:
        assert loader.get_tensor("b").dtype == torch.int64


def test_broken_index_is_an_input_error(tmp_path):
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(2)}, str(tmp_path / "model-00001-of-00001.safetensors"))
    index = tmp_path / "model.safetensors.index.json"
    for text, phrase in [("{not json", "not valid JSON"), ('{"weight_map": [1]}', "no weight_map"),
                         ('{"weight_map": {"a": "../elsewhere.safetensors"}}', "outside its own directory"),
                         ('{"weight_map": {"b": "model-00001-of-00001.safetensors"}}', "does not hold it")]:
        index.write_text(text)
        with pytest.raises(InputError, match=phrase):
            ShardedTensorIndex.from_path(tmp_path)
