"""Validate a safetensors header against the file it describes, reading no tensor data.

A safetensors file is an 8-byte little-endian header length N, N bytes of UTF-8 JSON, then the
data region. The JSON maps each tensor name to `{"dtype", "shape", "data_offsets": [begin, end]}`
(offsets relative to the data region), plus an optional `"__metadata__"` of string to string.
The reference loader also requires the tensors to tile the data region exactly: no overlaps, no
gaps, no trailing bytes. Checking all of that up front turns a truncated download or a corrupt
shard into one error naming the file, instead of a crash or garbage values in the middle of a run.

Every verb that reads local safetensors goes through `read_safetensors_header` (the merge loader)
or `validate_safetensors_dir` (model loading for eval, distill and calibrate).
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxkit.engines.errors import InputError

# The reference implementation refuses headers above 100 MB; a real header is kilobytes per
# thousand tensors, so anything larger is corruption, and refusing it avoids a huge allocation.
MAX_HEADER_BYTES = 100_000_000
METADATA_KEY = "__metadata__"

# safetensors dtype code -> (bytes per element, torch dtype name)
DTYPES: dict[str, tuple[int, str]] = {
    "BOOL": (1, "bool"), "U8": (1, "uint8"), "I8": (1, "int8"),
    "F8_E4M3": (1, "float8_e4m3fn"), "F8_E5M2": (1, "float8_e5m2"),
    "U16": (2, "uint16"), "I16": (2, "int16"), "F16": (2, "float16"), "BF16": (2, "bfloat16"),
    "U32": (4, "uint32"), "I32": (4, "int32"), "F32": (4, "float32"),
    "U64": (8, "uint64"), "I64": (8, "int64"), "F64": (8, "float64"),
}


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor as the header describes it; `begin`/`end` are absolute offsets in the file."""

    name: str
    dtype: str          # safetensors code, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def torch_dtype(self) -> str:
        return DTYPES[self.dtype][1]


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path
    data_start: int                      # 8 + header length
    tensors: dict[str, HeaderEntry]      # in header order
    metadata: dict[str, str]


def read_safetensors_header(path: str | os.PathLike) -> SafetensorsHeader:
    """Parse and fully validate the header of `path`; raises `InputError` naming the file and the fault."""
    path = Path(path)

    def bad(problem: str) -> InputError:
        return InputError(f"'{path}' is not a valid safetensors file: {problem}")

    with open(path, "rb") as handle:
        file_size = os.fstat(handle.fileno()).st_size
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise bad(f"it is {file_size} bytes long, shorter than the 8-byte header length (truncated?)")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES:
            raise bad(f"the header length reads {length} bytes, above the {MAX_HEADER_BYTES}-byte limit")
        if 8 + length > file_size:
            raise bad(f"the header length reads {length} bytes but only {file_size - 8} follow (truncated?)")
        raw = handle.read(length)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad(f"the header is not UTF-8 (byte {exc.start})") from None
    try:
        header = json.loads(text, object_pairs_hook=_refuse_duplicate_keys)
    except _DuplicateKey as exc:
        raise bad(f"the header names '{exc.key}' twice") from None
    except ValueError as exc:  # json.JSONDecodeError, and non-string keys, which JSON cannot spell
        raise bad(f"the header is not valid JSON ({exc})") from None
    except RecursionError:
        raise bad("the header nests JSON too deeply to be a tensor table") from None
    if not isinstance(header, dict):
        raise bad(f"the header is a JSON {type(header).__name__}, not an object of tensor names")

    metadata = header.pop(METADATA_KEY, {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise bad(f"'{METADATA_KEY}' must map strings to strings")

    data_start = 8 + length
    data_size = file_size - data_start
    tensors = {name: _entry(name, value, data_start, data_size, bad) for name, value in header.items()}
    _check_tiling(tensors, data_start, data_size, bad)
    return SafetensorsHeader(path, data_start, tensors, metadata)


def validate_safetensors_dir(directory: str | os.PathLike) -> None:
    """Validate the header of every `*.safetensors` file directly inside `directory`.

    Called before handing a local checkpoint to transformers, whose own errors for a truncated
    or corrupt shard are tracebacks from the Rust reader or, worse, silently wrong weights.
    """
    directory = Path(directory)
    if directory.is_dir():
        for file in sorted(directory.glob("*.safetensors")):
            read_safetensors_header(file)


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json.loads would keep the last of two equal names silently, hiding one tensor's bytes.
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entry(name: str, value: Any, data_start: int, data_size: int, bad) -> HeaderEntry:
    if not isinstance(value, dict):
        raise bad(f"the entry for '{name}' is a {type(value).__name__}, not an object")
    missing = [key for key in ("dtype", "shape", "data_offsets") if key not in value]
    if missing:
        raise bad(f"the entry for '{name}' has no {', '.join(missing)}")
    dtype, shape, offsets = value["dtype"], value["shape"], value["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise bad(f"tensor '{name}' has unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise bad(f"tensor '{name}' has shape {shape!r}; a shape is a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        raise bad(f"tensor '{name}' has data_offsets {offsets!r}; they are two non-negative integers")
    begin, end = offsets
    if begin > end:
        raise bad(f"tensor '{name}' has data_offsets [{begin}, {end}], which end before they begin")
    if end > data_size:
        raise bad(f"tensor '{name}' ends at byte {end} of the data region, which has only {data_size} "
                  "bytes (truncated?)")
    expected = DTYPES[dtype][0] * math.prod(shape)
    if end - begin != expected:
        raise bad(f"tensor '{name}' spans {end - begin} bytes, but {dtype} x {shape} needs {expected}")
    return HeaderEntry(name, dtype, tuple(shape), data_start + begin, data_start + end)


def _check_tiling(tensors: dict[str, HeaderEntry], data_start: int, data_size: int, bad) -> None:
    """The non-empty spans must cover [0, data_size) exactly, in some order."""
    covered, previous = 0, None
    for entry in sorted((e for e in tensors.values() if e.end > e.begin), key=lambda e: e.begin):
        begin, end = entry.begin - data_start, entry.end - data_start
        if begin < covered:
            raise bad(f"tensors '{previous}' and '{entry.name}' overlap (bytes {begin}..{covered} of the data region)")
        if begin > covered:
            raise bad(f"bytes {covered}..{begin} of the data region belong to no tensor")
        covered, previous = end, entry.name
    if covered != data_size:
        raise bad(f"the last {data_size - covered} bytes of the file belong to no tensor")
