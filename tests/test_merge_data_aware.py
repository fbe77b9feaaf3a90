"""Data-aware merging (RegMean, Fisher): each formula against an independent computation, the
statistics pass against forward hooks and autograd, and `mlx merge --data` end to end."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file
from typer.testing import CliRunner

from conftest import make_tiny_llama, save_with_tokenizer
from mlxkit.cli.main import app
from mlxkit.engines.errors import SingularMatrixError
from mlxkit.engines.merge.config import validate_config
from mlxkit.engines.merge.methods import registry
from mlxkit.engines.merge.methods.base import TensorJob
from mlxkit.engines.merge.methods.regmean import regmean_merge
from mlxkit.engines.merge.run import run_merge
from mlxkit.engines.merge.statistics import collect_fisher, collect_grams
from test_merge_common import state

runner = CliRunner()


def _job(name: str, statistics, weights=(1.0, 1.0), matrix: bool = True, **params) -> TensorJob:
    return TensorJob(name, matrix, params, [{"weight": w} for w in weights], statistics=statistics)


@pytest.fixture
def tiny_pair(tmp_path):
    """Two tiny random Llamas (other seeds, same byte-level tokenizer)."""
    return [save_with_tokenizer(make_tiny_llama(seed=seed), tmp_path / f"m{seed}") for seed in (3, 4)]


# ---- RegMean: the formula ------------------------------------------------------------------------

def test_regmean_single_layer_is_the_least_squares_layer():
    gen = torch.Generator().manual_seed(0)
    n, n_in, n_out = 50, 6, 4
    xs = [torch.randn(n, n_in, generator=gen, dtype=torch.float64) for _ in range(2)]
    xs[1] = xs[1] * torch.linspace(0.5, 2.0, n_in, dtype=torch.float64)  # the two tasks see different inputs
    ws = [torch.randn(n_out, n_in, generator=gen, dtype=torch.float64) for _ in range(2)]
    grams = [(x.T @ x / n).float() for x in xs]
    method = registry.get("regmean")

    merged = method.merge([w.float() for w in ws], _job("fc.weight", grams, scaling=1.0))
    # the one layer whose outputs are closest to each model's own outputs on that model's inputs
    stacked_in = torch.cat(xs)
    stacked_out = torch.cat([x @ w.T for x, w in zip(xs, ws)])
    expected = torch.linalg.lstsq(stacked_in, stacked_out).solution.T
    torch.testing.assert_close(merged.double(), expected, atol=1e-5, rtol=1e-5)

    # identical models come back unchanged, whatever their inputs
    same = method.merge([ws[0].float(), ws[0].float()], _job("fc.weight", grams, scaling=0.9))
    torch.testing.assert_close(same, ws[0].float(), atol=1e-5, rtol=1e-5)


def test_regmean_shrinks_off_diagonal_and_weighs_models():
    gen = torch.Generator().manual_seed(1)
    ws = [torch.randn(3, 5, generator=gen) for _ in range(2)]
    xs = [torch.randn(20, 5, generator=gen) for _ in range(2)]
    grams = [x.T @ x / 20 for x in xs]
    a, weights = 0.3, (2.0, 1.0)
    shrunk = [a * g.double() + (1 - a) * torch.diag(torch.diag(g.double())) for g in grams]
    expected = sum(c * w.double() @ g for c, w, g in zip(weights, ws, shrunk)) @ torch.linalg.inv(
        sum(c * g for c, g in zip(weights, shrunk)))
    merged = registry.get("regmean").merge(ws, _job("fc.weight", grams, weights, scaling=a))
    torch.testing.assert_close(merged.double(), expected, atol=1e-5, rtol=1e-5)


def test_regmean_falls_back_to_the_average_and_frees_dead_inputs():
    gen = torch.Generator().manual_seed(2)
    ws = [torch.randn(3, 4, generator=gen) for _ in range(2)]
    method = registry.get("regmean")
    # a norm, an embedding (not a matrix here), or a tensor without a Gram: the weighted average
    average = (2 * ws[0] + ws[1]) / 3
    torch.testing.assert_close(method.merge(ws, _job("norm.weight", None, (2.0, 1.0), scaling=0.9)), average)
    grams = [torch.eye(4), torch.eye(4)]
    torch.testing.assert_close(method.merge(ws, _job("embed_tokens.weight", grams, (2.0, 1.0), matrix=False,
                                                     scaling=0.9)), average)
    # an input coordinate no model's data reaches leaves its column free: it takes the average
    xs = [torch.randn(30, 4, generator=gen) for _ in range(2)]
    for x in xs:
        x[:, 2] = 0.0
    merged = regmean_merge(ws, [x.T @ x / 30 for x in xs], [1.0, 1.0], scaling=1.0)
    torch.testing.assert_close(merged[:, 2], (ws[0][:, 2] + ws[1][:, 2]) / 2)
    assert torch.isfinite(merged).all()


def test_regmean_refuses_a_singular_system():
    gen = torch.Generator().manual_seed(4)
    xs = [torch.randn(5, 16, generator=gen) for _ in range(2)]  # 10 calibration rows for 16 inputs
    ws = [torch.randn(4, 16, generator=gen) for _ in range(2)]
    grams = [x.T @ x / 5 for x in xs]
    with pytest.raises(SingularMatrixError, match="set scaling below 1 or give more calibration_tokens"):
        regmean_merge(ws, grams, [1.0, 1.0], scaling=1.0, name="fc.weight")
    assert torch.isfinite(regmean_merge(ws, grams, [1.0, 1.0], scaling=0.9)).all()  # the default shrinkage solves it


# ---- Fisher: the formula -------------------------------------------------------------------------

def test_fisher_formula_equal_fisher_is_the_average_and_floor():
    gen = torch.Generator().manual_seed(3)
    thetas = [torch.randn(5, 3, generator=gen) for _ in range(3)]
    method = registry.get("fisher")
    equal = [torch.full((5, 3), 0.7)] * 3
    torch.testing.assert_close(method.merge(thetas, _job("w", equal, (1.0, 1.0, 1.0), epsilon=1e-10)),
                               torch.stack(thetas).mean(0))
    fishers = [torch.rand(5, 3, generator=gen) + 0.01 for _ in range(3)]
    weights = (1.0, 2.0, 0.5)
    expected = (sum(w * f * t for w, f, t in zip(weights, fishers, thetas))
                / sum(w * f for w, f in zip(weights, fishers)))
    torch.testing.assert_close(method.merge(thetas, _job("w", fishers, weights, epsilon=1e-10)), expected)
    # where no model's data reaches a parameter (Fisher 0 everywhere), the floor makes it the weighted average
    zeros = [torch.zeros(5, 3)] * 3
    merged = method.merge(thetas, _job("w", zeros, weights, epsilon=1e-10))
    torch.testing.assert_close(merged, sum(w * t for w, t in zip(weights, thetas)) / sum(weights))


# ---- the statistics pass -------------------------------------------------------------------------

def test_collected_gram_is_the_inputs_gram():
    model = make_tiny_llama(seed=5)
    blocks = torch.randint(3, 100, (3, 16), generator=torch.Generator().manual_seed(0))
    grams = collect_grams(model, blocks, torch.device("cpu"))
    linear = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert set(grams) == linear

    captured: dict[str, list[torch.Tensor]] = {}
    watched = {"model.layers.0.self_attn.q_proj": model.model.layers[0].self_attn.q_proj,
               "model.layers.1.mlp.down_proj": model.model.layers[1].mlp.down_proj, "lm_head": model.lm_head}
    def keep(name: str):
        return lambda module, args: captured.setdefault(name, []).append(args[0].detach().flatten(0, -2))

    handles = [module.register_forward_pre_hook(keep(name)) for name, module in watched.items()]
    with torch.no_grad():
        for row in blocks:  # one sequence at a time: batching must not change the statistic
            model(input_ids=row.unsqueeze(0))
    for handle in handles:
        handle.remove()
    for name, rows in captured.items():
        x = torch.cat(rows).double()
        gram, count = grams[f"{name}.weight"]
        assert count == blocks.numel() == x.shape[0]
        torch.testing.assert_close(gram.double(), x.T @ x, rtol=1e-4, atol=1e-3)


def test_collected_fisher_is_the_mean_squared_gradient():
    model = make_tiny_llama(seed=6)
    blocks = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    fisher = collect_fisher(model, blocks, torch.device("cpu"))
    params = dict(model.named_parameters())
    assert set(fisher) == set(params)
    squares = []
    for row in blocks:
        logits = model(input_ids=row.unsqueeze(0)).logits[0]
        loss = F.cross_entropy(logits[:-1], row[1:])  # mean next-token loss of the sequence
        grads = torch.autograd.grad(loss, list(params.values()))
        squares.append({name: g.square() for name, g in zip(params, grads)})
    for name in params:
        torch.testing.assert_close(fisher[name], (squares[0][name] + squares[1][name]) / 2, rtol=1e-4, atol=1e-10)
    assert any(float(f.abs().max()) > 0 for f in fisher.values())
    assert all(p.grad is None for p in model.parameters())


def test_models_with_other_vocabularies_read_the_text_through_their_own_tokenizer(tmp_path, text_file):
    from conftest import recording_reporter
    from mlxkit.engines.merge.sources import resolve_input
    from mlxkit.engines.merge.statistics import calibration_statistics
    from test_merge_common import add_char_tokenizer

    byte_level = save_with_tokenizer(make_tiny_llama(seed=7), tmp_path / "bytes")
    make_tiny_llama(seed=8).save_pretrained(tmp_path / "words")
    word_level = add_char_tokenizer(tmp_path / "words")
    inputs = [resolve_input(str(byte_level)), resolve_input(str(word_level))]
    cfg = validate_config({"models": [{"model": str(byte_level)}, {"model": str(word_level)}],
                           "merge_method": "fisher", "data": str(text_file), "calibration_tokens": 64,
                           "calibration_seq_len": 32})
    reporter = recording_reporter()
    stats = calibration_statistics(cfg, "fisher", inputs, inputs[0], torch.device("cpu"), reporter)
    keys = []
    for s in stats:
        with safe_open(str(s.path), "pt") as stored:
            keys.append(json.loads(stored.metadata()["key"]))
    assert keys[0]["tokens"] != keys[1]["tokens"]  # the same text, read as each model's own ids
    assert any("each model through its own tokenizer" in line for line in reporter.lines), reporter.lines
    # rows re-indexed by token have no Fisher values in the merged order: those tensors are averaged
    for s in stats:
        assert s.get("model.embed_tokens.weight") is None and s.get("lm_head.weight") is None
        assert s.get("model.layers.0.mlp.up_proj.weight") is not None
        s.close()


# ---- end to end ----------------------------------------------------------------------------------

def test_fisher_merge_uses_the_saved_statistics_and_reuses_them(tmp_path, tiny_pair, text_file):
    from conftest import recording_reporter

    cfg = validate_config({"models": [{"model": str(m)} for m in tiny_pair], "merge_method": "fisher",
                           "data": str(text_file), "calibration_tokens": 96, "calibration_seq_len": 32})
    result = run_merge(cfg, tmp_path / "out", device="cpu")
    assert len(result["statistics"]) == 2
    fishers = [load_file(path) for path in result["statistics"]]
    thetas = [state(m) for m in tiny_pair]
    merged = state(tmp_path / "out")
    assert set(merged) == set(thetas[0])
    for name, value in merged.items():
        fs = [f[f"fisher/{name}"].clamp_min(1e-10) for f in fishers]
        expected = (fs[0] * thetas[0][name] + fs[1] * thetas[1][name]) / (fs[0] + fs[1])
        torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6)
    # the merge is not the plain average: the Fisher values matter
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.allclose(merged[name], (thetas[0][name] + thetas[1][name]) / 2, atol=1e-4)

    reporter = recording_reporter()
    again = run_merge(cfg, tmp_path / "again", device="cpu", reporter=reporter)
    assert again["statistics"] == result["statistics"]
    assert sum("reusing" in line for line in reporter.lines) == 2, reporter.lines
    assert all(torch.equal(state(tmp_path / "again")[n], merged[n]) for n in merged)


def test_cli_regmean_writes_a_loadable_model(tmp_path, tiny_pair, text_file):
    from mlxkit.engines.models.loading import load_model

    out = tmp_path / "merged"
    res = runner.invoke(app, ["merge", "--method", "regmean", "--data", str(text_file), *map(str, tiny_pair),
                              "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    payload = json.loads(res.stdout)
    assert payload["method"] == "regmean" and len(payload["statistics"]) == 2
    assert list(out.glob("*.safetensors")) and (out / "config.json").exists()
    manifest = json.loads((out / "mlxkit.json").read_text())
    assert manifest["verb"] == "merge" and "calibration_data" in manifest["inputs"]
    model = load_model(str(out), with_tokenizer=False).model
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.tensor([[5, 6, 7, 8]])).logits).all()

    # each linear weight is RegMean's solution from the stored Grams (default scaling 0.9), norms the average
    grams = [load_file(path) for path in payload["statistics"]]
    thetas, merged = [state(m) for m in tiny_pair], state(out)
    name = "model.layers.1.self_attn.o_proj.weight"
    means = [g[f"gram/{name}"] / g[f"count/{name}"].item() for g in grams]
    assert grams[0][f"count/{name}"].item() == 8192  # the default calibration budget
    expected = regmean_merge([t[name] for t in thetas], means, [1.0, 1.0], scaling=0.9)
    torch.testing.assert_close(merged[name], expected, rtol=1e-4, atol=1e-5)
    norm = "model.layers.0.input_layernorm.weight"
    torch.testing.assert_close(merged[norm], (thetas[0][norm] + thetas[1][norm]) / 2)


@pytest.mark.parametrize("method", ["regmean", "fisher"])
def test_missing_data_is_one_error_line(tmp_path, tiny_pair, method):
    out = tmp_path / "o"
    res = runner.invoke(app, ["merge", "--method", method, *map(str, tiny_pair), "--out", str(out)])
    assert res.exit_code != 0 and "Traceback" not in res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), res.output
    assert f"method '{method}' needs calibration text: pass --data" in lines[0]
    assert not out.exists()


def test_config_yaml_and_data_checks(tmp_path, tiny_pair, text_file):
    config = tmp_path / "merge.yaml"
    config.write_text(f"models:\n  - model: {tiny_pair[0]}\n  - model: {tiny_pair[1]}\nmerge_method: fisher\n")
    res = runner.invoke(app, ["merge", "--config", str(config), "-o", str(tmp_path / "o")])
    assert res.exit_code != 0 and "needs calibration text" in res.output and not (tmp_path / "o").exists()
    # calibration text given to a data-free method is refused, not ignored
    res = runner.invoke(app, ["merge", "--method", "linear", "--data", str(text_file), *map(str, tiny_pair),
                              "-o", str(tmp_path / "o")])
    assert res.exit_code != 0 and "data-aware methods (regmean, fisher)" in res.output
    # a missing calibration file fails before any model is run
    res = runner.invoke(app, ["merge", "--method", "regmean", "--data", str(tmp_path / "nope.txt"),
                              *map(str, tiny_pair), "-o", str(tmp_path / "o")])
    assert res.exit_code != 0 and "does not exist" in res.output and not (tmp_path / "o").exists()
    # the YAML key works as the flag does
    config.write_text(config.read_text() + f"data: {text_file}\ncalibration_tokens: 64\n"
                      "parameters: {epsilon: 1e-8}\n")
    res = runner.invoke(app, ["merge", "--config", str(config), "-o", str(tmp_path / "o"), "-q"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "o" / "config.json").exists()
