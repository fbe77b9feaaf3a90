"""`mlx search --gkd-tokens`: search, assembly and global distillation in one resumable command; the frontier."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import mlxkit  # noqa: F401
from mlxkit.cli.main import app
from mlxkit.engines.distill.trainer import DistillationRun
from mlxkit.engines.puzzle.search import child as search_child
from mlxkit.engines.puzzle.search.child import search_work_dir

runner = CliRunner()
GKD = ["--gkd-set", "data.seq_len=32", "--gkd-set", "data.held_out_sequences=2", "--gkd-set",
       "optim.batch_sequences=4", "--gkd-set", "optim.lr=1e-2", "--gkd-set", "schedule.checkpoint_every=1",
       "--gkd-set", "schedule.eval_every=2"]


def _search(library, text_file, out, *extra):
    return runner.invoke(app, ["search", "--library", str(library), "--throughput", "1.3x", "--data", str(text_file),
                               "--out", str(out), "--gkd-tokens", str(4 * 4 * 32), *GKD, "--json", *extra])


def _interrupt_gkd_after(steps: int, monkeypatch):
    """Make GKD raise KeyboardInterrupt once `steps` steps ran; returns the original step to restore."""
    original, calls = DistillationRun.train_step, []

    def failing_step(self, step):
        if len(calls) == steps:
            raise KeyboardInterrupt
        calls.append(step)
        return original(self, step)

    monkeypatch.setattr(DistillationRun, "train_step", failing_step)
    return original


def _weights(path):
    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_one_command_gives_a_distilled_child_and_resumes_where_it_stopped(built_library, text_file, tmp_path,
                                                                         monkeypatch):
    straight = tmp_path / "straight"
    result = _search(built_library, text_file, straight)
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["gkd"]["after"]["kl_div"] < payload["gkd"]["before"]["kl_div"]
    manifest = json.loads((straight / "mlxkit.json").read_text())
    stages = manifest["settings"]["search"]
    assert stages["mip"]["objective"] == pytest.approx(payload["objective"])
    assert stages["choices"] == payload["choices"] and "child_before_gkd" in stages
    assert (straight / "distill_log.jsonl").exists() and not search_work_dir(straight).exists()

    # interrupted after two GKD steps: the assembled child and the checkpoint stay, the output does not exist
    interrupted = tmp_path / "interrupted"
    original = _interrupt_gkd_after(2, monkeypatch)
    assert _search(built_library, text_file, interrupted).exit_code == 130
    assert (search_work_dir(interrupted) / "child-before-gkd").exists()
    assert (DistillationRun.work_dir_for(interrupted) / "checkpoint").exists() and not interrupted.exists()
    monkeypatch.setattr(DistillationRun, "train_step", original)
    resumed = _search(built_library, text_file, interrupted)
    assert resumed.exit_code == 0, resumed.output
    a, b = _weights(straight), _weights(interrupted)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_other_choices_reassemble_the_staged_child_and_restart_its_gkd(built_library, text_file, tmp_path,
                                                                       monkeypatch):
    # --throughput given twice: the last one counts, so the rerun below searches for 1.6x.
    straight = tmp_path / "straight"
    reference = _search(built_library, text_file, straight, "--throughput", "1.6x")
    assert reference.exit_code == 0, reference.output
    out = tmp_path / "out"
    original = _interrupt_gkd_after(2, monkeypatch)
    assert _search(built_library, text_file, out).exit_code == 130  # 1.3x: another child
    staged = json.loads((search_work_dir(out) / "child-before-gkd" / "mlxkit.json").read_text())["results"]
    assert staged["choices"] != json.loads(reference.stdout)["choices"]
    monkeypatch.setattr(DistillationRun, "train_step", original)
    built, build_child = [], search_child.build_child
    monkeypatch.setattr(search_child, "build_child", lambda *a, **k: built.append(1) or build_child(*a, **k))
    # The staged child is assembled again for the new choices, and GKD's unfinished run on the old
    # child is discarded rather than refused or resumed.
    rerun = _search(built_library, text_file, out, "--throughput", "1.6x")
    assert rerun.exit_code == 0, rerun.output
    assert built == [1]
    a, b = _weights(straight), _weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_gkd_tokens_cannot_be_combined_with_dry_run(built_library, text_file):
    result = runner.invoke(app, ["search", "--library", str(built_library), "--gkd-tokens", "64", "--dry-run"])
    assert result.exit_code != 0 and "--dry-run" in result.output


def test_frontier_solves_once_per_target_and_marks_where_it_ends(built_library):
    result = runner.invoke(app, ["search", "--library", str(built_library), "--throughput", "1.1x,1.3x,50x",
                                 "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["frontier"]
    assert [r["throughput"] for r in rows] == ["1.1x", "1.3x", "50x"]
    assert "infeasible" in rows[2]
    for row, target in zip(rows[:2], (1.1, 1.3)):
        assert row["speedup"] >= target - 1e-6
        single = runner.invoke(app, ["search", "--library", str(built_library), "--throughput", row["throughput"],
                                     "--dry-run", "--json"])
        assert json.loads(single.stdout)["objective"] == pytest.approx(row["objective"])
    assert rows[0]["objective"] <= rows[1]["objective"] + 1e-9
    needs_dry_run = runner.invoke(app, ["search", "--library", str(built_library), "--throughput", "1.1x,1.3x"])
    assert needs_dry_run.exit_code != 0 and "--dry-run" in needs_dry_run.output
