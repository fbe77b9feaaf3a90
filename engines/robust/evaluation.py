"""Clean, per-attack and union accuracy of a classifier on held-out data.

Union accuracy counts an example only if it is classified correctly clean and under every
attack evaluated: the robustness a defender has when the adversary picks the attack.
"""

from __future__ import annotations

from typing import Mapping

import torch

from mlxkit.engines.core.seeds import seeded_generator
from mlxkit.engines.robust.attacks import Attack, correct_under_attack
from mlxkit.engines.robust.data import LabelledArrays

CHUNK = 512  # examples per attack batch, to bound memory


def robustness_report(model: torch.nn.Module, data: LabelledArrays, attacks: Mapping[str, Attack],
                      seed: int) -> dict[str, object]:
    """{"clean": acc, "attacks": {name: acc}, "union": acc, "examples": n}; each attack seeded by its name."""
    model.eval()
    with torch.no_grad():
        clean = torch.cat([model(data.x[lo:lo + CHUNK]).argmax(dim=1) == data.y[lo:lo + CHUNK]
                           for lo in range(0, len(data), CHUNK)])
    union = clean.clone()
    per_attack: dict[str, float] = {}
    for name, attack in attacks.items():
        generator = seeded_generator(seed, "crt-eval", name)
        correct = torch.cat([correct_under_attack(model, data.x[lo:lo + CHUNK], data.y[lo:lo + CHUNK], attack,
                                                  generator) for lo in range(0, len(data), CHUNK)])
        per_attack[name] = round(float(correct.float().mean()), 6)
        union &= correct
    return {"clean": round(float(clean.float().mean()), 6), "attacks": per_attack,
            "union": round(float(union.float().mean()), 6), "examples": len(data)}
