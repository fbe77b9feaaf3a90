"""Qwen2 / Qwen2.5: Llama's layout with q/k/v biases and no o_proj bias.

The child's attention has one bias flag for all four projections, so the o_proj bias the
checkpoints lack is held as zeros.
"""

from mlxkit.engines.models.families import Family

FAMILY = Family(name="qwen2", model_types=("qwen2",), child_fields={"attention_bias": True},
                absent_as_zeros=("self_attn.o_proj.bias",))
