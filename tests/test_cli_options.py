"""The shared option layer: which verbs take --device/--dtype/--save-dtype, one --set, and the older spellings."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from mlxkit.cli.main import app
from test_merge_common import make_base, make_finetune

runner = CliRunner()

# --dtype is the compute dtype; merge always computes in float32 and solve names its working precision.
COMPUTING = ["search", "library build", "distill", "finetune", "eval", "calibrate"]
WRITES_WEIGHTS = ["search", "library build", "distill", "finetune", "merge"]
# export streams tensors from file to file and never runs a model; fetch and recipes compute nothing.
NOT_COMPUTING = ["export", "fetch", "recipes"]


def _help(verb: str) -> str:
    result = runner.invoke(app, [*verb.split(), "--help"], env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"})
    assert result.exit_code == 0, result.output
    return result.output


def _flags(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text))


@pytest.mark.parametrize("verb", [*COMPUTING, "merge", "solve"])
def test_computing_verbs_list_device_and_dtype(verb):
    flags = _flags(_help(verb))
    assert {"--device", "--json", "--quiet", "--verbose"} <= flags
    assert ("--dtype" in flags) == (verb in COMPUTING)
    assert ("--save-dtype" in flags) == (verb in WRITES_WEIGHTS)
    assert ("--precision" in flags) == (verb == "solve")


@pytest.mark.parametrize("verb", ["export", "search"])
def test_export_encoding_has_its_own_name(verb):
    flags = _flags(_help(verb))
    assert "--encoding" in flags and "--export-dtype" not in flags
    assert verb == "search" or "--dtype" not in flags


@pytest.mark.parametrize("verb", ["search", "library build", "distill", "finetune", "eval"])
def test_the_dtype_rule_is_in_help(verb):
    text = " ".join(_help(verb).split())
    for phrase in ("auto (bfloat16 on a GPU that supports it, float32 on a CPU)", "float32 master weights",
                   "losses in float32", "CUDA when available, else CPU"):
        assert phrase in re.sub(r"[│ ]+", " ", text), (verb, phrase)


@pytest.mark.parametrize("verb", NOT_COMPUTING)
def test_verbs_that_do_not_compute_have_no_device(verb):
    assert "--device" not in _flags(_help(verb))


@pytest.mark.parametrize("verb,aliases", [("search", {"--set", "--gkd-set"}), ("distill", {"--set"}),
                                          ("finetune", {"--set"}), ("merge", {"--set", "--param"})])
def test_one_set_option_per_verb(verb, aliases):
    assert aliases <= _flags(_help(verb))


def test_merge_names_out_and_keeps_output():
    flags = _flags(_help("merge"))
    assert {"--out", "--output", "--save-dtype"} <= flags


# ---- the aliases reach the same option -------------------------------------------------------------------

def _capture(monkeypatch, module: str, name: str, result: dict) -> list:
    seen: list = []

    def fake(options, *args, **kwargs):
        seen.append((options, args, kwargs))
        return result

    monkeypatch.setattr(f"{module}.{name}", fake)
    return seen


def test_search_set_and_gkd_set_are_one_option(monkeypatch, tmp_path):
    seen = _capture(monkeypatch, "mlxkit.engines.puzzle.search.run", "run_search", {"ok": True})
    result = runner.invoke(app, ["search", "--target", "cpu", "--out", str(tmp_path / "c"), "--gkd-set",
                                 "optim.lr=0.001", "--set", "data.seq_len=32", "--gkd-tokens", "64", "--device", "cpu", "--dtype",
                                 "bfloat16", "--save-dtype", "float16", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"ok": True}
    options = seen[0][0]
    assert options.gkd_overrides == {"optim.lr": 0.001, "data.seq_len": 32}
    assert (options.device, options.dtype, options.save_dtype) == ("cpu", "bfloat16", "float16")


def test_search_defaults_are_auto(monkeypatch, tmp_path):
    seen = _capture(monkeypatch, "mlxkit.engines.puzzle.search.run", "run_search", {})
    assert runner.invoke(app, ["search", "--target", "cpu", "--out", str(tmp_path / "c"), "--json"]).exit_code == 0
    options = seen[0][0]
    assert (options.device, options.dtype, options.save_dtype) == ("auto", "auto", None)


@pytest.mark.parametrize("flag", ["--set", "--gkd-set"])
def test_search_override_without_value_is_a_usage_error(flag):
    result = runner.invoke(app, ["search", "--target", "cpu", flag, "nokey"])
    assert result.exit_code == 2 and "takes key=value (got 'nokey')" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_distill_passes_placement_and_set(monkeypatch, tmp_path, text_file):
    seen = _capture(monkeypatch, "mlxkit.engines.distill.trainer", "run_distillation", {"done": 1})
    result = runner.invoke(app, ["distill", "--kd", "--teacher", "t", "--student", "s", "--data", str(text_file),
                                 "--out", str(tmp_path / "o"), "--set", "optim.lr=0.002", "--device", "cpu",
                                 "--dtype", "float32", "--save-dtype", "bfloat16", "--json"])
    assert result.exit_code == 0, result.output
    options = seen[0][0]
    assert options.recipe.optim.lr == 0.002
    assert (options.device, options.dtype, options.save_dtype) == ("cpu", "float32", "bfloat16")


def test_library_build_passes_placement(monkeypatch, tmp_path):
    seen = _capture(monkeypatch, "mlxkit.engines.puzzle.library.build", "run_library_build", {"done": 1})
    result = runner.invoke(app, ["library", "build", "--out", str(tmp_path / "lib"), "--device", "cpu", "--dtype",
                                 "bf16", "--json"])
    assert result.exit_code == 0, result.output
    assert (seen[0][0].device, seen[0][0].dtype, seen[0][0].save_dtype) == ("cpu", "bf16", None)


def test_finetune_passes_placement(monkeypatch, tmp_path, text_file):
    seen = _capture(monkeypatch, "mlxkit.engines.finetune.trainer", "run_finetune", {"done": 1})
    result = runner.invoke(app, ["finetune", "--data", str(text_file), "--out", str(tmp_path / "o"), "--set",
                                 "optim.lr=0.003", "--device", "cpu", "--dtype", "float16", "--json"])
    assert result.exit_code == 0, result.output
    options = seen[0][0]
    assert options.recipe.optim.lr == 0.003
    assert (options.device, options.dtype, options.save_dtype) == ("cpu", "float16", None)


@pytest.mark.parametrize("verb", ["search", "distill", "finetune", "eval", "calibrate"])
def test_unknown_dtype_is_a_usage_error(verb, tmp_path, text_file):
    args = {"search": ["search", "--target", "cpu"], "eval": ["eval", "m"],
            "distill": ["distill", "--kd", "--teacher", "t", "--student", "s", "--out", str(tmp_path / "o")],
            "finetune": ["finetune", "--data", str(text_file), "--out", str(tmp_path / "o")],
            "calibrate": ["calibrate", "--out", str(tmp_path / "p.yaml")]}[verb]
    result = runner.invoke(app, [*args, "--dtype", "float8"])
    assert result.exit_code == 2 and "unknown dtype 'float8'" in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def merge_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("options-merge")
    base = make_base(root / "base")
    return base, [make_finetune(base, root / f"ft{i}", seed=50 + i) for i in range(2)]


@pytest.mark.parametrize("spelling", [["--param", "density=0.4"], ["--set", "density=0.4"]])
@pytest.mark.parametrize("out_flag", ["-o", "--out", "--output"])
def test_merge_aliases(tmp_path, merge_models, spelling, out_flag):
    base, fts = merge_models
    out = tmp_path / "merged"
    result = runner.invoke(app, ["merge", "--method", "ties", *map(str, fts), "--base", str(base), *spelling,
                                 out_flag, str(out), "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["output"] == str(out.resolve())
    assert "density: 0.4" in (out / "merge.yaml").read_text()


def test_merge_param_without_value_names_the_main_flag(tmp_path, merge_models):
    base, fts = merge_models
    result = runner.invoke(app, ["merge", *map(str, fts), "--base", str(base), "--param", "density",
                                 "-o", str(tmp_path / "o")])
    assert result.exit_code == 2 and "--set takes key=value (got 'density')" in result.output


# ---- the shared epilogue -----------------------------------------------------------------------------------

def test_output_emits_json_or_renders(capsys):
    from mlxkit.cli._options import Output
    from mlxkit.engines.core.progress import Reporter, RichReporter

    shown: list = []
    Output(json=True).emit({"a": 1}, shown.append)
    assert json.loads(capsys.readouterr().out) == {"a": 1} and shown == []
    Output().emit({"a": 2}, shown.append)
    assert shown == [{"a": 2}] and capsys.readouterr().out == ""
    assert type(Output(quiet=True).reporter) is Reporter and isinstance(Output().reporter, RichReporter)


# ---- renamed options: the old spelling still works, with a notice; both spellings is an error -------------

def _solve_system(tmp_path):
    import numpy as np
    import scipy.sparse as sp

    n = 4
    line = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], (n, n))
    lap = (sp.kron(sp.eye(n), line) + sp.kron(line, sp.eye(n))).tocsr()  # 5-point Laplacian on a 4x4 grid
    path = tmp_path / "s.npz"
    sp.save_npz(path, lap)
    np.savez(path, **dict(np.load(path)), b=np.ones(n * n), grid_shape=np.array([n, n]))
    return path


def test_solve_precision_and_its_old_spelling(tmp_path):
    old, new = ["--dtype", "float32"], ["--precision", "float32"]
    path = _solve_system(tmp_path)
    reports = []
    for spelling in (new, old):
        result = runner.invoke(app, ["solve", str(path), "--device", "cpu", *spelling, "--json"])
        assert result.exit_code == 0, result.output
        assert ("--dtype is now --precision" in result.stderr) == (spelling is old)
        reports.append(json.loads(result.stdout))
    assert reports[0]["dtype"] == reports[1]["dtype"] == "float32"
    both = runner.invoke(app, ["solve", str(path), *old, *new])
    assert both.exit_code == 2 and "--dtype is the old spelling of --precision" in both.output


def test_export_encoding_and_its_old_spelling(tmp_path, merge_models):
    base, _ = merge_models
    for spelling, notice in ((["--encoding", "f16"], False), (["--dtype", "f16"], True)):
        out = tmp_path / f"out-{notice}"
        result = runner.invoke(app, ["export", str(base), "--format", "hf", "--out", str(out), *spelling,
                                     "--dry-run", "--json"])
        assert result.exit_code == 0, result.output
        assert ("--dtype is now --encoding" in result.stderr) == notice
        assert json.loads(result.stdout)["dtype"] == "f16"
    both = runner.invoke(app, ["export", str(base), "--format", "hf", "--out", str(tmp_path / "o"), "--dtype", "f16",
                               "--encoding", "f32"])
    assert both.exit_code == 2 and "--dtype is the old spelling of --encoding" in both.output


def test_search_encoding_and_its_old_spelling(monkeypatch, tmp_path):
    seen = _capture(monkeypatch, "mlxkit.engines.puzzle.search.run", "run_search", {"ok": True})
    for spelling in (["--encoding", "f16"], ["--export-dtype", "f16"]):
        result = runner.invoke(app, ["search", "--target", "cpu", "--out", str(tmp_path / "c"), "--export", "gguf",
                                     *spelling, "--json"])
        assert result.exit_code == 0, result.output
        assert ("--export-dtype is now --encoding" in result.stderr) == (spelling[0] == "--export-dtype")
    assert [options.export_encoding for options, _, _ in seen] == ["f16", "f16"]
    both = runner.invoke(app, ["search", "--target", "cpu", "--export", "gguf", "--export-dtype", "f16",
                               "--encoding", "f16"])
    assert both.exit_code == 2 and "--export-dtype is the old spelling of --encoding" in both.output


def test_merge_save_dtype_and_its_old_spelling(tmp_path, merge_models):
    import torch
    from safetensors import safe_open

    base, fts = merge_models
    for spelling, notice in ((["--save-dtype", "float16"], False), (["--dtype", "float16"], True)):
        out = tmp_path / f"merged-{notice}"
        result = runner.invoke(app, ["merge", "--method", "linear", *map(str, fts), *spelling, "-o", str(out),
                                     "--device", "cpu", "--no-check", "--json"])
        assert result.exit_code == 0, result.output
        assert ("--dtype is now --save-dtype" in result.stderr) == notice
        with safe_open(str(next(out.glob("*.safetensors"))), "pt") as f:
            assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float16}
    both = runner.invoke(app, ["merge", "--method", "linear", *map(str, fts), "--dtype", "float16",
                               "--save-dtype", "float32", "-o", str(tmp_path / "o")])
    assert both.exit_code == 2 and "--dtype is the old spelling of --save-dtype" in both.output
