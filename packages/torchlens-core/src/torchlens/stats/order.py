"""Order statistics: Quantile (exact), TopK / UnitTopK and Histogram.

`Quantile` in exact mode keeps every value it has seen (memory grows with the data; that is
the price of exactness) and answers with numpy.quantile's default (linear) rule. `TopK` keeps
k candidates per unit with a total order (value, then lowest example id, then lowest position),
so merging partial results in any order gives the same answer. `Histogram` counts against fixed
edges, which is what makes it mergeable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from torchlens.errors import InvalidArgumentError
from torchlens.stats._base import Accumulator, _register_kind, as_float64, bad_state, empty_result


def _units(a: np.ndarray, unit_axis: int | None, what: str) -> np.ndarray:
    """[units, values] view of `a`: one row per unit, or a single row without unit_axis."""
    if unit_axis is None:
        return a.reshape(1, -1)
    if not -a.ndim <= unit_axis < a.ndim:
        raise InvalidArgumentError("stats_shape_mismatch", f"{what}: unit_axis={unit_axis} is outside a {a.ndim}-d batch",
                                   remedy="name an axis of the batch")
    return np.moveaxis(a, unit_axis, 0).reshape(a.shape[unit_axis], -1)


def _check_unit_axis(unit_axis: Any) -> int | None:
    if unit_axis is not None and (not isinstance(unit_axis, int) or isinstance(unit_axis, bool)):
        raise InvalidArgumentError("invalid_argument", f"unit_axis={unit_axis!r} is not an int", remedy="unit_axis=-1")
    return unit_axis


@_register_kind
class Quantile(Accumulator):
    """Quantiles of every value seen (one set per unit with `unit_axis=`). Exact mode only."""

    _ARRAYS = ("values",)

    def __init__(self, q: float | Sequence[float] = 0.5, *, mode: str = "exact", unit_axis: int | None = None,
                 encoder: Callable[[Any], Any] | None = None) -> None:
        qs = np.atleast_1d(np.asarray(q, dtype=np.float64))
        if qs.ndim != 1 or not np.all((qs >= 0) & (qs <= 1)):
            raise InvalidArgumentError("invalid_argument", f"Quantile(q={q!r}) needs values in [0, 1]", remedy="q=[0.1, 0.5, 0.9]")
        if mode != "exact":
            raise InvalidArgumentError("stats_option_unsupported", f"Quantile(mode={mode!r}) is not built; only 'exact' is",
                                       remedy="use mode='exact' (keeps every value)")
        self.q = [float(v) for v in qs]
        self._scalar_q = np.ndim(q) == 0
        self.mode = mode
        self.unit_axis = _check_unit_axis(unit_axis)
        self.encoder = encoder
        self._chunks: list[np.ndarray] = []

    def config(self) -> dict[str, Any]:
        return {"q": self.q if not self._scalar_q else self.q[0], "mode": self.mode, "unit_axis": self.unit_axis}

    @property
    def _values(self) -> np.ndarray | None:
        if not self._chunks:
            return None
        if len(self._chunks) > 1:
            self._chunks = [np.concatenate(self._chunks, axis=1)]
        return self._chunks[0]

    @_values.setter
    def _values(self, v: np.ndarray | None) -> None:
        self._chunks = [] if v is None else [v]

    def update(self, x: Any) -> "Quantile":
        a = as_float64(self.encoder(x) if self.encoder is not None else x)
        u = _units(a, self.unit_axis, "Quantile")
        if self._chunks and u.shape[0] != self._chunks[0].shape[0]:
            raise InvalidArgumentError("stats_shape_mismatch", f"{u.shape[0]} units, earlier batches had {self._chunks[0].shape[0]}",
                                       remedy="feed batches with the same unit axis")
        if u.size:
            self._chunks.append(u.copy())
        return self

    def merge(self, other: "Quantile") -> "Quantile":
        self._require_same(other)
        if other._chunks:
            self.update_units(other._values)
        return self

    def update_units(self, u: np.ndarray) -> None:
        if self._chunks and u.shape[0] != self._chunks[0].shape[0]:
            raise InvalidArgumentError("stats_merge_mismatch", "unit counts differ", remedy="merge like with like")
        self._chunks.append(u)

    @property
    def count(self) -> int:
        return 0 if not self._chunks else int(sum(c.shape[1] for c in self._chunks))

    def result(self) -> np.ndarray:
        """[len(q)] (a scalar for a scalar q) or, per unit, [units, len(q)] ([units] for a scalar q)."""
        v = self._values
        if v is None:
            raise empty_result("Quantile")
        out = np.quantile(v, self.q, axis=1).T  # [units, q]
        if self.unit_axis is None:
            out = out[0]
            return out[0] if self._scalar_q else out
        return out[:, 0] if self._scalar_q else out

    def _check_state(self) -> None:
        v = self._values
        if v is not None and v.ndim != 2:
            raise bad_state("Quantile", "values is not [units, n]")


@dataclass(frozen=True)
class UnitTopK:
    """Per-unit top-k over a dataset: `values`, `example_ids`, `positions` are [units, k]
    (fewer columns while fewer candidates were seen); `unit_axis` is the batch axis of units."""

    values: np.ndarray
    example_ids: np.ndarray
    positions: np.ndarray
    unit_axis: int | None


@dataclass(frozen=True)
class TopKResult:
    """Top-k over every value: `values`, `example_ids`, `positions` are [k]."""

    values: np.ndarray
    example_ids: np.ndarray
    positions: np.ndarray


@_register_kind
class TopK(Accumulator):
    """The k largest (or smallest) values over a dataset with the example id and position of
    each. Axis 0 of a batch is the example axis; a position is the flat index over the other
    non-unit axes. Ties go to the lowest example id, then position. `unit_axis=` keeps one list
    per unit and returns a `UnitTopK`."""

    _ARRAYS = ("seen", "values", "ids", "positions")

    def __init__(self, k: int = 10, *, largest: bool = True, unit_axis: int | None = None,
                 encoder: Callable[[Any], Any] | None = None) -> None:
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise InvalidArgumentError("invalid_argument", f"TopK(k={k!r}) needs a positive int", remedy="k=10")
        if unit_axis == 0:
            raise InvalidArgumentError("invalid_argument", "unit_axis=0 is the example axis", remedy="unit_axis=-1")
        self.k, self.largest, self.unit_axis, self.encoder = k, bool(largest), _check_unit_axis(unit_axis), encoder
        self._seen = np.zeros(1, np.int64)
        self._values = self._ids = self._positions = None

    def config(self) -> dict[str, Any]:
        return {"k": self.k, "largest": self.largest, "unit_axis": self.unit_axis}

    def update(self, x: Any, example_ids: Sequence[int] | None = None) -> "TopK":
        a = as_float64(self.encoder(x) if self.encoder is not None else x)
        if a.ndim == 0:
            raise InvalidArgumentError("stats_input_invalid", "TopK needs a batch with an example axis", remedy="pass [examples, ...]")
        b = a.shape[0]
        if example_ids is None:
            ids = self._seen[0] + np.arange(b, dtype=np.int64)
        else:
            ids = np.asarray(list(example_ids) if isinstance(example_ids, range) else example_ids)
            if ids.shape != (b,) or not np.issubdtype(ids.dtype, np.integer):
                raise InvalidArgumentError("stats_input_invalid", f"example_ids must be {b} ints, one per example",
                                           remedy="example_ids=range(start, start + batch)")
            ids = ids.astype(np.int64)
        if self.unit_axis is None:
            vals = a.reshape(b, 1, -1)
        else:
            ax = self.unit_axis % a.ndim
            if ax == 0:
                raise InvalidArgumentError("invalid_argument", "unit_axis names the example axis", remedy="unit_axis=-1")
            vals = np.moveaxis(a, ax, 1).reshape(b, a.shape[ax], -1)
        p = vals.shape[2]
        cand_v = vals.transpose(1, 0, 2).reshape(vals.shape[1], b * p)
        cand_i = np.broadcast_to(np.repeat(ids, p), cand_v.shape)
        cand_p = np.broadcast_to(np.tile(np.arange(p, dtype=np.int64), b), cand_v.shape)
        self._fold(cand_v, cand_i, cand_p)
        self._seen = self._seen + b
        return self

    def _fold(self, v: np.ndarray, i: np.ndarray, p: np.ndarray) -> None:
        if self._values is not None:
            if v.shape[0] != self._values.shape[0]:
                raise InvalidArgumentError("stats_shape_mismatch", f"{v.shape[0]} units, earlier batches had {self._values.shape[0]}",
                                           remedy="feed batches with the same unit axis")
            v = np.concatenate([self._values, v], axis=1)
            i = np.concatenate([self._ids, i], axis=1)
            p = np.concatenate([self._positions, p], axis=1)
        key = -v if self.largest else v
        order = np.lexsort((p, i, key), axis=-1)[:, : self.k]
        self._values = np.take_along_axis(v, order, axis=1)
        self._ids = np.take_along_axis(i, order, axis=1)
        self._positions = np.take_along_axis(p, order, axis=1)

    def merge(self, other: "TopK") -> "TopK":
        self._require_same(other)
        if other._values is not None:
            self._fold(other._values, other._ids, other._positions)
        self._seen = self._seen + other._seen
        return self

    def result(self) -> UnitTopK | TopKResult:
        if self._values is None:
            raise empty_result("TopK")
        if self.unit_axis is None:
            return TopKResult(self._values[0].copy(), self._ids[0].copy(), self._positions[0].copy())
        return UnitTopK(self._values.copy(), self._ids.copy(), self._positions.copy(), self.unit_axis)

    def _check_state(self) -> None:
        if self._seen is None or self._seen.shape != (1,):
            raise bad_state("TopK", "seen is not a counter")
        arrs = (self._values, self._ids, self._positions)
        if any(a is None for a in arrs) != all(a is None for a in arrs):
            raise bad_state("TopK", "values, ids and positions are not all present")
        if self._values is not None and not (self._values.ndim == 2 and self._values.shape == self._ids.shape
                                             == self._positions.shape and self._values.shape[1] <= self.k):
            raise bad_state("TopK", "values, ids and positions shapes disagree")


@_register_kind
class Histogram(Accumulator):
    """Counts of values against fixed edges (`bins` equal bins over `range`, or explicit
    `edges`), plus underflow, overflow and NaN counts. numpy.histogram's rule: the last bin
    includes its right edge."""

    _ARRAYS = ("counts", "outside")

    def __init__(self, bins: int = 10, range: tuple[float, float] | None = None, *, edges: Sequence[float] | None = None) -> None:
        if edges is None:
            if range is None:
                raise InvalidArgumentError("stats_histogram_range_required",
                                           "a streaming Histogram needs fixed edges; range= was not given",
                                           remedy="Histogram(bins=50, range=(-5, 5)) or Histogram(edges=[...])")
            lo, hi = float(range[0]), float(range[1])
            if not (np.isfinite(lo) and np.isfinite(hi) and lo < hi) or not isinstance(bins, int) or bins < 1:
                raise InvalidArgumentError("invalid_argument", f"Histogram(bins={bins!r}, range={range!r}) is not usable",
                                           remedy="a positive bin count and a finite range lo < hi")
            e = np.linspace(lo, hi, bins + 1)
        else:
            e = np.asarray(edges, dtype=np.float64)
            if e.ndim != 1 or len(e) < 2 or not np.all(np.diff(e) > 0) or not np.all(np.isfinite(e)):
                raise InvalidArgumentError("invalid_argument", "edges must be finite and strictly increasing",
                                           remedy="edges=[0, 1, 2, 5]")
        self.edges = e
        self._counts = np.zeros(len(e) - 1, np.int64)
        self._outside = np.zeros(3, np.int64)  # under, over, nan

    def config(self) -> dict[str, Any]:
        return {"edges": [float(v) for v in self.edges]}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Histogram":
        return cls(edges=config["edges"])

    def update(self, x: Any) -> "Histogram":
        a = as_float64(x).ravel()
        nan = np.isnan(a)
        a = a[~nan]
        under, over = a < self.edges[0], a > self.edges[-1]
        inside = a[~(under | over)]
        self._counts = self._counts + np.histogram(inside, bins=self.edges)[0]
        self._outside = self._outside + np.array([under.sum(), over.sum(), nan.sum()], np.int64)
        return self

    def merge(self, other: "Histogram") -> "Histogram":
        self._require_same(other)
        self._counts = self._counts + other._counts
        self._outside = self._outside + other._outside
        return self

    def result(self) -> dict[str, Any]:
        u, o, n = (int(v) for v in self._outside)
        return {"counts": self._counts.copy(), "edges": self.edges.copy(), "underflow": u, "overflow": o, "nan": n}

    def _check_state(self) -> None:
        if self._counts is None or self._counts.shape != (len(self.edges) - 1,) or self._outside is None \
                or self._outside.shape != (3,) or (self._counts < 0).any() or (self._outside < 0).any():
            raise bad_state("Histogram", "counts do not match the edges")
