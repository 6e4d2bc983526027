"""Output-difference metrics: scalar distances between two payloads, computed on host copies.

Core imports no ML framework, so a metric sees NumPy arrays: the members' payloads go
through their backend's `host_copy` first (`values.host_array`). Each metric returns a
Python float. `relative_l1` and `relative_l2` are anchored on `a` (the baseline side), and
two values with different element counts raise `metric_size_mismatch`, never a broadcast.
A scalar-like site (one element) always uses `relative_l1`, whatever metric was asked for.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from torchlens.errors import InvalidArgumentError

EPS = 1e-12


def _pair(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a, b = _flat(a), _flat(b)
    if a.size != b.size:
        raise InvalidArgumentError("metric_size_mismatch", f"the two values hold {a.size} and {b.size} elements",
                                   remedy="compare sites whose outputs have the same number of elements",
                                   sizes=(int(a.size), int(b.size)))
    return a, b


def _flat(x: Any) -> np.ndarray:
    arr = np.asarray(x)
    if np.iscomplexobj(arr):  # a complex value compares as its (real, imaginary) pairs
        arr = np.stack([arr.real, arr.imag], axis=-1)
    return arr.astype(np.float64, copy=False).reshape(-1)


def cosine(a: Any, b: Any) -> float:
    """1 - cosine similarity of the flattened values. Two all-zero values are 0 apart; one
    all-zero value against a non-zero one is 1 apart (the similarity is undefined there)."""
    a, b = _pair(a, b)
    if np.array_equal(a, b):
        return 0.0  # exactly: 1 - a.a/(|a||a|) rounds to ~1e-16, which would mark an unchanged site
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    if na == 0.0 or nb == 0.0:
        return 0.0 if na == nb else 1.0
    return float(1.0 - float(np.dot(a, b)) / (na * nb))


def relative_l2(a: Any, b: Any) -> float:
    """norm(a - b) / max(norm(a), eps)."""
    a, b = _pair(a, b)
    return float(np.linalg.norm(a - b) / max(float(np.linalg.norm(a)), EPS))


def relative_l1(a: Any, b: Any) -> float:
    """sum|a - b| / max(sum|a|, eps): the scalar fallback."""
    a, b = _pair(a, b)
    return float(np.abs(a - b).sum() / max(float(np.abs(a).sum()), EPS))


def l2(a: Any, b: Any) -> float:
    """norm(a - b)."""
    a, b = _pair(a, b)
    return float(np.linalg.norm(a - b))


def max_abs(a: Any, b: Any) -> float:
    """max |a - b| (0 for empty values)."""
    a, b = _pair(a, b)
    return float(np.abs(a - b).max()) if a.size else 0.0


def mse(a: Any, b: Any) -> float:
    """mean (a - b)^2 (0 for empty values)."""
    a, b = _pair(a, b)
    return float(np.mean((a - b) ** 2)) if a.size else 0.0


METRICS: dict[str, Callable[[Any, Any], float]] = {
    "cosine": cosine, "relative_l2": relative_l2, "relative_l1": relative_l1, "l2": l2, "max_abs": max_abs, "mse": mse,
}


def resolve(metric: Any) -> tuple[str | None, Callable[[Any, Any], float]]:
    """(name, function) of a metric name or callable; a callable's name is its __name__
    (None for a lambda, which needs an explicit name where one is stored)."""
    if isinstance(metric, str):
        fn = METRICS.get(metric)
        if fn is None:
            raise InvalidArgumentError("metric_invalid", f"metric={metric!r} is not an output-difference metric",
                                       remedy=f"use one of {sorted(METRICS)} or a callable (a, b) -> float",
                                       metric=metric)
        return metric, fn
    if callable(metric):
        name = getattr(metric, "__name__", None)
        return (None if name in (None, "<lambda>") else name), metric
    raise InvalidArgumentError("metric_invalid", f"metric= takes a name or a callable, not {type(metric).__name__}",
                               remedy=f"use one of {sorted(METRICS)} or a callable (a, b) -> float")


def distance(fn: Callable[[Any, Any], float], a: Any, b: Any) -> float:
    """`fn(a, b)` as a float, with the scalar-like rule (one element: relative_l1)."""
    if np.asarray(a).size == 1 and np.asarray(b).size == 1:
        return relative_l1(a, b)
    value = fn(a, b)
    try:
        return float(value)
    except (TypeError, ValueError):
        raise InvalidArgumentError("metric_invalid", f"the metric returned {type(value).__name__}, not a number",
                                   remedy="return a float (or a 0-d array) from the metric callable") from None


__all__ = ["METRICS", "cosine", "relative_l2", "relative_l1", "l2", "max_abs", "mse", "resolve", "distance"]
