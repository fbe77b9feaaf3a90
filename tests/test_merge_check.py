"""`mlx merge`'s output check: the merged model's perplexity on a small text beside each input's."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import make_char_tokenizer, make_tiny_llama, recording_reporter
from mlxkit.engines.merge.check import CHECK_TOKENS, DEFAULT_TEXT, check_merge


def _save(model, path):
    model.save_pretrained(path)
    make_char_tokenizer().save_pretrained(path)
    (path / "mlxkit.json").write_text(json.dumps({"verb": "merge", "results": {}}))
    return path


def _perplexity(path, seq_len: int) -> float:
    """Written out here: the text's first tokens in blocks, mean next-token cross-entropy, exponentiated."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.tensor(tokenizer(DEFAULT_TEXT, add_special_tokens=False)["input_ids"][:CHECK_TOKENS])
    blocks = ids[: ids.numel() // seq_len * seq_len].view(-1, seq_len)
    with torch.no_grad():
        logits = model(blocks).logits[:, :-1].float()
    return math.exp(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), blocks[:, 1:].reshape(-1)).item())


@pytest.fixture
def models(tmp_path):
    a, b = make_tiny_llama(seed=0), make_tiny_llama(seed=1)
    merged = make_tiny_llama(seed=0)
    with torch.no_grad():
        for pm, pb in zip(merged.parameters(), b.parameters()):
            pm.add_(pb).mul_(0.5)
    return _save(a, tmp_path / "a"), _save(b, tmp_path / "b"), _save(merged, tmp_path / "merged")


def test_the_check_reports_each_models_perplexity(models):
    a, b, merged = models
    report = check_merge(merged, [str(a), str(b)], device="cpu", label="merged")
    seq_len = min(128, make_tiny_llama().config.max_position_embeddings)
    got = {row["model"]: row["perplexity"] for row in report["models"]}
    assert got["merged"] == pytest.approx(_perplexity(merged, seq_len), rel=1e-3)
    for path in (a, b):
        assert got[str(path)] == pytest.approx(_perplexity(path, seq_len), rel=1e-3)
    assert report["ratio_to_best_input"] == pytest.approx(got["merged"] / min(got[str(a)], got[str(b)]), rel=1e-6)


def test_a_broken_merge_is_flagged(models, tmp_path):
    a, b, _ = models
    broken = make_tiny_llama(seed=0)
    with torch.no_grad():
        broken.lm_head.weight.mul_(-40.0)  # confidently wrong next tokens
    broken_dir = _save(broken, tmp_path / "broken")
    reporter = recording_reporter()
    report = check_merge(broken_dir, [str(a), str(b)], device="cpu", reporter=reporter)
    assert report["looks_broken"] and report["ratio_to_best_input"] > 2
    assert any("may be broken" in line for line in reporter.lines)


def test_mlx_merge_checks_its_output_unless_told_not_to(models, tmp_path):
    from typer.testing import CliRunner

    from mlxkit.cli.main import app

    a, b, _ = models
    runner = CliRunner()
    out = tmp_path / "out"
    done = runner.invoke(app, ["merge", "--method", "linear", str(a), str(b), "-o", str(out), "--json"])
    assert done.exit_code == 0, done.output
    recorded = json.loads((out / "mlxkit.json").read_text())["results"]["check"]
    assert [row["role"] for row in recorded["models"]] == ["merged", "input", "input"]
    assert recorded["models"][0]["model"] == str(out.resolve()) and recorded["text"] == "built-in"
    assert json.loads(done.stdout)["check"] == recorded
    skipped = tmp_path / "skipped"
    done = runner.invoke(app, ["merge", "--method", "linear", str(a), str(b), "-o", str(skipped), "--no-check", "--json"])
    assert done.exit_code == 0 and "check" not in json.loads((skipped / "mlxkit.json").read_text())["results"]
    missing = tmp_path / "missing"
    done = runner.invoke(app, ["merge", "--method", "linear", str(a), str(b), "-o", str(missing), "--check",
                               str(tmp_path / "nope.txt")])
    assert done.exit_code != 0 and "nope.txt" in done.output and not missing.exists()


def test_a_model_too_large_for_the_device_skips_the_check(models, monkeypatch):
    import mlxkit.engines.training.budget as budget

    a, b, merged = models
    stored = sum(f.stat().st_size for f in merged.glob("*.safetensors"))
    monkeypatch.setattr(budget, "device_memory_bytes", lambda device: stored)  # the model alone is the whole memory
    reporter = recording_reporter()
    report = check_merge(merged, [str(a), str(b)], device="cpu", reporter=reporter)
    assert "skipped" in report and "mlx eval" in report["skipped"]
    assert any(line.startswith("check skipped") for line in reporter.lines)
