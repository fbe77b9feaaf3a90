"""Replace-1-block scores computed through `ParentTail`'s reused buffers equal those of fresh tensors,
bit for bit, for every variant in turn and in any order."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from conftest import make_tiny_llama
from mlxkit.engines.models.decilm.blocks import AttentionVariant, FFNVariant
from mlxkit.engines.models.decilm.convert import from_parent
from mlxkit.engines.puzzle.library.block_init import initialise
from mlxkit.engines.puzzle.library import activations
from mlxkit.engines.puzzle.library.scoring import ParentTail, parent_metrics, score_subblock
from mlxkit.engines.puzzle.subblocks import parent_subblock

SEQ = 12


def _fresh_metrics(parent, ids, final) -> dict[str, float]:
    """The metrics written out with fresh tensors and the model's own forward to the logits: the reference."""
    with torch.inference_mode():
        hidden = parent.model.norm(final[:, :-1])
        logp = F.log_softmax(parent.lm_head(hidden).float(), dim=-1)
        reference = F.log_softmax(parent(input_ids=ids).logits[:, :-1].float(), dim=-1)
        kl = (reference.exp() * (reference - logp)).sum(-1).mean()
        nll = -logp.gather(-1, ids[:, 1:].unsqueeze(-1)).mean()
        agree = (logp.argmax(-1) == reference.argmax(-1)).float().mean()
    return {"kl_div": kl.item(), "lm_loss": nll.item(), "top1_agreement": agree.item()}


def test_scores_through_reused_buffers_equal_fresh_ones_for_each_variant_in_turn():
    torch.manual_seed(0)
    parent = from_parent(make_tiny_llama(num_hidden_layers=3))
    parent.config._attn_implementation = "sdpa"
    ids = torch.randint(3, 128, (3, SEQ))
    pos = activations.position_embeddings(parent, SEQ)
    with torch.inference_mode():
        states = activations.embedded_states(parent, {"val": ids})
        tensors, nxt = activations.layer_states(parent.model.layers[0], states, pos, batch_sequences=2)
        h, mid = tensors["val_in"], tensors["val_mid"]
        final = nxt["val"]
        for layer in parent.model.layers[1:]:
            final = layer(final, pos)
    tail = ParentTail(parent, ids, final, pos)
    variants = [("ffn", FFNVariant("linear")), ("attention", AttentionVariant("gqa", 1)),
                ("ffn", FFNVariant("mlp", 24)), ("attention", AttentionVariant("no_op"))]
    scores, expected = [], []
    for kind, variant in variants:
        block = initialise(parent_subblock(parent, 0, kind), variant, parent.config, 0, h,
                           (mid - h) if kind == "attention" else (nxt["val"] - mid))
        scores.append(score_subblock(tail, block, 0, h, mid))
        with torch.inference_mode():
            state = h + block(h, pos) if kind == "attention" else mid + block(mid)
            if kind == "attention":
                state = state + parent.model.layers[0].ffn_delta(state)
            for layer in parent.model.layers[1:]:
                state = layer(state, pos)
        expected.append(_fresh_metrics(parent, ids, state))
    assert scores == expected
    assert len({s["kl_div"] for s in scores}) == len(variants), "each variant scored its own state"
    assert all(s["kl_div"] > 0 for s in scores)
    # the parent against itself after the variants: KL 0 and full agreement, whatever the buffers held
    assert parent_metrics(tail) == {**_fresh_metrics(parent, ids, final), "kl_div": 0.0}
    assert parent_metrics(tail)["top1_agreement"] == 1.0
