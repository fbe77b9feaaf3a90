"""`--device` / `--dtype` through the CLI on tiny models: low precision agrees with float32, a missing GPU
is one error line.

bfloat16 matmuls on a CPU are slow (no native kernels), so every input here is a few dozen tokens.
Tolerances: bfloat16 keeps 8 significant bits (relative rounding up to 2^-8 per value), which moves a
tiny model's perplexity and KL by well under 2 %; SSI in float32 is checked against float64 at 1e-4.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from conftest import make_tiny_llama
from mlxkit.cli.main import app
from test_merge_common import make_base, make_finetune, state

runner = CliRunner()
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without a GPU")


def _ok(result) -> dict:
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _one_error_line(result, code: int, *words: str) -> None:
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    for word in words:
        assert word in lines[0]


@pytest.fixture(scope="module")
def merge_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("device-merge")
    base = make_base(root / "base")
    return base, [make_finetune(base, root / f"ft{i}", seed=40 + i) for i in range(3)]


@pytest.fixture
def reference_dir(tmp_path):
    out = tmp_path / "reference"
    make_tiny_llama(seed=1).save_pretrained(out)
    return out


def _poisson_npz(path, side: int = 17):
    """The 5-point Poisson matrix on a side x side grid (SSI's 9-point form with zero corners) and b = 1."""
    import scipy.sparse as sp

    t = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(side, side))
    a = sp.kronsum(t, t).tocsr()
    sp.save_npz(path, a)
    arrays = dict(np.load(path))
    arrays["b"] = np.ones(side * side)
    np.savez(path, **arrays)
    return path, a


# ---- (a) a low compute dtype runs and agrees with float32 ------------------------------------------------

def test_eval_bfloat16_agrees_with_float32(tiny_llama_dir, reference_dir, text_file):
    args = ["eval", str(tiny_llama_dir), "--data", str(text_file), "--reference", str(reference_dir),
            "--max-tokens", "64", "--seq-len", "32", "--device", "cpu", "--json"]
    full = _ok(runner.invoke(app, [*args, "--dtype", "float32"]))
    low = _ok(runner.invoke(app, [*args, "--dtype", "bfloat16"]))
    assert (full["device"], full["dtype"]) == ("cpu", "float32")
    assert (low["device"], low["dtype"]) == ("cpu", "bfloat16")
    assert low["tokens"] == full["tokens"] == 62
    assert low["perplexity"] == pytest.approx(full["perplexity"], rel=0.02)
    assert low["reference_perplexity"] == pytest.approx(full["reference_perplexity"], rel=0.02)
    assert full["kl_div"] > 0.1 and low["kl_div"] == pytest.approx(full["kl_div"], rel=0.03)


def test_eval_auto_on_a_cpu_is_float32(tiny_llama_dir, text_file):
    if torch.cuda.is_available():
        pytest.skip("auto picks the GPU here")
    result = _ok(runner.invoke(app, ["eval", str(tiny_llama_dir), "--data", str(text_file), "--max-tokens", "32",
                                     "--seq-len", "32", "--json"]))
    assert (result["device"], result["dtype"]) == ("cpu", "float32")


def test_calibrate_bfloat16_on_cpu(tiny_llama_dir, tmp_path):
    out = tmp_path / "bf16box.yaml"
    result = runner.invoke(app, ["calibrate", "--model", str(tiny_llama_dir), "--out", str(out), "--device", "cpu",
                                 "--dtype", "bfloat16", "--batch", "1", "--seq", "8", "--copies", "1", "--repeats",
                                 "1", "--decode-steps", "2", "--threads", "1", "--json"])
    payload = _ok(result)
    from mlxkit.engines.hardware.profile import load_profile

    assert load_profile(out).calibration["dtype"] == "bfloat16"
    for row in payload["whole_model"]:
        weights = row["memory"]["weights_mib"]  # 2 bytes a weight: the prediction holds only if bf16 was timed
        assert weights["predicted"] == pytest.approx(weights["measured"])


def test_merge_bfloat16_output_agrees_with_float32(tmp_path, merge_models):
    base, fts = merge_models
    args = ["merge", "--isotropic", *map(str, fts), "--base", str(base), "--device", "cpu", "--json"]
    full = _ok(runner.invoke(app, [*args, "-o", str(tmp_path / "f32"), "--dtype", "float32"]))
    low = _ok(runner.invoke(app, [*args, "-o", str(tmp_path / "bf16"), "--dtype", "bfloat16"]))
    assert full["device"] == low["device"] == "cpu"
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    reference, rounded = state(tmp_path / "f32"), state(tmp_path / "bf16")
    assert reference.keys() == rounded.keys()
    for name, tensor in reference.items():
        assert rounded[name].dtype == torch.bfloat16, name
        # the arithmetic ran in float32 both times: the outputs differ only by rounding to bfloat16
        assert torch.allclose(rounded[name].float(), tensor, rtol=2**-8, atol=1e-6), name


def test_merge_save_dtype_is_the_output_dtype(tmp_path, merge_models):
    base, fts = merge_models
    _ok(runner.invoke(app, ["merge", "--method", "task-arithmetic", *map(str, fts[:2]), "--base", str(base),
                            "--save-dtype", "fp16", "--device", "cpu", "-o", str(tmp_path / "o"), "--json"]))
    assert {t.dtype for t in state(tmp_path / "o").values()} == {torch.float16}


def test_solve_on_cpu_float32_agrees_with_float64(tmp_path):
    path, a = _poisson_npz(tmp_path / "poisson.npz")
    full = _ok(runner.invoke(app, ["solve", str(path), "--device", "cpu", "--out", str(tmp_path / "x64.npz"),
                                   "--json"]))
    low = _ok(runner.invoke(app, ["solve", str(path), "--device", "cpu", "--precision", "float32", "--out",
                                  str(tmp_path / "x32.npz"), "--json"]))
    assert full["method"] == low["method"] == "ssi" and full["device"] == low["device"] == "cpu"
    with np.load(tmp_path / "x64.npz") as x64, np.load(tmp_path / "x32.npz") as x32:
        assert np.linalg.norm(x32["x"] - x64["x"]) <= 1e-4 * np.linalg.norm(x64["x"])


def test_solve_precision_takes_float64_or_float32(tmp_path):
    path, _ = _poisson_npz(tmp_path / "poisson.npz", side=5)
    result = runner.invoke(app, ["solve", str(path), "--device", "cpu", "--precision", "bfloat16"])
    _one_error_line(result, 2, "float64 or float32")


def test_factorized_keeps_tensors_on_the_device(tmp_path):
    from mlxkit.engines.solve import factorized

    _, a = _poisson_npz(tmp_path / "poisson.npz", side=9)
    solve = factorized(a, device="cpu")
    b = torch.ones(81, 2, dtype=torch.float64)
    x = solve(b)
    assert isinstance(x, torch.Tensor) and x.device == b.device and x.shape == b.shape
    assert np.allclose(a @ x.numpy(), b.numpy())
    assert isinstance(solve(b.numpy()), np.ndarray)  # arrays in, arrays out: the SciPy side is unchanged
    general = factorized(a, method="superlu")
    assert torch.allclose(general(b), x)


@no_gpu
def test_factorized_on_a_missing_gpu_is_a_backend_error(tmp_path):
    from mlxkit.engines.errors import BackendError
    from mlxkit.engines.solve import factorized

    _, a = _poisson_npz(tmp_path / "poisson.npz", side=5)
    with pytest.raises(BackendError, match="no CUDA device"):
        factorized(a, device="cuda")


# ---- (b) --device cuda without a GPU: one line, exit 6, nothing written -----------------------------------

def _cuda_cases(tiny_llama_dir, text_file, tmp_path, merge_models):
    base, fts = merge_models
    npz, _ = _poisson_npz(tmp_path / "poisson.npz", side=5)
    out = tmp_path / "out"
    return {
        "eval": (["eval", str(tiny_llama_dir), "--data", str(text_file), "--max-tokens", "32", "--seq-len", "32"],
                 None),
        "calibrate": (["calibrate", "--model", str(tiny_llama_dir), "--out", str(out) + ".yaml"],
                      tmp_path / "out.yaml"),
        "merge": (["merge", "--isotropic", *map(str, fts), "--base", str(base), "-o", str(out)], out),
        "solve": (["solve", str(npz), "--out", str(out) + ".npz"], tmp_path / "out.npz"),
        "search": (["search", "--model", str(tiny_llama_dir), "--target", "cpu", "--out", str(out)], out),
        "distill": (["distill", "--kd", "--teacher", str(tiny_llama_dir), "--student", str(tiny_llama_dir),
                     "--data", str(text_file), "--out", str(out)], out),
        "finetune": (["finetune", "--model", str(tiny_llama_dir), "--data", str(text_file), "--out", str(out)], out),
    }


@no_gpu
@pytest.mark.parametrize("verb", ["eval", "calibrate", "merge", "solve", "search", "distill", "finetune"])
@pytest.mark.parametrize("json_out", [False, True])
def test_missing_gpu_is_one_error_line(verb, json_out, tiny_llama_dir, text_file, tmp_path, merge_models):
    args, written = _cuda_cases(tiny_llama_dir, text_file, tmp_path, merge_models)[verb]
    before = set(tmp_path.iterdir())
    result = runner.invoke(app, [*args, "--device", "cuda", *(["--json"] if json_out else [])])
    assert result.exit_code == 6, result.output
    assert "Traceback" not in result.output
    stderr = result.stderr.strip().splitlines()
    assert len(stderr) == 1 and stderr[0].startswith("error:") and "no CUDA device" in stderr[0], result.output
    if json_out:
        assert json.loads(result.stdout)["error"]["type"] == "BackendError"
    else:
        assert result.stdout == ""
    assert written is None or not written.exists()
    assert set(tmp_path.iterdir()) == before  # nothing written, not even a temporary


@pytest.mark.parametrize("verb", ["eval", "calibrate", "merge", "solve", "search", "distill", "finetune"])
def test_unknown_device_is_a_usage_error(verb, tiny_llama_dir, text_file, tmp_path, merge_models):
    args, _ = _cuda_cases(tiny_llama_dir, text_file, tmp_path, merge_models)[verb]
    _one_error_line(runner.invoke(app, [*args, "--device", "tpu"]), 2, "unknown device 'tpu'")


# ----------------------------------------------------------------------------- the training verbs in bfloat16

def _safetensors_dtypes(directory, pattern: str = "*.safetensors") -> set[str]:
    from safetensors import safe_open

    found = set()
    for file in directory.glob(pattern):
        with safe_open(str(file), "pt") as handle:
            found |= {str(handle.get_slice(name).get_dtype()) for name in handle.keys()}
    return found


TRAIN_SETS = ["--set", "data.seq_len=32", "--set", "data.held_out_sequences=2", "--set", "optim.batch_sequences=2",
              "--set", "optim.micro_batch_sequences=1", "--set", "schedule.eval_every=2"]


def test_search_with_gkd_runs_in_bfloat16_and_writes_a_bfloat16_child(built_library, text_file, tmp_path):
    payload = _ok(runner.invoke(app, ["search", "--library", str(built_library), "--throughput", "1.3x", "--data",
                                      str(text_file), "--out", str(tmp_path / "child"), "--gkd-tokens", "128",
                                      "--device", "cpu", "--dtype", "bfloat16", "--json", *TRAIN_SETS]))
    assert payload["gkd"]["compute_dtype"] == "bfloat16" and payload["gkd"]["saved_dtype"] == "bfloat16"
    assert _safetensors_dtypes(tmp_path / "child") == {"BF16"}
    assert payload["gkd"]["after"]["kl_div"] == payload["gkd"]["after"]["kl_div"]  # finite, not NaN


def test_distill_kd_runs_in_bfloat16_and_save_dtype_overrides(tiny_llama_dir, reference_dir, text_file, tmp_path):
    from conftest import make_char_tokenizer

    make_char_tokenizer().save_pretrained(reference_dir)
    args = ["distill", "--kd", "--teacher", str(reference_dir), "--student", str(tiny_llama_dir), "--data",
            str(text_file), "--tokens", "128", "--device", "cpu", "--dtype", "bfloat16", "--json", *TRAIN_SETS]
    payload = _ok(runner.invoke(app, [*args, "--out", str(tmp_path / "kd")]))
    assert payload["compute_dtype"] == "bfloat16" and _safetensors_dtypes(tmp_path / "kd") == {"BF16"}
    _ok(runner.invoke(app, [*args, "--out", str(tmp_path / "kd32"), "--save-dtype", "float32"]))
    assert _safetensors_dtypes(tmp_path / "kd32") == {"F32"}


def test_finetune_lora_runs_in_bfloat16(tiny_llama_dir, text_file, tmp_path):
    payload = _ok(runner.invoke(app, ["finetune", "--recipe", "lora", "--model", str(tiny_llama_dir), "--data",
                                      str(text_file), "--steps", "2", "--out", str(tmp_path / "adapter"),
                                      "--device", "cpu", "--dtype", "bfloat16", "--json", *TRAIN_SETS]))
    assert payload["compute_dtype"] == "bfloat16"
    assert _safetensors_dtypes(tmp_path / "adapter", "adapter_model.safetensors") == {"BF16"}
