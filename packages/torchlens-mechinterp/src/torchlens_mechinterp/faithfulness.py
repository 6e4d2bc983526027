"""Circuit faithfulness summaries of the MIB circuit track.

Given the faithfulness f = (M_circuit - M_empty) / (M_full - M_empty) at each kept edge fraction,
``circuit_performance_ratio`` (CPR) is the trapezoidal area under f (higher is better) and
``circuit_model_difference`` (CMD) the trapezoidal area under |1 - f| (lower is better).
``log_scale=True`` integrates over log(fraction) instead of the fraction.
"""

from __future__ import annotations

import math
from typing import Any

from torchlens.errors import MechInterpError

#: the MIB circuit track's kept-edge fractions
MIB_FRACTIONS: tuple[float, ...] = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


def _refuse(function: str, why: str, **fields: Any) -> MechInterpError:
    return MechInterpError("mi_faithfulness_curve_invalid", f"{function}: {why}", remedy="pass one finite "
                           "faithfulness per fraction (the ten MIB fractions by default), fractions= strictly "
                           "increasing in (0, 1], or a {fraction: faithfulness} mapping", function=function, **fields)


def _curve(faithfulness: Any, fractions: Any, function: str) -> tuple[list[float], list[float]]:
    if isinstance(faithfulness, dict):
        if fractions is not None:
            raise _refuse(function, "a mapping carries its own fractions; fractions= must not be given too")
        items = sorted(faithfulness.items())
        xs, ys = [k for k, _ in items], [v for _, v in items]
    else:
        try:
            ys = list(faithfulness)
        except TypeError:
            raise _refuse(function, f"faithfulness is a {type(faithfulness).__name__}, not a sequence or "
                          "mapping") from None
        xs = list(MIB_FRACTIONS if fractions is None else fractions)
    try:
        xs, ys = [float(x) for x in xs], [float(y) for y in ys]
    except (TypeError, ValueError):
        raise _refuse(function, "fractions and faithfulness values must be numbers") from None
    if len(xs) != len(ys):
        raise _refuse(function, f"{len(ys)} faithfulness values for {len(xs)} fractions", n_values=len(ys),
                      n_fractions=len(xs))
    if len(xs) < 2:
        raise _refuse(function, "a curve needs at least two points", n_points=len(xs))
    if not all(math.isfinite(v) for v in xs + ys):
        raise _refuse(function, "the curve has a non-finite value")
    if not all(0 < x <= 1 for x in xs) or any(b <= a for a, b in zip(xs, xs[1:])):
        raise _refuse(function, f"fractions must be strictly increasing in (0, 1]: {xs}", fractions=xs)
    return xs, ys


def _area(xs: list[float], ys: list[float], log_scale: bool) -> float:
    if log_scale:
        xs = [math.log(x) for x in xs]
    return sum((x1 - x0) * (y0 + y1) / 2 for x0, x1, y0, y1 in zip(xs, xs[1:], ys, ys[1:]))


def circuit_performance_ratio(faithfulness: Any, *, fractions: Any = None, log_scale: bool = False) -> float:
    """CPR: the trapezoidal area under the faithfulness curve (higher is better)."""
    xs, ys = _curve(faithfulness, fractions, "circuit_performance_ratio")
    return _area(xs, ys, log_scale)


def circuit_model_difference(faithfulness: Any, *, fractions: Any = None, log_scale: bool = False) -> float:
    """CMD: the trapezoidal area under |1 - faithfulness| (lower is better)."""
    xs, ys = _curve(faithfulness, fractions, "circuit_model_difference")
    return _area(xs, [abs(1 - y) for y in ys], log_scale)


__all__ = ["circuit_performance_ratio", "circuit_model_difference", "MIB_FRACTIONS"]
