"""`mlx calibrate` end to end on a tiny random Llama (CPU, a few seconds)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from mlxkit.cli.main import app
from mlxkit.engines.calibrate.fit import apply_params, fit_profile
from mlxkit.engines.calibrate.run import calibration_variants
from mlxkit.engines.hardware.costs import CostModel
from mlxkit.engines.hardware.profile import load_profile
from mlxkit.engines.hardware.scenario import Scenario
from mlxkit.engines.models.decilm.blocks import FFNVariant, ParentShape

# One thread: tiny ops on a busy 2-core machine are dominated by OpenMP hand-offs otherwise.
FAST = ["--batch", "1,2", "--seq", "8,16", "--copies", "2", "--repeats", "1", "--decode-steps", "2", "--threads", "1"]


def test_calibrate_cli_writes_a_loadable_profile_and_report(tiny_llama_dir, tmp_path):
    out = tmp_path / "profiles" / "tinybox.yaml"
    runner = CliRunner()
    result = runner.invoke(app, ["calibrate", "--model", str(tiny_llama_dir), "--out", str(out), "--json", *FAST])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["profile"] == str(out)
    profile = load_profile(out)
    assert profile.name == "tinybox"
    assert profile.calibration["model"] == str(tiny_llama_dir)
    assert "measured by mlx calibrate" in profile.sources["efficiency"]
    report = json.loads((tmp_path / "profiles" / "tinybox.report.json").read_text())
    kinds = {(row["variant"], row["kind"]) for row in report["variants"]}
    assert ("kv2", "attention") in kinds and ("linear", "ffn") in kinds
    assert len(report["whole_model"]) == 4  # 2 batches x 2 prompt lengths
    for row in report["whole_model"]:
        assert row["decode_step_ms"]["measured"] > 0 and row["decode_step_ms"]["predicted"] > 0
        # The KV-cache formula is exact: batch x tokens x kv_heads x head_dim x 2 x bytes per layer.
        kv = row["memory"]["kv_cache_mib"]
        assert kv["predicted"] == pytest.approx(kv["measured"])
        weights = row["memory"]["weights_mib"]
        assert weights["predicted"] == pytest.approx(weights["measured"])
    assert report["summary"]["whole_model_decode_max_abs_rel_error"] is not None

    # Refusing to overwrite, then a table on request.
    again = runner.invoke(app, ["calibrate", "--model", str(tiny_llama_dir), "--out", str(out), *FAST])
    assert again.exit_code == 2 and "already exists" in again.output
    table = runner.invoke(app, ["calibrate", "--model", str(tiny_llama_dir), "--out", str(out), "--overwrite", *FAST])
    assert table.exit_code == 0, table.output
    assert "whole model" in table.output and "wrote" in table.output


def test_calibrate_rejects_bad_flags(tiny_llama_dir, tmp_path):
    runner = CliRunner()
    base = ["calibrate", "--model", str(tiny_llama_dir)]
    assert runner.invoke(app, [*base, "--out", str(tmp_path / "x.yaml"), "--device", "tpu"]).exit_code == 2
    assert runner.invoke(app, [*base, "--out", str(tmp_path / "x.yaml"), "--batch", "0"]).exit_code == 2
    assert runner.invoke(app, [*base, "--out", str(tmp_path / "x.txt"), *FAST]).exit_code == 2


def test_fit_recovers_known_efficiencies():
    # Synthetic "measurements" from a known profile: the fit must find it again from another start.
    parent = ParentShape(512, 4, 8, 4, 64, 1536, 1000, True)
    truth = apply_params(load_profile("cpu"), {"matmul": 0.42, "memory": 0.61, "kernel_overhead_us": 12.0})
    cases = [(b, s, w) for b in (1, 8) for s in (16, 256) for w in (384, 1536)]

    def predict(profile):
        out = []
        for batch, seq, width in cases:
            cm = CostModel(parent, profile, Scenario(batch, seq, 2, "fp32", "fp32"))
            out += [cm.ffn_step_ms(FFNVariant("mlp", width), batch, seq), cm.ffn_step_ms(FFNVariant("mlp", width), batch, 1)]
        return np.array(out)

    start = apply_params(truth, {"matmul": 0.1, "memory": 0.2, "kernel_overhead_us": 1.0})
    fit = fit_profile(start, predict, predict(truth), fit=("matmul", "memory", "kernel_overhead_us"))
    assert fit.params["matmul"] == pytest.approx(0.42, rel=0.02)
    assert fit.params["memory"] == pytest.approx(0.61, rel=0.02)
    assert fit.params["kernel_overhead_us"] == pytest.approx(12.0, rel=0.05)
    assert fit.max_abs_rel_error < 0.01


def test_default_calibration_variants():
    smollm = ParentShape(576, 30, 9, 3, 64, 1536, 49152, True)
    attention, ffn = calibration_variants(smollm)
    assert [v.name for v in attention] == ["kv3", "kv1", "linear"]
    assert [v.name for v in ffn] == ["ffn1536", "ffn1152", "ffn768", "ffn384", "linear"]


@pytest.mark.parametrize("args, message", [
    (["--engine", "onnx"], "--engine must be one of torch, llamacpp"),
    (["--engine", "llamacpp", "--batch", "1,4"], "use --batch 1"),
    (["--engine", "llamacpp", "--dtype", "bfloat16"], "float32 or float16"),
    (["--engine", "llamacpp", "--clock", "cpu"], "--clock cpu needs --engine torch"),
])
def test_calibrate_engine_flags_are_checked_before_any_timing(tiny_llama_dir, tmp_path, args, message):
    out = tmp_path / "x.yaml"
    result = CliRunner().invoke(app, ["calibrate", "--model", str(tiny_llama_dir), "--out", str(out), *args])
    assert result.exit_code == 2 and message in result.output, result.output
    assert not out.exists()
