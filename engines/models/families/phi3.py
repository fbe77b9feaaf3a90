"""Phi-3 / Phi-3.5 (and Phi-4-mini's `phi3` type with full rotary): Llama's layout with fused projections.

`qkv_proj` stacks q, k and v along its rows and `gate_up_proj` stacks gate and up; each is
split into the child's separate projections as a layer is read. `longrope` RoPE is carried as
it is, and so is Phi-3-mini-4k's sliding window. Phi-4-mini's partial rotary embeddings are
refused (see `check_parent`).
"""

from mlxkit.engines.models.families import Family, Fused

FAMILY = Family(name="phi3", model_types=("phi3",), fused=(
    Fused("self_attn.qkv_proj.weight", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                        "self_attn.v_proj.weight")),
    Fused("mlp.gate_up_proj.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
))
