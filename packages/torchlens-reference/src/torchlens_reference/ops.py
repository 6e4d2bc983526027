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


def _linear(a, w, b=None):
    return a @ w.T if b is None else a @ w.T + b


def _relu(a):
    return np.maximum(a, 0).astype(a.dtype)


def linear(x, weight, bias=None, *, params=()):
    if bias is None:
        return _op("linear", _linear, x, weight, params=params)
    return _op("linear", _linear, x, weight, bias, params=params)


def relu(x):
    return _op("relu", _relu, x)


def _tanh(a):
    return np.tanh(a)


def tanh(x):
    return _op("tanh", _tanh, x)


def _add(a, b):
    return np.add(a, b)


def add(a, b):
    return _op("add", _add, a, b)


def _mul(a, b):
    return np.multiply(a, b)


def mul(a, b):
    return _op("mul", _mul, a, b)


def _matmul(a, b):
    return np.matmul(a, b)


def matmul(a, b):
    return _op("matmul", _matmul, a, b)


def _softmax(a, axis=-1):
    e = np.exp(a - a.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def softmax(x, axis=-1):
    return _op("softmax", _softmax, x, axis)


def _zeros(shape, dtype="float32"):
    return np.zeros(shape, dtype=dtype)


def zeros(shape, dtype="float32"):
    return _op("zeros", _zeros, tuple(shape), str(np.dtype(dtype)))


_RNG = np.random.default_rng(0)


def seed(value: int) -> None:
    """Reset the reference framework's global random stream."""
    global _RNG
    _RNG = np.random.default_rng(value)


def rng_state() -> dict:
    return _RNG.bit_generator.state


def set_rng_state(state: dict) -> None:
    _RNG.bit_generator.state = state


def _noise(shape, dtype="float32"):
    return _RNG.standard_normal(shape).astype(dtype)


def noise(shape, dtype="float32"):
    """Standard-normal noise from the global stream: a random literal producer."""
    return _op("noise", _noise, tuple(shape), str(np.dtype(dtype)), random=True)
