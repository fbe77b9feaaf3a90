"""`mlx calibrate --child`: a searched child timed beside its parent, speedup measured against predicted;
and `--engine vllm`, in vLLM's CPU build (marker `vllm`) or refused where there is none."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from test_calibrate import FAST
from test_export_support import make_child_dir, make_parent_dir

from mlxkit.cli.main import app
from mlxkit.engines.calibrate.run import predict_model_ms
from mlxkit.engines.hardware.profile import load_profile
from mlxkit.engines.models.decilm.blocks import AttentionVariant, BlockChoice, FFNVariant, ParentShape
from mlxkit.engines.serving.vllm import SETUP_SCRIPT, vllm_python

runner = CliRunner()
SHAPE = dict(hidden_size=256, intermediate_size=768, num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
CHILD = ("kv2+ffn768", "kv1+ffn256", "no_op+ffn256", "kv1+no_op")


@pytest.fixture
def parent_and_child(tmp_path):
    return (make_parent_dir(tmp_path / "parent", **SHAPE, num_hidden_layers=len(CHILD)),
            make_child_dir(tmp_path / "child", names=CHILD, **SHAPE))


def _choices() -> list[BlockChoice]:
    out = []
    for name in CHILD:
        attention, ffn = name.split("+")
        out.append(BlockChoice(AttentionVariant.parse(attention), FFNVariant.parse(ffn)))
    return out


def _check_child_rows(payload: dict, profile_path, decode_steps: int) -> None:
    """Every point's speedups, recomputed from the raw timings and from the written profile."""
    timings = {(t["model"], t["batch"], t["seq"]): t for t in json.loads(
        profile_path.with_name(profile_path.stem + ".report.json").read_text())["timings"]}
    profile = load_profile(profile_path)
    parent = ParentShape(256, 4, 4, 2, 64, 768, 128, False)
    parent_layers = [BlockChoice(AttentionVariant("gqa", 2), FFNVariant("mlp", 768))] * 4
    rows = payload["child"]["points"]
    assert rows and {(r["batch"], r["seq"]) for r in rows} == {(t[1], t[2]) for t in timings if t[0] == "child"}
    for row in rows:
        p, c = timings[("model", row["batch"], row["seq"])], timings[("child", row["batch"], row["seq"])]
        measured = (p["prefill_ms"] + decode_steps * p["decode_step_ms"]) / \
            (c["prefill_ms"] + decode_steps * c["decode_step_ms"])
        assert row["measured_speedup"] == pytest.approx(measured, rel=1e-9)
        def total(times: tuple[float, float]) -> float:
            return times[0] + decode_steps * times[1]

        predicted = [total(predict_model_ms(profile, parent, layers, row["batch"], row["seq"], t["decode_ctx"], "fp32"))
                     for layers, t in ((parent_layers, p), (_choices(), c))]
        assert row["predicted_speedup"] == pytest.approx(predicted[0] / predicted[1], rel=1e-9)


def test_a_child_is_timed_beside_its_parent_and_kept_out_of_the_fit(parent_and_child, tmp_path):
    parent, child = parent_and_child
    out = tmp_path / "box.yaml"
    result = runner.invoke(app, ["calibrate", "--model", str(parent), "--child", str(child), "--out", str(out),
                                 "--json", *FAST])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    _check_child_rows(payload, out, decode_steps=2)
    assert load_profile(out).engine == "transformers"  # timed in torch
    # a model of another shape is no child of this parent
    other = make_parent_dir(tmp_path / "other", **{**SHAPE, "intermediate_size": 512}, num_hidden_layers=4)
    refused = runner.invoke(app, ["calibrate", "--model", str(parent), "--child", str(other), "--out",
                                  str(tmp_path / "x.yaml"), *FAST])
    assert refused.exit_code == 2 and "is not a child of the calibrated parent" in refused.output


def test_vllm_timing_without_vllm_is_one_error_naming_the_setup_script(parent_and_child, tmp_path, monkeypatch):
    monkeypatch.setenv("MLXKIT_VLLM_PYTHON", str(tmp_path / "no-such-python"))
    parent, _ = parent_and_child
    out = tmp_path / "box.yaml"
    result = runner.invoke(app, ["calibrate", "--model", str(parent), "--engine", "vllm", "--out", str(out)])
    assert result.exit_code == 6, result.output
    assert SETUP_SCRIPT in result.output and len(result.output.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.vllm
@pytest.mark.skipif(vllm_python() is None, reason=f"needs vLLM's CPU build: run {SETUP_SCRIPT}")
def test_vllm_calibration_times_parent_and_child_in_vllm(parent_and_child, tmp_path):
    parent, child = parent_and_child
    out = tmp_path / "vllm-box.yaml"
    result = runner.invoke(app, ["calibrate", "--model", str(parent), "--child", str(child), "--engine", "vllm",
                                 "--batch", "1,2", "--seq", "16", "--copies", "2", "--repeats", "1",
                                 "--decode-steps", "4", "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    profile = load_profile(out)
    assert profile.engine == "vllm" and "vLLM 0." in profile.calibration["device"]
    _check_child_rows(payload, out, decode_steps=4)
    timed = {t["model"] for t in json.loads(out.with_name("vllm-box.report.json").read_text())["timings"]}
    assert "linear" not in timed  # vLLM builds no linear attention or FFN, so neither is timed there
