"""CRT regularisers: the logit distance against an independent formula and finite differences, and x′ in its set."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.func import functional_call

from mlxkit.engines.core.threads import one_intra_op_thread
from mlxkit.engines.robust.attacks import make_attack
from mlxkit.engines.robust.classifier import ClassifierConfig, build_classifier
from mlxkit.engines.robust.regularizers import alr_point, logit_distance, uniform_point

SHAPE = [1, 4, 4]


@pytest.fixture(autouse=True)
def _one_thread():
    with one_intra_op_thread():  # the classifiers are tiny: a second thread only costs hand-offs
        yield


def _model(dtype=torch.float32):
    config = ClassifierConfig(architecture="mlp", input_shape=SHAPE, num_classes=3, hidden=[8])
    return build_classifier(config, 0).to(dtype).eval()


def _x(n=5, seed=0, dtype=torch.float32):
    return torch.rand((n, *SHAPE), generator=torch.Generator().manual_seed(seed), dtype=dtype)


def test_logit_distance_is_the_mean_l2_distance_of_the_logits():
    model = _model()
    x, x_prime = _x(seed=0), _x(seed=1)
    weights = {name: p.detach().numpy().astype(np.float64) for name, p in model.named_parameters()}

    def numpy_logits(batch):  # the MLP written out by hand: flatten, linear, relu, linear
        h = batch.reshape(len(batch), -1).numpy().astype(np.float64)
        h = np.maximum(h @ weights["layers.1.weight"].T + weights["layers.1.bias"], 0)
        return h @ weights["layers.3.weight"].T + weights["layers.3.bias"]

    expected = np.linalg.norm(numpy_logits(x_prime) - numpy_logits(x), axis=1).mean()
    assert abs(logit_distance(model, x, x_prime).item() - expected) < 1e-5


def test_logit_distance_gradient_matches_finite_differences():
    """gradcheck (central differences, float64) w.r.t. every weight and both inputs at once."""
    model = _model(torch.float64)
    names = [name for name, _ in model.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_(True) for _, p in model.named_parameters())
    x = _x(seed=2, dtype=torch.float64).requires_grad_(True)
    x_prime = _x(seed=3, dtype=torch.float64).requires_grad_(True)

    class Bound(torch.nn.Module):
        def __init__(self, weights):
            super().__init__()
            self.weights = weights

        def forward(self, inputs):
            return functional_call(model, dict(zip(names, self.weights)), (inputs,))

    def regulariser(*tensors):
        *weights, a, b = tensors
        return logit_distance(Bound(weights), a, b)

    assert torch.autograd.gradcheck(regulariser, (*params, x, x_prime), eps=1e-6, atol=1e-6)


def test_regularised_loss_gradient_matches_manual_central_differences():
    """The training loss CE(f(x_adv)) + λ·distance, for one weight matrix, against manual central differences."""
    model = _model(torch.float64)
    x, x_prime, x_adv = (_x(seed=seed, dtype=torch.float64) for seed in (4, 5, 6))
    y = torch.tensor([0, 1, 2, 0, 1])
    weight = model.layers[1].weight
    lam = 0.7

    def loss() -> torch.Tensor:
        return torch.nn.functional.cross_entropy(model(x_adv), y) + lam * logit_distance(model, x, x_prime)

    model.zero_grad()
    loss().backward()
    analytic = weight.grad.clone()
    numeric = torch.zeros_like(weight)
    h = 1e-6
    with torch.no_grad():
        for index in np.ndindex(*weight.shape):
            weight[index] += h
            up = loss().item()
            weight[index] -= 2 * h
            down = loss().item()
            weight[index] += h
            numeric[index] = (up - down) / (2 * h)
    torch.testing.assert_close(analytic, numeric, atol=1e-6, rtol=1e-5)


def test_uniform_point_is_within_sigma_and_the_range():
    x = _x(64, seed=7)
    for sigma in (0.05, 0.5, 5.0):
        x_prime = uniform_point(x, sigma, 0.0, 1.0, torch.Generator().manual_seed(8))
        norms = np.linalg.norm((x_prime - x).numpy().reshape(64, -1).astype(np.float64), axis=1)
        assert norms.max() <= sigma * (1 + 1e-5)
        assert x_prime.min() >= 0.0 and x_prime.max() <= 1.0
    # Away from the range's edges nothing is clipped: noise on [-1, 1]^16 is longer than 0.05, so it is
    # rescaled to exactly σ.
    inner = torch.full((8, *SHAPE), 0.5)
    x_prime = uniform_point(inner, 0.05, 0.0, 1.0, torch.Generator().manual_seed(9))
    norms = np.linalg.norm((x_prime - inner).numpy().reshape(8, -1).astype(np.float64), axis=1)
    np.testing.assert_allclose(norms, 0.05, rtol=1e-4)


def test_alr_point_is_in_the_threat_model_and_farther_in_logit_space_than_its_start():
    model = _model()
    x = _x(64, seed=10)
    for name, budget in (("linf", 0.1), ("l2", 0.5), ("l1", 2.0), ("stadv", 0.6)):
        attack = make_attack(name, budget, 10, budget / 4, 0.0, 1.0)
        searched = alr_point(model, x, attack, torch.Generator().manual_seed(11))
        start = attack.perturb(model, x, lambda logits: logits.sum(dim=1), torch.Generator().manual_seed(11), steps=0)
        assert searched.min() >= 0.0 and searched.max() <= 1.0
        if name != "stadv":
            order = {"linf": np.inf, "l2": 2, "l1": 1}[name]
            delta = (searched - x).numpy().reshape(64, -1).astype(np.float64)
            assert np.linalg.norm(delta, ord=order, axis=1).max() <= budget * (1 + 1e-5)
        with torch.no_grad():
            assert logit_distance(model, x, searched).item() > logit_distance(model, x, start).item(), name
