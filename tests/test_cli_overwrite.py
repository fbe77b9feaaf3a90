"""`--overwrite`: an existing output is replaced only by a complete new one, and nothing of the old stays."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from conftest import make_char_tokenizer, make_tiny_llama
from mlxkit.cli.main import app

runner = CliRunner()


@pytest.fixture
def three_models(tmp_path) -> list[Path]:
    paths = []
    for seed in range(3):
        path = tmp_path / f"model{seed}"
        make_tiny_llama(seed=seed).save_pretrained(path)
        make_char_tokenizer().save_pretrained(path)
        paths.append(path)
    return paths


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(directory / shard))
    assert set(tensors) == set(index["weight_map"])  # every indexed tensor is there, and no other
    return tensors


def _merge(*args: object):
    return runner.invoke(app, ["merge", "--method", "linear", *map(str, args), "--quiet"])


def test_overwrite_replaces_the_old_output_whole(three_models, tmp_path):
    a, b, c = three_models
    out = tmp_path / "merged"
    assert _merge(a, b, "-o", out).exit_code == 0
    old = _weights(out)
    (out / "left-by-the-old-run.txt").write_text("old")

    refused = _merge(a, c, "-o", out)
    assert refused.exit_code == 2 and "already exists" in refused.stderr
    assert (out / "left-by-the-old-run.txt").exists()  # untouched without --overwrite

    replaced = _merge(a, c, "-o", out, "--overwrite")
    assert replaced.exit_code == 0, replaced.output
    assert not (out / "left-by-the-old-run.txt").exists()
    new = _weights(out)
    assert any(not torch.equal(new[k], old[k]) for k in new)
    fresh = tmp_path / "fresh"  # the same merge into an empty place: the replacement is the whole of it
    assert _merge(a, c, "-o", fresh).exit_code == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in fresh.iterdir())
    reference = _weights(fresh)
    assert all(torch.equal(new[k], reference[k]) for k in reference)
    manifest = json.loads((out / "mlxkit.json").read_text())
    assert manifest["inputs"]["model_1"]["spec"] == str(c)  # the new run's provenance, not the old
    assert not [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]
