"""Attacks: projected gradient ascent under L∞, L2 and L1, and a spatial-flow (StAdv-style) attack.

Each attack maximises an objective of the logits (cross-entropy for adversarial training,
the logit distance for the ALR regulariser) inside its threat model, and keeps every input
in the valid range [low, high]. Clamping to the range after the projection never breaks the
budget: the clean input lies in the range, so clamping only moves a coordinate of the
perturbation towards zero, which shrinks every ℓp norm.

The flow attack displaces each pixel by a vector (dx, dy) in pixels and resamples the
image bilinearly (`grid_sample`, border padding); its budget bounds each pixel's
displacement length. The original StAdv adds a flow-smoothness penalty; this one bounds
the flow magnitude only, which keeps the threat model a plain projection.

Every random start draws from the (CPU) generator it is given and is then moved to the data's
device, so the draws are the same on every device, and a step's attack is a pure
function of the seed and the step: training resumes bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Literal, Union

import torch
import torch.nn.functional as F

# logits [N, K] -> the per-example value [N] the attack maximises
Objective = Callable[[torch.Tensor], torch.Tensor]
Norm = Literal["linf", "l2", "l1"]

ATTACK_NAMES = ("linf", "l2", "l1", "stadv")
# An L1 step moves only the coordinates whose gradient is in this top fraction: the L1
# ball's steepest direction is sparse, and one coordinate at a time is too slow.
L1_STEP_FRACTION = 0.05
_TINY = 1e-12


def cross_entropy_objective(labels: torch.Tensor) -> Objective:
    return lambda logits: F.cross_entropy(logits, labels, reduction="none")


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1)


def _broadcast(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return values.view(-1, *([1] * (like.dim() - 1)))


def lp_norm(delta: torch.Tensor, norm: Norm) -> torch.Tensor:
    """Per-example norm of a perturbation [N, ...]."""
    order = {"linf": math.inf, "l2": 2.0, "l1": 1.0}[norm]
    return torch.linalg.vector_norm(_flat(delta), ord=order, dim=1)


def project_l1(delta: torch.Tensor, radius: float) -> torch.Tensor:
    """Euclidean projection of each example onto the L1 ball (sort-and-threshold, Duchi et al. 2008)."""
    flat = _flat(delta)
    magnitude = flat.abs()
    outside = magnitude.sum(dim=1) > radius
    if not bool(outside.any()):
        return delta
    ordered, _ = magnitude.sort(dim=1, descending=True)
    cumulative = ordered.cumsum(dim=1)
    ranks = torch.arange(1, flat.shape[1] + 1, dtype=flat.dtype, device=flat.device)
    # The largest rank whose entry stays positive after removing the shared threshold.
    positive = ordered - (cumulative - radius) / ranks > 0
    last = positive.to(flat.dtype).mul(ranks).argmax(dim=1)
    threshold = (cumulative.gather(1, last[:, None]).squeeze(1) - radius) / (last + 1).to(flat.dtype)
    shrunk = flat.sign() * (magnitude - threshold[:, None]).clamp_min(0)
    return torch.where(outside[:, None], shrunk, flat).view_as(delta)


def project(delta: torch.Tensor, norm: Norm, radius: float) -> torch.Tensor:
    if norm == "linf":
        return delta.clamp(-radius, radius)
    if norm == "l2":
        scale = (radius / lp_norm(delta, "l2").clamp_min(_TINY)).clamp(max=1.0)
        return delta * _broadcast(scale, delta)
    return project_l1(delta, radius)


@dataclass(frozen=True)
class PGDAttack:
    """Projected gradient ascent inside an Lp ball of radius `budget`, from a random start."""

    name: str
    norm: Norm
    budget: float
    steps: int
    step_size: float
    low: float
    high: float

    def random_start(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        if self.norm == "linf":
            delta = (torch.rand(x.shape, generator=generator, dtype=x.dtype).to(x.device) * 2 - 1) * self.budget
        else:
            direction = torch.randn(x.shape, generator=generator, dtype=x.dtype).to(x.device)
            radius = torch.rand(x.shape[0], generator=generator, dtype=x.dtype).to(x.device) * self.budget
            delta = direction * _broadcast(radius / lp_norm(direction, self.norm).clamp_min(_TINY), x)
        return (x + delta).clamp(self.low, self.high) - x

    def ascent_direction(self, grad: torch.Tensor, x_adv: torch.Tensor) -> torch.Tensor:
        """The unit-norm (in this attack's norm) direction of steepest ascent."""
        if self.norm == "linf":
            return grad.sign()
        if self.norm == "l2":
            return grad / _broadcast(lp_norm(grad, "l2").clamp_min(_TINY), grad)
        # L1: spread the step over the top coordinates, skipping those already at the edge of the
        # valid range and pushed outwards (their step would be clamped away).
        blocked = ((x_adv <= self.low) & (grad < 0)) | ((x_adv >= self.high) & (grad > 0))
        score = _flat(grad.abs().masked_fill(blocked, 0.0))
        keep = max(1, math.ceil(L1_STEP_FRACTION * score.shape[1]))
        cutoff = score.topk(keep, dim=1).values[:, -1:]
        chosen = (score >= cutoff) & (score > 0)
        count = chosen.sum(dim=1, keepdim=True).clamp_min(1)
        return (_flat(grad).sign() * chosen / count).view_as(grad)

    def perturb(self, model: torch.nn.Module, x: torch.Tensor, objective: Objective, generator: torch.Generator,
                *, steps: int | None = None, step_size: float | None = None) -> torch.Tensor:
        """Adversarial inputs for `x`: each within `budget` of its clean input and inside [low, high]."""
        steps = self.steps if steps is None else steps
        step_size = self.step_size if step_size is None else step_size
        x = x.detach()
        delta = self.random_start(x, generator)
        for _ in range(steps):
            delta.requires_grad_(True)
            value = objective(model(x + delta)).sum()
            (grad,) = torch.autograd.grad(value, delta)
            with torch.no_grad():
                stepped = delta + step_size * self.ascent_direction(grad, x + delta)
                delta = (x + project(stepped, self.norm, self.budget)).clamp(self.low, self.high) - x
        return (x + delta).clamp(self.low, self.high).detach()


def identity_grid(height: int, width: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """[H, W, 2] sampling positions (x, y) of every pixel centre in grid_sample's [-1, 1] coordinates."""
    ys = torch.linspace(-1.0, 1.0, height, dtype=dtype, device=device) if height > 1 else \
        torch.zeros(1, dtype=dtype, device=device)
    xs = torch.linspace(-1.0, 1.0, width, dtype=dtype, device=device) if width > 1 else \
        torch.zeros(1, dtype=dtype, device=device)
    grid_y, grid_x = torch.meshgrid(ys, xs, indexing="ij")
    return torch.stack([grid_x, grid_y], dim=-1)


def warp(x: torch.Tensor, flow: torch.Tensor) -> torch.Tensor:
    """Resample images [N, C, H, W] at each pixel displaced by `flow` [N, H, W, 2] (dx, dy in pixels)."""
    height, width = x.shape[-2:]
    pixel = torch.tensor([2.0 / max(width - 1, 1), 2.0 / max(height - 1, 1)], dtype=x.dtype, device=x.device)
    grid = identity_grid(height, width, x.dtype, x.device) + flow * pixel
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=True)


def flow_magnitude(flow: torch.Tensor) -> torch.Tensor:
    """[N, H, W]: each pixel's displacement length in pixels."""
    return torch.linalg.vector_norm(flow, dim=-1)


@dataclass(frozen=True)
class FlowAttack:
    """Spatial-flow attack (StAdv-style): each pixel moves at most `budget` pixels; gradient ascent on the flow."""

    name: str
    budget: float
    steps: int
    step_size: float
    low: float
    high: float

    def _project(self, flow: torch.Tensor) -> torch.Tensor:
        scale = (self.budget / flow_magnitude(flow).clamp_min(_TINY)).clamp(max=1.0)
        return flow * scale[..., None]

    def perturb_with_flow(self, model: torch.nn.Module, x: torch.Tensor, objective: Objective,
                          generator: torch.Generator, *, steps: int | None = None,
                          step_size: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(adversarial images, the flow [N, H, W, 2] that made them)."""
        if x.dim() != 4:
            raise ValueError(f"the flow attack needs images [N, C, H, W] (got shape {list(x.shape)})")
        steps = self.steps if steps is None else steps
        step_size = self.step_size if step_size is None else step_size
        x = x.detach()
        batch, _, height, width = x.shape
        start = (torch.rand((batch, height, width, 2), generator=generator, dtype=x.dtype).to(x.device) * 2 - 1) \
            * self.budget
        flow = self._project(start)
        for _ in range(steps):
            flow.requires_grad_(True)
            value = objective(model(warp(x, flow))).sum()
            (grad,) = torch.autograd.grad(value, flow)
            with torch.no_grad():
                # Each pixel's vector moves `step_size` pixels along its own gradient.
                direction = grad / flow_magnitude(grad).clamp_min(_TINY)[..., None]
                flow = self._project(flow + step_size * direction)
        with torch.no_grad():
            return warp(x, flow).clamp(self.low, self.high), flow.detach()

    def perturb(self, model: torch.nn.Module, x: torch.Tensor, objective: Objective, generator: torch.Generator,
                *, steps: int | None = None, step_size: float | None = None) -> torch.Tensor:
        return self.perturb_with_flow(model, x, objective, generator, steps=steps, step_size=step_size)[0]


Attack = Union[PGDAttack, FlowAttack]


def make_attack(name: str, budget: float, steps: int, step_size: float, low: float, high: float) -> Attack:
    """One attack by name (`linf`, `l2`, `l1`, `stadv`)."""
    if name == "stadv":
        return FlowAttack(name, budget, steps, step_size, low, high)
    if name in ("linf", "l2", "l1"):
        return PGDAttack(name, name, budget, steps, step_size, low, high)  # type: ignore[arg-type]
    raise ValueError(f"unknown attack '{name}' (available: {', '.join(ATTACK_NAMES)})")


@torch.no_grad()
def _predict(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).argmax(dim=1)


def correct_under_attack(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, attack: Attack,
                         generator: torch.Generator, *, steps: int | None = None) -> torch.Tensor:
    """[N] bool: which examples the model still classifies correctly after the attack."""
    x_adv = attack.perturb(model, x, cross_entropy_objective(y), generator, steps=steps)
    return _predict(model, x_adv) == y
