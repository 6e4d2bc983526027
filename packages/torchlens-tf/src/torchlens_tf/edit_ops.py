"""The TensorFlow implementations of core's intervention hooks: edit ops (also the backend's
`ReplayOps` for core's replay engine) and module-output edits.

Edits of a TensorFlow trace stay `tf.Tensor`s (immutable: replay never writes a saved
payload, so `replay_args` copies nothing). A recorded op is called as `raw_op(...)` on its
filled inputs (`torchlens_tf.ops`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import tensorflow as tf

from torchlens.backends.sdk import ReplayOpsBase


def _tensor(x: Any) -> Any:
    return x if isinstance(x, tf.Tensor) else tf.convert_to_tensor(np.asarray(x))


class TFEditOps(ReplayOpsBase):
    """The math edits and replay run with, on `tf.Tensor` values (core's `EditOps`, and the
    backend's `ReplayOps`)."""

    def zeros_like(self, x: Any) -> Any:
        return tf.zeros_like(_tensor(x))

    def clone(self, x: Any) -> Any:
        return tf.identity(_tensor(x))

    def clip(self, x: Any, lo: Any, hi: Any) -> Any:
        x = _tensor(x)
        if lo is not None:
            x = tf.maximum(x, tf.cast(lo, x.dtype))
        if hi is not None:
            x = tf.minimum(x, tf.cast(hi, x.dtype))
        return x

    def mean(self, x: Any, dim: Any, keepdim: bool) -> Any:
        x = _tensor(x)
        return tf.cast(tf.reduce_mean(x, axis=dim, keepdims=keepdim), x.dtype)

    def norm(self, x: Any, dim: Any, keepdim: bool, p: float = 2.0) -> Any:
        x = _tensor(x)
        a = tf.abs(x)
        if np.isinf(p):
            return tf.reduce_max(a, axis=dim, keepdims=keepdim and dim is not None)
        return tf.cast(tf.reduce_sum(a ** p, axis=dim, keepdims=keepdim and dim is not None) ** (1.0 / p), x.dtype)

    def randn_like(self, x: Any, seed: int) -> Any:
        x = _tensor(x)
        s = int(seed) & 0x7FFFFFFF
        return tf.cast(tf.random.stateless_normal(tf.shape(x), seed=[s, 0]), x.dtype)

    def permute_flat(self, x: Any, seed: int) -> Any:
        x = _tensor(x)
        flat = tf.reshape(x, [-1])
        s = int(seed) & 0x7FFFFFFF
        keys = tf.random.stateless_uniform(tf.shape(flat), seed=[s, 1])
        return tf.reshape(tf.gather(flat, tf.argsort(keys)), tf.shape(x))

    def moveaxis(self, x: Any, src: int, dst: int) -> Any:
        x = _tensor(x)
        return tf.experimental.numpy.moveaxis(x, src, dst)

    def where(self, mask: Any, a: Any, b: Any) -> Any:
        a = _tensor(a)
        return tf.where(_tensor(mask), a, tf.cast(_tensor(b), a.dtype))

    def asarray(self, v: Any, like: Any) -> Any:
        a = v if isinstance(v, tf.Tensor) else tf.convert_to_tensor(np.asarray(v))
        return a if like is None or a.dtype == like.dtype else tf.cast(a, like.dtype)

    def param_stamp(self, p: Any) -> Any:
        """A parameter's payload is the value read at capture (an immutable tensor)."""
        if not isinstance(p, tf.Tensor):
            return None
        return (tuple(p.shape), p.dtype.name)

    def replay_args(self, op: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return args, kwargs

    def rng_state(self, state: Any) -> Any:
        """Recorded draws are stateless (the seed is an input): no state to restore."""
        return contextlib.nullcontext()

    def call(self, op: Any, args: tuple, kwargs: dict) -> Any:
        return op.func(*args, **kwargs)

    def grad_enabled(self) -> Any:
        return contextlib.nullcontext()


# module-output edits ----------------------------------------------------------------------

def _edit_tensor_output(out: Any, fn: Any) -> tuple[Any, int]:
    """Edit a layer output that is one tensor; any other output is left as it is."""
    return (fn(out), 1) if isinstance(out, tf.Tensor) else (out, 0)


def attach_module_edits(model: Any, modules: list[tuple[str, Any]], rules: list, ops: Any, fired: dict) -> Any:
    """Edit each targeted layer call's tensor output as it returns (`rules`: (address, call
    number or None, edit)). The patching is core's `attach_class_edits`."""
    from torchlens.backends.sdk import attach_class_edits

    # one class per layer, the first in its MRO defining `__call__`: Keras's `Layer.__call__`
    # calls `Operation.__call__` through super(), and core's class-edit wrapper has no
    # re-entry guard, so patching both would edit one output twice (see the notes)
    classes: list[type] = []
    for _a, m in modules:
        cls = next((c for c in type(m).__mro__ if "__call__" in c.__dict__), None)
        if cls is not None and cls is not object and cls not in classes:
            classes.append(cls)
    return attach_class_edits(modules, rules, ops, fired, classes, _edit_tensor_output)


__all__ = ["TFEditOps", "attach_module_edits"]
