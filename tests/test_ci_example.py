"""The CI job to copy (examples/ci/compress.sh) runs end to end on a tiny parent, and its gate can fail."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import TINY_PUZZLE_RECIPE, make_tiny_llama, save_with_tokenizer

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "ci" / "compress.sh"
GKD = ("--gkd-set data.seq_len=32 --gkd-set data.held_out_sequences=2 --gkd-set optim.batch_sequences=4 "
       "--gkd-set schedule.eval_every=2")


def _run(tmp_path: Path, parent: Path, text: Path, **env: str) -> subprocess.CompletedProcess:
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(TINY_PUZZLE_RECIPE)
    settings = {**os.environ, "MLX": str(Path(sys.executable).parent / "mlx"), "PARENT": str(parent),
                "TARGET": "cpu", "ARTIFACTS": str(tmp_path / "artifacts"),
                "SEARCH_ARGS": f"--recipe {recipe} --throughput 1.3x --data {text} --gkd-tokens 384 {GKD}", **env}
    settings.pop("MLXKIT_CACHE", None)  # the job's own default, beside it, as a CI cache step restores it
    return subprocess.run(["bash", str(SCRIPT)], cwd=tmp_path, env=settings, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture
def parent(tmp_path) -> Path:
    return save_with_tokenizer(make_tiny_llama(seed=0), tmp_path / "parent")


def test_the_ci_job_compresses_gates_and_leaves_the_child_with_its_card(parent, text_file, tmp_path):
    run = _run(tmp_path, parent, text_file, MAX_KL="100", MAX_PPL_RATIO="100")
    assert run.returncode == 0, run.stderr[-2000:]
    artifacts = tmp_path / "artifacts"
    report = json.loads((artifacts / "search.json").read_text())
    child = artifacts / "child"
    assert Path(report["out"]).resolve() == child.resolve()
    assert {"config.json", "mlxkit.json", "README.md"} <= {p.name for p in child.iterdir()}
    front = yaml.safe_load((child / "README.md").read_text().split("---")[1])
    assert front["base_model"] == str(parent) and "mlxkit" in front["tags"]
    # The job's own process draws the pictures the card embeds (the plots extra is installed).
    for picture in ("architecture.png", "training.png"):
        assert (child / picture).stat().st_size > 0 and f"({picture})" in (child / "README.md").read_text()
    # The CI log moves: timestamped stage lines on stderr, while stdout (the report) is JSON alone.
    assert re.search(r"^\[\d\d:\d\d:\d\d\] .*started", run.stderr, re.M), run.stderr[-1000:]
    evaluation = report.get("evaluation_after_gkd") or report["evaluation"]
    assert f"KL {evaluation['kl_div']:.4f}" in run.stderr
    # The cache it was told to keep is where mlxkit put the library, for the next run to restore.
    assert any((tmp_path / ".mlxkit-cache" / "libraries").iterdir())


def test_the_ci_job_fails_on_a_quality_regression(parent, text_file, tmp_path):
    run = _run(tmp_path, parent, text_file, MAX_KL="0", MAX_PPL_RATIO="100")
    assert run.returncode != 0
    assert "quality gate failed" in run.stderr


def test_the_actions_workflow_runs_the_script_with_the_settings_it_reads():
    workflow = yaml.safe_load((SCRIPT.parent / "compress.yml").read_text())
    job = workflow["jobs"]["compress"]
    runs = [step.get("run", "") for step in job["steps"]]
    assert any("bash examples/ci/compress.sh" in r for r in runs)
    read = set(re.findall(r"^([A-Z_]+)=\$\{\1:-", SCRIPT.read_text(), re.M)) | {"MLXKIT_CACHE"}
    assert set(job["env"]) <= read, set(job["env"]) - read
    cached = [step["with"]["path"] for step in job["steps"] if step.get("uses", "").startswith("actions/cache")]
    assert cached and job["env"]["MLXKIT_CACHE"].endswith(cached[0])
    uploaded = [step["with"]["path"] for step in job["steps"] if step.get("uses", "").startswith("actions/upload")]
    assert uploaded == ["artifacts/"]
