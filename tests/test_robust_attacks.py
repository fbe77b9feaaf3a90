"""CRT attacks: every attack stays in its budget and the valid range, and raises the loss it attacks.

Budgets are measured here with numpy on the returned inputs (and, for the flow attack, the
returned flow), not with the norms the attacks use internally; the flow attack's images are
checked against an independent bilinear warp.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mlxkit.engines.core.threads import one_intra_op_thread
from mlxkit.engines.robust.attacks import (FlowAttack, PGDAttack, cross_entropy_objective, make_attack,
                                           project_l1)
from mlxkit.engines.robust.classifier import ClassifierConfig, build_classifier

LOW, HIGH = -0.5, 1.5  # not [0, 1], so a range hard-coded anywhere would show
SHAPE = [2, 6, 6]


@pytest.fixture(autouse=True)
def _one_thread():
    with one_intra_op_thread():  # the classifiers are tiny: a second thread only costs hand-offs
        yield


def _model(architecture: str = "mlp", seed: int = 0):
    config = ClassifierConfig(architecture=architecture, input_shape=SHAPE, num_classes=4, hidden=[32],
                              channels=[8])
    return build_classifier(config, seed).eval()


def _inputs(n: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = LOW + (HIGH - LOW) * torch.rand((n, *SHAPE), generator=g)
    # A quarter of the pixels sit exactly on the range's edges, where clamping matters.
    edge = torch.rand((n, *SHAPE), generator=g)
    x = torch.where(edge < 0.125, torch.full_like(x, LOW), torch.where(edge > 0.875, torch.full_like(x, HIGH), x))
    return x, torch.randint(0, 4, (n,), generator=g)


def _bilinear_warp(image: np.ndarray, flow: np.ndarray) -> np.ndarray:
    """Independent reference: sample image [C, H, W] at (col + dx, row + dy), edges clamped (border padding)."""
    channels, height, width = image.shape
    out = np.zeros_like(image)
    for row in range(height):
        for col in range(width):
            sx = min(max(col + flow[row, col, 0], 0.0), width - 1.0)
            sy = min(max(row + flow[row, col, 1], 0.0), height - 1.0)
            x0, y0 = int(np.floor(sx)), int(np.floor(sy))
            x1, y1 = min(x0 + 1, width - 1), min(y0 + 1, height - 1)
            wx, wy = sx - x0, sy - y0
            out[:, row, col] = ((1 - wx) * (1 - wy) * image[:, y0, x0] + wx * (1 - wy) * image[:, y0, x1]
                                + (1 - wx) * wy * image[:, y1, x0] + wx * wy * image[:, y1, x1])
    return out


@pytest.mark.parametrize("norm,budget,order", [("linf", 0.1, np.inf), ("l2", 0.7, 2), ("l1", 3.0, 1)])
@pytest.mark.parametrize("architecture", ["mlp", "cnn"])
def test_pgd_stays_in_its_budget_and_the_range(norm, budget, order, architecture):
    model = _model(architecture)
    x, y = _inputs()
    # A step size as large as the budget makes every step hit the projection.
    attack = make_attack(norm, budget, 8, budget, LOW, HIGH)
    x_adv = attack.perturb(model, x, cross_entropy_objective(y), torch.Generator().manual_seed(1))
    delta = (x_adv - x).numpy().reshape(len(x), -1).astype(np.float64)
    norms = np.linalg.norm(delta, ord=order, axis=1)
    assert norms.max() <= budget * (1 + 1e-5)
    assert norms.max() >= 0.5 * budget  # the attack used its budget, it did not stay at the clean input
    assert x_adv.min() >= LOW and x_adv.max() <= HIGH


def test_flow_attack_stays_in_its_budget_and_resamples_the_image():
    model = _model("cnn")
    x, y = _inputs(6)
    budget = 0.8
    attack = FlowAttack("stadv", budget, 6, budget, LOW, HIGH)
    x_adv, flow = attack.perturb_with_flow(model, x, cross_entropy_objective(y), torch.Generator().manual_seed(2))
    lengths = np.sqrt((flow.numpy().astype(np.float64) ** 2).sum(axis=-1))  # each pixel's displacement
    assert lengths.max() <= budget * (1 + 1e-5) and lengths.max() >= 0.5 * budget
    assert x_adv.min() >= LOW and x_adv.max() <= HIGH
    for i in range(len(x)):
        expected = _bilinear_warp(x[i].numpy().astype(np.float64), flow[i].numpy().astype(np.float64))
        np.testing.assert_allclose(x_adv[i].numpy(), np.clip(expected, LOW, HIGH), atol=1e-5)


@pytest.mark.parametrize("name,budget", [("linf", 0.1), ("l2", 0.7), ("l1", 3.0), ("stadv", 0.8)])
def test_attacks_raise_the_loss_beyond_their_random_start(name, budget):
    model = _model("cnn")
    x, y = _inputs(32)
    attack = make_attack(name, budget, 10, 2.5 * budget / 10, LOW, HIGH)
    objective = cross_entropy_objective(y)
    searched = attack.perturb(model, x, objective, torch.Generator().manual_seed(3))
    start_only = attack.perturb(model, x, objective, torch.Generator().manual_seed(3), steps=0)
    with torch.no_grad():
        clean_loss = F.cross_entropy(model(x), y).item()
        start_loss = F.cross_entropy(model(start_only), y).item()
        attacked_loss = F.cross_entropy(model(searched), y).item()
    assert attacked_loss > clean_loss + 0.05 and attacked_loss > start_loss + 0.05, (clean_loss, start_loss,
                                                                                     attacked_loss)


def _l1_projection_by_bisection(v: np.ndarray, radius: float) -> np.ndarray:
    """Independent reference: the threshold θ with Σ max(|v| − θ, 0) = radius, found by bisection."""
    if np.abs(v).sum() <= radius:
        return v
    lo, hi = 0.0, np.abs(v).max()
    for _ in range(200):
        mid = (lo + hi) / 2
        if np.maximum(np.abs(v) - mid, 0).sum() > radius:
            lo = mid
        else:
            hi = mid
    return np.sign(v) * np.maximum(np.abs(v) - hi, 0)


def test_l1_projection_matches_a_bisection_reference():
    g = torch.Generator().manual_seed(4)
    delta = torch.randn((8, 3, 5), generator=g, dtype=torch.float64) * torch.tensor([0.01, 1, 3, 10, 0.5, 2, 5, 7],
                                                                                   dtype=torch.float64)[:, None, None]
    projected = project_l1(delta, 4.0)
    for i in range(len(delta)):
        expected = _l1_projection_by_bisection(delta[i].numpy().ravel(), 4.0)
        np.testing.assert_allclose(projected[i].numpy().ravel(), expected, atol=1e-9)


def test_unknown_attack_is_refused():
    with pytest.raises(ValueError, match="unknown attack 'l3'"):
        make_attack("l3", 1.0, 1, 1.0, 0.0, 1.0)
    assert isinstance(make_attack("l2", 1.0, 1, 1.0, 0.0, 1.0), PGDAttack)
