"""Baselines for the quality benchmark: block importance, layer dropping and uniform pruning at equal cost."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import make_tiny_llama
from mlxkit.engines.errors import InfeasibleError
from mlxkit.engines.hardware.costs import CostModel
from mlxkit.engines.hardware.profile import load_profile
from mlxkit.engines.models.decilm.blocks import AttentionVariant, BlockChoice, FFNVariant, ParentShape
from mlxkit.engines.models.decilm.convert import from_parent
from mlxkit.engines.puzzle.search.baselines import angular_distances, layer_drop_choices, uniform_choices


def _hf_layer_states(model, ids):
    """Inputs and outputs of every decoder layer of a transformers Llama, caught by forward hooks."""
    caught = []

    def hook(module, args, kwargs, output):
        hidden = args[0] if args else kwargs["hidden_states"]
        out = output[0] if isinstance(output, tuple) else output
        caught.append((hidden.detach().double().numpy(), out.detach().double().numpy()))

    handles = [layer.register_forward_hook(hook, with_kwargs=True) for layer in model.model.layers]
    with torch.no_grad():
        model(input_ids=ids)
    for handle in handles:
        handle.remove()
    return caught


def test_angular_distances_match_a_direct_computation_and_rank_layers_the_same():
    parent = make_tiny_llama(seed=4, num_hidden_layers=4)
    ids = torch.randint(3, 128, (3, 16), generator=torch.Generator().manual_seed(1))
    expected = []
    for h_in, h_out in _hf_layer_states(parent, ids):
        cos = (h_in * h_out).sum(-1) / np.linalg.norm(h_in, axis=-1) / np.linalg.norm(h_out, axis=-1)
        expected.append(float((np.arccos(np.clip(cos, -1, 1)) / np.pi).mean()))
    child = from_parent(parent)
    child.config._attn_implementation = "sdpa"
    got = angular_distances(child, ids, batch_sequences=2)
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-7)
    assert np.argsort(got).tolist() == np.argsort(expected).tolist()


def _cost_model(shape: ParentShape, target: str = "h100") -> CostModel:
    profile = load_profile(target)
    return CostModel(shape, profile, profile.scenario(None))


SHAPE = ParentShape(hidden_size=576, num_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                    intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True)


def test_layer_dropping_removes_the_least_important_layers_until_the_target_is_met():
    cost_model = _cost_model(SHAPE)
    distances = [0.5 + 0.01 * ((7 * i) % 30) for i in range(30)]
    picked = layer_drop_choices(SHAPE, distances, cost_model, 1.5)
    dropped = [i for i, c in enumerate(picked.choices) if c.attention.kind == "no_op"]
    assert dropped == sorted(sorted(range(30), key=lambda i: distances[i])[:len(dropped)])
    parent_runtime = cost_model.parent_model().runtime_ms
    assert parent_runtime / cost_model.model(picked.choices).runtime_ms == pytest.approx(picked.predicted_speedup)
    assert picked.predicted_speedup >= 1.5
    # one layer fewer would miss the target: the smallest drop that meets it
    fewer = list(picked.choices)
    last = sorted(dropped, key=lambda i: distances[i])[-1]
    fewer[last] = BlockChoice(AttentionVariant("gqa", 3), FFNVariant("mlp", 1536))
    assert parent_runtime / cost_model.model(fewer).runtime_ms < 1.5


def test_uniform_pruning_is_the_widest_uniform_child_that_meets_the_target():
    cost_model = _cost_model(SHAPE, "cpu")
    picked = uniform_choices(SHAPE, cost_model, 1.5)
    assert len({(c.attention, c.ffn) for c in picked.choices}) == 1
    assert picked.predicted_speedup >= 1.5
    choice = picked.choices[0]
    wider = [BlockChoice(choice.attention, FFNVariant("mlp", choice.ffn.intermediate_size + 64))] * 30
    parent_runtime = cost_model.parent_model().runtime_ms
    assert parent_runtime / cost_model.model(wider).runtime_ms < 1.5


def test_uniform_pruning_says_when_no_uniform_child_reaches_the_target():
    # batch-256 decode on an H100 is dominated by attention over the KV cache: even one KV head and
    # a 64-wide FFN in every layer stay below 1.5x, so only removing attention gets there
    cost_model = _cost_model(SHAPE, "h100")
    smallest = [BlockChoice(AttentionVariant("gqa", 1), FFNVariant("mlp", 64))] * 30
    assert cost_model.parent_model().runtime_ms / cost_model.model(smallest).runtime_ms < 1.5
    with pytest.raises(InfeasibleError, match="uniform"):
        uniform_choices(SHAPE, cost_model, 1.5)


def test_an_initialised_uniform_child_carries_the_initialised_blocks(built_library, tiny_llama_dir, tmp_path):
    from mlxkit.engines.models.loading import load_model
    from mlxkit.engines.puzzle.library import activations
    from mlxkit.engines.puzzle.search.baselines import build_initialised_child
    from mlxkit.engines.puzzle.library.block_init import initialise
    from mlxkit.engines.puzzle.subblocks import parent_subblock

    parent = from_parent(load_model(str(tiny_llama_dir)).model)
    parent.config._attn_implementation = "sdpa"
    choices = [BlockChoice(AttentionVariant("gqa", 1), FFNVariant("mlp", 32))] * 2
    states_dir = built_library / ".work" / "activations"
    child = build_initialised_child(parent, choices, states_dir, tmp_path / "blocks")
    states = activations.load_layer(states_dir, 1, 2)
    expected = initialise(parent_subblock(parent, 1, "ffn"), FFNVariant("mlp", 32), parent.config, 1,
                          states.train_mid, states.train_out - states.train_mid)
    torch.testing.assert_close(child.model.layers[1].mlp.down_proj.weight, expected.layer.mlp.down_proj.weight)
    assert child.config.block_configs[0]["attention"]["num_key_value_heads"] == 1
