"""Property-based tests over the parsers of user input.

Each property: the parser returns a valid object or raises the project's typed error
(`InputError` or a subclass), never anything else. CI runs `MLXKIT_HYPOTHESIS_EXAMPLES`
examples per property (default 150); RELIABILITY.md records a longer pass, e.g.
`MLXKIT_HYPOTHESIS_EXAMPLES=5000 pytest tests/test_reliability_properties.py`.
"""

from __future__ import annotations

import json
import math
import os
import struct

import numpy as np
import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from mlxkit.engines.core.sizes import parse_bytes  # noqa: E402
from mlxkit.engines.core.yaml_config import load_yaml_model  # noqa: E402
from mlxkit.engines.errors import InputError  # noqa: E402
from mlxkit.engines.io.safetensors_header import DTYPES, read_safetensors_header  # noqa: E402
from mlxkit.engines.puzzle.search.budgets import (Budgets, Throughput, parse_count, parse_memory_mib,  # noqa: E402
                                           parse_time_ms)
from mlxkit.engines.solve.validate import grid_shape, rhs_matrix, sparse_parts  # noqa: E402

EXAMPLES = int(os.environ.get("MLXKIT_HYPOTHESIS_EXAMPLES", "150"))
BOUNDED = settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= 150,
                   suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _typed_or_valid(parse, *args, check=lambda result: None, **kwargs):
    try:
        result = parse(*args, **kwargs)
    except InputError:
        return None
    check(result)
    return result


# ---------------------------------------------------------------------------------------------- safetensors

_counts = st.one_of(st.integers(0, 6), st.integers(-3, -1), st.integers(2**62, 2**64), st.floats(), st.text(max_size=3))
_entries = st.fixed_dictionaries(
    {"dtype": st.one_of(st.sampled_from(sorted(DTYPES)), st.text(max_size=4), st.integers()),
     "shape": st.one_of(st.lists(_counts, max_size=3), _counts),
     "data_offsets": st.one_of(st.lists(_counts, min_size=0, max_size=3), _counts)},
    optional={"extra": st.integers()})
_headers = st.dictionaries(st.text(max_size=6), st.one_of(_entries, st.integers(), st.text(max_size=3)), max_size=4)


def _valid_header(header) -> None:
    covered = sum(e.end - e.begin for e in header.tensors.values())
    assert covered == header.path.stat().st_size - header.data_start
    for entry in header.tensors.values():
        assert entry.end - entry.begin == DTYPES[entry.dtype][0] * math.prod(entry.shape)


@BOUNDED
@given(header=_headers, data_len=st.integers(0, 64), length_delta=st.sampled_from([0, 0, 0, -1, 1, 2**40]),
       metadata=st.one_of(st.none(), st.dictionaries(st.text(max_size=3), st.one_of(st.text(max_size=3), st.integers()),
                                                     max_size=2)))
def test_safetensors_header_from_json(tmp_path, header, data_len, length_delta, metadata):
    if metadata is not None:
        header = {**header, "__metadata__": metadata}
    body = json.dumps(header).encode()
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", max(0, len(body) + length_delta)) + body + bytes(data_len))
    _typed_or_valid(read_safetensors_header, path, check=_valid_header)


@BOUNDED
@given(blob=st.binary(max_size=96))
def test_safetensors_header_from_bytes(tmp_path, blob):
    path = tmp_path / "x.safetensors"
    path.write_bytes(blob)
    _typed_or_valid(read_safetensors_header, path, check=_valid_header)


@BOUNDED
@given(raw=st.binary(max_size=48), data_len=st.integers(0, 16))
def test_safetensors_header_raw_text(tmp_path, raw, data_len):
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(data_len))
    _typed_or_valid(read_safetensors_header, path, check=_valid_header)


# ---------------------------------------------------------------------------------------------- sparse npz

_small_ints = st.integers(-2, 6)
_arrays = st.one_of(
    st.lists(_small_ints, max_size=8).map(lambda v: np.array(v, dtype=np.int64)),
    st.lists(st.floats(allow_nan=True, allow_infinity=True, width=64), max_size=8).map(np.array),
    st.lists(_small_ints, max_size=4).map(lambda v: np.array(v, dtype=np.float32)),
    st.sampled_from([np.array(b"csr"), np.array(b"csc"), np.array(b"coo"), np.array(b"dia"), np.array(b"bsr"),
                     np.array("csr"), np.array(3), np.array([[1, 2], [3, 4]]), np.array([True, False]),
                     np.array([2**40, 2**40]), np.array([3, 3]), np.array([4, 4]), np.array([-1, 3]),
                     np.zeros((0,)), np.array(["a", "b"])]),
)
_sparse_keys = st.sampled_from(["format", "shape", "data", "indices", "indptr", "row", "col", "offsets", "b"])


@BOUNDED
@given(arrays=st.dictionaries(_sparse_keys, _arrays, max_size=7), square=st.booleans())
def test_sparse_parts(arrays, square):
    import scipy.sparse as sp

    def check(parts) -> None:
        assert all(int(n) >= 0 for n in parts.shape)

    parts = _typed_or_valid(sparse_parts, arrays, "fuzz.npz", square=square, check=check)
    if parts is not None:
        # What the checks accept, scipy itself builds, at the shape they reported.
        matrix = parts.to_csr()
        assert isinstance(matrix, sp.csr_matrix) and matrix.shape == tuple(int(n) for n in parts.shape)


@BOUNDED
@given(value=st.one_of(_arrays, st.text(max_size=12), st.tuples(st.integers(-3, 2**40), st.integers(-3, 2**40))),
       n=st.integers(0, 64))
def test_grid_shape(value, n):
    def check(shape) -> None:
        assert len(shape) == 2 and shape[0] >= 1 and shape[1] >= 1 and shape[0] * shape[1] == n

    _typed_or_valid(grid_shape, value, n, "fuzz", check=check)


@BOUNDED
@given(b=_arrays, n=st.integers(0, 8))
def test_rhs_matrix(b, n):
    def check(result) -> None:
        matrix, _ = result
        assert matrix.shape[0] == n and np.isfinite(matrix).all()

    _typed_or_valid(rhs_matrix, b, n, "fuzz", check=check)


# ---------------------------------------------------------------------------------------------- sizes, budgets

_unit_text = st.one_of(
    st.text(max_size=12),
    st.builds(lambda n, u: f"{n}{u}", st.one_of(st.integers(-10, 10**20), st.floats(allow_nan=True)),
              st.sampled_from(["", "b", "kb", "KiB", "MiB", "GiB", "TB", "tib", "x", "×", "ms", "s", "us", "min",
                               "K", "M", "B", "T", "tok/s", "tps", "k", " GiB", "e5", "e400"])),
)


@BOUNDED
@given(text=st.one_of(_unit_text, st.integers(-5, 2**70), st.floats(), st.booleans()))
def test_parse_bytes(text):
    _typed_or_valid(parse_bytes, text, check=lambda v: (isinstance(v, int) and 1 <= v <= 2**62) or pytest.fail(v))


def _finite_non_negative(value) -> None:
    assert isinstance(value, float) and math.isfinite(value) and value >= 0, value


@BOUNDED
@given(text=_unit_text)
def test_parse_memory_time_count(text):
    _typed_or_valid(parse_memory_mib, text, check=_finite_non_negative)
    _typed_or_valid(parse_time_ms, text, check=_finite_non_negative)
    _typed_or_valid(parse_count, text, check=_finite_non_negative)


@BOUNDED
@given(text=_unit_text)
def test_throughput(text):
    def check(t: Throughput) -> None:
        value = t.multiple if t.multiple is not None else t.tokens_per_s
        assert value is not None and math.isfinite(value) and value > 0, t

    _typed_or_valid(Throughput.parse, text, check=check)


@BOUNDED
@given(memory=st.one_of(st.none(), _unit_text), throughput=st.one_of(st.none(), _unit_text),
       latency=st.one_of(st.none(), _unit_text), params=st.one_of(st.none(), _unit_text))
def test_budgets(memory, throughput, latency, params):
    def check(budgets: Budgets) -> None:
        for value in budgets.constraints(256, parent_runtime_ms=10.0).values():
            assert math.isfinite(value) and value >= 0, budgets

    _typed_or_valid(Budgets.parse, memory=memory, throughput=throughput, latency=latency, params=params,
                    check=check)


# ---------------------------------------------------------------------------------------------- YAML recipes

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 10**6), st.floats(), st.text(max_size=6))
_yaml_values = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                               st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                            max_leaves=8)
_RECIPE_KEYS = ["name", "description", "search_space", "data", "bld", "scoring", "ffn_fractions", "kv_heads",
                "width_multiple", "seq_len", "train_sequences", "score_sequences", "tokens_per_block", "lr",
                "method", "objective", "lora", "htuning", "optim", "schedule", "loss", "steps", "batch_sequences"]


def _recipe_models():
    from mlxkit.engines.distill.recipe import DistillRecipe
    from mlxkit.engines.finetune.recipe import FinetuneRecipe
    from mlxkit.engines.puzzle.recipe import PuzzleRecipe

    return [PuzzleRecipe, DistillRecipe, FinetuneRecipe]


_recipe_docs = st.one_of(
    st.text(max_size=40),
    st.dictionaries(st.sampled_from(_RECIPE_KEYS), st.one_of(_yaml_values, st.dictionaries(
        st.sampled_from(_RECIPE_KEYS), _yaml_values, max_size=3)), max_size=4).map(
        lambda d: yaml.safe_dump(d, allow_unicode=True)),
)


@BOUNDED
@given(text=_recipe_docs, which=st.integers(0, 2))
def test_yaml_recipe_loading(text, which):
    model = _recipe_models()[which]
    _typed_or_valid(load_yaml_model, model, text, "recipe fuzz.yaml")


# ---------------------------------------------------------------------------------------------- GGUF, config.json, library

@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A valid GGUF of the tiny Llama (a path, so failure reports do not print its bytes)."""
    from conftest import make_char_tokenizer, make_tiny_llama
    from test_models_io import write_tiny_gguf

    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(make_tiny_llama(), make_char_tokenizer(), path)
    return path


# Mutations of a valid file: cut it short, or overwrite a few bytes (mostly in the header and
# metadata, where a parser decides how much to read and where).
_mutations = st.one_of(
    st.tuples(st.just("truncate"), st.floats(0, 1), st.binary(max_size=0)),
    st.tuples(st.just("overwrite"), st.one_of(st.floats(0, 0.05), st.floats(0, 1)), st.binary(min_size=1, max_size=8)),
)


def _mutate(blob: bytes, mutation) -> bytes:
    kind, where, data = mutation
    at = int(where * len(blob))
    if kind == "truncate":
        return blob[:at]
    return blob[:at] + data + blob[at + len(data):]


@settings(BOUNDED, max_examples=max(20, EXAMPLES // 3))
@given(mutation=_mutations)
def test_gguf_file(tmp_path_factory, tiny_gguf, mutation):
    """A mutated GGUF loads (a mutation in tensor data can still be a valid file) or is one typed error."""
    from mlxkit.engines.errors import MlxkitError
    from mlxkit.engines.models.loading import load_model

    path = tmp_path_factory.mktemp("mutated") / "model.gguf"
    path.write_bytes(_mutate(tiny_gguf.read_bytes(), mutation))
    try:
        load_model(str(path), with_tokenizer=False)
    except MlxkitError:
        pass


_config_values = st.one_of(st.none(), st.booleans(), st.integers(-2, 10**12), st.floats(), st.text(max_size=4),
                           st.lists(st.integers(-1, 4), max_size=3))
_CONFIG_KEYS = ["model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings", "rope_theta", "head_dim",
                "tie_word_embeddings", "rms_norm_eps", "rope_scaling", "architectures"]


@BOUNDED
@given(changes=st.dictionaries(st.sampled_from(_CONFIG_KEYS), _config_values, max_size=3),
       drop=st.lists(st.sampled_from(_CONFIG_KEYS), max_size=2), raw=st.one_of(st.none(), st.text(max_size=30)))
def test_config_json(tmp_path_factory, changes, drop, raw):
    """A config.json with changed, missing or unparseable fields: a config, or one typed error."""
    from mlxkit.engines.errors import MlxkitError
    from mlxkit.engines.models.loading import load_config

    config = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 256}
    config.update(changes)
    for key in drop:
        config.pop(key, None)
    path = tmp_path_factory.mktemp("config") / "config.json"
    path.write_text(raw if raw is not None else json.dumps(config))
    try:
        load_config(str(path))
    except MlxkitError:
        pass


_LIBRARY = os.path.join(os.path.dirname(__file__), "fixtures", "nvlabs_library_small.json")


def _replace_at(document, path: list[int], value):
    """`document` with the subtree reached by the index choices in `path` replaced by `value`."""
    if not path or not isinstance(document, (dict, list)) or not document:
        return value
    keys = list(document) if isinstance(document, dict) else list(range(len(document)))
    key = keys[path[0] % len(keys)]
    copy = dict(document) if isinstance(document, dict) else list(document)
    copy[key] = _replace_at(document[key], path[1:], value)
    return copy


@BOUNDED
@given(path=st.lists(st.integers(0, 50), max_size=5), value=_yaml_values)
def test_library_json(tmp_path_factory, path, value):
    """A block library (the NVlabs layout, converted on read) with one subtree replaced: a library or InputError."""
    from mlxkit.engines.puzzle.library.store import read_library

    with open(_LIBRARY) as handle:
        document = json.load(handle)
    target = tmp_path_factory.mktemp("library") / "library.json"
    target.write_text(json.dumps(_replace_at(document, path, value)))
    _typed_or_valid(read_library, target)
