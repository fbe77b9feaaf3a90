"""Exports served by vLLM itself (its CPU build), and what vLLM computes scored again under torch.

Marker `vllm`: needs vLLM's CPU build in its own environment (`scripts/setup_vllm.sh`, which
`.ci/run` runs); skipped with that reason where it is absent. Every case starts vLLM afresh
(about 30 s each on two cores).
"""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from conftest import make_tiny_llama
from test_export_support import make_bpe_tokenizer, make_child_dir, make_parent_dir, save_dir

from mlxkit.cli.main import app
from mlxkit.engines.export import export_model
from mlxkit.engines.serving.vllm import SETUP_SCRIPT, vllm_agreement, vllm_python

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(vllm_python() is None, reason=f"needs vLLM's CPU build: run {SETUP_SCRIPT}")]

# head_dim 64 (vLLM's CPU attention takes it), FFN 768 at hidden 256: ffn_mult 4.5 reads back exactly
SHAPE = dict(hidden_size=256, intermediate_size=768, num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
PROMPTS = [[1, 40, 41, 42, 43, 44], [1, 70, 71], [1, 90, 12, 30, 99, 5, 6, 7, 8, 60]]


def _check(agreement) -> None:
    assert agreement.positions == 3 * 12
    assert agreement.top1_agreement >= 0.99, agreement
    assert agreement.max_logprob_gap <= 1e-3, agreement


def test_a_llama_parent_serves_in_vllm_as_transformers_computes_it(tmp_path):
    from transformers import LlamaForCausalLM

    parent = make_parent_dir(tmp_path / "parent", **SHAPE, num_hidden_layers=3)
    export_model(parent, "nemotron-nas", tmp_path / "nas")
    reference = LlamaForCausalLM.from_pretrained(parent, dtype=torch.float32).eval()  # transformers' own Llama
    _check(vllm_agreement(tmp_path / "nas", reference, PROMPTS, max_tokens=12))


def _qwen2_parent(out):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SHAPE, num_hidden_layers=2, max_position_embeddings=256,
                                         tie_word_embeddings=False,
                                         rope_parameters={"rope_type": "default", "rope_theta": 30000.0})).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.15)
    return save_dir(model, out)


def _llama3_rope_parent(out):
    # llama3 scaling from position 16 on, so the prompts and continuations run past it
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    return save_dir(make_tiny_llama(**SHAPE, num_hidden_layers=2, max_position_embeddings=256,
                                    rope_parameters=rope), out)


@pytest.mark.parametrize("make_parent", [_qwen2_parent, _llama3_rope_parent], ids=["qwen2-biases", "llama3-rope"])
def test_other_parents_vllm_can_express_serve_as_transformers_computes_them(tmp_path, make_parent):
    from transformers import AutoModelForCausalLM

    parent = make_parent(tmp_path / "parent")
    export_model(parent, "nemotron-nas", tmp_path / "nas")
    reference = AutoModelForCausalLM.from_pretrained(parent, dtype=torch.float32).eval()  # transformers' own class
    _check(vllm_agreement(tmp_path / "nas", reference, PROMPTS, max_tokens=12))


def test_a_child_with_every_block_vllm_builds_serves_in_vllm_as_torch_computes_it(tmp_path):
    from transformers import AutoModelForCausalLM

    import mlxkit  # noqa: F401  (registers mlx_decilm)

    # no-op attention, fewer KV heads, no-op FFN, narrower FFNs
    child = make_child_dir(tmp_path / "child", names=("kv2+ffn768", "kv1+ffn512", "no_op+ffn256", "kv2+no_op"),
                           **SHAPE)
    export_model(child, "nemotron-nas", tmp_path / "nas")
    reference = AutoModelForCausalLM.from_pretrained(child, dtype=torch.float32).eval()
    _check(vllm_agreement(tmp_path / "nas", reference, PROMPTS, max_tokens=12))


def test_a_searched_h100_child_exports_to_a_directory_vllm_serves(tmp_path, text_file):
    from mlxkit.engines.models.loading import load_model

    parent = tmp_path / "parent"
    make_parent_dir(parent, **SHAPE, num_hidden_layers=3)
    make_bpe_tokenizer().save_pretrained(parent)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("name: served\nsearch_space: {ffn_fractions: [1.0, 0.67, 0.33], width_multiple: 256}\n"
                      "data: {seq_len: 32, train_sequences: 8, score_sequences: 2}\n"
                      "bld: {tokens_per_block: 512, batch_sequences: 4, lr: 1.0e-3}\n")
    out = tmp_path / "child"
    result = CliRunner().invoke(app, ["search", "--model", str(parent), "--target", "h100", "--data", str(text_file),
                                      "--recipe", str(recipe), "--throughput", "1.3x", "--refine", "0", "--out",
                                      str(out), "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["engine"]["name"] == "vllm"  # the h100 profile's engine
    exported = tmp_path / "nas"
    export = CliRunner().invoke(app, ["export", str(out), "--format", "nemotron-nas", "--out", str(exported)])
    assert export.exit_code == 0, export.output
    reference = load_model(str(out), with_tokenizer=False).model.eval()
    _check(vllm_agreement(exported, reference, PROMPTS, max_tokens=12))
