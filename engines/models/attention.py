"""Which attention implementation mlxkit runs a model with."""

from __future__ import annotations

from typing import Any


def prefer_sdpa(config: Any) -> Any:
    """Run the model's attention through SDPA, unless it soft-caps its attention scores (Gemma 2 and
    children of it): SDPA cannot cap, and transformers runs those eagerly. Returns the config."""
    capped = getattr(config, "attn_logit_softcapping", None) is not None
    config._attn_implementation = "eager" if capped else "sdpa"
    return config
