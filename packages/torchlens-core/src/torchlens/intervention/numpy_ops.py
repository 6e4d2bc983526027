"""Edit ops over numpy arrays (core depends on numpy; backends on numpy payloads use it).

Every backend that supports interventions returns an object with these members from
`edit_ops()`; this one is the reference implementation.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np


class NumpyEditOps:
    def zeros_like(self, x: Any) -> Any:
        return np.zeros_like(x)

    def clone(self, x: Any) -> Any:
        return np.array(x, copy=True)

    def clip(self, x: Any, lo: Any, hi: Any) -> Any:
        return np.clip(x, lo, hi)

    def mean(self, x: Any, dim: Any, keepdim: bool) -> Any:
        return np.mean(x, axis=dim, keepdims=keepdim).astype(np.asarray(x).dtype)

    def norm(self, x: Any, dim: Any, keepdim: bool, p: float = 2.0) -> Any:
        x = np.asarray(x)
        if np.isinf(p):  # the max norm (p = inf)
            return np.max(np.abs(x), axis=dim, keepdims=keepdim and dim is not None).astype(x.dtype)
        if dim is None:
            return np.asarray(np.sum(np.abs(x) ** p) ** (1.0 / p), dtype=x.dtype)
        return (np.sum(np.abs(x) ** p, axis=dim, keepdims=keepdim) ** (1.0 / p)).astype(x.dtype)

    def randn_like(self, x: Any, seed: int) -> Any:
        return np.random.default_rng(seed).standard_normal(np.shape(x)).astype(np.asarray(x).dtype)

    def permute_flat(self, x: Any, seed: int) -> Any:
        flat = np.asarray(x).reshape(-1)
        return flat[np.random.default_rng(seed).permutation(flat.size)].reshape(np.shape(x))

    def moveaxis(self, x: Any, src: int, dst: int) -> Any:
        return np.moveaxis(x, src, dst)

    def asarray(self, v: Any, like: Any) -> Any:
        dtype = None if like is None else np.asarray(like).dtype
        return np.asarray(v, dtype=dtype)

    def where(self, mask: Any, a: Any, b: Any) -> Any:
        return np.where(mask, a, b)

    def param_stamp(self, p: Any) -> Any:
        """A numpy array has no version counter: the stamp sees a moved buffer or a changed
        shape/dtype/strides, not an in-place write."""
        if not isinstance(p, np.ndarray):
            return None
        return (p.__array_interface__["data"][0], p.shape, str(p.dtype), p.strides)

    def replay_args(self, op: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Arguments replay may run on without writing into saved payloads: an in-place op's
        first argument is copied."""
        if op.is_inplace and args:
            args = (self.clone(args[0]),) + tuple(args[1:])
        return args, kwargs

    def rng_state(self, state: Any) -> Any:
        return contextlib.nullcontext()
