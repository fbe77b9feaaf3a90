"""The continual attack sampler: probabilities ∝ (1 − running robust accuracy), draws that follow them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mlxkit.engines.robust.sampler import ContinualSampler


def test_probabilities_follow_the_error_formula():
    rng = np.random.default_rng(0)
    for _ in range(20):
        accuracy = rng.uniform(0, 1, size=4)
        sampler = ContinualSampler(dict(zip(["linf", "l2", "l1", "stadv"], accuracy.tolist())))
        errors = 1.0 - accuracy
        expected = errors / errors.sum()
        got = sampler.probabilities()
        np.testing.assert_allclose([got[k] for k in ["linf", "l2", "l1", "stadv"]], expected, rtol=1e-12)


def test_an_attack_without_error_is_never_drawn_and_all_perfect_is_uniform():
    sampler = ContinualSampler({"linf": 1.0, "l2": 0.25})
    assert sampler.probabilities() == {"linf": 0.0, "l2": 1.0}
    assert all(sampler.choose(torch.Generator().manual_seed(s)) == "l2" for s in range(50))
    assert ContinualSampler({"linf": 1.0, "l2": 1.0}).probabilities() == {"linf": 0.5, "l2": 0.5}


def test_draws_follow_the_probabilities():
    sampler = ContinualSampler({"linf": 0.8, "l2": 0.3, "l1": 0.6})  # errors 0.2, 0.7, 0.4 -> 2/13, 7/13, 4/13
    draws = 6000
    counts = {"linf": 0, "l2": 0, "l1": 0}
    for seed in range(draws):
        counts[sampler.choose(torch.Generator().manual_seed(seed))] += 1
    for name, share in {"linf": 2 / 13, "l2": 7 / 13, "l1": 4 / 13}.items():
        sd = (share * (1 - share) / draws) ** 0.5
        assert abs(counts[name] / draws - share) < 4 * sd, (name, counts)


def test_update_is_an_exponential_moving_average_of_the_drawn_attack_only():
    sampler = ContinualSampler({"linf": 0.5, "l2": 0.1}, momentum=0.75)
    sampler.update("l2", 1.0)
    sampler.update("l2", 0.0)
    assert sampler.accuracy["linf"] == 0.5
    assert sampler.accuracy["l2"] == pytest.approx(0.75 * (0.75 * 0.1 + 0.25 * 1.0) + 0.25 * 0.0)
    again = ContinualSampler.from_state(sampler.state())
    assert again.accuracy == sampler.accuracy and again.momentum == 0.75
