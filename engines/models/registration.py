"""Register mlxkit's own architectures with transformers' Auto classes."""

from __future__ import annotations

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from transformers import AutoConfig, AutoModelForCausalLM

    from mlxkit.engines.models.decilm.configuration_mlx_decilm import MlxDeciLMConfig
    from mlxkit.engines.models.decilm.modeling_mlx_decilm import MlxDeciLMForCausalLM

    AutoConfig.register(MlxDeciLMConfig.model_type, MlxDeciLMConfig, exist_ok=True)
    AutoModelForCausalLM.register(MlxDeciLMConfig, MlxDeciLMForCausalLM, exist_ok=True)
    _registered = True
