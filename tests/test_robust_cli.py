"""`mlx finetune --recipe crt`: train, fine-tune for a new attack, reload, resume exactly, refuse bad input cleanly."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from mlxkit.cli.main import app
from mlxkit.engines.finetune.recipe import load_finetune_recipe
from mlxkit.engines.robust.classifier import load_classifier
from mlxkit.engines.robust.recipe import PhaseSpec
from mlxkit.engines.robust.trainer import CrtOptions, CrtRun, run_crt

runner = CliRunner()
FAST = {"train.steps": 6, "finetune.steps": 6, "optim.batch_size": 16, "schedule.eval_every": 3,
        "schedule.checkpoint_every": 2, "data.held_out_examples": 20, "sampler.probe_examples": 16,
        **{f"attacks.{name}.{key}": 2 for name in ("linf", "l2", "l1", "stadv") for key in ("steps", "eval_steps")}}
SETS = [arg for key, value in FAST.items() for arg in ("--set", f"{key}={value}")]


def _synthetic(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """3 classes of 4×4 images: class c lights up row c, plus noise, inside [0, 1]."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, size=n)
    x = rng.uniform(0, 0.3, size=(n, 1, 4, 4))
    x[np.arange(n), 0, y, :] += 0.6
    return np.clip(x, 0, 1).astype(np.float32), y


@pytest.fixture
def files(tmp_path) -> dict[str, Path]:
    x, y = _synthetic(120, 0)
    np.savez(tmp_path / "train.npz", x=x, y=y)
    x_test, y_test = _synthetic(40, 1)
    np.savez(tmp_path / "test.npz", x=x_test, y=y_test)
    (tmp_path / "mlp.json").write_text(json.dumps({"architecture": "mlp", "input_shape": [1, 4, 4],
                                                   "num_classes": 3, "hidden": [16]}))
    return {"train": tmp_path / "train.npz", "test": tmp_path / "test.npz", "mlp": tmp_path / "mlp.json",
            "root": tmp_path}


def _invoke(args: list[str]):
    return runner.invoke(app, ["finetune", "--recipe", "crt", *args, *SETS, "--json", "--quiet"])


def _accuracy(model_dir: Path, data: Path) -> float:
    """Clean accuracy on the evaluation examples (the first data.held_out_examples of --eval-data), recomputed
    from the files on disk (weights read with safetensors, config from JSON)."""
    model = load_classifier(model_dir)
    raw = load_file(str(model_dir / "model.safetensors"))
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, raw[name])
    arrays = np.load(data)
    count = FAST["data.held_out_examples"]
    with torch.no_grad():
        predicted = model(torch.from_numpy(arrays["x"][:count])).argmax(dim=1).numpy()
    return float((predicted == arrays["y"][:count]).mean())


def _crt_phase_rate(step: int, phase: PhaseSpec) -> float:
    """The rate crt's phases have always used: constant, or cosine from lr to 0 over the phase with no warm-up."""
    if phase.schedule == "constant":
        return phase.lr
    return phase.lr * (0.5 * (1 + math.cos(math.pi * (step / phase.steps))))


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_crt_phase_rates_on_the_shared_schedule_equal_crt_s_formula(schedule):
    shipped = load_finetune_recipe("crt")
    phases = [shipped.train, shipped.finetune, PhaseSpec(steps=7, lr=3.0, schedule=schedule),
              PhaseSpec(steps=1, lr=0.05, schedule=schedule)]
    for phase in phases:
        phase = phase.model_copy(update={"schedule": schedule})
        rates = [phase.lr_schedule().lr_at(step, phase.steps) for step in range(phase.steps)]
        assert rates == [_crt_phase_rate(step, phase) for step in range(phase.steps)], phase


def test_train_then_new_attack_writes_reloadable_models(files):
    first = files["root"] / "linf"
    result = _invoke(["--model", str(files["mlp"]), "--data", str(files["train"]), "--eval-data", str(files["test"]),
                      "--attacks", "linf", "--out", str(first)])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert {p.name for p in first.iterdir()} == {"model.safetensors", "config.json", "mlxkit.json", "crt_log.jsonl"}
    assert summary["attacks"] == ["linf"] and summary["attack_counts"] == {"linf": 6}
    assert json.loads((first / "config.json").read_text())["model_type"] == "mlx_robust_classifier"
    assert _accuracy(first, files["test"]) == pytest.approx(summary["after"]["clean"], abs=1e-6)
    assert not CrtRun.work_dir_for(first).exists()

    second = files["root"] / "linf-l2"
    result = _invoke(["--model", str(first), "--data", str(files["train"]), "--eval-data", str(files["test"]),
                      "--new-attack", "l2", "--out", str(second), "--set", "regularizer.kind=ur"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["phase"] == "finetune" and summary["old_attacks"] == ["linf"]
    assert summary["attacks"] == ["linf", "l2"] and sum(summary["attack_counts"].values()) == 6
    assert set(summary["after"]["attacks"]) == {"linf", "l2"}
    manifest = json.loads((second / "mlxkit.json").read_text())
    assert manifest["settings"]["attacks_trained"] == ["linf", "l2"]
    assert _accuracy(second, files["test"]) == pytest.approx(summary["after"]["clean"], abs=1e-6)
    before, after = load_file(str(first / "model.safetensors")), load_file(str(second / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_logged_sampler_state_follows_the_error_formula(files):
    """Recompute the running accuracies from the logged per-step accuracies and compare the logged probabilities."""
    first = files["root"] / "two"
    recipe = load_finetune_recipe("crt").with_overrides({**FAST, "train.steps": 8})
    run_crt(CrtOptions(model=str(files["mlp"]), data=files["train"], out=first, recipe=recipe,
                       attacks=("linf", "l1")))
    records = [json.loads(line) for line in (first / "crt_log.jsonl").read_text().splitlines()]
    accuracy = dict(records[0]["sampler"]["accuracy"])
    momentum = recipe.sampler.momentum
    for record in records[1:]:
        name = record["attack"]
        accuracy[name] = momentum * accuracy[name] + (1 - momentum) * record["robust_accuracy"]
        errors = {k: 1 - v for k, v in accuracy.items()}
        total = sum(errors.values())
        for k in errors:
            assert record["probabilities"][k] == pytest.approx(errors[k] / total if total else 0.5, abs=1e-9)


def test_resumed_run_ends_with_the_same_weights(files):
    recipe = load_finetune_recipe("crt").with_overrides(FAST)

    def options(out: Path, **extra) -> CrtOptions:
        return CrtOptions(model=str(files["mlp"]), data=files["train"], out=out, recipe=recipe,
                          attacks=("linf", "stadv"), seed=3, **extra)

    whole = files["root"] / "whole"
    run_crt(options(whole))
    cut = files["root"] / "cut"
    assert run_crt(options(cut, stop_after_steps=3)) == {}
    assert not cut.exists() and (CrtRun.work_dir_for(cut) / "checkpoint").exists()
    run_crt(options(cut))
    a, b = load_file(str(whole / "model.safetensors")), load_file(str(cut / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (whole / "crt_log.jsonl").read_text().count("\n") == (cut / "crt_log.jsonl").read_text().count("\n")


def _bad_inputs(files: dict[str, Path]) -> dict[str, tuple[list[str], str]]:
    root = files["root"]
    x, y = _synthetic(30, 2)
    np.savez(root / "no_y.npz", x=x)
    np.savez(root / "big_label.npz", x=x, y=np.where(y == 2, 3, y))
    np.savez(root / "out_of_range.npz", x=x * 3, y=y)
    (root / "typo.yaml").write_text("method: crt\nregulariser:\n  kind: alr\n")
    data = ["--model", str(files["mlp"]), "--data", str(files["train"])]
    return {
        "npz without y": (["--model", str(files["mlp"]), "--data", str(root / "no_y.npz"), "--attacks", "linf"],
                          "has no array 'y'"),
        "label out of range": (["--model", str(files["mlp"]), "--data", str(root / "big_label.npz"), "--attacks",
                                "linf"], "the model has 3 classes"),
        "inputs outside the range": (["--model", str(files["mlp"]), "--data", str(root / "out_of_range.npz"),
                                      "--attacks", "linf"], "outside the valid input range"),
        "unknown attack": ([*data, "--attacks", "linf,l3"], "unknown attack 'l3'"),
        "unknown new attack": ([*data, "--attacks", "linf", "--new-attack", "fog"], "unknown attack 'fog'"),
        "recipe key typo (--set)": ([*data, "--attacks", "linf", "--set", "attacks.linf.budgte=0.1"],
                                    "unknown recipe key 'attacks.linf.budgte'"),
        "recipe key typo (yaml)": ([*data, "--attacks", "linf"], "regulariser"),
        "non-finite budget": ([*data, "--attacks", "linf", "--set", "attacks.l2.budget=.nan"], "attacks.l2.budget"),
        "no attacks": (data, "needs --attacks"),
        "new attack on a config": ([*data, "--new-attack", "l2"], "--model must be the directory"),
        "stadv on flat inputs": (["--model", str(root / "flat.json"), "--data", str(files["train"]),
                                  "--attacks", "stadv"], "input_shape must be [C, H, W]"),
    }


@pytest.mark.parametrize("case", ["npz without y", "label out of range", "inputs outside the range", "unknown attack",
                                  "unknown new attack", "recipe key typo (--set)", "recipe key typo (yaml)",
                                  "non-finite budget", "no attacks", "new attack on a config",
                                  "stadv on flat inputs"])
def test_bad_input_is_one_error_line_and_leaves_nothing(case, files):
    (files["root"] / "flat.json").write_text(json.dumps({"input_shape": [16], "num_classes": 3}))
    args, message = _bad_inputs(files)[case]
    before = sorted(p.name for p in files["root"].iterdir())
    out = files["root"] / "out"
    recipe = [str(files["root"] / "typo.yaml")] if case == "recipe key typo (yaml)" else ["crt"]
    result = runner.invoke(app, ["finetune", "--recipe", *recipe, *args, "--out", str(out)])
    assert result.exit_code != 0
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], result.output
    assert "Traceback" not in result.output
    assert sorted(p.name for p in files["root"].iterdir()) == before


def test_new_attack_already_trained_is_refused(files):
    first = files["root"] / "linf"
    assert _invoke(["--model", str(files["mlp"]), "--data", str(files["train"]), "--attacks", "linf",
                    "--out", str(first)]).exit_code == 0
    before = sorted(p.name for p in files["root"].iterdir())
    result = runner.invoke(app, ["finetune", "--recipe", "crt", "--model", str(first), "--data", str(files["train"]),
                                 "--new-attack", "linf", "--out", str(files["root"] / "again")])
    assert result.exit_code != 0 and "already trained against 'linf'" in result.output
    assert sorted(p.name for p in files["root"].iterdir()) == before


def test_language_model_recipes_refuse_crt_options(files):
    result = runner.invoke(app, ["finetune", "--recipe", "lora", "--data", str(files["train"]), "--attacks", "linf",
                                 "--out", str(files["root"] / "out")])
    assert result.exit_code == 2 and "it is for finetune --recipe crt" in result.output
