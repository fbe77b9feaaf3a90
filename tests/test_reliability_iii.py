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
                parameters={}, average_embeddings=None, dtype=None, max_shard_size=None, seed=None)
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
        config = config_from_options(**_merge_options(str(path), parameters=parse_overrides(params)))
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


# ---------------------------------------------------------------------------------------------- CLI cases

import json  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from conftest import TINY_PUZZLE_RECIPE, library_workspace, make_char_tokenizer, make_tiny_llama  # noqa: E402
from mlxkit.cli.main import app  # noqa: E402

runner = CliRunner()


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("reliability-iii")
    paths = {}
    for i, name in enumerate(["base", "a", "b"]):
        make_tiny_llama(seed=i).save_pretrained(root / name)
        make_char_tokenizer().save_pretrained(root / name)
        paths[name] = root / name
    loud = make_tiny_llama()
    with torch.no_grad():
        loud.lm_head.weight.mul_(1e5)  # finite weights whose logits put the NLL far past exp's range
    loud.save_pretrained(root / "loud")
    make_char_tokenizer().save_pretrained(root / "loud")
    built = library_workspace(root, paths["base"], "--keep-activations")
    return {"root": root, **paths, "loud": root / "loud", **built}


OUT = "{out}"


def _write(ws, name: str, text: str) -> str:
    path = ws["case"] / name
    path.write_text(text)
    return str(path)


def _merge_config(ws, tail: str) -> str:
    head = (f"merge_method: ties\nbase_model: {ws['base']}\nmodels:\n  - model: {ws['a']}\n"
            f"  - model: {ws['b']}\n")
    return _write(ws, "cfg.yaml", head + tail)


def _system(ws, scale_a: float, scale_b: float) -> str:
    """A 5x5-grid Laplacian scaled by `scale_a`, with b of ones scaled by `scale_b`."""
    import scipy.sparse as sp

    n = 5
    t = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(n, n))
    a = ((sp.kron(sp.eye(n), t) + sp.kron(t, sp.eye(n))) * scale_a).tocsr()
    path = ws["case"] / "sys.npz"
    np.savez(path, data=a.data, indices=a.indices, indptr=a.indptr, format=b"csr", shape=np.array(a.shape),
             b=np.ones(n * n) * scale_b)
    return str(path)


def _crt(ws, *extra: str) -> list[str]:
    config = _write(ws, "clf.json", json.dumps({"architecture": "mlp", "input_shape": [1, 4, 4], "num_classes": 3,
                                                 "hidden": [8]}))
    data = ws["case"] / "train.npz"
    np.savez(data, x=np.full((40, 1, 4, 4), 0.5, dtype=np.float32), y=np.arange(40) % 3)
    return ["finetune", "--recipe", "crt", "--model", config, "--data", str(data), "--attacks", "linf",
            "--out", OUT, *extra]


def _kd(ws, *extra: str) -> list[str]:
    return ["distill", "--kd", "--teacher", str(ws["base"]), "--student", str(ws["base"]), "--data",
            str(ws["text"]), "--tokens", "256", "--out", OUT, *extra]


def _bld(ws, *extra: str) -> list[str]:
    return ["distill", "--bld", "--model", str(ws["base"]), "--recipe", str(ws["recipe"]), "--data",
            str(ws["text"]), "--out", OUT, *extra]


def _profile(ws, **changes) -> str:
    from mlxkit.engines.core.yaml_config import packaged_yaml

    data = yaml.safe_load(packaged_yaml("mlxkit.hw_profiles", "cpu").read_text())
    data.update(changes)
    return _write(ws, "prof.yaml", yaml.safe_dump(data))


_DEEP = "[" * 3000 + "]" * 3000
_LAUGHS = _laughs(9)

# (id, args builder, exit code, words the error line must contain (case-insensitive))
CASES = [
    # ---- config and override values, checked by type before use
    ("merge-parameters-list", lambda w: ["merge", "--config", _merge_config(w, "parameters: [1, 2]\n"), "-o", OUT],
     2, ["parameters", "dictionary"]),
    ("merge-parameters-string", lambda w: ["merge", "--config", _merge_config(w, "parameters: hello\n"), "-o", OUT],
     2, ["parameters", "dictionary"]),
    ("merge-parameters-int", lambda w: ["merge", "--config", _merge_config(w, "parameters: 3\n"), "-o", OUT],
     2, ["parameters", "dictionary"]),
    ("merge-parameters-list-with-set", lambda w: ["merge", "--config", _merge_config(w, "parameters: [1]\n"),
                                                  "--set", "density=0.3", "-o", OUT], 2, ["parameters", "mapping"]),
    ("merge-model-parameters-int", lambda w: ["merge", "--config", _merge_config(w, "").replace(
        "", "") if False else _write(w, "cfg.yaml", f"merge_method: ties\nbase_model: {w['base']}\nmodels:\n"
                                                     f"  - model: {w['a']}\n    parameters: 7\n  - model: {w['b']}\n"),
        "-o", OUT], 2, ["models.0.parameters"]),
    ("merge-seed-bad-timestamp", lambda w: ["merge", "--config", _merge_config(w, "seed: 2001-13-45\n"), "-o", OUT],
     2, ["not valid yaml", "month"]),
    ("merge-seed-5000-digits", lambda w: ["merge", "--config", _merge_config(w, "seed: " + "1" * 5000 + "\n"),
                                          "-o", OUT], 2, ["not valid yaml"]),
    ("merge-calibration-tokens-without-data", lambda w: ["merge", "--method", "ties", str(w["a"]), str(w["b"]),
                                                         "--base", str(w["base"]), "--calibration-tokens", "100",
                                                         "-o", OUT], 2, ["calibration_tokens", "data"]),
    ("kd-set-twice", lambda w: _kd(w, "--set", "optim.lr=1e-4", "--set", "optim.lr=2e-4"), 2, ["optim.lr", "twice"]),
    ("kd-set-empty-key-part", lambda w: _kd(w, "--set", "optim..lr=1e-4"), 2, ["optim..lr"]),
    ("kd-set-section-as-number", lambda w: _kd(w, "--set", "optim=5"), 2, ["optim"]),
    ("kd-set-lr-inf", lambda w: _kd(w, "--set", "optim.lr=.inf"), 2, ["optim.lr"]),
    ("kd-set-value-deep", lambda w: _kd(w, "--set", f"optim.lr={_DEEP}"), 2, ["optim.lr", "nested more than"]),
    ("bld-recipe-lr-inf", lambda w: _bld(w)[:5] + [_write(w, "r.yaml", TINY_PUZZLE_RECIPE.replace(
        "lr: 1.0e-3", "lr: .inf"))] + _bld(w)[6:], 2, ["bld.lr", "finite"]),
    ("bld-recipe-weight-decay-inf", lambda w: _bld(w)[:5] + [_write(w, "r.yaml", TINY_PUZZLE_RECIPE.replace(
        "lr: 1.0e-3", "lr: 1.0e-3, weight_decay: .inf"))] + _bld(w)[6:], 2, ["bld.weight_decay"]),
    ("profile-bandwidth-inf", lambda w: ["search", "--costs-only", "--model", str(w["base"]), "--target",
                                         _profile(w, memory_bandwidth_gbs=float("inf"))], 2, ["memory_bandwidth_gbs"]),
    ("profile-peak-nan", lambda w: ["search", "--costs-only", "--model", str(w["base"]), "--target",
                                    _profile(w, peak_tflops={"fp32": float("nan")})], 2, ["peak_tflops"]),
    # ---- YAML bounds
    ("merge-config-deep", lambda w: ["merge", "--config", _write(w, "deep.yaml", f"models: {_DEEP}\n"), "-o", OUT],
     2, ["deep.yaml", "nested more than 64"]),
    ("merge-config-laughs", lambda w: ["merge", "--config", _write(w, "lol.yaml", _LAUGHS), "-o", OUT],
     2, ["lol.yaml", "aliases are expanded"]),
    ("merge-config-alias-loop", lambda w: ["merge", "--config", _write(w, "loop.yaml", "models: &m [*m]\n"),
                                           "-o", OUT], 2, ["contains it"]),
    ("merge-config-huge", lambda w: ["merge", "--config", _write(w, "big.yaml", "# " + "x" * (2 << 20) + "\n"),
                                     "-o", OUT], 2, ["larger than 1 mib"]),
    ("merge-config-not-utf8", lambda w: ["merge", "--config", str(_binary(w, "bin.yaml")), "-o", OUT],
     2, ["utf-8"]),
    ("bld-recipe-deep", lambda w: _bld(w)[:5] + [_write(w, "r.yaml", f"name: {_DEEP}\n")] + _bld(w)[6:], 2,
     ["nested more than"]),
    ("search-profile-laughs", lambda w: ["search", "--costs-only", "--model", str(w["base"]), "--target",
                                         _write(w, "p.yaml", _LAUGHS)], 2, ["aliases are expanded"]),
    # ---- non-finite results: their own exit code, nothing written
    ("solve-x-overflows", lambda w: ["solve", _system(w, 1e-300, 1e300), "--method", "superlu", "--out", OUT],
     8, ["nan or infinite", "float64"]),
    ("solve-x-overflows-ssi", lambda w: ["solve", _system(w, 1e-300, 1e300), "--out", OUT], 8, ["nan or infinite"]),
    ("solve-float32-range", lambda w: ["solve", _system(w, 1e300, 1.0), "--precision", "float32", "--out", OUT],
     2, ["float32", "--precision float64"]),
    ("eval-perplexity-overflows", lambda w: ["eval", str(w["loud"]), "--data", str(w["text"]), "--max-tokens", "256"],
     8, ["perplexity", "float64"]),
    # ---- options a mode would ignore
    ("bld-tokens", lambda w: _bld(w, "--tokens", "100"), 2, ["--tokens", "distill --bld", "distill --kd"]),
    ("bld-set", lambda w: _bld(w, "--set", "bld.lr=1e-3"), 2, ["--set", "distill --bld"]),
    ("bld-sharding", lambda w: _bld(w, "--sharding", "none"), 2, ["--sharding", "distill --bld"]),
    ("bld-overwrite", lambda w: _bld(w, "--overwrite"), 2, ["--overwrite", "distill --bld"]),
    ("bld-teacher", lambda w: _bld(w, "--teacher", str(w["a"])), 2, ["--teacher", "distill --bld"]),
    ("kd-model", lambda w: _kd(w, "--model", str(w["a"])), 2, ["--model", "distill --kd", "distill --bld"]),
    ("kd-score-only", lambda w: _kd(w, "--score-only"), 2, ["--score-only", "distill --kd"]),
    ("kd-keep-activations", lambda w: _kd(w, "--keep-activations"), 2, ["--keep-activations", "distill --kd"]),
    ("crt-dtype", lambda w: _crt(w, "--dtype", "bf16"), 2, ["--dtype", "finetune --recipe crt"]),
    ("crt-save-dtype", lambda w: _crt(w, "--save-dtype", "bf16"), 2, ["--save-dtype", "finetune --recipe crt"]),
    ("crt-sharding", lambda w: _crt(w, "--sharding", "none"), 2, ["--sharding", "finetune --recipe crt"]),
    ("crt-text-field", lambda w: _crt(w, "--text-field", "body"), 2, ["--text-field", "finetune --recipe crt"]),
    ("crt-merge", lambda w: _crt(w, "--merge"), 2, ["--merge", "finetune --recipe crt"]),
    ("lora-new-attack", lambda w: ["finetune", "--recipe", "lora", "--model", str(w["base"]), "--data",
                                   str(w["text"]), "--new-attack", "l2", "--out", OUT], 2,
     ["--new-attack", "it is for finetune --recipe crt"]),
    ("costs-only-library", lambda w: ["search", "--costs-only", "--model", str(w["base"]), "--target", "cpu",
                                      "--library", str(w["lib"])], 2, ["--library", "search --costs-only"]),
    ("costs-only-device", lambda w: ["search", "--costs-only", "--model", str(w["base"]), "--target", "cpu",
                                     "--device", "cpu"], 2, ["--device", "search --costs-only"]),
    ("costs-only-write-lp", lambda w: ["search", "--costs-only", "--model", str(w["base"]), "--target", "cpu",
                                       "--write-lp", OUT], 2, ["--write-lp"]),
    ("search-gkd-set-alone", lambda w: ["search", "--library", str(w["lib"]), "--target", "cpu", "--model",
                                        str(w["base"]), "--set", "optim.lr=1e-4", "--out", OUT], 2,
     ["--set", "without --gkd-tokens"]),
    ("search-gkd-recipe-alone", lambda w: ["search", "--library", str(w["lib"]), "--target", "cpu", "--dry-run",
                                           "--gkd-recipe", "kd"], 2, ["--gkd-recipe", "without --gkd-tokens"]),
    ("search-sharding-alone", lambda w: ["search", "--library", str(w["lib"]), "--target", "cpu", "--dry-run",
                                         "--sharding", "none"], 2, ["--sharding", "without --gkd-tokens"]),
    ("search-dry-run-out", lambda w: ["search", "--library", str(w["lib"]), "--target", "cpu", "--dry-run",
                                      "--out", OUT], 2, ["--out", "--dry-run"]),
    ("merge-dry-run-check", lambda w: ["merge", "--method", "ties", str(w["a"]), str(w["b"]), "--base",
                                       str(w["base"]), "--dry-run", "--check", str(w["text"])], 2,
     ["--check", "--dry-run"]),
    ("solve-superlu-dtype", lambda w: ["solve", _system(w, 1.0, 1.0), "--method", "superlu", "--precision", "float32",
                                       "--out", OUT], 2, ["--precision", "solve --method superlu|pardiso"]),
    ("solve-superlu-leaf", lambda w: ["solve", _system(w, 1.0, 1.0), "--method", "superlu", "--leaf", "8",
                                      "--out", OUT], 2, ["--leaf"]),
    ("solve-superlu-grid", lambda w: ["solve", _system(w, 1.0, 1.0), "--method", "superlu", "--grid", "5x5",
                                      "--out", OUT], 2, ["--grid"]),
    ("eval-seed-with-data", lambda w: ["eval", str(w["base"]), "--data", str(w["text"]), "--seed", "3"], 2,
     ["--seed", "with --data"]),
    ("eval-text-field-without-data", lambda w: ["eval", str(w["base"]), "--text-field", "body"], 2,
     ["--text-field", "without --data"]),
]


def _binary(ws, name: str) -> Path:
    path = ws["case"] / name
    path.write_bytes(b"models: \xff\xfe\n")
    return path


def _snapshot(root: Path) -> dict[Path, str]:
    import hashlib

    return {p: "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*")}


@pytest.mark.parametrize("name,build,code,must", CASES, ids=[c[0] for c in CASES])
def test_case_is_one_error_line_with_its_exit_code(ws, tmp_path, name, build, code, must):
    case = tmp_path / "case"
    case.mkdir()
    out = tmp_path / "out"
    args = [a.replace(OUT, str(out)) for a in build(dict(ws, case=case))]
    before = _snapshot(case)
    result = runner.invoke(app, args)
    assert result.exit_code == code, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    for word in must:
        assert word.lower() in lines[0].lower(), lines[0]
    assert not list(tmp_path.glob("out*")) and not [p for p in tmp_path.rglob("*") if ".tmp-" in p.name]
    assert _snapshot(case) == before


def test_an_option_a_mode_reads_is_not_refused_at_its_default_or_typed(ws, tmp_path):
    """The check refuses what a mode ignores, never what it reads: a BLD run typing its own defaults runs."""
    out = tmp_path / "lib"
    shutil.copytree(ws["lib"], out)
    result = runner.invoke(app, [*_bld(ws)[:-2], "--out", str(out), "--score-only", "--seed", "0", "--device", "cpu",
                                 "--quiet"])
    assert result.exit_code == 0, result.output


def test_solve_of_a_scaled_system_is_checked_and_the_finite_one_still_solves(ws, tmp_path):
    """1e300 in A and b: x near 1 is finite and is written; 1e-300 in A: x passes float64 and nothing is."""
    from mlxkit.engines.solve.runner import run_solve

    case = tmp_path / "case"
    case.mkdir()
    path = _system(dict(ws, case=case), 1e300, 1e300)
    report, x = run_solve(path, method="superlu", out=tmp_path / "x.npz")
    assert np.isfinite(x).all() and report["residual"] < 1e-12
    import scipy.sparse as sp

    n = 5
    t = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(n, n))
    reference = sp.linalg.spsolve((sp.kron(sp.eye(n), t) + sp.kron(t, sp.eye(n))).tocsc(), np.ones(n * n))
    assert np.allclose(x.ravel(), reference, rtol=1e-10)  # the scales cancel: same x as the unscaled system


def test_saved_weights_are_checked_after_the_cast(tmp_path):
    """A finite float32 weight past 65504 is infinite in float16: save_model refuses and leaves nothing."""
    from mlxkit.engines.core.manifest import Manifest
    from mlxkit.engines.errors import NonFiniteError
    from mlxkit.engines.models.saving import save_model

    model = make_tiny_llama()
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = 1e5
    with pytest.raises(NonFiniteError, match="down_proj"):
        save_model(model, None, tmp_path / "out", Manifest(verb="test"), dtype=torch.float16)
    assert list(tmp_path.iterdir()) == []
    model = make_tiny_llama()
    save_model(model, None, tmp_path / "ok", Manifest(verb="test"), dtype=torch.float16)
    assert all(torch.isfinite(t).all() for t in load_file(tmp_path / "ok" / "model.safetensors").values())


def test_a_checkpoint_with_a_nan_weight_is_not_written(tmp_path):
    from mlxkit.engines.errors import NonFiniteError
    from mlxkit.engines.training.checkpoint import TrainingState, save_checkpoint

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    with torch.no_grad():
        model.weight[1, 2] = float("nan")
    with pytest.raises(NonFiniteError, match="weight"):
        save_checkpoint(tmp_path / "checkpoint", model, optimizer, TrainingState(3, 0, 0, {}))
    assert not (tmp_path / "checkpoint").exists()


def test_every_float_of_every_packaged_recipe_and_profile_refuses_inf_and_nan():
    """Walk each packaged YAML's validated values; each float, set to inf, -inf or nan, is an error naming it."""
    import copy
    from importlib import resources

    from mlxkit.engines.core.yaml_config import read_yaml_mapping, validate_model
    from mlxkit.engines.distill.recipe import DistillRecipe
    from mlxkit.engines.finetune.recipe import FinetuneRecipe
    from mlxkit.engines.hardware.profile import HardwareProfile
    from mlxkit.engines.puzzle.recipe import PuzzleRecipe
    from mlxkit.engines.robust.recipe import CrtRecipe

    def floats(value, path=()):
        if isinstance(value, dict):
            for k, v in value.items():
                yield from floats(v, (*path, k))
        elif isinstance(value, list):
            for i, v in enumerate(value):
                yield from floats(v, (*path, i))
        elif isinstance(value, float):
            yield path

    checked = 0
    for package, schema in [("mlxkit.recipes.puzzle", PuzzleRecipe), ("mlxkit.recipes.distill", DistillRecipe),
                            ("mlxkit.recipes.finetune", None), ("mlxkit.hw_profiles", HardwareProfile)]:
        for item in resources.files(package).iterdir():
            if not item.name.endswith(".yaml"):
                continue
            model = schema or (CrtRecipe if item.name == "crt.yaml" else FinetuneRecipe)
            data = validate_model(model, read_yaml_mapping(item.read_text(), item.name), item.name).model_dump()
            for path in floats(data):
                for bad in (math.inf, -math.inf, math.nan):
                    broken = copy.deepcopy(data)
                    node = broken
                    for key in path[:-1]:
                        node = node[key]
                    node[path[-1]] = bad
                    with pytest.raises(InputError, match=str(path[0])):
                        validate_model(model, broken, item.name)
                    checked += 1
    assert checked > 100


# ---------------------------------------------------------------------------------------------- corrupted caches


def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _notices(result) -> str:
    return result.stderr.lower()


@pytest.mark.parametrize("how", ["cut", "garbage"])
def test_sampled_calibration_tokens_damaged_between_runs_are_sampled_again(ws, tmp_path, how):
    args = ["eval", str(ws["base"]), "--max-tokens", "512", "--json"]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    (cached,) = (Path(os.environ["MLXKIT_CACHE"]) / "calibration").glob("*.pt")
    _cut(cached) if how == "cut" else cached.write_bytes(b"not a tensor file\n")
    second = runner.invoke(app, args)
    assert second.exit_code == 0, second.output
    assert "unreadable" in _notices(second) and "sampling them again" in _notices(second)
    assert json.loads(second.stdout)["perplexity"] == json.loads(first.stdout)["perplexity"]


def test_sampled_calibration_tokens_outside_the_vocabulary_are_sampled_again(ws, tmp_path):
    args = ["eval", str(ws["base"]), "--max-tokens", "512", "--json"]
    first = runner.invoke(app, args)
    (cached,) = (Path(os.environ["MLXKIT_CACHE"]) / "calibration").glob("*.pt")
    pool = torch.load(cached, weights_only=True)
    torch.save(pool + 10_000, cached)  # loads fine: only the ids say it is not this model's
    second = runner.invoke(app, args)
    assert second.exit_code == 0 and "outside the vocabulary" in _notices(second)
    assert json.loads(second.stdout)["perplexity"] == json.loads(first.stdout)["perplexity"]


def test_merge_statistics_damaged_between_runs_are_computed_again(ws, tmp_path):
    args = ["merge", "--method", "regmean", str(ws["a"]), str(ws["b"]), "--data", str(ws["text"]),
            "--calibration-tokens", "256", "--no-check"]
    assert runner.invoke(app, [*args, "-o", str(tmp_path / "m1"), "--quiet"]).exit_code == 0
    stored = sorted((Path(os.environ["MLXKIT_CACHE"]) / "merge-statistics").glob("*.safetensors"))
    assert len(stored) == 2
    _cut(stored[0])
    second = runner.invoke(app, [*args, "-o", str(tmp_path / "m2")])
    assert second.exit_code == 0, second.output
    assert "unreadable" in _notices(second) and "computing them again" in _notices(second)
    one, two = load_file(tmp_path / "m1" / "model.safetensors"), load_file(tmp_path / "m2" / "model.safetensors")
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)


def _library_copy(ws, tmp_path) -> Path:
    out = tmp_path / "lib"
    shutil.copytree(ws["lib"], out)
    return out


def _scores(lib: Path) -> dict:
    return {p.name: json.loads(p.read_text()) for p in sorted((lib / "scores").glob("*.json"))}


def test_bld_tokens_damaged_between_runs_are_made_again_and_the_scores_agree(ws, tmp_path):
    lib = _library_copy(ws, tmp_path)
    before = _scores(lib)
    for path in (lib / "scores").glob("*.json"):
        path.unlink()  # so --score-only scores again from the remade tokens
    (lib / ".work" / "tokens.pt").write_bytes(b"garbage")
    result = runner.invoke(app, [*_bld(ws)[:-2], "--out", str(lib), "--score-only", "--keep-activations"])
    assert result.exit_code == 0, result.output
    assert "calibration tokens" in _notices(result) and "making them again" in _notices(result)
    after = _scores(lib)
    assert after.keys() == before.keys()
    for name in before:
        assert after[name] == pytest.approx(before[name], rel=1e-5), name


@pytest.mark.parametrize("what", ["library.json", "block record"])
def test_library_files_damaged_between_runs_are_one_clean_error(ws, tmp_path, what):
    lib = _library_copy(ws, tmp_path)
    target = lib / "library.json" if what == "library.json" else sorted((lib / "blocks").glob("*.json"))[0]
    _cut(target)
    for args in (["search", "--library", str(lib), "--target", "cpu", "--dry-run"],
                 [*_bld(ws)[:-2], "--out", str(lib), "--score-only"]):
        result = runner.invoke(app, args)
        if result.exit_code == 0:  # a reader that does not need the file must not have used it
            assert what == "block record" and args[0] == "search"
            continue
        lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert result.exit_code == 2 and len(lines) == 1 and target.name in lines[0], result.output


@pytest.mark.parametrize("damage", ["state-cut", "state-list", "state-no-step", "optimizer-garbage",
                                    "weights-cut"])
def test_a_damaged_checkpoint_is_one_clean_error(ws, tmp_path, damage):
    from mlxkit.engines.training.checkpoint import (OPTIMIZER, STATE, WEIGHTS, TrainingState, load_checkpoint,
                                                    save_checkpoint)

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    save_checkpoint(tmp_path / "ck", model, optimizer, TrainingState(3, 10, 2, {}))
    assert load_checkpoint(tmp_path / "ck", model, optimizer).step == 3
    files = {"state": tmp_path / "ck" / STATE, "optimizer": tmp_path / "ck" / OPTIMIZER,
             "weights": tmp_path / "ck" / WEIGHTS}
    part, how = damage.split("-", 1)
    if how == "cut":
        _cut(files[part])
    elif how == "list":
        files[part].write_text("[1, 2]")
    elif how == "no-step":
        files[part].write_text(json.dumps({"tokens_seen": 1, "log_lines": 0}))
    else:
        files[part].write_bytes(b"garbage")
    with pytest.raises(InputError, match="cannot be resumed"):
        load_checkpoint(tmp_path / "ck", model, optimizer)


@pytest.mark.parametrize("damage", ["layer-cut", "layer-garbage", "final-cut"])
def test_bld_activations_damaged_between_runs_are_computed_again_and_the_scores_agree(ws, tmp_path, damage):
    lib = _library_copy(ws, tmp_path)
    before = _scores(lib)
    for path in (lib / "scores").glob("*.json"):
        path.unlink()
    states = lib / ".work" / "activations"
    target = states / ("final.safetensors" if damage.startswith("final") else "layer001.safetensors")
    _cut(target) if damage.endswith("cut") else target.write_bytes(b"garbage")
    result = runner.invoke(app, [*_bld(ws)[:-2], "--out", str(lib), "--score-only", "--keep-activations"])
    assert result.exit_code == 0, result.output
    assert "parent activations" in _notices(result) and "computing them again" in _notices(result)
    assert target.name in result.stderr
    after = _scores(lib)
    assert after.keys() == before.keys()
    for name in before:
        assert after[name] == pytest.approx(before[name], rel=1e-5), name


def test_gkd_token_shards_damaged_between_runs_are_tokenised_again(ws, tmp_path):
    small = ("--set", "data.seq_len=32", "--set", "data.held_out_sequences=2", "--set", "optim.batch_sequences=4")
    first = runner.invoke(app, [a.replace(OUT, str(tmp_path / "one")) for a in _kd(ws, *small, "--quiet")])
    assert first.exit_code == 0, first.output
    (shard,) = (Path(os.environ["MLXKIT_CACHE"]) / "token-shards").glob("*/shard-*.bin")
    data = bytearray(shard.read_bytes())
    data[:8] = bytes(8)  # the same size, so only the manifest's hash tells
    shard.write_bytes(bytes(data))
    second = runner.invoke(app, [a.replace(OUT, str(tmp_path / "two")) for a in _kd(ws, *small)])
    assert second.exit_code == 0, second.output
    assert "token shards" in _notices(second) and "tokenising the data again" in _notices(second)
    one, two = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
