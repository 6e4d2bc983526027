"""Output-difference metrics on host arrays: scalar distances between two outputs."""

from __future__ import annotations

from typing import Any

import numpy as np

from torchlens.errors import InvalidArgumentError
from torchlens.stats._base import as_float64

EPS = 1e-12


def _pair(a: Any, b: Any) -> tuple[np.ndarray, np.ndarray]:
    x, y = as_float64(a, "a").ravel(), as_float64(b, "b").ravel()
    if x.size != y.size:
        raise InvalidArgumentError("stats_shape_mismatch", f"a has {x.size} elements, b has {y.size}",
                                   remedy="compare outputs of the same size")
    return x, y


def cosine_distance(a: Any, b: Any) -> np.ndarray:
    """1 - cosine similarity of the two flattened arrays (a 0-d float64 array)."""
    x, y = _pair(a, b)
    return np.asarray(1.0 - float(x @ y) / max(float(np.linalg.norm(x) * np.linalg.norm(y)), EPS))


def relative_l2(a: Any, b: Any) -> np.ndarray:
    """norm(a - b) / max(norm(a), eps)."""
    x, y = _pair(a, b)
    return np.asarray(float(np.linalg.norm(x - y)) / max(float(np.linalg.norm(x)), EPS))


def relative_l1(a: Any, b: Any) -> np.ndarray:
    """|a - b| / max(|a|, eps) summed over elements (the scalar fallback)."""
    x, y = _pair(a, b)
    return np.asarray(float(np.abs(x - y).sum()) / max(float(np.abs(x).sum()), EPS))
