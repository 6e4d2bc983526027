"""The reference framework's operations. Each one reports itself to an active recorder."""

from __future__ import annotations

import numpy as np

from torchlens_reference import runtime


def _op(name, fn, *args, params=(), random=False):
    rec = runtime.RECORDER
    meta = {"rng_state": rng_state()} if (random and rec is not None) else None
    out = fn(*args)
    if rec is not None:
        out = rec.op(name, fn, args, out, params, meta)
    return out


def linear(x, weight, bias=None, *, params=()):
    if bias is None:
        return _op("linear", lambda a, w: a @ w.T, x, weight, params=params)
    return _op("linear", lambda a, w, b: a @ w.T + b, x, weight, bias, params=params)


def relu(x):
    return _op("relu", lambda a: np.maximum(a, 0).astype(a.dtype), x)


def tanh(x):
    return _op("tanh", np.tanh, x)


def add(a, b):
    return _op("add", np.add, a, b)


def mul(a, b):
    return _op("mul", np.multiply, a, b)


def matmul(a, b):
    return _op("matmul", np.matmul, a, b)


def softmax(x, axis=-1):
    def _softmax(a):
        e = np.exp(a - a.max(axis=axis, keepdims=True))
        return e / e.sum(axis=axis, keepdims=True)

    return _op("softmax", _softmax, x)


def zeros(shape, dtype=np.float32):
    return _op("zeros", lambda: np.zeros(shape, dtype=dtype))


_RNG = np.random.default_rng(0)


def seed(value: int) -> None:
    """Reset the reference framework's global random stream."""
    global _RNG
    _RNG = np.random.default_rng(value)


def rng_state() -> dict:
    return _RNG.bit_generator.state


def set_rng_state(state: dict) -> None:
    _RNG.bit_generator.state = state


def noise(shape, dtype=np.float32):
    """Standard-normal noise from the global stream: a random literal producer."""
    return _op("noise", lambda: _RNG.standard_normal(shape).astype(dtype), random=True)
