"""Initialise a child subblock from the parent, before any training (Puzzle, App. A).

* fewer KV heads: K and V projections mean-pooled over the parent heads each new group uses; the
  per-head q/k norms (Qwen3) are copied, since they act on head_dim and not on a head count;
* narrower FFN: keep the channels with the largest measured contribution
  |act_i| * ||W_down[:, i]|| on calibration activations;
* linear replacements: the least-squares map from the subblock's (normed) input to the
  parent subblock's output on calibration activations (with Gemma 2's norm after the subblock,
  to what that norm turns into the output: the output over the norm's scale). The paper's
  W_o.W_v and W_down.W_up products are one point of that same family, so on the calibration
  data the least-squares map is never worse;
* the norms around the subblock (and Gemma 2's after it) are the parent's.

Every tensor is created on the device of the parent block. The new block is built on
the meta device and given storage there (`build_on`), since every parameter is overwritten.
"""

from __future__ import annotations

import torch

from mlxkit.engines.models.decilm.blocks import AttentionVariant, FFNVariant
from mlxkit.engines.models.decilm.modeling_mlx_decilm import SUBBLOCK_MODULES
from mlxkit.engines.puzzle.subblocks import Subblock, SubblockKind
from mlxkit.engines.training.device import build_on, module_device, module_dtype

RIDGE = 1e-6  # relative to the mean diagonal of X^T X; keeps the solve stable on rank-poor data


@torch.no_grad()
def initialise(parent_block: Subblock, variant: AttentionVariant | FFNVariant, parent_config, layer_idx: int,
               inputs: torch.Tensor, targets: torch.Tensor, *, dtype: torch.dtype | None = None) -> Subblock:
    """A new `Subblock` for `variant`, initialised from `parent_block` and calibration states.

    `inputs` are the residual-stream states entering the subblock, `targets` what the
    parent subblock adds to them, both `[n, seq, hidden]`, on the parent block's device.
    The block is on that device, in `dtype` (default: the parent block's). BLD passes
    float32, its master-weight dtype, so a parent held in bfloat16 still gets a float32
    least-squares solution and float32 pooled KV heads.
    """
    kind: SubblockKind = parent_block.kind
    dtype = dtype or module_dtype(parent_block)
    child = build_on(module_device(parent_block),
                     lambda: Subblock(parent_config, layer_idx, kind, variant).to(dtype))
    if variant.kind == "no_op":
        return child.eval()
    src, dst = parent_block.layer, child.layer
    norm_name, _, output_norm_name = SUBBLOCK_MODULES[kind]
    getattr(dst, norm_name).weight.copy_(getattr(src, norm_name).weight)
    output_norm = getattr(src, output_norm_name)
    if output_norm is not None:  # Gemma 2's norm after the subblock, kept by every variant
        getattr(dst, output_norm_name).weight.copy_(output_norm.weight)
    normed = getattr(src, norm_name)(inputs).reshape(-1, inputs.shape[-1])
    if variant.kind == "linear":
        linear = dst.self_attn.linear_attn if kind == "attention" else dst.mlp.linear_mlp
        linear.weight.copy_(least_squares_map(normed, _before_output_norm(targets, output_norm).reshape(
            -1, targets.shape[-1]), dtype=linear.weight.dtype))
    elif kind == "attention":
        _pool_kv_heads(src.self_attn, dst.self_attn)
    else:
        keep = ffn_channel_ranking(src.mlp, normed)[: variant.intermediate_size].sort().values
        _copy_ffn_channels(src.mlp, dst.mlp, keep)
    return child.eval()


def _before_output_norm(targets: torch.Tensor, output_norm) -> torch.Tensor:
    """What the map in front of `output_norm` must give for the norm to give `targets`.

    An RMSNorm's output divided by its scale has unit RMS and the direction of its input, and the
    norm is blind to its input's scale, so targets / scale is an exact preimage.
    """
    if output_norm is None:
        return targets
    scale = output_norm.weight.float() + getattr(output_norm, "offset", 0.0)
    return (targets.float() / scale).to(targets.dtype)


def least_squares_map(x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """W minimising ||x W^T - y||^2 (tiny ridge), as an nn.Linear weight [out, in], in `dtype` (default x's).

    Solved in float64 on x's device (GPUs solve float64 too, only slower; the system is
    hidden x hidden).
    """
    x64, y64 = x.double(), y.double()
    gram = x64.T @ x64
    gram += RIDGE * gram.diagonal().mean() * torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    solution = torch.linalg.solve(gram, x64.T @ y64)  # [in, out]
    return solution.T.to(dtype or x.dtype)


def ffn_channel_ranking(mlp, normed: torch.Tensor) -> torch.Tensor:
    """Channel indices sorted by contribution, largest first: mean |act_i| * ||W_down[:, i]||.

    The activations come in the parent's dtype; their mean and the column norms are taken
    in float32, where a bfloat16 parent's near-ties still sort by value.
    """
    act = mlp.act_fn(mlp.gate_proj(normed)) * mlp.up_proj(normed)
    contribution = act.float().abs().mean(0) * mlp.down_proj.weight.float().norm(dim=0)
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


def kv_head_groups(num_heads: int, parent_kv: int, child_kv: int,
                   device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """For each child KV head, how much each parent KV head is used by its query heads (float64, summing to 1)."""
    groups = []
    per_child, per_parent = num_heads // child_kv, num_heads // parent_kv
    parents = torch.arange(parent_kv, device=device)
    for j in range(child_kv):
        queries = torch.arange(j * per_child, (j + 1) * per_child, device=device)
        # How many of the group's query heads read each parent KV head, counted by comparison:
        # bincount's output length depends on the data, which costs a GPU a host round trip.
        weights = (queries[:, None] // per_parent == parents[None, :]).sum(0).double()
        groups.append(weights / weights.sum())
    return groups


def _pool_kv_heads(src, dst) -> None:
    head_dim = src.head_dim
    dst.q_proj.load_state_dict(src.q_proj.state_dict())
    dst.o_proj.load_state_dict(src.o_proj.state_dict())
    if src.q_norm is not None:
        dst.q_norm.load_state_dict(src.q_norm.state_dict())
        dst.k_norm.load_state_dict(src.k_norm.state_dict())
    groups = kv_head_groups(src.num_heads, src.num_key_value_heads, dst.num_key_value_heads,
                            device=src.k_proj.weight.device)
    for name in ("k_proj", "v_proj"):
        parent_w = getattr(src, name).weight.view(src.num_key_value_heads, head_dim, -1).double()
        pooled = torch.stack([torch.einsum("p,pdh->dh", g, parent_w) for g in groups])
        getattr(dst, name).weight.copy_(pooled.reshape(-1, parent_w.shape[-1]).to(getattr(dst, name).weight.dtype))
        if getattr(src, name).bias is not None:
            parent_b = getattr(src, name).bias.view(src.num_key_value_heads, head_dim).double()
            pooled_b = torch.stack([g @ parent_b for g in groups])
            getattr(dst, name).bias.copy_(pooled_b.reshape(-1).to(getattr(dst, name).bias.dtype))
