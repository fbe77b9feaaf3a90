"""Fit a hardware profile's efficiency factors and overheads to measured times.

The cost model is a roofline (a max of two terms per op), so the fit is a small bounded
non-linear least-squares problem, solved with scipy's trust-region reflective method on
log-ratios: every measurement counts by its relative error, so a 50 µs decode step weighs
as much as a 2 s prefill.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from mlxkit.engines.errors import InputError
from mlxkit.engines.hardware.profile import HardwareProfile

# Parameters the fit may move, with their bounds. Efficiencies are fitted in log space.
FIT_PARAMS: dict[str, tuple[float, float]] = {
    "matmul": (1e-3, 1.5),
    "memory": (1e-3, 1.5),
    "attention": (1e-4, 1.5),
    "kernel_overhead_us": (0.0, 5e3),
    "step_overhead_us": (0.0, 1e5),
    "overlap": (0.0, 1.0),
    "matmul_half_rows": (0.0, 4096.0),
    "gemm_weight_passes": (0.0, 4.0),
}
_EFFICIENCIES = ("matmul", "memory", "attention")


@dataclass(frozen=True)
class FitResult:
    profile: HardwareProfile
    rms_log_error: float
    max_abs_rel_error: float
    params: dict[str, float]


def apply_params(profile: HardwareProfile, params: dict[str, float]) -> HardwareProfile:
    """A copy of `profile` with some efficiencies / overheads replaced."""
    eff = profile.efficiency.model_copy(update={k: float(v) for k, v in params.items() if k in _EFFICIENCIES})
    update = {k: float(v) for k, v in params.items() if k not in _EFFICIENCIES}
    return profile.model_copy(update={"efficiency": eff, **update})


def fit_profile(profile: HardwareProfile, predict: Callable[[HardwareProfile], np.ndarray],
                measured_ms: Sequence[float], fit: Sequence[str] = tuple(FIT_PARAMS),
                bounds: dict[str, tuple[float, float]] | None = None,
                weights: Sequence[float] | None = None) -> FitResult:
    """Least-squares fit of the named profile parameters so that `predict(profile)` ≈ `measured_ms`.

    Parameters
    ----------
    profile : the starting profile (its values are the initial guess and the fixed values).
    predict : maps a candidate profile to predicted times (ms), aligned with `measured_ms`.
    measured_ms : measured times, all positive.
    fit : which of `FIT_PARAMS` to move.
    bounds : overrides of `FIT_PARAMS` bounds (e.g. efficiencies ≤ 1 against a trusted datasheet peak).
    weights : per-measurement weights of the log-ratio residuals (default 1).
    """
    from scipy.optimize import least_squares

    measured = np.asarray(measured_ms, dtype=np.float64)
    if measured.size == 0 or np.any(~np.isfinite(measured)) or np.any(measured <= 0):
        raise InputError("fitting needs positive, finite measured times")
    unknown = [name for name in fit if name not in FIT_PARAMS]
    if unknown:
        raise InputError(f"cannot fit {unknown}; fittable: {list(FIT_PARAMS)}")
    names = list(fit)
    w = np.ones_like(measured) if weights is None else np.asarray(weights, dtype=np.float64)
    if w.shape != measured.shape:
        raise InputError("one weight per measurement")
    limits = {**FIT_PARAMS, **(bounds or {})}

    def current(name: str) -> float:
        return getattr(profile.efficiency, name) if name in _EFFICIENCIES else getattr(profile, name)

    def encode(name: str, value: float) -> float:
        lo, hi = limits[name]
        value = min(max(value, lo), hi)
        return float(np.log(value)) if name in _EFFICIENCIES else value

    def decode(vector: np.ndarray) -> dict[str, float]:
        return {n: float(np.exp(v)) if n in _EFFICIENCIES else float(v) for n, v in zip(names, vector)}

    lower = [np.log(limits[n][0]) if n in _EFFICIENCIES else limits[n][0] for n in names]
    upper = [np.log(limits[n][1]) if n in _EFFICIENCIES else limits[n][1] for n in names]
    x0 = np.array([encode(n, current(n)) for n in names])
    x0 = np.clip(x0, np.array(lower) + 1e-9, np.array(upper) - 1e-9)

    def residuals(vector: np.ndarray) -> np.ndarray:
        pred = np.asarray(predict(apply_params(profile, decode(vector))), dtype=np.float64)
        return w * np.log(np.maximum(pred, 1e-12) / measured)

    # Overheads are in µs while efficiencies are log-fractions: x_scale keeps steps comparable.
    scale = np.array([1.0 if n in _EFFICIENCIES or n in ("overlap", "gemm_weight_passes") else max(10.0, abs(current(n)))
                      for n in names])
    # A ramp parameter starting at 0 sits on its bound with no gradient; start it inside.
    x0 = np.array([max(v, 8.0) if n == "matmul_half_rows" else max(v, 0.5) if n == "gemm_weight_passes" else v
                   for n, v in zip(names, x0)])
    best = None
    # A roofline has flat regions where the gradient vanishes; a few starts avoid them.
    starts = [x0] + [np.clip(x0 + shift, lower, upper) for shift in (np.where([n in _EFFICIENCIES for n in names], s, 0.0)
                                                                     for s in (-1.5,))]
    for start in starts:
        result = least_squares(residuals, start, bounds=(lower, upper), x_scale=scale, method="trf")
        if best is None or result.cost < best.cost:
            best = result
    assert best is not None
    params = decode(best.x)
    fitted = apply_params(profile, params)
    res = residuals(best.x) / w
    return FitResult(fitted, float(np.sqrt(np.mean(res ** 2))), float(np.max(np.abs(np.expm1(res)))), params)
