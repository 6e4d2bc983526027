"""The MLX backend's small models for tests and the conformance suite (roles `mlp`, `conv`,
`attention`, `loop`, `constant`, `random`), each with its tier-3 oracle: the model's
computation written by hand with `mlx.core` on the model's own weights, calling
`tap(label, value)` at each op output it reproduces (labels are the trace's).
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx
import mlx.nn as nn

def _square_sum(out):
    return (out ** 2).sum()


def _backward(trace, loss):
    return trace.backward(loss)  # the MLX backend takes the loss as a callable of the outputs


def _autodiff(forward):
    """The gradient oracle: `mx.grad` of the loss with respect to a zero perturbation added at
    every tapped value of the hand forward (never the backend's own backward)."""
    def grads(loss, *args, **kwargs):
        seen = {}

        def find(label, v):
            seen[label] = v
            return v

        forward(find, *args, **kwargs)
        labels = list(seen)

        def f(eps):
            by = dict(zip(labels, eps))
            return loss(forward(lambda label, v: v + by[label], *args, **kwargs))

        g = mx.grad(f)([mx.zeros_like(seen[label]) for label in labels])
        return dict(zip(labels, g))
    return grads

CONST = mx.array([0.5, -1.0, 2.0, 0.25])


class ConstantNet(nn.Module):
    """Adds a closure constant (an array that is no input, parameter or op output)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def __call__(self, x):
        return nn.relu(self.fc(x) + CONST)


class RandomNet(nn.Module):
    """Draws noise with an explicit key derived from the input's batch size."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def __call__(self, x, key):
        return self.fc(x) + mx.random.normal(x.shape, key=key)


class LoopNet(nn.Module):
    """One layer applied three times."""

    def __init__(self, steps: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.cell = nn.Linear(4, 4)
        self.steps = steps

    def __call__(self, x):
        h = self.inp(x)
        for _ in range(self.steps):
            h = mx.tanh(self.cell(h))
        return h


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, kernel_size=3, padding=1)
        self.fc = nn.Linear(3, 2)

    def __call__(self, x):  # x: NHWC
        h = nn.relu(self.conv(x))
        return self.fc(h.mean(axis=(1, 2)))


class AttentionBlock(nn.Module):
    def __init__(self, dims: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dims)
        self.attn = nn.MultiHeadAttention(dims, heads)

    def __call__(self, x):
        h = self.norm(x)
        return x + self.attn(h, h, h)


def _lin(layer: nn.Linear, x):
    return mx.addmm(layer.bias, x, layer.weight.T)


def _mlp_forward(m):
    def forward(tap, x):
        h = tap("addmm_1_2", _lin(m.layers[0], x))
        h = tap("maximum_1_3", mx.maximum(h, 0))
        return tap("addmm_2_5", _lin(m.layers[2], h))
    return forward


def _loop_forward(m):
    def forward(tap, x):
        h = tap("addmm_1_2", _lin(m.inp, x))
        for i in range(1, m.steps + 1):
            h = tap(f"tanh_1_5:{i}", mx.tanh(tap(f"addmm_2_4:{i}", _lin(m.cell, h))))
        return h
    return forward


def _constant_forward(m):
    def forward(tap, x):
        h = tap("add_1_4", tap("addmm_1_2", _lin(m.fc, x)) + CONST)
        return tap("maximum_1_5", mx.maximum(h, 0))
    return forward


def _random_forward(m):
    def forward(tap, x, key):
        return tap("add_1_4", tap("addmm_1_2", _lin(m.fc, x)) + mx.random.normal(x.shape, key=key))
    return forward


def _conv_forward(m):
    def forward(tap, x):
        h = tap("add_1_2", mx.conv2d(x, m.conv.weight, padding=1) + m.conv.bias)
        h = tap("maximum_1_3", mx.maximum(h, 0))
        h = tap("mean_1_4", h.mean(axis=(1, 2)))
        return tap("addmm_1_6", _lin(m.fc, h))
    return forward


def _attention_forward(m):
    a = m.attn

    def forward(tap, x):
        h = tap("layernorm_1_1", mx.fast.layer_norm(x, m.norm.weight, m.norm.bias, m.norm.eps))
        q, k, v = (h @ p.weight.T for p in (a.query_proj, a.key_proj, a.value_proj))
        q, k, v = (mx.unflatten(t, -1, (a.num_heads, -1)).transpose(0, 2, 1, 3) for t in (q, k, v))
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=math.sqrt(1 / q.shape[-1]), mask=None)
        o = tap("scaleddotproductattention_1_14", o)
        o = tap("flatten_1_16", o.transpose(0, 2, 1, 3).flatten(-2, -1))
        return tap("add_1_19", x + o @ a.out_proj.weight.T)
    return forward


#: `mx.array` members that are Python object plumbing, never an array computation.
_PLUMBING = frozenset({"__init__", "__new__", "__getattribute__", "__setattr__", "__delattr__", "__class__", "__repr__",
                       "__str__", "__format__", "__hash__", "__sizeof__", "__reduce__", "__reduce_ex__", "__getstate__",
                       "__setstate__", "__dir__", "__init_subclass__", "__subclasshook__", "__doc__", "__module__"})


def count_framework_calls(model, *args, **kwargs) -> int:
    """The conformance no-silent-gap counter: how many framework calls a plain forward makes
    that produce arrays, counted without the capture machinery. It wraps *every* callable of
    the `mlx.core` namespaces (no skip list) and every member of `mx.array`, `mx.ArrayAt`
    and `mx.ArrayIterator`
    other than object plumbing, counts the outermost calls whose result is (or holds) an
    array, and restores everything. A call the capture does not record makes the counts
    differ. Compilation is disabled, as during capture, so `mx.compile`d functions (`nn.relu`)
    run their Python bodies."""
    count, depth, saved = [0], [0], []

    def is_array_result(r):
        return isinstance(r, mx.array) or (isinstance(r, (tuple, list)) and any(isinstance(v, mx.array) for v in r))

    def wrap(f, always=False):
        @functools.wraps(f)
        def counted(*a, **k):
            depth[0] += 1
            try:
                r = f(*a, **k)
            finally:
                depth[0] -= 1
            if depth[0] == 0 and (always or is_array_result(r)):
                count[0] += 1
            return r
        return counted

    for ns in (mx, mx.random, mx.fast, mx.linalg, mx.fft):
        for name in dir(ns):
            obj = getattr(ns, name)
            if not name.startswith("_") and callable(obj) and not isinstance(obj, type) and type(obj).__name__ != "module":
                saved.append((ns, name, obj))
    for cls in (mx.array, mx.ArrayAt, mx.ArrayIterator):  # `for row in a` counts one call per row
        for name, obj in vars(cls).items():
            if name in _PLUMBING:
                continue
            if isinstance(obj, property) or type(obj).__name__ == "nb_property" or hasattr(obj, "__get__") and not callable(obj):
                saved.append((cls, name, obj))
            elif callable(obj):
                saved.append((cls, name, obj))
    try:
        for owner, name, obj in saved:
            if callable(obj):
                setattr(owner, name, wrap(obj, always=name == "__setitem__"))
            else:
                setattr(owner, name, property(wrap(obj.__get__)))
        mx.disable_compile()
        try:
            model(*args, **kwargs)
        finally:
            mx.enable_compile()
    finally:
        for owner, name, obj in saved:
            setattr(owner, name, obj)
    return count[0]


def _c3(forward, site, other_args) -> dict:
    return {"site": site, "forward": forward, "other_args": other_args, "other_kwargs": {},
            "loss": _square_sum, "backward": _backward, "grads": _autodiff(forward)}


def zoo() -> dict[str, dict]:
    mx.random.seed(7)
    x = mx.linspace(-1, 1, 12).reshape(3, 4)
    other = mx.cos(mx.arange(12, dtype=mx.float32)).reshape(3, 4)
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    loop, constant, random, conv, attn = LoopNet(), ConstantNet(), RandomNet(), ConvNet(), AttentionBlock()
    key = mx.random.key(1234)
    img = mx.sin(mx.arange(2 * 5 * 5 * 2, dtype=mx.float32)).reshape(2, 5, 5, 2)
    seq = mx.sin(mx.arange(2 * 5 * 8, dtype=mx.float32) * 0.37).reshape(2, 5, 8)
    mx.eval(mlp.parameters(), loop.parameters(), constant.parameters(), random.parameters(), conv.parameters(),
            attn.parameters(), x, other, key, img, seq)
    entries = {
        "mlp": {"model": mlp, "args": (x,), "kwargs": {}, "c3": _c3(_mlp_forward(mlp), "maximum_1_3", (other,))},
        "conv": {"model": conv, "args": (img,), "kwargs": {}, "c3": _c3(_conv_forward(conv), "maximum_1_3", (mx.cos(img),))},
        "attention": {"model": attn, "args": (seq,), "kwargs": {},
                      "c3": _c3(_attention_forward(attn), "scaleddotproductattention_1_14", (mx.cos(seq),))},
        "loop": {"model": loop, "args": (x,), "kwargs": {}, "c3": _c3(_loop_forward(loop), "tanh_1_5:2", (other,))},
        "constant": {"model": constant, "args": (x,), "kwargs": {},
                     "c3": _c3(_constant_forward(constant), "add_1_4", (other,))},
        "random": {"model": random, "args": (x, key), "kwargs": {}, "reseed": lambda: mx.random.seed(1234),
                   "c3": _c3(_random_forward(random), "addmm_1_2", (other, key))},
    }
    for entry in entries.values():
        entry["count_ops"] = count_framework_calls
    return entries
