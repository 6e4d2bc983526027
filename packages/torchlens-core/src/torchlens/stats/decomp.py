"""Decompositions on streamed moments: PCA (from the exact covariance) and CKA (exact
full-data linear CKA from the two covariances and the cross-covariance; never a minibatch
average)."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from torchlens.errors import InvalidArgumentError
from torchlens.stats._base import Accumulator, _register_kind, bad_state, empty_result, feature_rows
from torchlens.stats.moments import Covariance, CrossCovariance


@_register_kind
class PCA(Covariance):
    """Principal components of the rows (eigenvectors of the covariance, largest first).
    Each component's sign is fixed so its largest-magnitude coordinate is positive."""

    _ARRAYS = ("count", "mean", "m2")

    def __init__(self, n_components: int | None = None, *, encoder: Callable[[Any], Any] | None = None) -> None:
        super().__init__()
        if n_components is not None and (not isinstance(n_components, int) or n_components < 1):
            raise InvalidArgumentError("invalid_argument", f"PCA(n_components={n_components!r}) needs a positive int",
                                       remedy="n_components=16, or None for all")
        self.n_components = n_components
        self.encoder = encoder

    def config(self) -> dict[str, Any]:
        return {"n_components": self.n_components}

    def update(self, x: Any) -> "PCA":
        return super().update(self.encoder(x) if self.encoder is not None else x)  # type: ignore[return-value]

    def _eig(self) -> tuple[np.ndarray, np.ndarray]:
        w, v = np.linalg.eigh(self.covariance())
        order = np.argsort(w)[::-1][: self.n_components]
        w, v = w[order], v[:, order].T
        flip = np.sign(v[np.arange(len(v)), np.abs(v).argmax(axis=1)])
        return np.clip(w, 0.0, None), v * flip[:, None]

    @property
    def components(self) -> np.ndarray:
        """[n_components, features]."""
        return self._eig()[1]

    @property
    def explained_variance(self) -> np.ndarray:
        return self._eig()[0]

    @property
    def explained_variance_ratio(self) -> np.ndarray:
        return self._eig()[0] / np.trace(self.covariance())

    def transform(self, x: Any) -> np.ndarray:
        r = feature_rows(self.encoder(x) if self.encoder is not None else x)
        return (r - self.mean) @ self.components.T

    def result(self) -> dict[str, np.ndarray]:
        w, v = self._eig()
        return {"components": v, "explained_variance": w, "explained_variance_ratio": w / np.trace(self.covariance()),
                "mean": self.mean}


@_register_kind
class CKA(Accumulator):
    """Linear CKA between two row-matched representations x [n, p] and y [n, q] over every
    row folded: ||Cxy||_F^2 / (||Cxx||_F ||Cyy||_F) on the centred scatter matrices."""

    _ARRAYS = ("count", "mean_x", "mean_y", "sxx", "syy", "sxy")

    def __init__(self) -> None:
        self._x, self._y, self._xy = Covariance(), Covariance(), CrossCovariance()

    def config(self) -> dict[str, Any]:
        return {}

    @property
    def count(self) -> int:
        return self._xy.count

    def update(self, x: Any, y: Any) -> "CKA":
        rx, ry = feature_rows(x, "x"), feature_rows(y, "y")
        self._xy.update(rx, ry)  # checks row matching first, before anything folds
        self._x.update(rx)
        self._y.update(ry)
        return self

    def merge(self, other: "CKA") -> "CKA":
        self._require_same(other)
        self._xy.merge(other._xy)
        self._x.merge(other._x)
        self._y.merge(other._y)
        return self

    def result(self) -> float:
        if self.count < 2:
            raise empty_result("CKA")
        sxy = self._xy.scatter()
        num = float(np.sum(sxy * sxy))
        den = float(np.linalg.norm(self._x.scatter()) * np.linalg.norm(self._y.scatter()))
        return num / den if den > 0 else float("nan")

    def state_dict(self) -> dict[str, np.ndarray]:
        if self.count == 0:
            return {"count": np.zeros(1, np.int64)}
        return {"count": self._xy._count.copy(), "mean_x": self._x._mean.copy(), "mean_y": self._y._mean.copy(),
                "sxx": self._x._m2.copy(), "syy": self._y._m2.copy(), "sxy": self._xy._cxy.copy()}

    def _load_state(self, arrays: dict[str, np.ndarray]) -> None:
        c = arrays.get("count")
        if c is None:
            raise bad_state("CKA", "no count")
        if int(c[0]) == 0:
            if len(arrays) != 1:
                raise bad_state("CKA", "an empty state carries moments")
            return
        try:
            self._x._load_state({"count": c, "mean": arrays["mean_x"], "m2": arrays["sxx"]})
            self._y._load_state({"count": c, "mean": arrays["mean_y"], "m2": arrays["syy"]})
            self._xy._load_state({"count": c, "mean_x": arrays["mean_x"], "mean_y": arrays["mean_y"], "cxy": arrays["sxy"]})
        except KeyError as e:
            raise bad_state("CKA", f"missing {e}") from None
