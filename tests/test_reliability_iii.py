"""Reliability III: merge configs, overrides, YAML bounds, non-finite outputs, flags a mode ignores,
and corrupted caches.

Every CLI case must end in its documented exit code with exactly one `error:` line (or a notice
and a rebuilt result), no traceback, and nothing published. RELIABILITY.md lists the cases.
"""

from __future__ import annotations

import math
import os

import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from mlxkit.engines.core.yaml_config import (MAX_YAML_DEPTH, MAX_YAML_NODES, load_yaml,  # noqa: E402
                                             parse_overrides, with_overrides)
from mlxkit.engines.errors import InputError  # noqa: E402
from mlxkit.engines.merge.config import MergeConfig, config_from_options, validate_config  # noqa: E402

EXAMPLES = int(os.environ.get("MLXKIT_HYPOTHESIS_EXAMPLES", "60"))
BOUNDED = settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= 150,
                   suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


# ---------------------------------------------------------------------------------------------- bounded YAML


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _laughs(levels: int, fan: int = 9) -> str:
    """The billion-laughs shape: each anchor a list of `fan` aliases of the one before."""
    lines = ["l0: &l0 [lol]"]
    for i in range(1, levels + 1):
        lines.append(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * fan)}]")
    return "\n".join(lines) + "\n"


def _expanded(value, seen=None) -> int:
    """Nodes in `value` counted as a consumer walking it sees them (the independent count)."""
    if isinstance(value, dict):
        return 1 + sum(_expanded(k) + _expanded(v) for k, v in value.items())
    if isinstance(value, list):
        return 1 + sum(_expanded(v) for v in value)
    return 1


def test_yaml_depth_at_the_bound_loads_and_past_it_is_one_typed_error():
    assert load_yaml(_nested(MAX_YAML_DEPTH), "x") is not None
    assert load_yaml(_nested(MAX_YAML_DEPTH), "x") == yaml.safe_load(_nested(MAX_YAML_DEPTH))
    with pytest.raises(InputError, match="nested more than"):
        load_yaml(_nested(MAX_YAML_DEPTH + 1), "x")
    with pytest.raises(InputError, match="nested more than"):
        load_yaml(_nested(5000), "x")  # the plain safe loader ends in RecursionError here
    with pytest.raises(RecursionError):
        yaml.safe_load(_nested(5000))


def test_yaml_alias_expansion_is_counted_like_its_consumer_sees_it():
    small = _laughs(3)  # 1 + 9 + 81 + 729 leaves and lists: well inside the bound
    data = load_yaml(small, "x")
    assert data == yaml.safe_load(small)
    assert _expanded(data) < MAX_YAML_NODES
    with pytest.raises(InputError, match="aliases are expanded"):
        load_yaml(_laughs(9), "x")  # 9**9 nodes once expanded
    assert _expanded(yaml.safe_load(_laughs(5))) > MAX_YAML_NODES  # the bound is where the count says
    with pytest.raises(InputError, match="aliases are expanded"):
        load_yaml(_laughs(5), "x")


def test_yaml_alias_loops_and_size_are_refused():
    with pytest.raises(InputError, match="contains it"):
        load_yaml("a: &a [*a]", "x")
    with pytest.raises(InputError, match="larger than"):
        load_yaml("a: " + "x" * (1 << 20), "x")


@pytest.mark.parametrize("text", ["a: 2001-13-45", "a: " + "1" * 5000, "a: !!float 'x'", "a: [1, 2",
                                  "a: 1\n---\nb: 2", "? [1]\n: 2"])
def test_yaml_the_safe_constructor_refuses_is_one_typed_error(text):
    with pytest.raises(InputError):
        load_yaml(text, "cfg.yaml")


# ---------------------------------------------------------------------------------------------- fuzzing

_leaf = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.integers(2**62, 2**70),
                  st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
                  st.sampled_from(["mlp", "self_attn", "re:[", "*", "/tmp/r3/a", "0.5", "auto", "union", "base"]))
_json = st.recursive(_leaf, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                    st.dictionaries(st.one_of(st.text(max_size=5), st.integers(0, 2)),
                                                                    inner, max_size=3)), max_leaves=12)
_KEYS = ["models", "slices", "base_model", "merge_method", "parameters", "alpha", "alpha_grid", "dtype", "out_dtype",
         "tokenizer", "tokenizer_source", "chat_template", "max_shard_size", "seed", "eval_data", "embedding_pattern",
         "average_embeddings", "eval_tokens", "calibration_tokens", "data", "text_field"]
_METHODS = ["ties", "dare-ties", "linear", "slerp", "task-arithmetic", "iso-cts", "model-stock", "passthrough", "nosuch"]
_params = st.dictionaries(st.sampled_from(["weight", "density", "drop_rate", "epsilon", "lambda", "t", "common_frac",
                                           "normalize", "k", "gamma", "select_topk"]), _json, max_size=3)
_model_entry = st.one_of(st.fixed_dictionaries({"model": st.sampled_from(["a", "b", "c", "a/"])},
                                               optional={"parameters": st.one_of(_params, _json)}), _json)
_slice = st.fixed_dictionaries({"sources": st.one_of(st.lists(st.fixed_dictionaries(
    {"model": st.sampled_from(["a", "b"]), "layer_range": st.one_of(st.lists(st.integers(-1, 3), max_size=3), _json)},
    optional={"parameters": st.one_of(_params, _json)}), max_size=3), _json)})
_config = st.fixed_dictionaries({}, optional={
    "models": st.one_of(st.lists(_model_entry, max_size=3), _json),
    "slices": st.one_of(st.lists(_slice, max_size=2), _json),
    "merge_method": st.one_of(st.sampled_from(_METHODS), _json),
    "parameters": st.one_of(_params, _json),
    "base_model": st.one_of(st.sampled_from(["a", "base"]), _json),
    **{key: _json for key in _KEYS if key not in ("models", "slices", "merge_method", "parameters", "base_model")}})


def _merge_options(recipe: str, **flags) -> dict:
    base = dict(models=[], recipe=recipe, base=None, method=None, isotropic=False, alpha=None, eval_data=[],
                common_frac=None, params=[], average_embeddings=None, dtype=None, max_shard_size=None, seed=None)
    return {**base, **flags}


@BOUNDED
@given(data=_config, params=st.lists(st.text(max_size=12), max_size=2))
def test_mergekit_reader_gives_a_config_or_the_typed_error(tmp_path, data, params):
    """Dump the structure as YAML, read it as `mlx merge --config` does, with or without --param."""
    path = tmp_path / "cfg.yaml"
    try:
        path.write_text(yaml.safe_dump(data))
    except yaml.YAMLError:
        return
    try:
        config = config_from_options(**_merge_options(str(path), params=params))
    except InputError:
        return
    assert isinstance(config, MergeConfig)
    for value in (config.alpha, *(config.alpha_grid or [])):
        assert value == "auto" or math.isfinite(value)
    validate_config(yaml.safe_load(config.to_yaml()))  # what is saved with the output reads back


@BOUNDED
@given(text=st.text(alphabet=st.sampled_from(list("abmodels:-[]{}&*!|>\n ,0.5'\"#%@`?")), max_size=80))
def test_mergekit_reader_on_raw_text(tmp_path, text):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    try:
        config_from_options(**_merge_options(str(path)))
    except InputError:
        pass


_dotted = st.lists(st.sampled_from(["optim", "lr", "schedule", "steps", "tokens", "data", "seq_len", "loss",
                                    "", " ", "x", "0", "batch_sequences"]), min_size=0, max_size=3).map(".".join)
_raw_value = st.one_of(st.text(max_size=10), st.sampled_from(["1e-4", "nan", ".inf", "-.inf", "[1, 2]", "{a: 1}",
                                                             "&a [*a]", "[[[[", "null", "true", "2001-13-45",
                                                             "1" * 5000, "0x10", "1e999", "1.0e999"]),
                       st.floats(allow_nan=True).map(repr), st.integers().map(str))
_pairs = st.lists(st.one_of(st.tuples(_dotted, _raw_value).map("=".join), st.text(max_size=12)), max_size=4)


@BOUNDED
@given(pairs=_pairs)
def test_set_grammar_gives_overrides_or_the_typed_error(pairs):
    """`--set` pairs through the grammar and into a distill recipe: a recipe or `InputError`."""
    from mlxkit.engines.distill.recipe import load_distill_recipe

    try:
        overrides = parse_overrides(pairs)
    except InputError:
        return
    assert len(overrides) == len({p.partition("=")[0].strip() for p in pairs})
    recipe = load_distill_recipe("kd")
    try:
        changed = recipe.with_overrides(overrides)
    except InputError:
        return
    assert type(changed) is type(recipe)
    _all_numbers_finite(changed.model_dump())


def _all_numbers_finite(value, path="") -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _all_numbers_finite(v, f"{path}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _all_numbers_finite(v, f"{path}.{i}")
    elif isinstance(value, float):
        assert math.isfinite(value), path
