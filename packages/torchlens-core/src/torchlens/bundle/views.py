"""Super* views: one site read across every Bundle member (`Bundle.at(site)`).

`SuperOp` holds the op (or the passes of a layer, or a module's output ops) each member
resolved the site to; `SuperParam` one parameter address in every member. `.compare()` is
the member-by-member distance matrix at that site; it runs the comparison gate over every
pair first (parameter reads also the checkpoint live-ref guard).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from torchlens.bundle import metrics as _metrics
from torchlens.bundle.align import joined, payload_arrays
from torchlens.errors import PayloadUnavailableError


@dataclass(frozen=True)
class ComparisonMatrix:
    """`values[i][j]` is metric(member i, member j), anchored on member i (the row)."""

    names: tuple[str, ...]
    values: tuple[tuple[float, ...], ...]
    metric: str | None
    on: str
    site: Any

    def __getitem__(self, pair: tuple[str, str]) -> float:
        a, b = pair
        return self.values[self.names.index(a)][self.names.index(b)]

    def to_numpy(self) -> np.ndarray:
        return np.array(self.values, dtype=np.float64)


def _matrix(names: list[str], arrays: dict[str, np.ndarray], metric: Any, on: str, site: Any) -> ComparisonMatrix:
    name, fn = _metrics.resolve(metric)
    rows = tuple(tuple(0.0 if a == b else _metrics.distance(fn, arrays[a], arrays[b]) for b in names) for a in names)
    return ComparisonMatrix(tuple(names), rows, name, on, site)


class SuperOp:
    """One op site across members: `ops[name]` is the tuple of ops (several for a layer's
    passes or a module's outputs, joined in order when compared)."""

    def __init__(self, bundle: Any, site: Any, ops: dict[str, tuple[Any, ...]]) -> None:
        self._bundle = bundle
        self.site = site
        self.ops = ops

    @property
    def members(self) -> tuple[str, ...]:
        return tuple(self.ops)

    @property
    def labels(self) -> dict[str, tuple[str, ...]]:
        return {n: tuple(o.label for o in ops) for n, ops in self.ops.items()}

    @property
    def out(self) -> dict[str, Any]:
        """Each member's payload, framework-native (a tuple when the site holds several ops)."""
        return {n: (ops[0].out if len(ops) == 1 else tuple(o.out for o in ops)) for n, ops in self.ops.items()}

    def _arrays(self, on: str) -> dict[str, np.ndarray]:
        out = {}
        for n, ops in self.ops.items():
            parts: list[np.ndarray] = []
            for op in ops:
                arr = payload_arrays(self._bundle[n], op, on)
                if arr is None:
                    code = "activation_not_saved" if on == "out" else "grad_not_saved"
                    raise PayloadUnavailableError(code, f"member {n!r}: op {op.label!r} has no saved {on} array",
                                                  remedy="capture every member with the site saved", label=op.label,
                                                  member=n)
                parts.extend(arr)
            out[n] = joined(parts)
        return out

    def compare(self, metric: Any = "cosine", *, on: str = "out") -> ComparisonMatrix:
        names = list(self.ops)
        self._bundle._gate_all(names)
        self._bundle._check_on(on)
        return _matrix(names, self._arrays(on), metric, on, self.site)

    def __repr__(self) -> str:
        return f"<SuperOp {self.site!r} over {list(self.ops)}>"


class SuperParam:
    """One parameter address across members. Value reads with two or more members need
    capture-time snapshots (the checkpoint live-ref guard)."""

    def __init__(self, bundle: Any, address: str, names: list[str]) -> None:
        self._bundle = bundle
        self.site = address
        self._names = names

    @property
    def members(self) -> tuple[str, ...]:
        return tuple(self._names)

    @property
    def params(self) -> dict[str, Any]:
        """The Param records (metadata; no value read)."""
        return {n: self._bundle[n]._params[self.site] for n in self._names}

    @property
    def out(self) -> dict[str, np.ndarray]:
        """Each member's capture-time parameter value (a read-only host array)."""
        from torchlens.bundle.guard import require_snapshots

        if len(self._names) < 2:
            from torchlens.bundle.guard import snapshot_of

            snap = snapshot_of(self._bundle[self._names[0]])
            if snap is not None:
                return {self._names[0]: snap[self.site]}
            from torchlens.bundle.align import host_array

            n = self._names[0]
            return {n: host_array(self._bundle[n], self._bundle[n]._params[self.site].value)}
        snaps = require_snapshots(self._bundle.members, self._names, f"at({self.site!r}).out")
        return {n: snaps[n][self.site] for n in self._names}

    def compare(self, metric: Any = "relative_l2", *, on: str = "out") -> ComparisonMatrix:
        from torchlens.bundle.guard import require_snapshots

        self._bundle._check_on(on, allowed=("out",))
        snaps = require_snapshots(self._bundle.members, self._names, f"at({self.site!r}).compare()")
        self._bundle._floor_all(self._names)
        return _matrix(self._names, {n: snaps[n][self.site] for n in self._names}, metric, on, self.site)

    def __repr__(self) -> str:
        return f"<SuperParam {self.site!r} over {self._names}>"


__all__ = ["SuperOp", "SuperParam", "ComparisonMatrix"]
