"""Initialise a child subblock from the parent, before any training (Puzzle, App. A).

* fewer KV heads: K and V projections mean-pooled over the parent heads each new group uses;
* narrower FFN: keep the channels with the largest measured contribution
  |act_i| * ||W_down[:, i]|| on calibration activations;
* linear replacements: the least-squares map from the subblock's (normed) input to the
  parent subblock's output on calibration activations. The paper's W_o.W_v and
  W_down.W_up products are one point of that same family, so on the calibration data the
  least-squares map is never worse.
"""

from __future__ import annotations

import torch

from mlxkit.engines.models.decilm.blocks import AttentionVariant, FFNVariant
from mlxkit.engines.puzzle.subblocks import Subblock, SubblockKind

RIDGE = 1e-6  # relative to the mean diagonal of X^T X; keeps the solve stable on rank-poor data


@torch.no_grad()
def initialise(parent_block: Subblock, variant: AttentionVariant | FFNVariant, parent_config, layer_idx: int,
               inputs: torch.Tensor, targets: torch.Tensor) -> Subblock:
    """A new `Subblock` for `variant`, initialised from `parent_block` and calibration states.

    `inputs` are the residual-stream states entering the subblock, `targets` what the
    parent subblock adds to them, both `[n, seq, hidden]`.
    """
    kind: SubblockKind = parent_block.kind
    child = Subblock(parent_config, layer_idx, kind, variant)
    if variant.kind == "no_op":
        return child.eval()
    src, dst = parent_block.layer, child.layer
    norm_name = "input_layernorm" if kind == "attention" else "post_attention_layernorm"
    getattr(dst, norm_name).weight.copy_(getattr(src, norm_name).weight)
    normed = getattr(src, norm_name)(inputs).reshape(-1, inputs.shape[-1])
    if variant.kind == "linear":
        weight = least_squares_map(normed, targets.reshape(-1, targets.shape[-1]))
        (dst.self_attn.linear_attn if kind == "attention" else dst.mlp.linear_mlp).weight.copy_(weight)
    elif kind == "attention":
        _pool_kv_heads(src.self_attn, dst.self_attn)
    else:
        keep = ffn_channel_ranking(src.mlp, normed)[: variant.intermediate_size].sort().values
        _copy_ffn_channels(src.mlp, dst.mlp, keep)
    return child.eval()


def least_squares_map(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """W minimising ||x W^T - y||^2 (tiny ridge), as an nn.Linear weight [out, in]; solved in float64."""
    x64, y64 = x.double(), y.double()
    gram = x64.T @ x64
    gram += RIDGE * gram.diagonal().mean() * torch.eye(gram.shape[0], dtype=gram.dtype)
    solution = torch.linalg.solve(gram, x64.T @ y64)  # [in, out]
    return solution.T.to(x.dtype)


def ffn_channel_ranking(mlp, normed: torch.Tensor) -> torch.Tensor:
    """Channel indices sorted by contribution, largest first: mean |act_i| * ||W_down[:, i]||."""
    act = mlp.act_fn(mlp.gate_proj(normed)) * mlp.up_proj(normed)
    contribution = act.abs().mean(0) * mlp.down_proj.weight.norm(dim=0)
    return contribution.argsort(descending=True)


def _copy_ffn_channels(src, dst, keep: torch.Tensor) -> None:
    dst.gate_proj.weight.copy_(src.gate_proj.weight[keep])
    dst.up_proj.weight.copy_(src.up_proj.weight[keep])
    dst.down_proj.weight.copy_(src.down_proj.weight[:, keep])
    for name in ("gate_proj", "up_proj"):
        if getattr(src, name).bias is not None:
            getattr(dst, name).bias.copy_(getattr(src, name).bias[keep])
    if src.down_proj.bias is not None:
        dst.down_proj.bias.copy_(src.down_proj.bias)


def kv_head_groups(num_heads: int, parent_kv: int, child_kv: int) -> list[torch.Tensor]:
    """For each child KV head, how much each parent KV head is used by its query heads (weights sum to 1)."""
    groups = []
    per_child, per_parent = num_heads // child_kv, num_heads // parent_kv
    for j in range(child_kv):
        queries = torch.arange(j * per_child, (j + 1) * per_child)
        weights = torch.bincount(queries // per_parent, minlength=parent_kv).double()
        groups.append(weights / weights.sum())
    return groups


def _pool_kv_heads(src, dst) -> None:
    head_dim = src.head_dim
    dst.q_proj.load_state_dict(src.q_proj.state_dict())
    dst.o_proj.load_state_dict(src.o_proj.state_dict())
    groups = kv_head_groups(src.num_heads, src.num_key_value_heads, dst.num_key_value_heads)
    for name in ("k_proj", "v_proj"):
        parent_w = getattr(src, name).weight.view(src.num_key_value_heads, head_dim, -1).double()
        pooled = torch.stack([torch.einsum("p,pdh->dh", g, parent_w) for g in groups])
        getattr(dst, name).weight.copy_(pooled.reshape(-1, parent_w.shape[-1]).to(getattr(dst, name).weight.dtype))
        if getattr(src, name).bias is not None:
            parent_b = getattr(src, name).bias.view(src.num_key_value_heads, head_dim).double()
            pooled_b = torch.stack([g @ parent_b for g in groups])
            getattr(dst, name).bias.copy_(pooled_b.reshape(-1).to(getattr(dst, name).bias.dtype))
