"""Typed merge parameters: each method declares its parameters once, as `ParamDef`s.

Kept free of torch so that the CLI can quote ranges in `--help` without importing it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mlxkit.engines.errors import InputError


@dataclass(frozen=True)
class ParamDef:
    """A parameter a method accepts, declared once with its type and valid range.

    `check` is called on every value (scalar or each filtered entry) when the merge config is
    validated, so a bad value fails before any tensor is read; the planner calls it again to get
    the coerced value. Numbers must be finite. `per_model` parameters may differ between input
    models (and may also be given once, globally, for all of them).
    """

    name: str
    type: type                   # bool, int or float
    default: Any
    help: str
    per_model: bool = False
    required: bool = False       # no default: every model (or the global parameters) must set it
    low: float | None = None     # inclusive bound, exclusive when low_open
    high: float | None = None    # inclusive bound, exclusive when high_open
    low_open: bool = False
    high_open: bool = False

    def valid_values(self) -> str:
        """What `check` accepts, in words: 'a number in [0, 1]', 'an integer >= 0', 'true or false'."""
        if self.type is bool:
            return "true or false"
        noun = "an integer" if self.type is int else "a number"
        if self.low is not None and self.high is not None:
            return (f"{noun} in {'(' if self.low_open else '['}{self.low:g}, "
                    f"{self.high:g}{')' if self.high_open else ']'}")
        if self.low is not None:
            return f"{noun} {'>' if self.low_open else '>='} {self.low:g}"
        if self.high is not None:
            return f"{noun} {'<' if self.high_open else '<='} {self.high:g}"
        return "an integer" if self.type is int else "a finite number"

    def check(self, value: Any) -> Any:
        """`value` as this parameter's type; `InputError` naming the parameter and its range otherwise."""
        converted = self._convert(value)
        if converted is None or (self.type is not bool and not self._in_range(converted)):
            raise InputError(f"{self.name} must be {self.valid_values()} (got {value!r})")
        return converted

    def _convert(self, value: Any) -> Any:
        if self.type is bool:
            return value if isinstance(value, bool) else None
        if isinstance(value, bool):
            return None  # True is an int to Python, but never a meaningful density or weight
        if isinstance(value, str):  # `--param density=1e-3`: YAML 1.1 reads that as a string
            text = value.strip()
            try:
                value = int(text)
            except ValueError:
                try:
                    value = float(text)
                except ValueError:
                    return None
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if self.type is int:
            if isinstance(value, float) and not value.is_integer():
                return None
            return int(value) if isinstance(value, (int, float)) else None
        if not isinstance(value, (int, float)):
            return None
        try:
            return float(value)
        except OverflowError:  # an integer beyond any float
            return None

    def _in_range(self, value: float) -> bool:
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        return not (self.high is not None and (value > self.high or (self.high_open and value == self.high)))


# The relative weight most methods take per model; negative weights subtract a task (forgetting).
WEIGHT = ParamDef("weight", float, 1.0, "relative weight of this model", per_model=True)
# Methods that weigh models inside a positive-definite system or a ratio of sums (RegMean, Fisher)
# have no meaning for a subtracted model, so their weights must be positive.
POSITIVE_WEIGHT = ParamDef("weight", float, 1.0, "relative weight of this model (> 0)", per_model=True, low=0.0,
                           low_open=True)


# α scales the merged task vector. The Iso-C/Iso-CTS paper sweeps 0.2–3.0 and task arithmetic uses
# λ ≤ 1 (negative to subtract a task), so ±100 leaves wide room while refusing values such as 1e308
# whose only effect is to overflow every weight to infinity.
ALPHA_LIMIT = 100.0
ALPHA = ParamDef("alpha", float, 1.0, "scale of the merged task vector", low=-ALPHA_LIMIT, high=ALPHA_LIMIT)
ALPHA_GRID_POINT = ParamDef("each alpha_grid point", float, None, "a point of the alpha sweep", low=0.0,
                            high=ALPHA_LIMIT)

# mergekit's task-vector methods scale the combined delta by `lambda`; it multiplies α, per tensor.
LAMBDA = ParamDef("lambda", float, 1.0, "scale of the combined task vector (mergekit's name; multiplies alpha)",
                  low=-ALPHA_LIMIT, high=ALPHA_LIMIT)
# Accepted so that mergekit configs run unchanged: mergekit stores its sign masks as int8 to save
# memory; our masks are booleans already, so the setting changes nothing.
INT8_MASK = ParamDef("int8_mask", bool, False, "accepted for mergekit configs; masks are always compact here")
