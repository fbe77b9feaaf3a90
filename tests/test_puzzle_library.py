"""The typed block library: reading and writing `library.json`, the NVlabs demo conversion, and pricing."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from conftest import make_tiny_llama
from mlxkit.engines.errors import InputError
from mlxkit.engines.hardware.costs import CostModel
from mlxkit.engines.hardware.profile import load_profile
from mlxkit.engines.hardware.scenario import Scenario
from mlxkit.engines.models.decilm.blocks import AttentionVariant, FFNVariant, ParentShape
from mlxkit.engines.puzzle.library.store import read_library, write_library
from mlxkit.engines.puzzle.search.pricing import (library_problem, parent_totals, price_library,
                                                   solution_block_choices, stored_costs)
from mlxkit.engines.puzzle.library.schema import BlockLibrary
from mlxkit.engines.puzzle.search.mip import Solver
from mlxkit.engines.puzzle.library.nvlabs import block_choice, split_variant_name

FIXTURE = Path(__file__).parent / "fixtures" / "nvlabs_library_small.json"


def _toy_library_dict() -> dict:
    shape = ParentShape.from_config(make_tiny_llama().config)
    attention = {"kv2": ({"kind": "gqa", "n_kv_heads": 2}, 0.0), "kv1": ({"kind": "gqa", "n_kv_heads": 1}, 0.2),
                 "linear": ({"kind": "linear"}, 0.5), "no_op": ({"kind": "no_op"}, 1.5)}
    ffn = {"ffn64": ({"kind": "mlp", "intermediate_size": 64}, 0.0),
           "ffn32": ({"kind": "mlp", "intermediate_size": 32}, 0.3), "no_op": ({"kind": "no_op"}, 2.0)}
    layers = []
    for i in range(shape.num_layers):
        layers.append({"layer": i,
                       "attention": {n: {"variant": v, "metrics": {"kl_div": s * (i + 1), "lm_loss": 2 + s}}
                                     for n, (v, s) in attention.items()},
                       "ffn": {n: {"variant": v, "metrics": {"kl_div": s * (i + 1), "lm_loss": 2 + s}}
                               for n, (v, s) in ffn.items()}})
    return {"format": "mlxkit.block_library", "version": 1,
            "parent": {"spec": "tiny", "shape": shape.__dict__}, "layers": layers}


def _write(tmp_path: Path, data: dict, name: str = "library.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


# ---------------------------------------------------------------- the schema

def test_library_round_trips_through_the_one_reader_and_writer(tmp_path):
    library = read_library(_write(tmp_path, _toy_library_dict(), "in.json"))
    assert library.layers[0].attention["kv1"].variant == AttentionVariant("gqa", 1)
    assert library.layers[1].ffn["ffn32"].variant == FFNVariant("mlp", 32)
    out = tmp_path / "lib"
    out.mkdir()
    write_library(out, library)
    assert read_library(out) == library
    on_disk = json.loads((out / "library.json").read_text())
    assert on_disk["layers"][0]["attention"]["kv1"] == {"variant": {"kind": "gqa", "n_kv_heads": 1},
                                                        "metrics": {"kl_div": 0.2, "lm_loss": 2.2}}


@pytest.mark.parametrize("breakage, message", [
    (lambda d: d.pop("layers"), "layers: Field required"),
    (lambda d: d["layers"][1].pop("ffn"), r"layers\.1\.ffn: Field required"),
    (lambda d: d.update(version=7), "format version 7; this mlxkit reads version 1"),
    (lambda d: d["layers"][0]["ffn"]["ffn32"].update(stats={"runtime_ms": -3.0}), r"ffn32\.stats\.runtime_ms"),
    (lambda d: d["layers"][0]["attention"]["kv1"]["metrics"].update(kl_div=math.nan), r"kv1\.metrics\.kl_div"),
    (lambda d: d["layers"][0]["attention"]["kv1"].update(variant={"kind": "gqa", "n_kv_heads": 2}),
     "'kv1' describes 'kv2'"),
    (lambda d: d["layers"].reverse(), "numbered 0..1 in order"),
    (lambda d: d["layers"][0].update(bogus=1), r"layers\.0\.bogus"),
])
def test_malformed_libraries_are_clean_input_errors(tmp_path, breakage, message):
    data = _toy_library_dict()
    breakage(data)
    with pytest.raises(InputError, match=message):
        read_library(_write(tmp_path, data))


def test_non_json_and_unknown_formats_are_input_errors(tmp_path):
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(InputError, match="not valid JSON"):
        read_library(tmp_path / "broken.json")
    with pytest.raises(InputError, match="neither an mlxkit block library nor"):
        read_library(_write(tmp_path, {"format": "something else"}))
    with pytest.raises(InputError, match="no block library"):
        read_library(tmp_path / "missing")


# ---------------------------------------------------------------- pricing

def test_pricing_is_a_stage_that_returns_new_costs_from_the_cost_model():
    library = BlockLibrary.model_validate(_toy_library_dict())
    before = library.model_dump()
    profile, scenario = load_profile("h100"), Scenario.parse("batch=4,in=32,out=32")
    costs = price_library(library, profile, scenario)
    assert library.model_dump() == before  # nothing written into the library
    cm = CostModel(library.parent.shape, profile, scenario)
    for layer in costs.layers:
        for name, stats in layer.attention.items():
            assert stats == pytest.approx(cm.attention(AttentionVariant.parse(name)).stats())
        for name, stats in layer.ffn.items():
            assert stats == pytest.approx(cm.ffn(FFNVariant.parse(name)).stats())
    assert costs.non_block == pytest.approx(cm.non_block().stats())
    assert costs.context.profile == "h100" and costs.context.scenario == scenario

    # The same stats stored in the library (as a measurement would be) give the same problem.
    data = library.model_dump(mode="json")
    for layer, priced in zip(data["layers"], costs.layers):
        for name in layer["attention"]:
            layer["attention"][name]["stats"] = priced.attention[name]
        for name in layer["ffn"]:
            layer["ffn"][name]["stats"] = priced.ffn[name]
    data["non_block"] = {"stats": costs.non_block}
    measured = BlockLibrary.model_validate(data)
    from_stats = library_problem(measured, stored_costs(measured))
    from_profile = library_problem(library, costs)
    caps = {"memory_mib": parent_totals(from_profile)["memory_mib"] * 0.9}
    a, b = Solver.build(from_stats).solve(caps), Solver.build(from_profile).solve(caps)
    assert a.choices == b.choices and a.totals["memory_mib"] == pytest.approx(b.totals["memory_mib"])
    assert len(solution_block_choices(a)) == 2


def test_stored_costs_and_metrics_must_be_there():
    library = BlockLibrary.model_validate(_toy_library_dict())
    with pytest.raises(InputError, match="no stats"):
        stored_costs(library)
    costs = price_library(library, load_profile("h100"), Scenario())
    with pytest.raises(InputError, match="top1_agreement"):
        library_problem(library, costs, metric="top1_agreement")


# ---------------------------------------------------------------- the NVlabs demo format

def test_nvlabs_fixture_converts_reads_and_solves():
    library = read_library(FIXTURE)
    assert library.converted_from and library.parent is None and not library.has_trained_blocks
    assert len(library.layers) == 3 and all(len(layer.blocks) == 5 for layer in library.layers)
    raw = json.loads(FIXTURE.read_text())
    name = next(iter(raw["layer_0"]))
    assert split_variant_name(name) == ("4 kv heads (parent * 100%)", "intermediate size 1e3 (parent * 100%)")
    assert block_choice(name, raw["layer_0"][name]["stats"]).name == "kv4+ffn1024"
    assert block_choice("attention = no_op (parent * 0%)\t&&\tffn = no_op (parent * 0%)").name == "no_op+no_op"
    block = library.layers[0].blocks["kv4+ffn1024"]
    assert block.original_name == name and block.metrics == raw["layer_0"][name]["metrics"]
    assert library.layers[0].block_choice("kv4+ffn1024").attention == AttentionVariant("gqa", 4)

    problem = library_problem(library, stored_costs(library))
    assert [g.kind for g in problem.groups] == ["block"] * 3 and not problem.fixed_costs
    assert parent_totals(problem) == {"memory_mib": 192.0, "runtime_ms": 150.0, "num_params": 3 * 1_050_112}
    solution = Solver.build(problem).solve({"memory_mib": 150})
    # Saving 42 MiB: dropping layer 1's attention (KL 0.4), or three smaller cuts (0.08 + 0.12 + 0.2).
    assert solution.objective == pytest.approx(0.4)
    assert solution.totals["memory_mib"] <= 150
    # Re-pricing with a profile needs the parent's shape, which the demo format does not record.
    with pytest.raises(InputError, match="parent's shape"):
        price_library(library, load_profile("h100"), Scenario())
    shape = ParentShape(256, 3, 4, 4, 64, 1024, 1000, False)
    repriced = library_problem(library, price_library(library, load_profile("h100"), Scenario(), parent=shape))
    assert repriced.fixed_costs["num_params"] > 0
    assert repriced.groups[0].options[0].meta["name"].startswith("attention = 4 kv heads")


def test_nvlabs_reader_rejects_malformed_files(tmp_path):
    bad = _write(tmp_path, {"layer_0": {"attention = kv && ffn = x": {"stats": {}}}}, "bad.json")
    with pytest.raises(InputError, match="metrics"):
        read_library(bad)
    gap = _write(tmp_path, {"layer_1": {"attention = no_op && ffn = no_op": {"stats": {}, "metrics": {}}}}, "gap.json")
    with pytest.raises(InputError, match="missing"):
        read_library(gap)
    raw = json.loads(FIXTURE.read_text())
    name = next(iter(raw["layer_0"]))
    raw["layer_0"][name]["stats"]["runtime_ms"] = -1.0
    with pytest.raises(InputError, match="runtime_ms"):
        read_library(_write(tmp_path, raw, "negative.json"))
    raw["layer_0"][name]["stats"]["runtime_ms"] = 1.0
    raw["layer_0"][name]["metrics"]["kl_div"] = math.nan
    with pytest.raises(InputError, match="kl_div"):
        read_library(_write(tmp_path, raw, "nan.json"))
    with pytest.raises(InputError):
        split_variant_name("ffn = only")
