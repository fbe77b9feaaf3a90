"""mergekit configs run unchanged through `mlx merge --config`, on tiny random Llamas.

Each fixture under fixtures/mergekit/ is written as mergekit's documentation writes its examples;
the models are directories next to the config (./base, ./model-a, ...).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from mlxkit.cli.main import app
from test_merge_common import add_char_tokenizer, make_base, make_finetune, state

runner = CliRunner()
FIXTURES = Path(__file__).parent / "fixtures" / "mergekit"
CONFIGS = sorted(FIXTURES.glob("*.yml"))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("mergekit")
    base = make_base(root / "base")
    for i, name in enumerate(["model-a", "model-b", "model-c"]):
        make_finetune(base, root / name, seed=70 + i)
    add_char_tokenizer(root / "model-b")
    return root


def _run(workdir: Path, config: Path, out: str, monkeypatch, *extra: str):
    monkeypatch.chdir(workdir)
    return runner.invoke(app, ["merge", "--config", str(config), "-o", out, "--device", "cpu", "-q", *extra])


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_mergekit_example_config_runs(workdir, config, monkeypatch, tmp_path):
    out = tmp_path / "out"
    res = _run(workdir, config, str(out), monkeypatch)
    assert res.exit_code == 0, res.output
    merged = state(out)
    reference = state(workdir / "base")
    assert merged and all(torch.isfinite(t.float()).all() for t in merged.values())
    cfg = json.loads((out / "config.json").read_text())
    if config.stem == "passthrough":
        assert cfg["num_hidden_layers"] == 3
        assert set(merged) == {n.replace("layers.1.", "layers.2.") for n in reference} | set(reference)
    else:
        assert set(merged) == set(reference)
        assert cfg["num_hidden_layers"] == 2
    assert (out / "merge.yaml").exists()


def test_passthrough_slices_copy_and_scale_layers(workdir, monkeypatch, tmp_path):
    out = tmp_path / "out"
    assert _run(workdir, FIXTURES / "passthrough.yml", str(out), monkeypatch).exit_code == 0
    merged, a = state(out), state(workdir / "model-a")
    for name, value in a.items():
        assert torch.equal(merged[name], value.to(torch.bfloat16)), name
    for name, value in a.items():
        if "layers.1." not in name:
            continue
        copied = merged[name.replace("layers.1.", "layers.2.")]
        expected = torch.zeros_like(value) if ("o_proj" in name or "down_proj" in name) else value
        assert torch.equal(copied, expected.to(torch.bfloat16)), name


def _slerp(t, a, b):
    """SLERP of two flattened tensors, written out for the test (float64)."""
    a64, b64 = a.double().flatten(), b.double().flatten()
    cos = float(a64 @ b64 / (a64.norm() * b64.norm()))
    omega = math.acos(cos)
    return ((math.sin((1 - t) * omega) * a64 + math.sin(t * omega) * b64) / math.sin(omega)).view(a.shape)


def test_slerp_gradients_follow_the_layers(workdir, monkeypatch, tmp_path):
    out = tmp_path / "out"
    assert _run(workdir, FIXTURES / "slerp.yml", str(out), monkeypatch, "--save-dtype", "float32").exit_code == 0
    merged, a, b = state(out), state(workdir / "model-a"), state(workdir / "model-b")
    # 2 layers: layer 0 at position 0, layer 1 at position 1 of each gradient
    cases = {"model.layers.0.self_attn.q_proj.weight": 0.0, "model.layers.1.self_attn.q_proj.weight": 1.0,
             "model.layers.0.mlp.up_proj.weight": 1.0, "model.layers.1.mlp.up_proj.weight": 0.0,
             "model.layers.0.input_layernorm.weight": 0.5, "lm_head.weight": 0.5}
    for name, t in cases.items():
        torch.testing.assert_close(merged[name].double(), _slerp(t, a[name], b[name]), atol=1e-6, rtol=1e-5)


def test_task_arithmetic_gradient_filter_and_lambda(workdir, monkeypatch, tmp_path):
    out = tmp_path / "out"
    assert _run(workdir, FIXTURES / "task_arithmetic.yml", str(out), monkeypatch).exit_code == 0
    merged, base = state(out), state(workdir / "base")
    a, b = state(workdir / "model-a"), state(workdir / "model-b")
    for name in base:
        # weight [0, 0.5, 1] over 2 layers: 1 at layer 1; layer 0 and every tensor outside the layers at 0
        at = 1.0 if "layers.1." in name else 0.0
        wa = at
        wb = 0.5 if "mlp" in name else 0.2
        expected = base[name] + 0.8 * (wa * (a[name] - base[name]) + wb * (b[name] - base[name]))
        torch.testing.assert_close(merged[name], expected, atol=1e-6, rtol=1e-5)


def test_ties_drops_the_listed_base(workdir, monkeypatch, tmp_path):
    out = tmp_path / "out"
    res = _run(workdir, FIXTURES / "ties.yml", str(out), monkeypatch, "--dry-run", "--json")
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout)
    assert [Path(m).name for m in plan["models"]] == ["model-a", "model-b", "model-c"]


def test_tokenizer_source_and_chat_template(workdir, monkeypatch, tmp_path):
    out = tmp_path / "out"
    assert _run(workdir, FIXTURES / "chat_template.yml", str(out), monkeypatch).exit_code == 0
    assert (out / "tokenizer.json").read_text() == (workdir / "model-b" / "tokenizer.json").read_text()
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_cfg["chat_template"]
    assert (out / "chat_template.jinja").read_text() == tok_cfg["chat_template"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("extra,message", [
    ("tokenizer_source: union\ntokenizer:\n  source: union\n", "give tokenizer_source or tokenizer, not both"),
    ("tokenizer:\n  source: base\n  tokens: {}\n", "'tokens' is not a key mlx merge supports"),
    ("modules: {}\n", "'modules' is not a key mlx merge supports"),
    ("chat_template: vicuna-v9\n", "chat_template 'vicuna-v9' is not supported"),
    ("tokenizer_source: ./elsewhere\n", "tokenizer source './elsewhere' is not one of the merged models"),
])
def test_unsupported_keys_are_one_error_line(workdir, monkeypatch, tmp_path, extra, message):
    config = tmp_path / "c.yml"
    config.write_text((FIXTURES / "linear.yml").read_text() + extra)
    res = _run(workdir, config, str(tmp_path / "out"), monkeypatch)
    assert res.exit_code != 0
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], res.output
    assert not (tmp_path / "out").exists()


def test_recipe_and_config_together_is_refused(workdir, monkeypatch, tmp_path):
    res = _run(workdir, FIXTURES / "linear.yml", str(tmp_path / "o"), monkeypatch, "--recipe", "x.yaml")
    assert res.exit_code != 0 and "not both" in res.output
