"""The shipped generation reducers (glossary: Streaming generation recording).

Each is a named `Reducer`; calling it applies its wrapped callable `Reducer.fn` to a site's
payload after every forward. The result's first axis is the forward's positions.

- `norm(ord=2.0, dim=-1, position_dim=1)`: one norm per position.
- `top_k(k, dim=-1, position_dim=-2)`: the k largest indices per position (on an attention
  probability site [batch, heads, queries, keys]: the attended keys per query position).
- `probe(fitted, position_dim=1)`: the decision function of an already-fitted linear probe:
  a scikit-learn linear estimator (`coef_`, `intercept_`), an `nn.Linear` or a
  `(weight, bias)` pair (`weight` [classes, features]; a one-class probe gives [positions]).

Core imports no framework: the reducers use the payload's own array methods (a torch tensor's
`norm`, `movedim`, `topk`, `new_tensor`, or numpy for a numpy array).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from torchlens.errors import RecordingError


@dataclass(frozen=True)
class Reducer:
    """A named reducer: `name` (recorded in each record's metadata) and `fn`."""

    name: str
    fn: Callable[[Any], Any]

    def __call__(self, value: Any) -> Any:
        return self.fn(value)


def _invalid(message: str, remedy: str) -> RecordingError:
    return RecordingError("record_generation_reducer_invalid", message, remedy=remedy)


def _axis(dim: int, ndim: int, what: str) -> int:
    if not -ndim <= dim < ndim:
        raise _invalid(f"{what}={dim} is outside a value with {ndim} dimensions", f"pick {what} in [-{ndim}, {ndim})")
    return dim % ndim


def _moveaxis(x: Any, src: int, dst: int) -> Any:
    if isinstance(x, np.ndarray):
        return np.moveaxis(x, src, dst)
    return x.movedim(src, dst)


def norm(ord: float = 2.0, dim: int = -1, position_dim: int = 1) -> Reducer:
    """One `ord`-norm over `dim` per position ([positions] for a batch of one)."""

    def fn(x: Any) -> Any:
        nd = len(x.shape)
        d, p = _axis(dim, nd, "dim"), _axis(position_dim, nd, "position_dim")
        if d == p:
            raise _invalid("norm(): dim and position_dim are the same axis", "norm(dim=-1, position_dim=1)")
        if isinstance(x, np.ndarray):
            out = np.linalg.norm(x, ord=ord, axis=d)
        else:
            out = x.norm(p=ord, dim=d)
        p_after = p - 1 if d < p else p
        out = _moveaxis(out, p_after, 0)
        n = out.shape[0]
        rest = 1
        for s in out.shape[1:]:
            rest *= int(s)
        return out.reshape(n) if rest == 1 else out.reshape(n, rest)

    return Reducer(f"norm(ord={ord}, dim={dim}, position_dim={position_dim})", fn)


def top_k(k: int, dim: int = -1, position_dim: int = -2) -> Reducer:
    """The indices of the `k` largest entries along `dim`, positions first."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise RecordingError("record_generation_options_invalid", f"top_k(k={k!r}): k is not an int >= 1", remedy="top_k(5)")

    def fn(x: Any) -> Any:
        nd = len(x.shape)
        d, p = _axis(dim, nd, "dim"), _axis(position_dim, nd, "position_dim")
        if d == p:
            raise _invalid("top_k(): dim and position_dim are the same axis", "top_k(k, dim=-1, position_dim=-2)")
        kk = min(k, int(x.shape[d]))
        if isinstance(x, np.ndarray):
            idx = np.flip(np.argsort(x, axis=d, kind="stable"), axis=d).take(range(kk), axis=d)
        else:
            idx = x.topk(kk, dim=d).indices
        return _moveaxis(idx, p, 0)

    return Reducer(f"top_k(k={k}, dim={dim}, position_dim={position_dim})", fn)


def _probe_weights(fitted: Any) -> tuple[Any, Any]:
    if isinstance(fitted, tuple) and len(fitted) == 2:
        w, b = fitted
    elif hasattr(fitted, "coef_") and hasattr(fitted, "intercept_"):  # a fitted scikit-learn linear estimator
        w, b = np.atleast_2d(np.asarray(fitted.coef_)), np.atleast_1d(np.asarray(fitted.intercept_))
    elif hasattr(fitted, "weight") and hasattr(fitted, "in_features"):  # an nn.Linear (duck-typed: core imports no torch)
        w, b = fitted.weight, fitted.bias
    else:
        raise RecordingError("record_generation_options_invalid", f"probe() got {type(fitted).__name__}, not a fitted "
                             "linear probe", remedy="probe(sklearn_estimator), probe(nn.Linear(d, c)) or probe((W, b))")
    if hasattr(w, "detach"):
        w = w.detach()
    if b is not None and hasattr(b, "detach"):
        b = b.detach()
    if len(w.shape) == 1:
        w = w.reshape(1, -1)
    if len(w.shape) != 2:
        raise RecordingError("record_generation_options_invalid", f"probe weight of shape {tuple(w.shape)} is not "
                             "[classes, features]", remedy="weight [classes, features], bias [classes]")
    return w, b


def probe(fitted: Any, position_dim: int = 1) -> Reducer:
    """`x @ weight.T + bias` per position (the probe's decision function)."""
    w0, b0 = _probe_weights(fitted)
    squeeze = int(w0.shape[0]) == 1

    def fn(x: Any) -> Any:
        nd = len(x.shape)
        p = _axis(position_dim, nd, "position_dim")
        if int(x.shape[-1]) != int(w0.shape[1]):
            raise _invalid(f"probe(): the site has {int(x.shape[-1])} features, the probe {int(w0.shape[1])}",
                           "fit the probe on this site's last axis")
        v = _moveaxis(x, p, 0)
        if isinstance(x, np.ndarray):
            w, b = np.asarray(w0, dtype=x.dtype), None if b0 is None else np.asarray(b0, dtype=x.dtype)
        else:
            w = w0.to(dtype=x.dtype, device=x.device) if hasattr(w0, "to") else x.new_tensor(np.asarray(w0))
            b = None if b0 is None else (b0.to(dtype=x.dtype, device=x.device) if hasattr(b0, "to")
                                         else x.new_tensor(np.asarray(b0)))
        out = v @ w.T
        if b is not None:
            out = out + b
        n = out.shape[0]
        rest = 1
        for s in out.shape[1:]:
            rest *= int(s)
        if squeeze and rest == 1:
            return out.reshape(n)
        return out.reshape(n, -1) if rest == int(w0.shape[0]) else out

    return Reducer(f"probe({type(fitted).__name__}, position_dim={position_dim})", fn)


__all__ = ["Reducer", "norm", "top_k", "probe"]
