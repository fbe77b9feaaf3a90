"""In-context refinement of the MIP's scores: the child measurement, the corrected problem, the loop."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_tiny_llama
from mlxkit.engines.eval.language_model import evaluate
from mlxkit.engines.models.decilm.blocks import AttentionVariant, BlockChoice, FFNVariant
from mlxkit.engines.models.decilm.convert import from_parent
from mlxkit.engines.puzzle.library import activations
from mlxkit.engines.puzzle.search.assemble import child_from_blocks
from mlxkit.engines.puzzle.library.block_init import initialise
from mlxkit.engines.puzzle.search.mip import Group, Option, SearchProblem, Solver
from mlxkit.engines.puzzle.search.refine import (ChildMeasurement, Corrections, measure_child, refine, refinement_file,
                                          tokens_hash)
from mlxkit.engines.puzzle.subblocks import parent_subblock

PARENT_ATTENTION, PARENT_FFN = AttentionVariant("gqa", 2), FFNVariant("mlp", 64)


def _parent(layers: int = 3):
    parent = from_parent(make_tiny_llama(num_hidden_layers=layers)).eval()
    parent.config._attn_implementation = "sdpa"
    return parent


def _blocks(parent, choices):
    """Library-style blocks for every non-parent subblock, initialised from the parent's own states."""
    torch.manual_seed(0)
    ids = torch.randint(3, 128, (4, 16))
    pos = activations.position_embeddings(parent, 16)
    states = activations.embedded_states(parent, {"train": ids})
    blocks = {}
    with torch.no_grad():
        for layer, choice in enumerate(choices):
            tensors, states = activations.layer_states(parent.model.layers[layer], states, pos)
            h, mid = tensors["train_in"], tensors["train_mid"]
            out = states["train"]
            for kind, variant, x, y in (("attention", choice.attention, h, mid - h),
                                        ("ffn", choice.ffn, mid, out - mid)):
                if variant not in (PARENT_ATTENTION, PARENT_FFN) and variant.kind != "no_op":
                    block = initialise(parent_subblock(parent, layer, kind), variant, parent.config, layer, x, y,
                                       dtype=torch.float32)
                    blocks[(layer, kind)] = block.weights()
    return blocks


def test_child_kl_and_each_contribution_match_children_assembled_without_that_replacement():
    parent = _parent()
    choices = [BlockChoice(AttentionVariant("linear"), PARENT_FFN),
               BlockChoice(PARENT_ATTENTION, FFNVariant("mlp", 24)),
               BlockChoice(AttentionVariant("no_op"), FFNVariant("linear"))]
    blocks = _blocks(parent, choices)
    child = child_from_blocks(parent, choices, blocks).eval()
    val = torch.randint(3, 128, (2, 20), generator=torch.Generator().manual_seed(5))

    measured = measure_child(parent, child, choices, val)

    with torch.no_grad():
        assert measured.child_kl == pytest.approx(evaluate(child, val, reference=parent).kl_div, rel=1e-5)
        assert set(measured.contributions) == {(0, "attention"), (1, "ffn"), (2, "attention"), (2, "ffn")}
        for (layer, kind), delta in measured.contributions.items():
            restored = list(choices)
            old = restored[layer]
            restored[layer] = (BlockChoice(PARENT_ATTENTION, old.ffn) if kind == "attention"
                               else BlockChoice(old.attention, PARENT_FFN))
            other = child_from_blocks(parent, restored, {k: v for k, v in blocks.items() if k != (layer, kind)}).eval()
            expected = measured.child_kl - evaluate(other, val, reference=parent).kl_div
            assert delta == pytest.approx(expected, rel=1e-4, abs=1e-6), (layer, kind)
    # the swaps left the child as it was
    assert measure_child(parent, child, choices, val).child_kl == pytest.approx(measured.child_kl, rel=1e-6)


def _problem() -> SearchProblem:
    """Two layers, one group each; option 'p' is the parent's, 'a' and 'b' replacements."""
    def group(layer, a, b):
        return Group(layer, "attention", (Option("p", 0.0, {"runtime_ms": 10.0}),
                                          Option("a", a, {"runtime_ms": 5.0}),
                                          Option("b", b, {"runtime_ms": 1.0})))
    return SearchProblem([group(0, 0.1, 0.4), group(1, 0.19, 0.3)], {"runtime_ms": 0.0})


PARENTS = {(0, "attention"): "p", (1, "attention"): "p"}


def test_corrected_scores_by_hand():
    corrections = Corrections("kl_div", "t", "h100")
    measurement = ChildMeasurement(0.9, {(0, "attention"): 0.5, (1, "attention"): -0.01},
                                   {(0, "attention"): "a", (1, "attention"): "b"})
    corrections.update(measurement, isolated_sum=0.1 + 0.3)
    assert corrections.scale == pytest.approx(0.9 / 0.4)
    scores = {(g.layer, o.name): o.score for g in corrections.corrected(_problem(), PARENTS).groups for o in g.options}
    assert scores == pytest.approx({(0, "p"): 0.0, (0, "a"): 0.5, (0, "b"): 0.4 * 2.25,
                                    (1, "p"): 0.0, (1, "a"): 0.19 * 2.25, (1, "b"): 0.0})


def test_the_loop_measures_corrects_and_keeps_the_best_child(tmp_path):
    """A synthetic truth where option 'a' of layer 0 compounds badly with anything in layer 1."""
    problem = _problem()
    solver = Solver.build(problem)
    caps = {"runtime_ms": 11.0}  # at most one group keeps the parent; forces a trade-off

    def measure(solution):
        picks = solution.picks
        truth = {"p": 0.0, "a": 0.1, "b": 0.4}
        base = {0: truth[picks[(0, "attention")]], 1: {"p": 0.0, "a": 0.19, "b": 0.3}[picks[(1, "attention")]]}
        interaction = 1.0 if picks[(0, "attention")] == "a" and picks[(1, "attention")] != "p" else 0.0
        contributions = {(layer, "attention"): base[layer] + interaction
                         for layer in (0, 1) if picks[(layer, "attention")] != "p"}
        return ChildMeasurement(sum(base.values()) + interaction, contributions,
                                {key: picks[key] for key in contributions})

    result = refine(problem, lambda p: Solver.build(p).solve(caps), measure, PARENTS,
                    Corrections("kl_div", "t", "h100"), max_rounds=4)
    # Isolated scores pick (a, a): 0.29, which measures 1.29. Corrected, (p, b) is predicted at
    # 0.3 · 1.29 / 0.29 and measures 0.3; solved again with that, it is chosen again.
    assert solver.solve(caps).choices == result.rounds[0].choices
    assert [[c["attention"] for c in r.choices] for r in result.rounds] == [["a", "a"], ["p", "b"]]
    assert [r.measured for r in result.rounds] == pytest.approx([1.29, 0.3])
    assert result.rounds[1].predicted_corrected == pytest.approx(0.3 * 1.29 / 0.29)
    assert result.stopped == "the choice repeated" and result.best_round == 1
    assert result.solution.choices == result.rounds[1].choices

    written = result.corrections.write(tmp_path)
    assert written == refinement_file(tmp_path, "h100")
    again = Corrections.read(tmp_path, "kl_div", "t", "h100")
    assert again is not None and again.in_context == result.corrections.in_context
    assert Corrections.read(tmp_path, "kl_div", "other tokens", "h100") is None
    assert Corrections.read(tmp_path, "lm_loss", "t", "h100") is None
    assert Corrections.read(tmp_path, "kl_div", "t", "cpu") is None  # never another target's
    written.write_text(json.dumps({**result.corrections.to_json(), "scale": "nan"}))
    assert Corrections.read(tmp_path, "kl_div", "t", "h100") is None


def test_search_refines_in_context_and_later_solves_use_the_corrections(built_library, tmp_path):
    from typer.testing import CliRunner

    from mlxkit.cli.main import app
    from mlxkit.engines.puzzle.library.store import read_library

    def search(*args):
        result = CliRunner().invoke(app, ["search", "--target", "h100", "--library", str(built_library),
                                          "--throughput", "1.3x", *args, "--json"])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    library = read_library(built_library)

    def isolated(choices):
        return sum(library.layers[c["layer"]].entries(kind)[c[kind]].metrics["kl_div"]
                   for c in choices for kind in ("attention", "ffn"))

    payload = search("--out", str(tmp_path / "child"), "--refine", "3")
    refinement = payload["refinement"]
    kept = refinement["rounds"][refinement["best_round"]]
    assert 1 <= len(refinement["rounds"]) <= 3
    assert kept["choices"] == payload["choices"]
    assert kept["measured"] == min(r["measured"] for r in refinement["rounds"])
    # what refinement measured is what the search's own evaluation of the saved child reports
    assert payload["evaluation"]["kl_div"] == pytest.approx(kept["measured"], rel=1e-4)
    for entry in refinement["rounds"]:
        assert entry["predicted_isolated"] == pytest.approx(isolated(entry["choices"]), rel=1e-6)
    assert payload["objective_isolated"] == pytest.approx(isolated(payload["choices"]), rel=1e-6)
    assert refinement_file(built_library, "h100").exists()

    dry = search("--dry-run")
    assert dry["corrected"] is False and "refinement" not in dry
    # the same choice the first round made (isolated scores), estimated with the corrections kept on disk
    assert dry["choices"] == refinement["rounds"][0]["choices"]
    assert dry["objective"] == pytest.approx(isolated(dry["choices"]), rel=1e-6)
    corrections = Corrections.read(built_library, "kl_div", tokens_hash(
        torch.load(built_library / ".work" / "tokens.pt", weights_only=True)["val"][:4]), "h100")
    assert corrections is not None
    def corrected_score(layer, kind, name):
        score = library.layers[layer].entries(kind)[name].metrics["kl_div"]
        if name in ("kv2", "ffn64"):  # the tiny parent's own variants keep their score
            return score
        return corrections.in_context.get(Corrections.key(layer, kind, name), score * corrections.scale)

    by_hand = sum(corrected_score(c["layer"], kind, c[kind]) for c in dry["choices"] for kind in ("attention", "ffn"))
    assert dry["estimate_corrected"] == pytest.approx(by_hand, rel=1e-6)
    other_target = CliRunner().invoke(app, ["search", "--target", "cpu", "--library", str(built_library),
                                            "--throughput", "1.3x", "--dry-run", "--json"])
    assert other_target.exit_code == 0 and json.loads(other_target.stdout)["estimate_corrected"] is None
    again = search("--out", str(tmp_path / "again"), "--refine", "3")  # refining starts from the isolated scores
    assert again["refinement"] == refinement and again["choices"] == payload["choices"]


def test_a_library_calibrated_on_sampled_text_is_not_refined_unless_asked(tiny_llama_dir, tiny_recipe_file, tmp_path,
                                                                          isolated_cache):
    from typer.testing import CliRunner

    from mlxkit.cli.main import app

    runner = CliRunner()
    library = tmp_path / "lib"
    built = runner.invoke(app, ["library", "build", "--model", str(tiny_llama_dir), "--recipe", str(tiny_recipe_file),
                                "--out", str(library), "--quiet"])
    assert built.exit_code == 0, built.output
    search = ["search", "--target", "h100", "--library", str(library), "--throughput", "1.3x"]
    default = runner.invoke(app, [*search, "--out", str(tmp_path / "a")])
    assert default.exit_code == 0, default.output
    assert "not refining by default" in default.stderr
    payload = json.loads(runner.invoke(app, [*search, "--out", str(tmp_path / "b"), "--json"]).stdout)
    assert "refinement" not in payload
    forced = json.loads(runner.invoke(app, [*search, "--out", str(tmp_path / "c"), "--refine", "2", "--json"]).stdout)
    assert len(forced["refinement"]["rounds"]) >= 1
