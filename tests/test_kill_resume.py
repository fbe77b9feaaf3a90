"""SIGKILL at seeded random writes, then the same command again: the result of an uninterrupted run.

For `merge`, `library build`, `distill --gkd` and `finetune` (lora and htuning), one
uninterrupted run counts its writes (see `kill_points.py`) and is the reference. Then, for
seeded random kill points K and a seeded choice of kill mode (before a write, after it, or
with the file torn in half), a fresh run is SIGKILLed at write K and the unchanged command is
run again to the end. Checked after every kill: no complete-looking output is ever partial;
and after the rerun: the result equals the reference (bit-identical tensors), and nothing
temporary or stale is left beside it.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, make_char_tokenizer, make_tiny_llama

pytestmark = pytest.mark.kill

DRIVER = REPO / "tests" / "kill_points.py"
KILLS_PER_VERB = 5
MODES = ("before", "torn", "after")


def _env(place: Path) -> dict[str, str]:
    # One intra-op thread: the same floating-point order in every run, and two runs fit the two cores.
    # Each place has its own cache (token shards, sampled text), so every killed run makes the writes the
    # reference run counted, and its rerun finds what it left there.
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MLXKIT_CACHE": str(place / "cache")}


def _run(args: list[str], cwd: Path, kill_at: int = 0, mode: str = "before") -> subprocess.CompletedProcess:
    command = [sys.executable, str(DRIVER), str(cwd / "events.txt"), str(kill_at), mode, "--", *args, "--quiet"]
    return subprocess.run(command, cwd=cwd, env=_env(cwd), capture_output=True, text=True, timeout=600)


def _saved(model, path: Path) -> Path:
    model.save_pretrained(path)
    make_char_tokenizer().save_pretrained(path)
    return path


def _tensors(directory: Path, pattern: str = "*.safetensors") -> dict[str, torch.Tensor]:
    return {f"{f.relative_to(directory)}:{k}": v for f in sorted(directory.glob(pattern))
            for k, v in load_file(f).items()}


def _same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _leftovers(directory: Path) -> list[str]:
    """Temporaries anywhere below `directory`, and hidden work directories beside the output."""
    temporaries = [p for p in directory.rglob("*") if ".tmp-" in p.name]
    hidden = [p for p in directory.iterdir() if p.name.startswith(".")]
    return sorted(str(p.relative_to(directory)) for p in temporaries + hidden)


def _kill_points(total: int, seed: str) -> list[tuple[int, str]]:
    """Seeded random points, plus the run's very last write: the window after the output is in place."""
    rng = random.Random(seed)
    points = sorted(rng.sample(range(1, total), min(KILLS_PER_VERB, total - 1)))
    return [(k, rng.choice(MODES)) for k in points] + [(total, "before")]


class Verb:
    """How to run one verb on `out`, what its result is, and what a killed run may leave at `out`."""

    name: str

    def args(self, inputs: Path, out: Path) -> list[str]:
        raise NotImplementedError

    def result(self, out: Path) -> object:
        return _tensors(out)

    def check_killed(self, out: Path, reference: Path) -> None:
        """A killed run's `out` is absent, or complete and equal to the reference (the kill came after the rename)."""
        if out.exists():
            assert _same_tensors(self.result(out), self.result(reference))


class Merge(Verb):
    name = "merge"

    def prepare(self, inputs: Path) -> None:
        _saved(make_tiny_llama(seed=0), inputs / "a")
        _saved(make_tiny_llama(seed=1), inputs / "b")
        _saved(make_tiny_llama(seed=2), inputs / "base")

    def args(self, inputs, out):
        return ["merge", "--method", "ties", str(inputs / "a"), str(inputs / "b"), "--base", str(inputs / "base"),
                "-o", str(out)]


TINY_BLD_RECIPE = """
name: tiny
search_space: {ffn_fractions: [1.0, 0.5], width_multiple: 8}
data: {seq_len: 32, train_sequences: 8, score_sequences: 2}
bld: {tokens_per_block: 512, batch_sequences: 4, lr: 1.0e-3}
"""


def _write_text(path: Path) -> Path:
    path.write_text("".join(f"Line {i}: the quick brown fox jumps over the lazy dog {i * 7 % 13}.\n"
                            for i in range(400)))
    return path


class BuildLibrary(Verb):
    """`library build` builds its library in place (resumable block by block), so `out` exists while it runs."""

    name = "library-build"

    def prepare(self, inputs: Path) -> None:
        _saved(make_tiny_llama(seed=0), inputs / "parent")
        (inputs / "tiny.yaml").write_text(TINY_BLD_RECIPE)
        _write_text(inputs / "text.txt")

    def args(self, inputs, out):
        return ["library", "build", "--model", str(inputs / "parent"), "--recipe", str(inputs / "tiny.yaml"),
                "--data", str(inputs / "text.txt"), "--out", str(out)]

    def result(self, out):
        library = json.loads((out / "library.json").read_text())
        metrics = {(i, kind, name): entry["metrics"] for i, layer in enumerate(library["layers"])
                   for kind in ("attention", "ffn") for name, entry in layer[kind].items()}
        return _tensors(out / "blocks", "[!.]*.safetensors"), metrics

    def check_killed(self, out, reference):
        if not out.exists():
            return
        for block in sorted((out / "blocks").glob("[!.]*.safetensors")) if (out / "blocks").exists() else []:
            load_file(block)  # a block under its own name is whole: a torn one would not load
        if (out / "library.json").exists():
            json.loads((out / "library.json").read_text())

    def result_equal(self, a, b) -> bool:
        return _same_tensors(a[0], b[0]) and a[1] == b[1]


class GlobalDistill(Verb):
    name = "distill-gkd"

    def prepare(self, inputs: Path) -> None:
        _saved(make_tiny_llama(seed=0), inputs / "teacher")
        _saved(make_tiny_llama(seed=1), inputs / "student")
        _write_text(inputs / "text.txt")

    def args(self, inputs, out):
        return ["distill", "--gkd", "--teacher", str(inputs / "teacher"), "--student", str(inputs / "student"),
                "--data", str(inputs / "text.txt"), "--tokens", str(6 * 4 * 32), "--out", str(out),
                "--set", "data.seq_len=32", "--set", "data.held_out_sequences=2", "--set", "optim.batch_sequences=4",
                "--set", "optim.micro_batch_sequences=2", "--set", "schedule.eval_every=3",
                "--set", "schedule.checkpoint_every=2"]


class Finetune(Verb):
    def __init__(self, recipe: str) -> None:
        self.recipe = recipe
        self.name = f"finetune-{recipe}"

    def prepare(self, inputs: Path) -> None:
        _saved(make_tiny_llama(seed=0), inputs / "base")
        _write_text(inputs / "text.txt")

    def args(self, inputs, out):
        extra = ["--set", "htuning.fo_sequences=2"] if self.recipe == "htuning" else []
        return ["finetune", "--recipe", self.recipe, "--model", str(inputs / "base"), "--data",
                str(inputs / "text.txt"), "--steps", "6", "--batch", "4", "--out", str(out),
                "--set", "data.seq_len=32", "--set", "data.held_out_sequences=2",
                "--set", "optim.micro_batch_sequences=2", "--set", "schedule.eval_every=3",
                "--set", "schedule.checkpoint_every=2", *extra]


VERBS = [Merge(), BuildLibrary(), GlobalDistill(), Finetune("lora"), Finetune("htuning")]


def _equal(verb: Verb, a: object, b: object) -> bool:
    return verb.result_equal(a, b) if hasattr(verb, "result_equal") else _same_tensors(a, b)


@pytest.mark.parametrize("verb", VERBS, ids=[v.name for v in VERBS])
def test_killed_at_random_writes_then_rerun_equals_an_uninterrupted_run(verb, tmp_path):
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    verb.prepare(inputs)
    reference = tmp_path / "reference"
    done = _run(verb.args(inputs, reference), tmp_path)
    assert done.returncode == 0, done.stderr
    total = int((tmp_path / "events.txt").read_text())
    expected = verb.result(reference)

    def killed_then_rerun(kill_at: int, mode: str) -> None:
        place = tmp_path / f"k{kill_at}-{mode}"
        place.mkdir()
        out = place / "out"
        killed = _run(verb.args(inputs, out), place, kill_at, mode)
        assert killed.returncode == -signal.SIGKILL, (kill_at, mode, killed.returncode, killed.stderr[-2000:])
        verb.check_killed(out, reference)

        rerun = subprocess.run([sys.executable, "-m", "mlxkit", *verb.args(inputs, out), "--quiet"], cwd=place,
                               env=_env(place), capture_output=True, text=True, timeout=600)
        if rerun.returncode != 0:
            # Only a run killed after its output was in place may find it there; that output is the result.
            assert "already exists" in rerun.stderr, (kill_at, mode, rerun.stderr[-2000:])
        assert "Traceback" not in rerun.stderr
        assert _equal(verb, verb.result(out), expected), (kill_at, mode)
        assert _leftovers(place) == [], (kill_at, mode)

    # Two scenarios at a time, one thread each: the two cores, and half the wall time.
    with ThreadPoolExecutor(max_workers=2) as pool:
        for scenario in [pool.submit(killed_then_rerun, k, mode) for k, mode in _kill_points(total, verb.name)]:
            scenario.result()
