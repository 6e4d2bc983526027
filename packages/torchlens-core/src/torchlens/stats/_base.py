"""The `StreamingStat` protocol and the helpers every accumulator shares.

An accumulator folds batches into a small float64 state and merges exactly with another
accumulator of the same kind and configuration (Chan's pairwise update), so a dataset split
across batches, processes or a save/load boundary reduces to the same statistic. Its whole
state is a flat mapping of named NumPy arrays plus a JSON-able configuration, which is what
`save_fitted` writes (no pickle anywhere). Core imports NumPy only, never a framework: values
arrive as anything `numpy.asarray` accepts (a backend's host copy of a tensor).
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np

from torchlens.errors import ArtifactError, InvalidArgumentError

#: kind name -> accumulator class; filled by `_register_kind` (the only classes load_fitted builds)
KINDS: dict[str, type["Accumulator"]] = {}


@runtime_checkable
class StreamingStat(Protocol):
    """What every `tl.stats` accumulator provides."""

    def update(self, x: Any) -> "StreamingStat": ...
    def merge(self, other: "StreamingStat") -> "StreamingStat": ...
    def state_dict(self) -> dict[str, np.ndarray]: ...
    def config(self) -> dict[str, Any]: ...


def _register_kind(cls: type) -> type:
    KINDS[cls.__name__] = cls
    return cls


def as_float64(x: Any, what: str = "x") -> np.ndarray:
    """`x` as a float64 array, or a typed refusal (a graph-connected tensor must be detached
    first: its values would be copied silently otherwise)."""
    try:
        a = np.asarray(x)
    except (TypeError, ValueError, RuntimeError) as e:
        raise InvalidArgumentError("stats_input_invalid", f"{what} could not be read as an array: {e}",
                                   remedy="pass a NumPy array or a detached CPU tensor "
                                          "(tensor.detach().cpu())") from e
    if a.dtype == object or not (np.issubdtype(a.dtype, np.number) or a.dtype == np.bool_):
        raise InvalidArgumentError("stats_input_invalid", f"{what} has non-numeric dtype {a.dtype}",
                                   remedy="pass numeric values")
    if np.iscomplexobj(a):
        raise InvalidArgumentError("stats_input_invalid", f"{what} is complex", remedy="pass real values")
    return a.astype(np.float64, copy=False)


def feature_rows(x: Any, what: str = "x") -> np.ndarray:
    """Rows over the last (feature) axis: [..., d] -> [n, d]; a 1-D input is n scalar rows."""
    a = as_float64(x, what)
    if a.ndim == 0:
        raise InvalidArgumentError("stats_input_invalid", f"{what} is 0-d; a batch needs at least one axis",
                                   remedy="pass a [rows] or [..., features] array")
    if a.ndim == 1:
        return a[:, None]
    return a.reshape(-1, a.shape[-1])


class Accumulator:
    """Base of the concrete accumulators: config + named float64/int64 arrays, exact merge."""

    _ARRAYS: ClassVar[tuple[str, ...]] = ()

    def config(self) -> dict[str, Any]:
        raise NotImplementedError

    def state_dict(self) -> dict[str, np.ndarray]:
        return {name: np.array(getattr(self, "_" + name), copy=True) for name in self._ARRAYS
                if getattr(self, "_" + name) is not None}

    def _load_state(self, arrays: dict[str, np.ndarray]) -> None:
        """Restore from `state_dict()` output; `load_fitted` has checked names and dtypes."""
        for name in self._ARRAYS:
            setattr(self, "_" + name, arrays.get(name))
        self._check_state()

    def _check_state(self) -> None:
        """Raise `stats_state_invalid` when restored arrays do not fit together."""

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Accumulator":
        return cls(**config)

    def _require_same(self, other: Any) -> None:
        if type(other) is not type(self):
            raise InvalidArgumentError("stats_merge_mismatch",
                                       f"cannot merge a {type(other).__name__} into a {type(self).__name__}",
                                       remedy="merge accumulators of the same kind")
        if other.config() != self.config():
            raise InvalidArgumentError("stats_merge_mismatch",
                                       f"{type(self).__name__} configurations differ: {self.config()} vs {other.config()}",
                                       remedy="build both accumulators with the same arguments")

    def copy(self) -> "Accumulator":
        new = type(self).from_config(self.config())
        new._load_state(self.state_dict())
        return new

    def __repr__(self) -> str:
        cfg = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"tl.stats.{type(self).__name__}({cfg})"


def bad_state(kind: str, why: str) -> ArtifactError:
    return ArtifactError("stats_state_invalid", f"{kind} state does not fit together: {why}",
                         remedy="the file is damaged or was not written by tl.stats.save_fitted; re-fit it")


def empty_result(kind: str) -> InvalidArgumentError:
    return InvalidArgumentError("stats_empty", f"{kind} has folded no rows yet", remedy="update() it with data first")
