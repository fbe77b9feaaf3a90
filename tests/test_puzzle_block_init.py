"""Initialising child subblocks from the parent (Puzzle App. A)."""

from __future__ import annotations

import torch

from conftest import tiny_layer0_states
from mlxkit.engines.models.decilm.blocks import AttentionVariant, FFNVariant
from mlxkit.engines.puzzle.library.bld import normalized_mse
from mlxkit.engines.puzzle.library.block_init import initialise, kv_head_groups, least_squares_map
from mlxkit.engines.puzzle.subblocks import parent_subblock


def _parent_and_states(seq_len: int = 24, n: int = 6):
    return tiny_layer0_states(n, seq_len)


def test_linear_attention_least_squares_beats_wo_wv_product():
    parent, pos, h, mid, _ = _parent_and_states()
    source = parent_subblock(parent, 0, "attention")
    fitted = initialise(source, AttentionVariant("linear"), parent.config, 0, h, mid - h)
    # The paper's initialisation: each token attends only to itself, so attention = W_o . W_v (per group).
    attn = source.layer.self_attn
    groups = attn.num_key_value_groups
    w_v = attn.v_proj.weight.view(attn.num_key_value_heads, attn.head_dim, -1).repeat_interleave(groups, 0)
    product = attn.o_proj.weight @ w_v.reshape(-1, w_v.shape[-1])
    paper = initialise(source, AttentionVariant("linear"), parent.config, 0, h, mid - h)
    with torch.no_grad():
        paper.layer.self_attn.linear_attn.weight.copy_(product)
        ls_error = normalized_mse(fitted(h, pos), mid - h).item()
        paper_error = normalized_mse(paper(h, pos), mid - h).item()
    assert ls_error <= paper_error
    assert ls_error < 0.999 * paper_error, "least squares should be strictly better on random weights"


def test_linear_ffn_least_squares_matches_numpy_lstsq():
    parent, _, _, mid, out = _parent_and_states()
    source = parent_subblock(parent, 0, "ffn")
    block = initialise(source, FFNVariant("linear"), parent.config, 0, mid, out - mid)
    with torch.no_grad():
        x = source.layer.post_attention_layernorm(mid).reshape(-1, 32).double().numpy()
    import numpy as np

    reference = np.linalg.lstsq(x, (out - mid).reshape(-1, 32).double().numpy(), rcond=None)[0].T
    torch.testing.assert_close(block.layer.mlp.linear_mlp.weight.double(), torch.from_numpy(reference),
                               rtol=1e-3, atol=1e-3)


def test_full_width_and_full_kv_initialise_to_the_parent_exactly():
    parent, pos, h, mid, out = _parent_and_states()
    ffn_parent = parent_subblock(parent, 0, "ffn")
    attn_parent = parent_subblock(parent, 0, "attention")
    ffn = initialise(ffn_parent, FFNVariant("mlp", 64), parent.config, 0, mid, out - mid)
    attn = initialise(attn_parent, AttentionVariant("gqa", 2), parent.config, 0, h, mid - h)
    with torch.no_grad():
        torch.testing.assert_close(ffn(mid), out - mid, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(attn(h, pos), mid - h, rtol=1e-5, atol=1e-6)


def test_ffn_pruning_drops_the_channels_that_contribute_nothing():
    parent, _, _, mid, out = _parent_and_states()
    source = parent_subblock(parent, 0, "ffn")
    dead = torch.arange(0, 64, 2)  # half the channels write nothing to the residual stream
    with torch.no_grad():
        source.layer.mlp.down_proj.weight[:, dead] = 0
        target = source(mid)
    block = initialise(source, FFNVariant("mlp", 32), parent.config, 0, mid, target)
    with torch.no_grad():
        torch.testing.assert_close(block(mid), target, rtol=1e-5, atol=1e-6)


def test_kv_heads_are_mean_pooled_within_groups():
    groups = kv_head_groups(num_heads=4, parent_kv=2, child_kv=1)
    assert len(groups) == 1 and torch.allclose(groups[0], torch.tensor([0.5, 0.5], dtype=torch.float64))
    parent, pos, h, mid, _ = _parent_and_states()
    source = parent_subblock(parent, 0, "attention")
    block = initialise(source, AttentionVariant("gqa", 1), parent.config, 0, h, mid - h)
    k_parent = source.layer.self_attn.k_proj.weight.view(2, 8, 32)
    torch.testing.assert_close(block.layer.self_attn.k_proj.weight, k_parent.mean(0))


def test_least_squares_map_recovers_a_known_linear_map():
    torch.manual_seed(0)
    x = torch.randn(500, 16)
    w = torch.randn(8, 16)
    torch.testing.assert_close(least_squares_map(x, x @ w.T), w, rtol=1e-4, atol=1e-4)
