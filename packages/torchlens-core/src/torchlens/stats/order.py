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


_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _splitmix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on uint64 arrays (wrapping arithmetic): a counter-based hash."""
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & _M64
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _M64
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _M64
        return x ^ (x >> np.uint64(31))


def _element_keys(seed: int, ids: np.ndarray, units: int, positions: int) -> np.ndarray:
    """[b, units, positions] uint64 priority keys of (seed, example id, unit, position): fixed
    per element, so any split of a stream keeps the same bottom-k."""
    h = _splitmix(np.full(1, seed % 2**64, dtype=np.uint64))
    h = _splitmix(h ^ ids.astype(np.int64).view(np.uint64))[:, None, None]
    h = _splitmix(h ^ np.arange(units, dtype=np.uint64)[None, :, None])
    return _splitmix(h ^ np.arange(positions, dtype=np.uint64)[None, None, :])


@_register_kind
class Quantile(Accumulator):
    """Quantiles of every value seen (one set per unit with `unit_axis=`).

    `mode="exact"` (default) keeps every value. `mode="reservoir"` keeps, per unit, a uniform
    random sample of at most `size` values: each element gets a fixed priority key hashed from
    (`seed`, its example id, unit, position within the example) and the reservoir holds the
    `size` smallest keys. The reservoir of a stream is therefore the same however it is split
    into batches, processes (`merge`) or save/load boundaries, as long as example ids are the
    same (`update(x, example_ids=...)`; default: rows counted from 0 by this accumulator, so
    streams merged from separately fed accumulators must pass ids). Up to `size` values per
    unit the result is exact. Beyond, `rank_error(delta)` bounds how far the estimate's rank
    can be from q: with probability at least 1 - delta, |F_n(estimate) - q| <= sqrt(ln(2 /
    delta) / (2 * size)) (Hoeffding, sampling without replacement), F_n the data's empirical
    distribution function."""

    _ARRAYS = ("values", "keys", "seen", "count")

    def __init__(self, q: float | Sequence[float] = 0.5, *, mode: str = "exact", unit_axis: int | None = None,
                 encoder: Callable[[Any], Any] | None = None, size: int = 4096, seed: int = 0) -> None:
        qs = np.atleast_1d(np.asarray(q, dtype=np.float64))
        if qs.ndim != 1 or not np.all((qs >= 0) & (qs <= 1)):
            raise InvalidArgumentError("invalid_argument", f"Quantile(q={q!r}) needs values in [0, 1]", remedy="q=[0.1, 0.5, 0.9]")
        if mode not in ("exact", "reservoir"):
            raise InvalidArgumentError("stats_option_unsupported", f"Quantile(mode={mode!r}) is not built; "
                                       "'exact' and 'reservoir' are",
                                       remedy="mode='exact' (keeps every value) or mode='reservoir' (size= values per unit)")
        for name, v, lo in (("size", size, 1), ("seed", seed, 0)):
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise InvalidArgumentError("invalid_argument", f"Quantile({name}={v!r}) is not an int >= {lo}",
                                           remedy=f"{name}={lo if name == 'seed' else 4096}")
        self.q = [float(v) for v in qs]
        self._scalar_q = np.ndim(q) == 0
        self.mode = mode
        self.unit_axis = _check_unit_axis(unit_axis)
        self.encoder = encoder
        self.size, self.seed = size, seed
        self._chunks: list[np.ndarray] = []
        self._keys: np.ndarray | None = None  # reservoir: [units, m] int64 (uint64 bits)
        self._seen = np.zeros(1, np.int64) if mode == "reservoir" else None  # rows folded (default example ids)
        self._count = np.zeros(1, np.int64) if mode == "reservoir" else None  # elements per unit folded

    def config(self) -> dict[str, Any]:
        cfg = {"q": self.q if not self._scalar_q else self.q[0], "mode": self.mode, "unit_axis": self.unit_axis}
        if self.mode == "reservoir":
            cfg.update(size=self.size, seed=self.seed)
        return cfg

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

    def update(self, x: Any, example_ids: Sequence[int] | None = None) -> "Quantile":
        a = as_float64(self.encoder(x) if self.encoder is not None else x)
        if self.mode == "reservoir":
            return self._update_reservoir(a, example_ids)
        u = _units(a, self.unit_axis, "Quantile")
        if self._chunks and u.shape[0] != self._chunks[0].shape[0]:
            raise InvalidArgumentError("stats_shape_mismatch", f"{u.shape[0]} units, earlier batches had {self._chunks[0].shape[0]}",
                                       remedy="feed batches with the same unit axis")
        if u.size:
            self._chunks.append(u.copy())
        return self

    def _update_reservoir(self, a: np.ndarray, example_ids: Any) -> "Quantile":
        if a.ndim == 0:
            raise InvalidArgumentError("stats_input_invalid", "a reservoir Quantile needs a batch with an example axis",
                                       remedy="pass [examples, ...]")
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
        units, per = vals.shape[1], vals.shape[2]
        if self._keys is not None and self._keys.shape[0] != units:
            raise InvalidArgumentError("stats_shape_mismatch", f"{units} units, earlier batches had {self._keys.shape[0]}",
                                       remedy="feed batches with the same unit axis")
        keys = _element_keys(self.seed, ids, units, per).view(np.int64)
        self._fold(np.moveaxis(vals, 1, 0).reshape(units, -1), np.moveaxis(keys, 1, 0).reshape(units, -1))
        self._seen = self._seen + b
        self._count = self._count + b * per
        return self

    def _fold(self, values: np.ndarray, keys: np.ndarray) -> None:
        """Keep, per unit, the `size` smallest keys of the reservoir and these elements
        (ties by value, so the result never depends on the order of folding)."""
        if self._keys is not None:
            values = np.concatenate([self._values, values], axis=1)
            keys = np.concatenate([self._keys, keys], axis=1)
        if keys.shape[1] > self.size:
            ukeys = keys.view(np.uint64)
            order = np.stack([np.lexsort((values[i], ukeys[i]))[:self.size] for i in range(keys.shape[0])])
            values = np.take_along_axis(values, order, axis=1)
            keys = np.take_along_axis(keys, order, axis=1)
        self._values, self._keys = np.ascontiguousarray(values), np.ascontiguousarray(keys)

    def merge(self, other: "Quantile") -> "Quantile":
        self._require_same(other)
        if self.mode == "reservoir":
            if other._keys is not None:
                if self._keys is not None and other._keys.shape[0] != self._keys.shape[0]:
                    raise InvalidArgumentError("stats_merge_mismatch", "unit counts differ", remedy="merge like with like")
                self._fold(other._values, other._keys)
            self._seen = self._seen + other._seen
            self._count = self._count + other._count
            return self
        if other._chunks:
            self.update_units(other._values)
        return self

    def update_units(self, u: np.ndarray) -> None:
        if self._chunks and u.shape[0] != self._chunks[0].shape[0]:
            raise InvalidArgumentError("stats_merge_mismatch", "unit counts differ", remedy="merge like with like")
        self._chunks.append(u)

    @property
    def count(self) -> int:
        """Values folded per unit (in reservoir mode too, not the reservoir's size)."""
        if self.mode == "reservoir":
            return int(self._count[0])
        return 0 if not self._chunks else int(sum(c.shape[1] for c in self._chunks))

    def rank_error(self, delta: float = 1e-3) -> float:
        """With probability >= 1 - delta, the rank error |F_n(estimate) - q| of one quantile is
        at most this (0 while the reservoir holds every value)."""
        if not 0 < delta < 1:
            raise InvalidArgumentError("invalid_argument", f"delta={delta!r} is not in (0, 1)", remedy="delta=1e-3")
        if self.mode == "exact" or self.count <= self.size:
            return 0.0
        return float(np.sqrt(np.log(2.0 / delta) / (2.0 * self.size)))

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
        if self.mode == "exact":
            if self._keys is not None or self._seen is not None or self._count is not None:
                raise bad_state("Quantile", "an exact Quantile has no reservoir arrays")
            return
        for name in ("seen", "count"):
            c = getattr(self, "_" + name)
            if c is None or c.shape != (1,) or c.dtype != np.int64 or c[0] < 0:
                raise bad_state("Quantile", f"{name} is not one non-negative int64")
        k = self._keys
        if (v is None) != (k is None) or (k is not None and (k.dtype != np.int64 or k.shape != v.shape
                                                              or v.shape[1] > self.size
                                                              or v.shape[1] != min(self.size, int(self._count[0])))):
            raise bad_state("Quantile", "reservoir keys/values do not fit size and count")


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
