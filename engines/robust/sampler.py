"""Which attack a batch trains against: one attack per batch, weighted by its current error.

Following Croce & Hein's quick fine-tuning, as used by continual robust training: attack a
is drawn with probability (1 − acc_a) / Σ_b (1 − acc_b), where acc_a is the running robust
training accuracy against a. The weakest attack gets the most batches, and the old ones keep
being replayed so their robustness is not forgotten. The running accuracy is an exponential
moving average over the batches that drew the attack, started from a measured value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class ContinualSampler:
    accuracy: dict[str, float]   # attack name -> running robust training accuracy, in [0, 1]
    momentum: float = 0.9        # weight of the history in each update

    def probabilities(self) -> dict[str, float]:
        """The draw probability of each attack; uniform when no attack has any error left."""
        errors = {name: max(0.0, 1.0 - acc) for name, acc in self.accuracy.items()}
        total = sum(errors.values())
        if total <= 0.0:
            return {name: 1.0 / len(errors) for name in errors}
        return {name: error / total for name, error in errors.items()}

    def choose(self, generator: torch.Generator) -> str:
        """Draw one attack name (inverse CDF of one uniform number, so a seed fixes the choice)."""
        draw = float(torch.rand((), generator=generator, dtype=torch.float64))
        cumulative = 0.0
        probabilities = self.probabilities()
        for name, probability in probabilities.items():
            cumulative += probability
            if draw < cumulative:
                return name
        return list(probabilities)[-1]  # rounding left the cumulative sum a hair below 1

    def update(self, name: str, batch_accuracy: float) -> None:
        self.accuracy[name] = self.momentum * self.accuracy[name] + (1.0 - self.momentum) * batch_accuracy

    def state(self) -> dict[str, Any]:
        return {"accuracy": dict(self.accuracy), "momentum": self.momentum}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "ContinualSampler":
        return cls({str(k): float(v) for k, v in state["accuracy"].items()}, float(state["momentum"]))
