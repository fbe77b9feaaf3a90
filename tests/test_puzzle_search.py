"""`mlx search` end to end on a tiny parent, and `--costs-only` from a config alone."""

from __future__ import annotations

import itertools
import json
import math
import re

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from conftest import lp_terms
import mlxkit  # noqa: F401  (registers the Auto classes)
from mlxkit.cli.main import app
from mlxkit.engines.hardware.costs import CostModel
from mlxkit.engines.hardware.profile import load_profile
from mlxkit.engines.models.decilm.blocks import AttentionVariant, FFNVariant
from mlxkit.engines.puzzle.library.store import LibraryDir, read_library

runner = CliRunner()


def _search(*args: str) -> dict:
    result = runner.invoke(app, ["search", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_search_saves_a_child_that_loads_and_evaluates_as_reported(built_library, tiny_llama_dir, tmp_path):
    out = tmp_path / "child"
    payload = _search("--target", "h100", "--library", str(built_library), "--throughput", "1.3x", "--out", str(out),
                      "--refine", "0")
    assert payload["predicted"]["speedup"] >= 1.3 - 1e-6
    assert len(payload["choices"]) == 2 and payload["objective"] > 0
    library = read_library(built_library)
    expected = sum(library.layers[c["layer"]].entries(kind)[c[kind]].metrics["kl_div"]
                   for c in payload["choices"] for kind in ("attention", "ffn"))
    assert payload["objective"] == pytest.approx(expected, rel=1e-6)
    child = AutoModelForCausalLM.from_pretrained(out).eval()
    config = json.loads((out / "config.json").read_text())
    for row, block in zip(payload["choices"], config["block_configs"]):
        assert (row["attention"] == "no_op") == block["attention"]["no_op"]
        assert (row["ffn"] == "linear") == block["ffn"]["replace_with_linear"]
    assert sum(p.numel() for p in child.parameters()) == payload["num_params"]
    generated = child.generate(torch.tensor([[1, 40, 50]]), max_new_tokens=4, do_sample=False, pad_token_id=2)
    assert generated.shape == (1, 7)
    manifest = json.loads((out / "mlxkit.json").read_text())
    assert manifest["verb"] == "search" and manifest["results"]["choices"] == payload["choices"]

    # The reported evaluation, recomputed from the saved child and the plain transformers parent
    # on the same held-out tokens (all positions that predict a next token).
    val = torch.load(built_library / ".work" / "tokens.pt", weights_only=True)["val"][:4]
    parent = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    with torch.no_grad():
        child_logits, parent_logits = child(val).logits[:, :-1].float(), parent(val).logits[:, :-1].float()
    targets = val[:, 1:].reshape(-1)
    vocab = child_logits.shape[-1]
    child_nll = F.cross_entropy(child_logits.reshape(-1, vocab), targets).item()
    parent_nll = F.cross_entropy(parent_logits.reshape(-1, vocab), targets).item()
    p, q = F.log_softmax(parent_logits, -1), F.log_softmax(child_logits, -1)
    evaluation = payload["evaluation"]
    assert evaluation["tokens"] == targets.numel()
    assert evaluation["perplexity"] == pytest.approx(math.exp(child_nll), rel=1e-4)
    assert evaluation["parent_perplexity"] == pytest.approx(math.exp(parent_nll), rel=1e-4)
    assert evaluation["kl_div"] == pytest.approx((p.exp() * (p - q)).sum(-1).mean().item(), rel=1e-4, abs=1e-6)
    assert evaluation["top1_agreement"] == pytest.approx((p.argmax(-1) == q.argmax(-1)).float().mean().item())
    assert evaluation["kl_div"] > 0  # the child differs from its parent


def test_infeasible_budget_explains_the_best_reachable(built_library, tmp_path):
    result = runner.invoke(app, ["search", "--library", str(built_library), "--memory", "1KiB",
                                 "--out", str(tmp_path / "never")])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "memory" in result.output and "smallest" in result.output
    assert not (tmp_path / "never").exists()


def test_batch_sweep_keeps_the_batch_whose_own_search_is_best(built_library):
    # 200,000 tok/s on the CPU profile: small batches cannot reach it at all, and larger ones
    # reach it with different amounts of pruning. Each batch is solved on its own, then compared.
    common = ["--library", str(built_library), "--target", "cpu", "--throughput", "200000", "--memory", "16MiB",
              "--dry-run"]
    batches = (1, 8, 64, 128, 256, 512)
    alone: dict[int, dict] = {}
    for batch in batches:
        result = runner.invoke(app, ["search", *common, "--scenario", f"batch={batch}", "--json"])
        alone[batch] = json.loads(result.stdout)
        assert result.exit_code == (4 if "error" in alone[batch] else 0), result.output
    feasible = [b for b in batches if "error" not in alone[b]]
    assert 1 not in feasible and len({round(alone[b]["objective"], 9) for b in feasible}) > 1  # the sweep matters
    best = min(alone[b]["objective"] for b in feasible)
    winner = max(b for b in feasible if alone[b]["objective"] <= best + 1e-12)  # ties go to the larger batch

    swept = _search(*common, "--batch-sweep", ",".join(map(str, batches)))
    assert swept["scenario"]["batch"] == winner
    assert swept["objective"] == pytest.approx(alone[winner]["objective"])
    assert swept["choices"] == alone[winner]["choices"]
    assert swept["predicted"] == pytest.approx(alone[winner]["predicted"])
    for batch in batches:
        if batch in feasible:
            assert swept["batch_sweep"][str(batch)] == pytest.approx(alone[batch]["objective"])
        else:
            assert swept["batch_sweep"][str(batch)] == alone[batch]["error"]["message"]


def test_diverse_solutions(built_library):
    payload = _search("--library", str(built_library), "--throughput", "1.2x", "--solutions", "2",
                      "--min-distance", "1", "--dry-run")
    assert payload["alternatives"] and payload["alternatives"][0]["distance_from_best"] >= 1
    assert payload["alternatives"][0]["objective"] >= payload["objective"]
    assert "out" not in payload


def test_target_cpu_prices_the_cpu_profiles_own_scenario(built_library):
    cpu = load_profile("cpu")
    payload = _search("--library", str(built_library), "--target", "cpu", "--dry-run")
    assert payload["scenario"] == cpu.default_scenario.to_dict()
    assert payload["scenario"]["batch"] == 1 and payload["scenario"]["weight_dtype"] == "fp32"
    shape = read_library(built_library).parent.shape
    parent = CostModel(shape, cpu, cpu.default_scenario).parent_model()
    assert payload["predicted"]["parent_runtime_ms"] == pytest.approx(parent.runtime_ms)
    assert payload["predicted"]["parent_memory_mib"] == pytest.approx(parent.memory_mib)
    # --scenario replaces only the fields it names.
    changed = _search("--library", str(built_library), "--target", "cpu", "--scenario", "batch=4", "--dry-run")
    assert changed["scenario"] == {**cpu.default_scenario.to_dict(), "batch": 4}
    assert _search("--library", str(built_library), "--target", "h100", "--dry-run")["scenario"] == {
        "batch": 256, "input_len": 128, "output_len": 1024, "weight_dtype": "fp8", "kv_dtype": "fp8"}


def test_write_costs_and_lp_match_the_cost_model(built_library, tmp_path):
    costs_file, lp_file = tmp_path / "costs.json", tmp_path / "puzzle.lp"
    payload = _search("--library", str(built_library), "--target", "h100", "--throughput", "1.3x", "--dry-run",
                      "--write-costs", str(costs_file), "--write-lp", str(lp_file))
    assert payload["costs_file"] == str(costs_file) and payload["lp_file"] == str(lp_file)
    library = read_library(built_library)
    h100 = load_profile("h100")
    cm = CostModel(library.parent.shape, h100, h100.scenario())

    costs = json.loads(costs_file.read_text())
    assert costs["context"]["profile"] == "h100" and costs["context"]["scenario"] == payload["scenario"]
    assert costs["non_block"] == pytest.approx(cm.non_block().stats())
    assert [layer["layer"] for layer in costs["layers"]] == [0, 1]
    for layer, entry in zip(costs["layers"], library.layers):
        assert set(layer["attention"]) == set(entry.attention) and set(layer["ffn"]) == set(entry.ffn)
        for name, stats in layer["attention"].items():
            assert stats == pytest.approx(cm.attention(AttentionVariant.parse(name)).stats())
        for name, stats in layer["ffn"].items():
            assert stats == pytest.approx(cm.ffn(FFNVariant.parse(name)).stats())

    text = lp_file.read_text()
    assert text.splitlines()[1] == "Minimize"
    objective = lp_terms(text.split("Subject To")[0].split(":", 1)[1])
    cap = re.search(r"cap_runtime_ms:(.*?)<= *([-+0-9.e]+)", text, re.S)
    runtime = lp_terms(cap.group(1))
    assert float(cap.group(2)) == pytest.approx(payload["caps"]["runtime_ms"] - cm.non_block().runtime_ms, rel=1e-9)
    variables = set(re.findall(r"^(L\d+_\w+)$", text.split("Binaries")[1], re.M))
    assert variables and variables >= set(objective) | set(runtime)
    for var in variables:  # dominated options are left out of the model; every one kept is priced right
        layer, kind, name = re.fullmatch(r"L(\d+)_(attention|ffn)_(\w+)", var).groups()
        entry = library.layers[int(layer)].entries(kind)[name]
        cost = cm.attention(entry.variant) if kind == "attention" else cm.ffn(entry.variant)
        assert objective.get(var, 0.0) == pytest.approx(entry.metrics["kl_div"], rel=1e-9, abs=1e-12)
        assert runtime.get(var, 0.0) == pytest.approx(cost.runtime_ms, rel=1e-9)
    assert len(re.findall(r"^one_L\d+_(attention|ffn):", text, re.M)) == 4


def test_costs_library_uses_the_stats_an_mlxkit_library_records(built_library):
    # A library built by `mlx distill` records no costs, so --costs library refuses it ...
    refused = runner.invoke(app, ["search", "--library", str(built_library), "--costs", "library", "--dry-run"])
    assert refused.exit_code == 2 and "no stats" in refused.output
    # ... until stats are recorded (as a measurement on the target would): deliberately unlike
    # the cost model's, so the result shows which ones the search used.
    data = json.loads((built_library / "library.json").read_text())
    size = {"kv2": 10.0, "kv1": 7.0, "linear": 2.0, "no_op": 0.0, "ffn64": 10.0, "ffn32": 4.0}
    for layer in data["layers"]:
        for kind in ("attention", "ffn"):
            for name, entry in layer[kind].items():
                scale = size[name] if name in size else 2.0  # the FFN's linear variant
                entry["stats"] = {"runtime_ms": scale * (layer["layer"] + 1), "memory_mib": scale, "num_params": 1e3 * scale}
    data["non_block"] = {"stats": {"runtime_ms": 5.0, "memory_mib": 1.0, "num_params": 500.0}}
    data["stats_context"] = {"profile": "measured by hand", "source": "test"}
    (built_library / "library.json").write_text(json.dumps(data))
    library = read_library(built_library)

    payload = _search("--library", str(built_library), "--costs", "library", "--throughput", "1.5x", "--dry-run")
    entries = [(layer.layer, kind, layer.entries(kind)) for layer in library.layers for kind in ("attention", "ffn")]
    parent_runtime = 5.0 + sum(e["kv2" if kind == "attention" else "ffn64"].stats["runtime_ms"]
                               for _, kind, e in entries)
    cap = parent_runtime / 1.5
    best = None  # brute force over every architecture, on the stored stats
    for picks in itertools.product(*(list(e.items()) for _, _, e in entries)):
        runtime = 5.0 + sum(item.stats["runtime_ms"] for _, item in picks)
        score = sum(item.metrics["kl_div"] for _, item in picks)
        if runtime <= cap + 1e-9 and (best is None or score < best - 1e-12):
            best = score
    assert payload["costs"] == "library" and payload["caps"]["runtime_ms"] == pytest.approx(cap)
    assert payload["objective"] == pytest.approx(best, abs=1e-9)
    chosen = [library.layers[c["layer"]].entries(kind)[c[kind]] for c in payload["choices"] for kind in ("attention", "ffn")]
    assert payload["predicted"]["runtime_ms"] == pytest.approx(5.0 + sum(e.stats["runtime_ms"] for e in chosen))
    assert payload["predicted"]["memory_mib"] == pytest.approx(1.0 + sum(e.stats["memory_mib"] for e in chosen))
    assert payload["predicted"]["parent_runtime_ms"] == pytest.approx(parent_runtime)


def test_costs_only_prices_from_a_config_without_weights(tiny_llama_dir, tmp_path):
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_text((tiny_llama_dir / "config.json").read_text())
    report = _search("--costs-only", "--model", str(config_only / "config.json"), "--target", "a100-80gb")
    assert set(report["attention"]) == {"kv2", "kv1", "linear", "no_op"}
    assert report["attention"]["kv2"]["num_params"] > report["attention"]["kv1"]["num_params"]
    assert report["ffn"]["no_op"]["num_params"] == 0
    assert report["scenario"] == load_profile("a100-80gb").default_scenario.to_dict()


def test_search_builds_the_missing_library_then_reuses_it(tiny_llama_dir, text_file, tiny_recipe_file, tmp_path):
    args = ["--model", str(tiny_llama_dir), "--recipe", str(tiny_recipe_file), "--data", str(text_file),
            "--throughput", "1.2x"]
    first = _search(*args, "--out", str(tmp_path / "a"))
    library = first["library"]
    assert (tmp_path / "a" / "config.json").exists()
    block = next(LibraryDir(library).blocks.glob("*.safetensors"))
    stamp = block.stat().st_mtime_ns
    second = _search(*args, "--out", str(tmp_path / "b"))
    assert second["library"] == library and block.stat().st_mtime_ns == stamp


def test_export_gguf_searches_without_linear_ffn_and_writes_the_gguf(built_library, tiny_llama_dir, tmp_path):
    from gguf import GGUFReader

    from test_export_support import make_bpe_tokenizer

    # The parent's own tokenizer is checked before the search: llama.cpp needs BPE merges.
    refused = runner.invoke(app, ["search", "--target", "h100", "--library", str(built_library), "--out",
                                  str(tmp_path / "refused"), "--export", "gguf"])
    assert refused.exit_code == 2 and "no BPE merges" in refused.output and not (tmp_path / "refused").exists()
    make_bpe_tokenizer().save_pretrained(tiny_llama_dir)
    full = tmp_path / "full.json"
    _search("--target", "h100", "--library", str(built_library), "--dry-run", "--write-costs", str(full))
    restricted = tmp_path / "restricted.json"
    _search("--target", "h100", "--library", str(built_library), "--dry-run", "--export", "gguf",
            "--write-costs", str(restricted))
    for every, kept in zip(json.loads(full.read_text())["layers"], json.loads(restricted.read_text())["layers"]):
        assert set(every["ffn"]) - set(kept["ffn"]) == {"linear"}
        assert kept["attention"] == every["attention"]

    out = tmp_path / "child"
    payload = _search("--target", "h100", "--library", str(built_library), "--throughput", "1.3x", "--out", str(out),
                      "--export", "gguf")
    assert all(c["ffn"] != "linear" for c in payload["choices"])
    gguf_file = out / "model-f32.gguf"
    assert payload["export"]["out"] == str(gguf_file) and gguf_file.with_name("model-f32.gguf.mlxkit.json").exists()
    reader = GGUFReader(gguf_file)
    assert reader.fields["general.architecture"].contents() == "deci"
    lengths = reader.fields["deci.feed_forward_length"].contents()
    config = json.loads((out / "config.json").read_text())
    for length, block in zip(lengths, config["block_configs"]):
        if not block["ffn"]["no_op"]:
            assert length == block["ffn"]["intermediate_size"]


@pytest.mark.parametrize("args, message", [
    (["--export", "onnx"], "unknown export format 'onnx'"),
    (["--export", "hf", "--encoding", "q8_0"], "q8_0 is a GGUF type"),
])
def test_export_options_are_checked_before_any_work(args, message, tmp_path):
    result = runner.invoke(app, ["search", "--target", "h100", "--library", str(tmp_path / "missing"),
                                 "--out", str(tmp_path / "child"), *args])
    assert result.exit_code != 0 and message in result.output
    assert not (tmp_path / "child").exists()


def test_a_parent_the_export_format_cannot_hold_fails_before_the_library_is_built(tmp_path, monkeypatch):
    from conftest import make_tiny_llama, save_with_tokenizer
    from mlxkit.engines.puzzle.library import build

    parent = save_with_tokenizer(make_tiny_llama(head_dim=16), tmp_path / "parent")  # not hidden / heads
    monkeypatch.setattr(build, "run_library_build", lambda *a, **k: pytest.fail("the library build started"))
    result = runner.invoke(app, ["search", "--model", str(parent), "--target", "h100", "--export", "nemotron-nas",
                                 "--out", str(tmp_path / "child")])
    assert result.exit_code == 2 and "Nemotron-NAS derives head_dim" in result.output
    assert not (tmp_path / "child").exists()
