"""Parent families beyond Llama: the converted child is the parent; search → GKD → eval → export and merge run.

Every parent is a tiny random model of transformers' own class (4 layers, hidden 64), so the
reference each check compares against is transformers' implementation of that family, not ours.
Norm weights are drawn away from 1, so a norm that is dropped or put in the wrong place shows.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import mlxkit  # noqa: F401  (registers the Auto classes)
from conftest import TINY_PUZZLE_RECIPE, save_with_tokenizer
from test_export_support import logits_without_mlxkit, torch_logits

from mlxkit.cli.main import app
from mlxkit.engines.models.decilm.blocks import AttentionVariant
from mlxkit.engines.models.decilm.convert import StreamedParent, from_parent
from mlxkit.engines.models.loading import load_config
from mlxkit.engines.puzzle.library.block_init import initialise
from mlxkit.engines.puzzle.subblocks import parent_subblock

runner = CliRunner()
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, vocab_size=128, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=2,
             tie_word_embeddings=False)
# What each family's child must carry in its config.json for a loader without mlxkit.
FAMILY_FIELDS = {"llama": {"qk_norm": False}, "mistral": {"qk_norm": False, "sliding_window": None},
                 "mistral-window": {"sliding_window": 16}, "phi3-window": {"sliding_window": 16},
                 "qwen2": {"attention_bias": True, "qk_norm": False}, "qwen3": {"qk_norm": True},
                 "phi3": {"qk_norm": False},
                 "gemma": {"norm_weight_offset": 1.0, "embedding_multiplier": 8.0, "hidden_act": "gelu_pytorch_tanh",
                           "sandwich_norms": False, "tie_word_embeddings": True},
                 "gemma2": {"norm_weight_offset": 1.0, "embedding_multiplier": 8.0, "hidden_act": "gelu_pytorch_tanh",
                            "sandwich_norms": True, "query_pre_attn_scalar": 24.0, "attn_logit_softcapping": 5.0,
                            "final_logit_softcapping": 3.0, "sliding_window": 16,
                            "windowed_layers": [True, False, True, False]}}
GKD = ["--gkd-set", "data.seq_len=32", "--gkd-set", "data.held_out_sequences=2", "--gkd-set",
       "optim.batch_sequences=4"]


# Phi-3.5's RoPE: other frequencies past `original_max_position_embeddings`, which the random
# tokens below (48) pass.
LONGROPE = dict(rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                 "short_factor": [1.0, 1.1, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0],
                                 "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 10.0]},
                original_max_position_embeddings=32)
# Llama 3.1's RoPE scaling, over a pretraining length the random tokens pass.
LLAMA3 = dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 32})


def tiny_parent(family: str, seed: int = 0, **overrides):
    """A random parent of `family` built from transformers' own config and model classes."""
    from transformers import (Gemma2Config, Gemma2ForCausalLM, GemmaConfig, GemmaForCausalLM, LlamaConfig,
                              LlamaForCausalLM, MistralConfig, MistralForCausalLM, Phi3Config, Phi3ForCausalLM,
                              Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

    classes = {"llama": (LlamaConfig, LlamaForCausalLM, {}), "llama3-rope": (LlamaConfig, LlamaForCausalLM, LLAMA3),
               "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
               "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
               "qwen3": (Qwen3Config, Qwen3ForCausalLM, {}), "phi3": (Phi3Config, Phi3ForCausalLM, {}),
               "phi3-longrope": (Phi3Config, Phi3ForCausalLM, LONGROPE),
               # A window as long as the model's positions never hides a token: full attention.
               "mistral-full-window": (MistralConfig, MistralForCausalLM, {"sliding_window": 256}),
               # Windows far shorter than the random tokens (48) and the generations past them.
               "mistral-window": (MistralConfig, MistralForCausalLM, {"sliding_window": 16}),
               "phi3-window": (Phi3Config, Phi3ForCausalLM, {"sliding_window": 16}),
               "qwen2-window": (Qwen2Config, Qwen2ForCausalLM, {"use_sliding_window": True, "sliding_window": 16,
                                                                 "max_window_layers": 0}),
               # Qwen's windows start at layer max_window_layers: the layers before it attend to everything.
               "qwen2-some-windowed": (Qwen2Config, Qwen2ForCausalLM, {"use_sliding_window": True,
                                                                        "sliding_window": 16, "max_window_layers": 2}),
               "gemma": (GemmaConfig, GemmaForCausalLM, {"tie_word_embeddings": True}),
               # Caps small enough that random weights reach them, a window shorter than the tokens, on
               # alternating layers, and a query scalar other than head_dim.
               "gemma2": (Gemma2Config, Gemma2ForCausalLM, {"sliding_window": 16, "query_pre_attn_scalar": 24,
                                                            "attn_logit_softcapping": 5.0,
                                                            "final_logit_softcapping": 3.0})}
    config_class, model_class, fields = classes[family]
    torch.manual_seed(seed)
    model = model_class(config_class(**{**SHAPE, **fields, **overrides})).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.15)
            elif name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.05)
    return model


def random_ids(batch: int = 2, length: int = 48, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, SHAPE["vocab_size"], (batch, length), generator=generator)


@pytest.mark.parametrize("family", ["llama", "llama3-rope", "mistral", "mistral-full-window", "mistral-window",
                                    "qwen2", "qwen2-window", "qwen2-some-windowed", "qwen3", "phi3", "phi3-longrope",
                                    "phi3-window", "gemma", "gemma2"])
def test_converted_parent_gives_the_parents_logits(family):
    parent = tiny_parent(family)
    ids = random_ids()
    with torch.no_grad():
        expected = parent(ids).logits
        converted = from_parent(parent)
        torch.testing.assert_close(converted(ids).logits, expected, rtol=0, atol=1e-5)
    greedy = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert converted.generate(ids[:1], **greedy).tolist() == parent.generate(ids[:1], **greedy).tolist()


@pytest.mark.parametrize("family", ["qwen3", "phi3-window", "gemma", "gemma2"])
def test_converted_bfloat16_parent_gives_the_parents_logits(family, tmp_path):
    """As a bfloat16 run loads it (RoPE frequencies stay float32), fused rows split included."""
    from transformers import AutoModelForCausalLM

    tiny_parent(family).save_pretrained(tmp_path / family)
    parent = AutoModelForCausalLM.from_pretrained(tmp_path / family, dtype=torch.bfloat16).eval()
    ids = random_ids()
    with torch.no_grad():
        converted = from_parent(parent)
        assert next(converted.parameters()).dtype == torch.bfloat16
        torch.testing.assert_close(converted(ids).logits, parent(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_a_windowed_layer_run_on_its_own_keeps_the_window(attention):
    """BLD runs one layer at a time without the model's mask: past the window it must still see only the window."""
    parent = tiny_parent("mistral-window")
    parent.config._attn_implementation = attention
    ids = random_ids(2, 40)
    converted = from_parent(parent)
    assert converted.config.sliding_window == 16
    with torch.no_grad():
        states = parent(ids, output_hidden_states=True).hidden_states
        full = from_parent(tiny_parent("mistral"))(ids).logits
        assert (full - parent(ids).logits).abs().max() > 1e-2  # the window matters on these tokens
        position = converted.model.rotary_emb(states[0], torch.arange(40).unsqueeze(0))
        alone = converted.model.layers[0](states[0], position)
    torch.testing.assert_close(alone, states[1], rtol=0, atol=1e-5)


def test_qwen3_child_carries_qk_norm_and_reloads_from_its_config(tmp_path):
    converted = from_parent(tiny_parent("qwen3"))
    assert converted.config.qk_norm is True
    attention = converted.model.layers[0].self_attn
    assert tuple(attention.q_norm.weight.shape) == tuple(attention.k_norm.weight.shape) == (16,)
    converted.save_pretrained(tmp_path / "child")
    assert json.loads((tmp_path / "child" / "config.json").read_text())["qk_norm"] is True
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "child").eval()
    ids = random_ids()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, converted(ids).logits, rtol=0, atol=0)


def test_fewer_kv_heads_keep_the_qwen3_qk_norms():
    parent = from_parent(tiny_parent("qwen3"))
    source = parent_subblock(parent, 1, "attention")
    torch.manual_seed(3)
    x = torch.randn(2, 24, SHAPE["hidden_size"])
    position = parent.model.rotary_emb(x, torch.arange(24).unsqueeze(0))
    with torch.no_grad():
        target = source(x, position)
    # The parent's own head count, initialised the way BLD does, is the parent subblock exactly.
    same = initialise(source, AttentionVariant("gqa", 2), parent.config, 1, x, target)
    with torch.no_grad():
        torch.testing.assert_close(same(x, position), target, rtol=0, atol=1e-6)
    narrow = initialise(source, AttentionVariant("gqa", 1), parent.config, 1, x, target).layer.self_attn
    assert narrow.num_key_value_heads == 1
    assert torch.equal(narrow.q_norm.weight, source.layer.self_attn.q_norm.weight)
    assert torch.equal(narrow.k_norm.weight, source.layer.self_attn.k_norm.weight)


@pytest.mark.parametrize("family", ["qwen3", "phi3", "gemma2"])
def test_streamed_parent_reads_the_families_tensors(family, tmp_path):
    path = save_with_tokenizer(tiny_parent(family), tmp_path / family)
    whole = from_parent(tiny_parent(family))
    streamed = StreamedParent.open(path, load_config(str(path)), dtype=torch.float32, device="cpu", spec=str(path))
    assert streamed is not None
    expected = whole.state_dict()
    for i in range(SHAPE["num_hidden_layers"]):
        with streamed.hold(i) as layer:
            for name, tensor in layer.state_dict().items():
                assert torch.equal(tensor, expected[f"model.layers.{i}.{name}"]), name
    # The fingerprint's samples, read element by element, land on the same values (fused rows included).
    for name in ("model.layers.2.self_attn.k_proj.weight", "model.layers.2.mlp.up_proj.weight"):
        assert torch.equal(streamed.sampled_values(name, 7, 50), expected[name].reshape(-1)[::7][:50])


@pytest.mark.parametrize("family", ["llama", "mistral", "mistral-window", "qwen2", "qwen3", "phi3", "phi3-window",
                                    "gemma", "gemma2"])
def test_search_gkd_eval_and_hf_export_run_on_the_family(family, text_file, tmp_path):
    parent = save_with_tokenizer(tiny_parent(family), tmp_path / "parent")
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(TINY_PUZZLE_RECIPE)
    child = tmp_path / "child"
    # Gemma scales its (tied) embeddings by sqrt(hidden): on these random weights the first two Adam steps
    # at the recipe's rate overshoot (KL 0.274 -> 0.304), and eight steps bring it down.
    tokens = "1024" if family.startswith("gemma") else "256"
    result = runner.invoke(app, ["search", "--model", str(parent), "--target", "cpu", "--recipe", str(recipe),
                                 "--throughput", "1.3x", "--data", str(text_file), "--out", str(child),
                                 "--gkd-tokens", tokens, *GKD, "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["gkd"]["after"]["kl_div"] < payload["gkd"]["before"]["kl_div"]
    config = json.loads((child / "config.json").read_text())
    assert config["model_type"] == "mlx_decilm"
    assert {k: config.get(k) for k in FAMILY_FIELDS[family]} == FAMILY_FIELDS[family]

    evaluated = runner.invoke(app, ["eval", str(child), "--reference", str(parent), "--data", str(text_file),
                                    "--seq-len", "32", "--max-tokens", "512", "--json"])
    assert evaluated.exit_code == 0, evaluated.output
    assert json.loads(evaluated.stdout)["kl_div"] > 0

    exported = runner.invoke(app, ["export", str(child), "--format", "hf", "--out", str(tmp_path / "hf")])
    assert exported.exit_code == 0, exported.output
    ids = random_ids(1, 40)[0].tolist()
    remote, info = logits_without_mlxkit(tmp_path / "hf", ids, tmp_path)
    assert info["class"] == "MlxDeciLMForCausalLM" and not info["mlxkit_loaded"]
    np.testing.assert_allclose(remote, torch_logits(child, ids).numpy(), rtol=0, atol=1e-5)


def _refused_configs():
    from transformers import GPT2Config, Gemma3TextConfig, Phi3Config

    small = {k: SHAPE[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                   "num_key_value_heads", "vocab_size", "max_position_embeddings", "bos_token_id",
                                   "eos_token_id", "pad_token_id")}
    return {
        "gemma3": (Gemma3TextConfig(**small, head_dim=16), "rope_local_base_freq"),
        "phi4-mini-partial-rotary": (Phi3Config(**small, partial_rotary_factor=0.75),
                                     "partial rotary embeddings (partial_rotary_factor 0.75)"),
        "gpt2": (GPT2Config(n_embd=64, n_layer=2, n_head=4), "got model_type 'gpt2'"),
    }


@pytest.mark.parametrize("case", ["gemma3", "phi4-mini-partial-rotary", "gpt2"])
def test_parents_the_child_cannot_reproduce_are_refused_naming_what_is_missing(case):
    from mlxkit.engines.errors import InputError
    from mlxkit.engines.models.decilm.convert import child_config

    config, feature = _refused_configs()[case]
    with pytest.raises(InputError) as refused:
        child_config(config)
    assert feature in str(refused.value)


def test_search_refuses_a_gemma3_parent_before_any_work(text_file, tmp_path):
    from transformers import Gemma3ForCausalLM

    config, _ = _refused_configs()["gemma3"]
    parent = save_with_tokenizer(Gemma3ForCausalLM(config), tmp_path / "gemma3")
    result = runner.invoke(app, ["search", "--model", str(parent), "--target", "cpu", "--data", str(text_file),
                                 "--out", str(tmp_path / "child")])
    assert result.exit_code == 2, result.output
    assert "gemma3 parents are not supported" in result.output and "rope_local_base_freq" in result.output
    assert not (tmp_path / "child").exists()


@pytest.mark.parametrize("family", ["qwen3", "phi3-window"])
def test_merge_runs_on_children_of_the_family(family, tmp_path):
    from safetensors.torch import load_file

    children = [save_with_tokenizer(from_parent(tiny_parent(family, seed=seed)), tmp_path / f"child{seed}")
                for seed in (0, 1)]
    result = runner.invoke(app, ["merge", "--method", "linear", *map(str, children), "-o", str(tmp_path / "merged"),
                                 "--json"])
    assert result.exit_code == 0, result.output
    merged = {k: v for f in (tmp_path / "merged").glob("*.safetensors") for k, v in load_file(f).items()}
    inputs = [{k: v for f in c.glob("*.safetensors") for k, v in load_file(f).items()} for c in children]
    name = "model.layers.1.self_attn.k_norm.weight" if family == "qwen3" else "model.layers.1.mlp.up_proj.weight"
    torch.testing.assert_close(merged[name], (inputs[0][name] + inputs[1][name]) / 2)
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert {k: config.get(k) for k in ("qk_norm", "sliding_window")} == \
        {"qk_norm": family == "qwen3", "sliding_window": 16 if family == "phi3-window" else None}


def test_gemma2_variants_keep_the_norm_after_the_subblock_and_the_activation():
    """BLD's variants of a Gemma 2 layer: the parent's own shape is the parent subblock exactly, every variant
    keeps the parent's norms (the one after the subblock included), and a narrower FFN keeps GeGLU."""
    from mlxkit.engines.models.decilm.blocks import FFNVariant
    from mlxkit.engines.puzzle.library.block_init import _before_output_norm

    parent = from_parent(tiny_parent("gemma2"))
    torch.manual_seed(3)
    x = torch.randn(2, 24, SHAPE["hidden_size"])
    position = parent.model.rotary_emb(x, torch.arange(24).unsqueeze(0))
    for kind, same, others in (("attention", AttentionVariant("gqa", 2), (AttentionVariant("gqa", 1),
                                                                            AttentionVariant("linear"))),
                               ("ffn", FFNVariant("mlp", 128), (FFNVariant("mlp", 64), FFNVariant("linear")))):
        source = parent_subblock(parent, 1, kind)
        with torch.no_grad():
            target = source(x, position)
        initialised = initialise(source, same, parent.config, 1, x, target)
        with torch.no_grad():
            torch.testing.assert_close(initialised(x, position), target, rtol=0, atol=1e-5)
        output_norm = "attention_output_norm" if kind == "attention" else "ffn_output_norm"
        for variant in others:
            block = initialise(source, variant, parent.config, 1, x, target).layer
            assert torch.equal(getattr(block, output_norm).weight, getattr(source.layer, output_norm).weight)
            if kind == "ffn" and variant.kind == "mlp":
                assert block.mlp.act_fn.__class__.__name__ == source.layer.mlp.act_fn.__class__.__name__ != "SiLU"
    # What the linear variants are fitted to: the norm after the subblock maps it back onto the target.
    norm = parent.model.layers[1].ffn_output_norm
    with torch.no_grad():
        target = norm(torch.randn(2, 24, SHAPE["hidden_size"]) * 3.0)
        torch.testing.assert_close(norm(_before_output_norm(target, norm)), target, rtol=1e-5, atol=1e-5)


def test_engines_without_gemma_layers_refuse_a_gemma2_parent_and_its_export(tmp_path):
    from mlxkit.engines.errors import InputError
    from mlxkit.engines.serving.capabilities import check_engine_holds_parent, get_engine

    config = tiny_parent("gemma2").config
    for engine in ("vllm", "llamacpp"):
        with pytest.raises(InputError) as refused:
            check_engine_holds_parent(get_engine(engine), config, "default")
        message = str(refused.value)
        assert "RMSNorm scaled by (1 + weight)" in message and "attention soft-capping" in message
        assert "--engine transformers can hold it" in message
    check_engine_holds_parent(get_engine("transformers"), config, "default")
    child = save_with_tokenizer(from_parent(tiny_parent("gemma2")), tmp_path / "child")
    for fmt, out in (("gguf", tmp_path / "child.gguf"), ("nemotron-nas", tmp_path / "nas")):
        result = runner.invoke(app, ["export", str(child), "--format", fmt, "--out", str(out)])
        assert result.exit_code == 2 and "norm after each subblock" in result.output, result.output
        assert not out.exists()


def test_gkd_logit_kl_sees_gemma2s_final_logit_cap():
    """The chunked logit KL equals the KL between the two models' own forward logits, which Gemma 2
    caps; the raw vocabulary projection's logits give another value."""
    from mlxkit.engines.distill.losses import logit_term_sums
    from mlxkit.engines.eval.metrics import kl_per_position
    from mlxkit.engines.models.heads import OutputHead
    from mlxkit.engines.training.step import decoder_states

    teacher, student = tiny_parent("gemma2", seed=0), tiny_parent("gemma2", seed=1)
    ids = random_ids()
    with torch.no_grad():
        expected = kl_per_position(teacher(input_ids=ids).logits[:, :-1].reshape(-1, 128),
                                   student(input_ids=ids).logits[:, :-1].reshape(-1, 128)).sum()
        _, teacher_final = decoder_states(teacher, ids)
        _, student_final = decoder_states(student, ids)
        capped = logit_term_sums(student_final, teacher_final, ids, OutputHead(student), OutputHead(teacher),
                                 chunk=7).kl
        raw = logit_term_sums(student_final, teacher_final, ids, student.get_output_embeddings(),
                              teacher.get_output_embeddings(), chunk=7).kl
    assert capped.item() == pytest.approx(expected.item(), rel=1e-4)
    assert abs(raw.item() - expected.item()) > 1e-2 * expected.item()
