"""Every model mlxkit writes gets a model card generated from its manifest, and the two agree."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from conftest import make_tiny_llama, save_with_tokenizer
from mlxkit.cli.main import app

runner = CliRunner()
GKD = ["--set", "data.seq_len=32", "--set", "data.held_out_sequences=2", "--set", "optim.batch_sequences=4",
       "--set", "schedule.eval_every=2"]


def _card(directory: Path) -> tuple[dict, str]:
    text = (directory / "README.md").read_text()
    match = re.match(r"---\n(.*?)\n---\n(.*)", text, re.S)
    assert match, text[:200]
    return yaml.safe_load(match.group(1)), match.group(2)


def _table(body: str, heading: str) -> list[list[str]]:
    section = body.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in section.splitlines()
            if line.startswith("|") and not line.startswith("|---")][1:]


def _manifest(directory: Path) -> dict:
    return json.loads((directory / "mlxkit.json").read_text())


@pytest.fixture
def pair(tmp_path) -> tuple[Path, Path]:
    teacher = save_with_tokenizer(make_tiny_llama(seed=0), tmp_path / "teacher")
    # The parent's own card carries its license; the output's card must carry it over.
    (teacher / "README.md").write_text("---\nlicense: apache-2.0\nlanguage: en\n---\n# teacher\n")
    return teacher, save_with_tokenizer(make_tiny_llama(seed=1), tmp_path / "student")


def test_a_distilled_model_s_card_names_its_base_and_license_and_reports_the_manifest_s_numbers(pair, text_file,
                                                                                              tmp_path):
    out = tmp_path / "distilled"
    result = runner.invoke(app, ["distill", "--gkd", "--teacher", str(pair[0]), "--student", str(pair[1]), "--data",
                                 str(text_file), "--tokens", str(3 * 4 * 32), "--out", str(out), *GKD, "--json"])
    assert result.exit_code == 0, result.output
    front, body = _card(out)
    assert front["base_model"] == str(pair[0]) and front["license"] == "apache-2.0"
    assert front["library_name"] == "transformers" and front["pipeline_tag"] == "text-generation"
    assert front["tags"] == ["mlxkit", "distillation"]
    results = _manifest(out)["results"]
    names = {"held-out perplexity": "perplexity", "KL(parent ‖ model)": "kl_div",
             "top-1 agreement with the parent": "top1_agreement"}
    rows = _table(body, "Measured")
    assert len(rows) == 6
    for stage, label, value in rows:
        assert float(value) == pytest.approx(results[stage][names[label]], rel=1e-5)
    assert _manifest(out)["command"].split()[1:3] == ["distill", "--gkd"] or "distill" in body
    assert not any(p.name.startswith(".") for p in out.parent.iterdir() if p.name != ".cache")


def test_a_merge_s_card_lists_every_input_as_its_base(tmp_path):
    base = save_with_tokenizer(make_tiny_llama(seed=0), tmp_path / "base")
    tuned = [save_with_tokenizer(make_tiny_llama(seed=s), tmp_path / f"ft{s}") for s in (1, 2)]
    out = tmp_path / "merged"
    result = runner.invoke(app, ["merge", "--method", "task-arithmetic", *map(str, tuned), "--base", str(base),
                                 "--device", "cpu", "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    front, body = _card(out)
    assert front["base_model"] == [str(base), *map(str, tuned)] and front["tags"] == ["mlxkit", "merge"]
    assert "license" not in front  # none of the inputs has a card that says
    assert "# merged" in body


def test_a_searched_child_s_card_has_the_predicted_figures_of_its_manifest(built_library, text_file, tmp_path):
    out = tmp_path / "child"
    result = runner.invoke(app, ["search", "--library", str(built_library), "--throughput", "1.3x", "--data",
                                 str(text_file), "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    front, body = _card(out)
    assert front["tags"] == ["mlxkit", "puzzle"]
    manifest = _manifest(out)
    predicted = manifest["results"]["predicted"]
    rows = {label: (child, parent) for label, child, parent in _table(body, "Predicted on the target")}
    assert float(rows["throughput (tokens/s)"][0]) == pytest.approx(predicted["tokens_per_s"], rel=1e-5)
    assert float(rows["throughput (tokens/s)"][1]) == pytest.approx(predicted["parent_tokens_per_s"], rel=1e-5)
    assert float(rows["memory (MiB)"][0]) == pytest.approx(predicted["memory_mib"], rel=1e-5)
    assert f"{predicted['speedup']:.3f}x" in body
    assert "# child" in body and 'from_pretrained("child"' in body
    measured = {label: float(value) for stage, label, value in _table(body, "Measured") if stage == "child"}
    assert measured["held-out perplexity"] == pytest.approx(manifest["results"]["evaluation"]["perplexity"], rel=1e-5)
