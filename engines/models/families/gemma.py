"""Gemma 1/2/3: refused up front, naming what the child's blocks lack for them."""

from mlxkit.engines.models.families import Family

FAMILY = Family(name="gemma", model_types=("gemma", "gemma2", "gemma3", "gemma3_text"), refused=(
    "the child has none of Gemma's own features: RMSNorm scaled by (1 + weight), the sqrt(hidden_size) "
    "embedding scale, GeGLU FFNs, and (Gemma 2/3) norms after each sublayer, attention and final-logit "
    "soft-capping, and alternating sliding-window layers"))
