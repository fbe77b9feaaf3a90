"""Logit-distance regularisers of continual robust training: λ·E‖f(x′) − f(x)‖₂ on the logits.

Why logits: the gap between a model's robustness to two attacks is bounded by how far each
attack moves an input in logit space (Dai et al., ICML 2025), so keeping that distance
small keeps robustness to the old attacks while the model adapts to a new one.

Two ways to pick x′:
  * ALR (adversarial): one ascent step of size ε on ‖f(x′) − f(x)‖₂ from a random start
    inside the current attack's threat model (the paper's setting of one iteration).
  * UR (uniform): x + uniform noise on [−1, 1]^d, scaled down to an ℓ2 norm of at most σ,
    clipped to the valid input range. No search, so it is cheaper.
"""

from __future__ import annotations

import torch

from mlxkit.engines.robust.attacks import Attack, _broadcast, lp_norm


def logit_distance(model: torch.nn.Module, x: torch.Tensor, x_prime: torch.Tensor) -> torch.Tensor:
    """mean_i ‖f(x′_i) − f(x_i)‖₂, differentiable through both forward passes."""
    return torch.linalg.vector_norm(model(x_prime) - model(x), dim=1).mean()


def alr_point(model: torch.nn.Module, x: torch.Tensor, attack: Attack, generator: torch.Generator) -> torch.Tensor:
    """x′ for ALR: the attack's threat model, one step of size ε, maximising the logit distance to f(x)."""
    with torch.no_grad():
        anchor = model(x)
    return attack.perturb(model, x, lambda logits: torch.linalg.vector_norm(logits - anchor, dim=1), generator,
                          steps=1, step_size=attack.budget)


def uniform_point(x: torch.Tensor, sigma: float, low: float, high: float, generator: torch.Generator) -> torch.Tensor:
    """x′ for UR: uniform noise rescaled to ℓ2 norm ≤ σ, clipped to [low, high]."""
    noise = torch.rand(x.shape, generator=generator, dtype=x.dtype).to(x.device) * 2 - 1
    scale = (sigma / lp_norm(noise, "l2").clamp_min(1e-12)).clamp(max=1.0)
    return (x + noise * _broadcast(scale, x)).clamp(low, high)
