"""One finiteness test for tensors, shared by every writer that publishes numbers.

A NaN or infinity in one weight makes every logit NaN, and one in a solution or a metric makes
it meaningless; each writer refuses them before anything is published (`NonFiniteError`).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch


def all_finite(tensor: torch.Tensor) -> bool:
    """True when no entry is NaN or ±inf (non-float tensors always are)."""
    if not tensor.is_floating_point():
        return True
    # One float32 sum is the fast test: a NaN or infinity anywhere makes it non-finite. A sum can also
    # overflow on large finite entries, so only a non-finite sum pays for the exact element-wise test.
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def first_non_finite(named: Iterable[tuple[str, torch.Tensor]]) -> Optional[str]:
    """The name of the first tensor holding NaN or ±inf, or None when all are finite."""
    for name, tensor in named:
        if not all_finite(tensor):
            return name
    return None
