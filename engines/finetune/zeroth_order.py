"""The zeroth-order half of H-Tuning: SPSA along a seeded direction, and the per-tensor blend.

SPSA (MeZO, Malladi et al. 2023) estimates the directional derivative of the loss along a
random direction z from two forwards and no backward:

    p = (L(θ + εz) − L(θ − εz)) / (2ε)  ≈  ∇L · z,        g_ZO = p · z

z is drawn per tensor from a generator seeded by (step seed, tensor index), so it is never
stored: it is regenerated for each perturbation and for the gradient. The forwards run
without autograd, so they keep no activations.

Restoring θ exactly: in floating point θ + εz − 2εz + εz is not always θ again (each add
rounds), so instead the perturbed tensors are copied once before the first perturbation and
copied back afterwards. Only the adapter's tensors are perturbed, so the copy is a few MB,
small next to the frozen model, and far smaller than the activations SPSA avoids storing.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Sequence, TypeVar

import torch

from mlxkit.engines.core.seeds import seeded_generator

T = TypeVar("T")


def direction(params: Sequence[torch.Tensor], seed: int) -> Iterator[torch.Tensor]:
    """z for each tensor: standard normal, from a generator seeded by (seed, tensor index)."""
    for index, param in enumerate(params):
        generator = seeded_generator(seed, "spsa", index, device=param.device)
        yield torch.randn(param.shape, generator=generator, dtype=param.dtype, device=param.device)


@torch.no_grad()
def perturb_(params: Sequence[torch.Tensor], seed: int, scale: float) -> None:
    """θ ← θ + scale · z, in place."""
    for param, z in zip(params, direction(params, seed)):
        param.add_(z, alpha=scale)


@contextlib.contextmanager
def restored(params: Sequence[torch.Tensor]) -> Iterator[None]:
    """Put `params` back bit for bit on leaving the block, whatever happened inside it."""
    saved = [p.detach().clone() for p in params]
    try:
        yield
    finally:
        with torch.no_grad():
            for param, copy in zip(params, saved):
                param.copy_(copy)


def spsa_losses(params: Sequence[torch.Tensor], loss_at: Callable[[int], T], eps: float,
                seed: int) -> tuple[T, T]:
    """(loss at θ + εz, loss at θ − εz); `loss_at(+1)` and `loss_at(-1)` evaluate them. θ is restored exactly.

    The caller forms p = (plus − minus) / (2ε), after summing the losses over processes if any.
    """
    with restored(params):
        perturb_(params, seed, eps)
        plus = loss_at(+1)
        perturb_(params, seed, -2.0 * eps)
        minus = loss_at(-1)
    return plus, minus


def zo_gradients(params: Sequence[torch.Tensor], seed: int, projected: float) -> list[torch.Tensor]:
    """g_ZO = p · z for each tensor (z regenerated from the seed)."""
    return [projected * z for z in direction(params, seed)]


def mix_gradient(g_fo: torch.Tensor, g_zo: torch.Tensor, coef: float) -> torch.Tensor:
    """H-Tuning's blend for one tensor: c·g_FO + (1−c)·‖g_FO‖·g_ZO/‖g_ZO‖.

    The ZO direction is rescaled to the first-order gradient's norm, so only its direction
    counts. A zero ZO estimate (p = 0) contributes nothing.
    """
    zo_norm = torch.linalg.vector_norm(g_zo)
    if zo_norm == 0:
        return coef * g_fo
    return coef * g_fo + (1.0 - coef) * torch.linalg.vector_norm(g_fo) * (g_zo / zo_norm)
