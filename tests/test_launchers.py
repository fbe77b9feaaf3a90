"""Runs under the launchers users start them with: torchrun and accelerate.

`mlx search --gkd-tokens` under torchrun: rank 0 alone builds, writes and reports, the other
ranks take part in the distributed stages and exit 0, and the child equals one process's.
`accelerate launch` sets the same environment, so KD under it equals one process too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, make_char_tokenizer, make_tiny_llama
from mlxkit.engines.distill.recipe import load_distill_recipe
from mlxkit.engines.distill.trainer import DistillationOptions, run_distillation

GKD_SETTINGS = ["data.seq_len=32", "data.held_out_sequences=2", "optim.batch_sequences=4", "optim.lr=1e-2",
                "schedule.checkpoint_every=2", "schedule.eval_every=2"]
GKD_TOKENS = 3 * 4 * 32  # three steps of the global batch


def _search_command(model, recipe, text_file, out) -> list[str]:
    return ["-m", "mlxkit", "search", "--model", str(model), "--recipe", str(recipe), "--target", "h100",
            "--throughput", "1.3x", "--data", str(text_file), "--out", str(out), "--gkd-tokens", str(GKD_TOKENS),
            "--json", *[f"--gkd-set={setting}" for setting in GKD_SETTINGS]]


def _weights(path):
    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.distributed
def test_two_ranks_give_one_output_equal_to_one_rank(tiny_llama_dir, tiny_recipe_file, text_file, tmp_path):
    base_env = {**os.environ, "MLXKIT_BACKEND": "gloo", "OMP_NUM_THREADS": "1", "MLXKIT_THREADS": "1"}

    single_out = tmp_path / "single" / "child"
    single_out.parent.mkdir()
    single = subprocess.run([sys.executable, *_search_command(tiny_llama_dir, tiny_recipe_file, text_file, single_out)],
                            env={**base_env, "MLXKIT_CACHE": str(tmp_path / "cache-single")}, cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr[-3000:]

    double_out = tmp_path / "double" / "child"
    double_out.parent.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29541",
               *_search_command(tiny_llama_dir, tiny_recipe_file, text_file, double_out)]
    double = subprocess.run(command, env={**base_env, "MLXKIT_CACHE": str(tmp_path / "cache-double")}, cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    assert double.returncode == 0, double.stderr[-3000:]

    # One report: rank 0 prints the JSON object, the other rank prints nothing.
    payload = json.loads(double.stdout)
    assert payload["out"] == str(double_out.resolve()) and payload["gkd"]["world_size"] == 2
    # One output beside nothing else: no work directory of either stage is left.
    assert sorted(p.name for p in double_out.parent.iterdir()) == ["child"]

    single_payload = json.loads(single.stdout)
    assert payload["choices"] == single_payload["choices"]
    a, b = _weights(single_out), _weights(double_out)
    assert a.keys() == b.keys()
    assert all(torch.allclose(a[k], b[k], atol=2e-5) for k in a), \
        max((a[k] - b[k]).abs().max().item() for k in a)


KD_SETTINGS = {"data.seq_len": 32, "data.held_out_sequences": 2, "optim.batch_sequences": 4,
               "optim.micro_batch_sequences": 1, "optim.lr": 1e-2, "schedule.eval_every": 2,
               "schedule.checkpoint_every": 2}


@pytest.mark.distributed
def test_accelerate_launch_runs_two_processes_that_match_one(text_file, tmp_path):
    teacher, student = tmp_path / "teacher", tmp_path / "student"
    for seed, path in ((0, teacher), (1, student)):
        make_tiny_llama(seed=seed).save_pretrained(path)
        make_char_tokenizer().save_pretrained(path)
    tokens = 4 * 4 * 32
    single = tmp_path / "single"
    recipe = load_distill_recipe("kd").with_overrides(KD_SETTINGS)
    run_distillation(DistillationOptions(mode="kd", teacher=str(teacher), student=str(student), out=single,
                                         recipe=recipe, data=text_file, tokens=tokens))
    double = tmp_path / "double"
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    # --multi_gpu is accelerate's name for its torchrun-style multi-process launcher; with no GPU the
    # processes run on the CPU and mlxkit joins them with gloo.
    command = [accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29547",
               "-m", "mlxkit", "distill", "--kd", "--teacher", str(teacher), "--student", str(student),
               "--data", str(text_file), "--tokens", str(tokens), "--out", str(double), "--json",
               *[f"--set={k}={v}" for k, v in KD_SETTINGS.items()]]
    done = subprocess.run(command, env={**os.environ, "MLXKIT_THREADS": "1"}, cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["world_size"] == 2
    a, b = _weights(single), _weights(double)
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=2e-5) for k in a)


def test_only_rank_zero_reports(monkeypatch, capsys):
    from mlxkit.cli._options import Output
    from mlxkit.engines.core.progress import Reporter, RichReporter

    monkeypatch.setenv("RANK", "0")
    assert isinstance(Output(json=False).reporter, RichReporter)
    Output(json=True).emit({"out": "x"})
    assert '"out": "x"' in capsys.readouterr().out
    monkeypatch.setenv("RANK", "1")
    output = Output(json=True)
    assert type(output.reporter) is Reporter  # the silent one
    output.emit({})
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("args, code, stream, text", [
    (["--version"], 0, "stdout", "mlx"),
    (["distill", "--kd", "--json"], 2, "stdout", "error"),
    (["no-such-verb"], 2, "stderr", "no-such-verb"),
])
def test_a_launched_process_keeps_its_exit_code_and_output(args, code, stream, text):
    # Under a launcher `main` ends the process itself once the verb returns: the exit code and
    # everything printed must still come out.
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "1"}
    done = subprocess.run([sys.executable, "-m", "mlxkit", *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == code, done.stderr
    assert text in getattr(done, stream)
    assert "Traceback" not in done.stderr
