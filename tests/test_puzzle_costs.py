"""Hardware profiles, the analytic cost model, budgets, and library pricing/reading."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_llama
from mlxkit.engines.errors import InputError
from mlxkit.engines.puzzle.budgets import Budgets, Throughput, parse_count, parse_memory_mib, parse_time_ms
from mlxkit.engines.puzzle.costs import MIB, CostModel, Scenario, price_variants
from mlxkit.engines.puzzle.hw_profile import HardwareProfile, available_profiles, load_profile
from mlxkit.engines.puzzle.library_pricing import (library_format, library_problem, load_library, parent_totals,
                                                   price_library, solution_block_choices)
from mlxkit.engines.puzzle.mip import Solver
from mlxkit.engines.puzzle.nvlabs_library import block_choice, read_nvlabs_library, split_variant_name
from mlxkit.engines.puzzle.variants import AttentionVariant, BlockChoice, FFNVariant, ParentShape

FIXTURE = Path(__file__).parent / "fixtures" / "nvlabs_library_small.json"
LLAMA70B = ParentShape(hidden_size=8192, num_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                       intermediate_size=28672, vocab_size=128256, tie_word_embeddings=False)
NVLABS_KEYS = {"memory_mib", "runtime_ms", "num_params", "num_kv_heads", "ffn_intermediate_size",
               "attention_memory_mib", "attention_runtime_ms", "attention_num_params",
               "ffn_memory_mib", "ffn_runtime_ms", "ffn_num_params"}


def _ideal(**changes) -> HardwareProfile:
    """A profile with no overheads, so scaling laws show through exactly."""
    base = load_profile("h100")
    return base.model_copy(update={"kernel_overhead_us": 0.0, "step_overhead_us": 0.0, **changes})


# ---------------------------------------------------------------- profiles

def test_packaged_profiles_load_and_cite_sources():
    names = available_profiles()
    assert {"h100", "h100-pcie", "h200", "a100-80gb", "l40s", "cpu"} <= set(names)
    for name in names:
        profile = load_profile(name)
        assert profile.name == name
        for key in ("peak_tflops", "memory_bandwidth_gbs", "memory_capacity_gib", "efficiency", "kernel_overhead_us"):
            assert profile.sources.get(key), f"{name}: no source for {key}"
    assert load_profile("h100").peak_flops("fp8") == pytest.approx(2 * load_profile("h100").peak_flops("bf16"), rel=1e-3)
    # A100 has no FP8 units: FP8 weights run at the BF16 rate.
    assert load_profile("a100-80gb").compute_dtype("fp8") == "bf16"


def test_unknown_profile_lists_available_ones():
    with pytest.raises(InputError, match="available: .*h100.*l40s"):
        load_profile("b9000")


def test_profile_from_path_and_validation(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(load_profile("l40s").model_copy(update={"name": "mine"}).to_yaml())
    assert load_profile(str(path)).name == "mine"
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\npeak_tflops: {bf17: 3}\n")
    with pytest.raises(InputError, match="bad.yaml"):
        load_profile(bad)
    with pytest.raises(InputError, match="does not exist"):
        load_profile(tmp_path / "missing.yaml")


# ---------------------------------------------------------------- scenario and budgets

def test_scenario_parsing():
    s = Scenario.parse("batch=256,in=128,out=1024")
    assert (s.batch, s.input_len, s.output_len, s.weight_dtype, s.kv_dtype) == (256, 128, 1024, "bf16", "bf16")
    assert s.tokens == 256 * 1152
    fp8 = Scenario.parse("batch=8, in=1k, out=64, weights=fp8")
    assert (fp8.input_len, fp8.kv_dtype) == (1000, "fp8")  # the cache follows FP8 weights unless kv= is given
    assert Scenario.parse("weights=fp8,kv=bf16").kv_dtype == "bf16"
    assert Scenario.parse(str(fp8)) == fp8
    for bad in ("batch=0", "batch256", "colour=red", "weights=fp7", "in=abc"):
        with pytest.raises(InputError):
            Scenario.parse(bad)


def test_budget_strings():
    assert parse_memory_mib("80GiB") == 80 * 1024
    assert parse_memory_mib("40GB") == pytest.approx(40e9 / 2**20)
    assert parse_memory_mib("75000") == 75000
    assert parse_time_ms("500ms") == 500 and parse_time_ms("2s") == 2000 and parse_time_ms("250") == 250
    assert parse_count("7B") == 7e9 and parse_count("500M") == 5e8
    assert Throughput.parse("2x").multiple == 2 and Throughput.parse("5000").tokens_per_s == 5000
    assert Throughput.parse("5k tok/s").tokens_per_s == 5000
    caps = Budgets.parse(memory="80GiB", throughput="2x", latency="40s").constraints(tokens=1000, parent_runtime_ms=60000)
    assert caps == {"memory_mib": 81920, "runtime_ms": 30000}
    # Absolute throughput: batch*(in+out) tokens must take at most tokens/target seconds.
    assert Budgets.parse(throughput="5000").constraints(tokens=307200)["runtime_ms"] == pytest.approx(61440)
    for bad, fn in (("80 parsecs", parse_memory_mib), ("fast", parse_time_ms), ("2y", Throughput.parse),
                    ("0x", Throughput.parse)):
        with pytest.raises(InputError):
            fn(bad)
    with pytest.raises(InputError, match="parent"):
        Budgets.parse(throughput="2x").constraints(tokens=10)


# ---------------------------------------------------------------- cost model scaling laws

def test_parameter_counts_match_real_torch_modules():
    model = make_tiny_llama()
    shape = ParentShape.from_config(model.config)
    layer = model.model.layers[0]
    attention_params = sum(p.numel() for p in layer.self_attn.parameters()) + layer.input_layernorm.weight.numel()
    ffn_params = sum(p.numel() for p in layer.mlp.parameters()) + layer.post_attention_layernorm.weight.numel()
    assert AttentionVariant("gqa", shape.num_key_value_heads).num_params(shape) == attention_params
    assert FFNVariant("mlp", shape.intermediate_size).num_params(shape) == ffn_params
    cm = CostModel(shape, load_profile("cpu"), Scenario(1, 8, 8, "fp32", "fp32"))
    assert cm.parent_model().num_params == sum(p.numel() for p in model.parameters())


def test_parameter_counts_match_heterogeneous_child():
    from mlxkit.engines.models.decilm.convert import child_config
    from mlxkit.engines.models.decilm.modeling_mlx_decilm import MlxDeciLMForCausalLM

    parent = make_tiny_llama()
    shape = ParentShape.from_config(parent.config)
    choices = [BlockChoice(AttentionVariant("gqa", 1), FFNVariant("linear")),
               BlockChoice(AttentionVariant("linear"), FFNVariant("mlp", 32))]
    torch.manual_seed(0)
    child = MlxDeciLMForCausalLM(child_config(parent.config, choices))
    cm = CostModel(shape, load_profile("cpu"), Scenario(1, 8, 8, "fp32", "fp32"))
    assert cm.model(choices).num_params == sum(p.numel() for p in child.parameters())


def test_decode_time_is_linear_in_weight_bytes_when_memory_bound():
    # Batch 1 decode is memory-bound on an H100: time tracks bytes read.
    scenario = Scenario(1, 16, 64, "bf16", "bf16")
    cm = CostModel(LLAMA70B, _ideal(), scenario)
    widths = (4096, 8192, 16384, 28672)
    times = [cm.ffn(FFNVariant("mlp", w)).decode_step_ms for w in widths]
    params = [FFNVariant("mlp", w).num_params(LLAMA70B) for w in widths]
    for t, p in zip(times, params):
        assert t / times[-1] == pytest.approx(p / params[-1], rel=0.01)
    # Halving the bytes per weight halves a memory-bound step.
    fp8 = CostModel(LLAMA70B, _ideal(), Scenario(1, 16, 64, "fp8", "bf16"))
    assert fp8.ffn(FFNVariant("mlp", 28672)).decode_step_ms == pytest.approx(times[-1] / 2, rel=0.01)


def test_prefill_attention_flops_are_quadratic_in_length():
    cm = CostModel(LLAMA70B, _ideal(), Scenario(1, 16, 2, "bf16", "bf16"))
    kv8 = AttentionVariant("gqa", 8)
    core = [cm.attention_ops(kv8, 1, n, n)[1].flops for n in (2048, 4096, 8192)]
    assert core[1] / core[0] == pytest.approx(4.0, rel=1e-3)
    assert core[2] / core[1] == pytest.approx(4.0, rel=1e-3)
    projections = [cm.attention_ops(kv8, 1, n, n)[0].flops for n in (2048, 4096)]
    assert projections[1] / projections[0] == pytest.approx(2.0)  # matmul FLOPs stay linear
    # At long prompts the quadratic term dominates the prefill time.
    long = [float(cm.attention_step_ms(kv8, 1, n, n)) for n in (32768, 65536)]
    assert 3.0 < long[1] / long[0] < 4.0


def test_kv_cache_memory_is_linear_in_batch_and_length():
    kv2 = AttentionVariant("gqa", 2)

    def kv_mib(batch, in_len, out_len, kv="bf16"):
        return CostModel(LLAMA70B, _ideal(), Scenario(batch, in_len, out_len, "bf16", kv)).attention(kv2).kv_cache_mib

    assert kv_mib(2, 100, 100) == pytest.approx(2 * kv_mib(1, 100, 100))
    assert kv_mib(1, 200, 200) == pytest.approx(2 * kv_mib(1, 100, 100))
    assert kv_mib(3, 50, 14) == pytest.approx(3 * 64 * 2 * 2 * 128 * 2 / MIB)  # batch·len·kv·head_dim·2·bytes
    assert kv_mib(1, 100, 100, kv="fp8") == pytest.approx(kv_mib(1, 100, 100) / 2)
    assert CostModel(LLAMA70B, _ideal(), Scenario()).attention(AttentionVariant("linear")).kv_cache_mib == 0


def test_decode_integrates_the_growing_context():
    scenario = Scenario(64, 512, 512, "bf16", "bf16")
    cm = CostModel(LLAMA70B, _ideal(), scenario)
    kv8 = AttentionVariant("gqa", 8)
    steps = scenario.output_len - 1
    first = float(cm.attention_step_ms(kv8, 64, 1, 513))
    last = float(cm.attention_step_ms(kv8, 64, 1, 1023))
    total = cm.attention(kv8).decode_runtime_ms
    assert first * steps < total < last * steps
    assert total == pytest.approx((first + last) / 2 * steps, rel=0.02)  # linear in context when memory-bound


def test_linear_subblocks_cost_the_same_in_attention_and_ffn():
    # Both are one hidden x hidden matmul plus a norm: every decode step must be charged for both.
    cm = CostModel(LLAMA70B, load_profile("h100"), Scenario.parse("batch=16,in=64,out=256"))
    attention, ffn = cm.attention(AttentionVariant("linear")), cm.ffn(FFNVariant("linear"))
    assert attention.runtime_ms == pytest.approx(ffn.runtime_ms)
    assert attention.decode_runtime_ms == pytest.approx(255 * attention.decode_step_ms)


def test_llama70b_cost_check_against_the_brief():
    # §10 of the Puzzle brief: batch 256, 128+1024 tokens, FP8 weights and KV cache on one H100.
    cm = CostModel(LLAMA70B, load_profile("h100"), Scenario.parse("batch=256,in=128,out=1024,weights=fp8"))
    parent = cm.parent_model()
    assert parent.num_params == pytest.approx(70.55e9, rel=1e-3)
    weights_gib = parent.num_params / 2**30
    assert weights_gib == pytest.approx(65.7, abs=0.1)
    assert parent.kv_cache_mib / 1024 == pytest.approx(45.0, abs=0.1)
    assert parent.memory_mib / 1024 > 80  # does not fit one H100
    assert parent.tokens_per_s == pytest.approx(256 * 1152 / (parent.runtime_ms / 1e3))
    assert parent.generated_tokens_per_s == pytest.approx(256 * 1024 / (parent.runtime_ms / 1e3))


def test_h100_profile_reproduces_nvlabs_demo_measurements_within_10_percent():
    # Demo: 'NVIDIA H100 80GB HBM3', fp8, batch 256, 1200 tokens (split assumed 128 + 1072).
    cm = CostModel(LLAMA70B, load_profile("h100"), Scenario(256, 128, 1072, "fp8", "fp8"))
    measured_ffn = {28672: 463.15, 21504: 354.68, 17920: 306.18, 14336: 226.34, 7168: 130.42, 5632: 115.92,
                    2816: 83.98}
    for width, ms in measured_ffn.items():
        assert cm.ffn(FFNVariant("mlp", width)).runtime_ms == pytest.approx(ms, rel=0.10)
    assert cm.attention(AttentionVariant("gqa", 8)).runtime_ms == pytest.approx(353.84, rel=0.10)
    assert cm.ffn(FFNVariant("mlp", 28672)).num_params == 704_651_264  # the demo's ffn_num_params
    assert cm.attention(AttentionVariant("gqa", 8)).num_params == 151_003_136


def test_stats_use_the_nvlabs_vocabulary():
    cm = CostModel(LLAMA70B, load_profile("h100"), Scenario.parse("batch=8,in=128,out=128"))
    stats = cm.block_stats(BlockChoice(AttentionVariant("gqa", 4), FFNVariant("mlp", 14336)))
    assert NVLABS_KEYS <= set(stats)
    assert {"prefill_runtime_ms", "decode_step_ms"} <= set(stats)
    assert stats["runtime_ms"] == pytest.approx(stats["attention_runtime_ms"] + stats["ffn_runtime_ms"])
    assert stats["num_kv_heads"] == 4 and stats["ffn_intermediate_size"] == 14336
    no_op = cm.block_stats(BlockChoice(AttentionVariant("no_op"), FFNVariant("no_op")))
    assert no_op["runtime_ms"] == 0 and no_op["memory_mib"] == 0 and no_op["num_params"] == 0
    table = price_variants(LLAMA70B, load_profile("h100"), Scenario(), [AttentionVariant("gqa", 8)],
                           [FFNVariant("linear")])
    assert set(table) == {"attention", "ffn", "non_block", "parent", "stats_context"}


# ---------------------------------------------------------------- libraries

def _toy_library() -> dict:
    shape = ParentShape.from_config(make_tiny_llama().config)
    attention = {"kv2": ({"kind": "gqa", "n_kv_heads": 2}, 0.0), "kv1": ({"kind": "gqa", "n_kv_heads": 1}, 0.2),
                 "linear": ({"kind": "linear"}, 0.5), "no_op": ({"kind": "no_op"}, 1.5)}
    ffn = {"ffn64": ({"kind": "mlp", "intermediate_size": 64}, 0.0),
           "ffn32": ({"kind": "mlp", "intermediate_size": 32}, 0.3), "no_op": ({"kind": "no_op"}, 2.0)}
    layers = []
    for i in range(shape.num_layers):
        layers.append({"layer": i,
                       "attention": {n: {"variant": v, "file": None, "metrics": {"kl_div": s * (i + 1), "lm_loss": 2 + s}}
                                     for n, (v, s) in attention.items()},
                       "ffn": {n: {"variant": v, "file": None, "metrics": {"kl_div": s * (i + 1), "lm_loss": 2 + s}}
                               for n, (v, s) in ffn.items()}})
    return {"format": "mlxkit.block_library", "version": 1,
            "parent": {"spec": "tiny", "shape": shape.__dict__}, "layers": layers}


def test_price_library_fills_stats_and_matches_profile_pricing():
    library = _toy_library()
    profile, scenario = load_profile("h100"), Scenario.parse("batch=4,in=32,out=32")
    priced = price_library(copy.deepcopy(library), profile, scenario)
    entry = priced["layers"][0]["attention"]["kv1"]
    assert {"memory_mib", "runtime_ms", "num_params", "num_kv_heads", "prefill_runtime_ms",
            "decode_step_ms"} <= set(entry["stats"])
    assert priced["stats_context"]["profile"] == "h100"
    assert priced["stats_context"]["scenario"]["batch"] == 4
    assert "stats" in priced["non_block"]
    from_stats = library_problem(priced, costs="library")
    from_profile = library_problem(library, costs="profile", profile=profile, scenario=scenario)
    caps = {"memory_mib": parent_totals(from_profile)["memory_mib"] * 0.9}
    a, b = Solver.build(from_stats).solve(caps), Solver.build(from_profile).solve(caps)
    assert a.choices == b.choices and a.totals["memory_mib"] == pytest.approx(b.totals["memory_mib"])
    assert len(solution_block_choices(a)) == 2
    with pytest.raises(InputError, match="no stats"):
        library_problem(library, costs="library")
    with pytest.raises(InputError, match="top1_agreement"):
        library_problem(priced, metric="top1_agreement", costs="library")


def test_nvlabs_fixture_reads_and_solves():
    library = load_library(FIXTURE)
    assert library_format(library) == "nvlabs"
    layers = read_nvlabs_library(library)
    assert len(layers) == 3 and all(len(v) == 5 for v in layers)
    name = next(iter(layers[0]))
    assert split_variant_name(name) == ("4 kv heads (parent * 100%)", "intermediate size 1e3 (parent * 100%)")
    assert block_choice(name, layers[0][name]["stats"]).name == "kv4+ffn1024"
    assert block_choice("attention = no_op (parent * 0%)\t&&\tffn = no_op (parent * 0%)").name == "no_op+no_op"
    problem = library_problem(library, costs="library")
    assert [g.kind for g in problem.groups] == ["block"] * 3 and not problem.fixed_costs
    assert parent_totals(problem) == {"memory_mib": 192.0, "runtime_ms": 150.0, "num_params": 3 * 1_050_112}
    solution = Solver.build(problem).solve({"memory_mib": 150})
    # Saving 42 MiB: dropping layer 1's attention (KL 0.4), or three smaller cuts (0.08 + 0.12 + 0.2).
    assert solution.objective == pytest.approx(0.4)
    assert solution.totals["memory_mib"] <= 150
    # Re-pricing with a profile needs the parent's shape.
    with pytest.raises(InputError, match="parent"):
        library_problem(library, costs="profile", profile=load_profile("h100"), scenario=Scenario())
    shape = ParentShape(256, 3, 4, 4, 64, 1024, 1000, False)
    repriced = library_problem(library, costs="profile", profile=load_profile("h100"), scenario=Scenario(), parent=shape)
    assert repriced.fixed_costs["num_params"] > 0
    option = repriced.groups[0].options[0]
    assert option.meta["name"].startswith("attention = 4 kv heads")


def test_nvlabs_reader_rejects_malformed_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"layer_0": {"attention = kv && ffn = x": {"stats": {}}}}')
    with pytest.raises(InputError, match="metrics"):
        read_nvlabs_library(bad)
    gap = tmp_path / "gap.json"
    gap.write_text('{"layer_1": {"attention = no_op && ffn = no_op": {"stats": {}, "metrics": {}}}}')
    with pytest.raises(InputError, match="missing"):
        read_nvlabs_library(gap)
    with pytest.raises(InputError):
        split_variant_name("ffn = only")
