"""Moment accumulators: Mean, Covariance, CrossCovariance, Norm, RunningStats.

Every update computes the batch's own centred moments (two passes over the batch) and folds
them in with Chan's pairwise formulas in float64, the same code path `merge` uses; a state
split across batches, processes or a save/load boundary therefore reduces the same way.
Rows run over every axis but the last (the feature axis).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from torchlens.errors import InvalidArgumentError
from torchlens.stats._base import Accumulator, _register_kind, as_float64, bad_state, empty_result, feature_rows


def _chan(na: float, ma: np.ndarray, nb: float, mb: np.ndarray) -> tuple[float, np.ndarray, np.ndarray, float]:
    """Merged count and mean, the mean delta and the cross weight na*nb/n."""
    n = na + nb
    delta = mb - ma
    return n, ma + delta * (nb / n), delta, na * nb / n


class _Counted(Accumulator):
    _count: np.ndarray

    @property
    def count(self) -> int:
        return int(self._count[0])

    def _fresh(self) -> bool:
        return self.count == 0


@_register_kind
class Mean(_Counted):
    """Per-feature mean over rows."""

    _ARRAYS = ("count", "mean")

    def __init__(self) -> None:
        self._count = np.zeros(1, np.int64)
        self._mean: np.ndarray | None = None

    def config(self) -> dict[str, Any]:
        return {}

    def update(self, x: Any) -> "Mean":
        r = feature_rows(x)
        if len(r):
            self._fold(len(r), r.mean(axis=0))
        return self

    def _fold(self, nb: int, mb: np.ndarray) -> None:
        if self._mean is not None and mb.shape != self._mean.shape:
            raise InvalidArgumentError("stats_shape_mismatch", f"feature shape {mb.shape} differs from {self._mean.shape}",
                                       remedy="feed batches with the same feature axis")
        if self._fresh():
            self._count, self._mean = np.array([nb], np.int64), mb.copy()
            return
        n, m, _, _ = _chan(self.count, self._mean, nb, mb)
        self._count, self._mean = np.array([n], np.int64), m

    def merge(self, other: "Mean") -> "Mean":
        self._require_same(other)
        if not other._fresh():
            self._fold(other.count, other._mean)
        return self

    @property
    def mean(self) -> np.ndarray:
        if self._fresh():
            raise empty_result("Mean")
        return self._mean.copy()

    def result(self) -> np.ndarray:
        return self.mean

    def _check_state(self) -> None:
        if self._count.shape != (1,) or (self.count > 0) != (self._mean is not None) or self.count < 0:
            raise bad_state("Mean", "count and mean disagree")
        if self._mean is not None and self._mean.ndim != 1:
            raise bad_state("Mean", "mean is not a vector")


@_register_kind
class Covariance(_Counted):
    """Per-feature mean and the feature-by-feature covariance (Welford/Chan, float64)."""

    _ARRAYS = ("count", "mean", "m2")

    def __init__(self) -> None:
        self._count = np.zeros(1, np.int64)
        self._mean: np.ndarray | None = None
        self._m2: np.ndarray | None = None

    def config(self) -> dict[str, Any]:
        return {}

    def update(self, x: Any) -> "Covariance":
        r = feature_rows(x)
        if len(r):
            mb = r.mean(axis=0)
            c = r - mb
            self._fold(len(r), mb, c.T @ c)
        return self

    def _fold(self, nb: int, mb: np.ndarray, m2b: np.ndarray) -> None:
        if self._mean is not None and mb.shape != self._mean.shape:
            raise InvalidArgumentError("stats_shape_mismatch", f"feature shape {mb.shape} differs from {self._mean.shape}",
                                       remedy="feed batches with the same feature axis")
        if self._fresh():
            self._count, self._mean, self._m2 = np.array([nb], np.int64), mb.copy(), m2b.copy()
            return
        n, m, d, w = _chan(self.count, self._mean, nb, mb)
        self._m2 = self._m2 + m2b + np.outer(d, d) * w
        self._count, self._mean = np.array([n], np.int64), m

    def merge(self, other: "Covariance") -> "Covariance":
        self._require_same(other)
        if not other._fresh():
            self._fold(other.count, other._mean, other._m2)
        return self

    @property
    def mean(self) -> np.ndarray:
        if self._fresh():
            raise empty_result(type(self).__name__)
        return self._mean.copy()

    def covariance(self, ddof: int = 1) -> np.ndarray:
        """The covariance matrix with `ddof` (1: numpy.cov's default)."""
        if self.count - ddof <= 0:
            raise empty_result(type(self).__name__)
        return self._m2 / (self.count - ddof)

    def scatter(self) -> np.ndarray:
        """The centred sum of outer products (the unnormalised covariance)."""
        if self._fresh():
            raise empty_result(type(self).__name__)
        return self._m2.copy()

    def result(self) -> np.ndarray:
        return self.covariance()

    def _check_state(self) -> None:
        if self._count.shape != (1,) or self.count < 0 or (self.count > 0) != (self._mean is not None):
            raise bad_state("Covariance", "count and mean disagree")
        if self._mean is not None and (self._mean.ndim != 1 or self._m2 is None
                                       or self._m2.shape != (len(self._mean),) * 2):
            raise bad_state("Covariance", "mean and m2 shapes disagree")


@_register_kind
class CrossCovariance(_Counted):
    """Covariance between two row-matched streams x [n, p] and y [n, q] (p-by-q)."""

    _ARRAYS = ("count", "mean_x", "mean_y", "cxy")

    def __init__(self) -> None:
        self._count = np.zeros(1, np.int64)
        self._mean_x = self._mean_y = self._cxy = None

    def config(self) -> dict[str, Any]:
        return {}

    def update(self, x: Any, y: Any) -> "CrossCovariance":
        rx, ry = feature_rows(x, "x"), feature_rows(y, "y")
        if len(rx) != len(ry):
            raise InvalidArgumentError("stats_shape_mismatch", f"x has {len(rx)} rows, y has {len(ry)}",
                                       remedy="pass row-matched x and y")
        if len(rx):
            mx, my = rx.mean(axis=0), ry.mean(axis=0)
            self._fold(len(rx), mx, my, (rx - mx).T @ (ry - my))
        return self

    def _fold(self, nb: int, mx: np.ndarray, my: np.ndarray, cb: np.ndarray) -> None:
        if self._fresh():
            self._count, self._mean_x, self._mean_y, self._cxy = np.array([nb], np.int64), mx.copy(), my.copy(), cb.copy()
            return
        if mx.shape != self._mean_x.shape or my.shape != self._mean_y.shape:
            raise InvalidArgumentError("stats_shape_mismatch", "feature shapes differ from earlier batches",
                                       remedy="feed batches with the same feature axes")
        n, mxn, dx, w = _chan(self.count, self._mean_x, nb, mx)
        _, myn, dy, _ = _chan(self.count, self._mean_y, nb, my)
        self._cxy = self._cxy + cb + np.outer(dx, dy) * w
        self._count, self._mean_x, self._mean_y = np.array([n], np.int64), mxn, myn

    def merge(self, other: "CrossCovariance") -> "CrossCovariance":
        self._require_same(other)
        if not other._fresh():
            self._fold(other.count, other._mean_x, other._mean_y, other._cxy)
        return self

    def covariance(self, ddof: int = 1) -> np.ndarray:
        if self.count - ddof <= 0:
            raise empty_result("CrossCovariance")
        return self._cxy / (self.count - ddof)

    def scatter(self) -> np.ndarray:
        if self._fresh():
            raise empty_result("CrossCovariance")
        return self._cxy.copy()

    def result(self) -> np.ndarray:
        return self.covariance()

    def _check_state(self) -> None:
        if self._count.shape != (1,) or self.count < 0 or (self.count > 0) != (self._cxy is not None):
            raise bad_state("CrossCovariance", "count and state disagree")
        if self._cxy is not None and (self._mean_x is None or self._mean_y is None
                                      or self._cxy.shape != (len(self._mean_x), len(self._mean_y))):
            raise bad_state("CrossCovariance", "means and cross-scatter shapes disagree")


class _Scalar:
    """Count, mean, M2..M4, min, max of a stream of scalars (Pebay's pairwise formulas)."""

    @staticmethod
    def batch(v: np.ndarray) -> np.ndarray:
        n = float(len(v))
        m = v.mean()
        d = v - m
        return np.array([n, m, (d * d).sum(), (d ** 3).sum(), (d ** 4).sum(), v.min(), v.max()])

    @staticmethod
    def combine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        na, nb = a[0], b[0]
        if na == 0:
            return b.copy()
        if nb == 0:
            return a.copy()
        n = na + nb
        d = b[1] - a[1]
        m = a[1] + d * nb / n
        m2 = a[2] + b[2] + d * d * na * nb / n
        m3 = a[3] + b[3] + d ** 3 * na * nb * (na - nb) / n ** 2 + 3 * d * (na * b[2] - nb * a[2]) / n
        m4 = (a[4] + b[4] + d ** 4 * na * nb * (na * na - na * nb + nb * nb) / n ** 3
              + 6 * d * d * (na * na * b[2] + nb * nb * a[2]) / n ** 2 + 4 * d * (na * b[3] - nb * a[3]) / n)
        return np.array([n, m, m2, m3, m4, min(a[5], b[5]), max(a[6], b[6])])


@_register_kind
class Norm(_Counted):
    """Statistics of each row's vector norm over the feature axis (`ord=2` by default)."""

    _ARRAYS = ("moments",)

    def __init__(self, ord: float = 2.0) -> None:
        if not isinstance(ord, (int, float)) or isinstance(ord, bool) or not ord > 0:
            raise InvalidArgumentError("invalid_argument", f"Norm(ord={ord!r}) needs a positive number",
                                       remedy="ord=2 (Euclidean) or ord=1")
        self.ord = float(ord)
        self._moments = np.zeros(7)

    @property
    def count(self) -> int:
        return int(self._moments[0])

    def config(self) -> dict[str, Any]:
        return {"ord": self.ord}

    def update(self, x: Any) -> "Norm":
        r = feature_rows(x)
        if len(r):
            v = np.linalg.norm(r, ord=self.ord, axis=1)
            self._moments = _Scalar.combine(self._moments, _Scalar.batch(v))
        return self

    def merge(self, other: "Norm") -> "Norm":
        self._require_same(other)
        self._moments = _Scalar.combine(self._moments, other._moments)
        return self

    def result(self) -> dict[str, float]:
        n, m, m2, _, _, lo, hi = self._moments
        if n == 0:
            raise empty_result("Norm")
        return {"count": int(n), "mean": float(m), "var": float(m2 / (n - 1)) if n > 1 else float("nan"),
                "min": float(lo), "max": float(hi)}

    def _check_state(self) -> None:
        if self._moments is None or self._moments.shape != (7,):
            raise bad_state("Norm", "moments is not a 7-vector")


#: the 16 slots of a RunningStats vector, in order
RUNNING_SLOTS = ("count", "mean", "m2", "m3", "m4", "min", "max", "abs_mean", "abs_max",
                 "numel", "nan_count", "posinf_count", "neginf_count", "zero_count", "positive_count", "negative_count")


@_register_kind
class RunningStats(Accumulator):
    """Scalar summary of every element seen, as one 16-slot float64 vector (`RUNNING_SLOTS`):
    moments of the finite values (count, mean, M2..M4, min, max, mean and max of |x|) and
    counts of all elements, NaN, +inf, -inf, zeros, positives and negatives."""

    _ARRAYS = ("slots",)

    def __init__(self) -> None:
        self._slots = np.zeros(16)
        self._slots[5], self._slots[6] = np.inf, -np.inf

    def config(self) -> dict[str, Any]:
        return {}

    @staticmethod
    def _of(a: np.ndarray) -> np.ndarray:
        v = np.zeros(16)
        v[5], v[6] = np.inf, -np.inf
        fin = a[np.isfinite(a)]
        if len(fin):
            v[:7] = _Scalar.batch(fin)
            ab = np.abs(fin)
            v[7], v[8] = ab.mean(), ab.max()
        v[9] = a.size
        v[10], v[11], v[12] = np.isnan(a).sum(), np.isposinf(a).sum(), np.isneginf(a).sum()
        v[13], v[14], v[15] = (a == 0).sum(), (a > 0).sum(), (a < 0).sum()
        return v

    @staticmethod
    def _combine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        out = a + b  # the plain counts (slots 9..15)
        out[:7] = _Scalar.combine(a[:7], b[:7])
        na, nb = a[0], b[0]
        out[7] = a[7] if nb == 0 else b[7] if na == 0 else a[7] + (b[7] - a[7]) * nb / (na + nb)
        out[8] = max(a[8], b[8]) if na and nb else (a[8] if na else b[8])
        return out

    def update(self, x: Any) -> "RunningStats":
        a = as_float64(x).ravel()
        if a.size:
            self._slots = self._combine(self._slots, self._of(a))
        return self

    def merge(self, other: "RunningStats") -> "RunningStats":
        self._require_same(other)
        self._slots = self._combine(self._slots, other._slots)
        return self

    @property
    def vector(self) -> np.ndarray:
        return self._slots.copy()

    def result(self) -> dict[str, float]:
        out = dict(zip(RUNNING_SLOTS, (float(v) for v in self._slots)))
        n = out["count"]
        out["var"] = out["m2"] / (n - 1) if n > 1 else float("nan")
        out["std"] = float(np.sqrt(out["var"])) if n > 1 else float("nan")
        return out

    def _check_state(self) -> None:
        if self._slots is None or self._slots.shape != (16,):
            raise bad_state("RunningStats", "slots is not a 16-vector")
