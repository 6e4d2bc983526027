"""The paddle backend's small models for tests and the conformance suite (roles `mlp`, `conv`,
`attention`, `loop`, `constant`, `random`), each with its tier-3 oracle: the model's
computation written by hand with `paddle.nn.functional`, the layers called one at a time on
the model's own weights, calling `tap(label, value)` at each op output it reproduces
(labels are the trace's).
"""

from __future__ import annotations

import sys

import numpy as np

from torchlens_paddle.plugin import load_paddle

paddle = load_paddle()
import paddle.nn as nn  # noqa: E402
import paddle.nn.functional as F  # noqa: E402


def _square_sum(out):
    return (out ** 2).sum()


def _backward(trace, loss):
    return trace.backward(loss)  # the paddle backend takes the loss as a callable of the outputs


def _autodiff(forward):
    """The gradient oracle: `paddle.grad` of the loss with respect to a zero perturbation added
    at every tapped value of the hand forward (never the backend's own backward)."""
    def grads(loss, *args, **kwargs):
        seen = {}

        def find(label, v):
            seen[label] = v
            return v

        reseed = kwargs.pop("_reseed", None)
        if reseed:
            reseed()
        forward(find, *args, **kwargs)
        labels = list(seen)
        eps = {}
        for label in labels:
            z = paddle.zeros_like(seen[label])
            z.stop_gradient = False
            eps[label] = z
        if reseed:
            reseed()
        value = loss(forward(lambda label, v: v + eps[label], *args, **kwargs))
        g = paddle.grad([value], [eps[label] for label in labels], allow_unused=True)
        return {label: (paddle.zeros_like(eps[label]) if gi is None else gi) for label, gi in zip(labels, g)}
    return grads


def _t(values, shape=None):
    a = np.asarray(values, dtype=np.float32)
    return paddle.to_tensor(a if shape is None else a.reshape(shape))


CONST = _t([0.5, -1.0, 2.0, 0.25])


class ConstantNet(nn.Layer):
    """Adds a closure constant (a tensor that is no input, parameter or op output)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return F.relu(self.fc(x) + CONST)


class RandomNet(nn.Layer):
    """Adds noise drawn from paddle's global generator (seeded by the entry's `reseed`)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) + paddle.randn(x.shape)


class LoopNet(nn.Layer):
    """One layer applied three times."""

    def __init__(self, steps: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.cell = nn.Linear(4, 4)
        self.steps = steps

    def forward(self, x):
        h = self.inp(x)
        for _ in range(self.steps):
            h = paddle.tanh(self.cell(h))
        return h


class ConvNet(nn.Layer):
    """Conv2D, BatchNorm2D (evaluated in eval mode: running statistics), ReLU, a mean, Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2D(2, 3, kernel_size=3, padding=1)
        self.bn = nn.BatchNorm2D(3)
        self.fc = nn.Linear(3, 2)

    def forward(self, x):  # x: NCHW
        h = F.relu(self.bn(self.conv(x)))
        return self.fc(h.mean(axis=[2, 3]))


class AttentionBlock(nn.Layer):
    def __init__(self, dims: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dims)
        self.attn = nn.MultiHeadAttention(dims, heads)

    def forward(self, x):
        h = self.norm(x)
        return x + self.attn(h, h, h)


def _lin(layer, x):
    return F.linear(x, layer.weight, layer.bias)


def _mlp_forward(m):
    def forward(tap, x):
        x = tap("input_1", x)
        h = tap("linear_1_1", _lin(m[0], x))
        h = tap("relu_1_2", F.relu(h))
        return tap("linear_2_3", _lin(m[2], h))
    return forward


def _loop_forward(m):
    def forward(tap, x):
        x = tap("input_1", x)
        h = tap("linear_1_1", _lin(m.inp, x))
        for i in range(1, m.steps + 1):
            h = tap(f"tanh_1_3:{i}", paddle.tanh(tap(f"linear_2_2:{i}", _lin(m.cell, h))))
        return h
    return forward


def _constant_forward(m):
    def forward(tap, x):
        x = tap("input_1", x)
        h = tap("add_1_3", tap("linear_1_1", _lin(m.fc, x)) + tap("constant_1_2", CONST))
        return tap("relu_1_4", F.relu(h))
    return forward


def _random_forward(m):
    def forward(tap, x):
        x = tap("input_1", x)
        h = tap("linear_1_1", _lin(m.fc, x))
        return tap("add_1_3", h + tap("gaussian_1_2", paddle.randn(x.shape)))
    return forward


def _conv_forward(m):
    def forward(tap, x):
        x = tap("input_1", x)
        h = tap("conv2d_1_1", F.conv2d(x, m.conv.weight, padding=1))
        h = tap("add_1_3", h + tap("reshape_1_2", m.conv.bias.reshape([1, -1, 1, 1])))
        bn = m.bn
        # batchnorm_1_4 is a multi-output kernel (its output and statistics): not tapped
        h = F.batch_norm(h, bn._mean, bn._variance, bn.weight, bn.bias, training=False, epsilon=bn._epsilon)
        h = tap("relu_1_5", F.relu(h))
        h = tap("mean_1_6", h.mean(axis=[2, 3]))
        return tap("linear_1_7", _lin(m.fc, h))
    return forward


def _attention_forward(m):
    a = m.attn

    def heads(tap, t, n):  # n: the labels' layer numbers (reshape_<n>, transpose_<n>)
        t = tap(f"reshape_{n[0]}", t.reshape([0, 0, a.num_heads, a.head_dim]))
        return tap(f"transpose_{n[1]}", t.transpose([0, 2, 1, 3]))

    def forward(tap, x):
        x = tap("input_1", x)
        h = tap("layernorm_1_1", F.layer_norm(x, [x.shape[-1]], m.norm.weight, m.norm.bias, m.norm._epsilon))
        q = heads(tap, tap("linear_1_2", _lin(a.q_proj, h)), ("1_3", "1_4"))
        k = tap("linear_2_5", _lin(a.k_proj, h))
        v = tap("linear_3_6", _lin(a.v_proj, h))
        k, v = heads(tap, k, ("2_7", "2_8")), heads(tap, v, ("3_9", "3_10"))
        q = tap("multiply_1_11", q * (a.head_dim ** -0.5))
        w = tap("softmax_1_13", F.softmax(tap("matmul_1_12", paddle.matmul(q, k, transpose_y=True))))
        o = tap("matmul_2_14", paddle.matmul(w, v))
        o = tap("transpose_4_15", o.transpose([0, 2, 1, 3]))
        o = tap("reshape_4_16", o.reshape([0, 0, o.shape[2] * o.shape[3]]))
        return tap("add_1_18", x + tap("linear_4_17", _lin(a.out_proj, o)))
    return forward


def count_framework_calls(model, *args, **kwargs) -> int:
    """The conformance no-silent-gap counter: how many framework calls a plain forward makes
    that produce tensors, counted without the capture machinery. It wraps *every* callable
    of `paddle._C_ops` wherever a module binds it (its own scan of `sys.modules`, no skip
    list) and every C-level method of `paddle.Tensor` (and its Python `__getitem__` and
    `__setitem__`), counts the outermost calls whose result is (or holds) a tensor, and
    restores everything. A call the capture does not record makes the counts differ."""
    from paddle import _C_ops

    count, depth, saved = [0], [0], []
    kernels = {id(v): v for k, v in vars(_C_ops).items() if not k.startswith("__") and callable(v)}

    def is_tensor_result(r):
        return isinstance(r, paddle.Tensor) or (isinstance(r, (tuple, list)) and any(isinstance(v, paddle.Tensor) for v in r))

    def wrap(f, always=False):
        def counted(*a, **k):
            depth[0] += 1
            try:
                r = f(*a, **k)
            finally:
                depth[0] -= 1
            if depth[0] == 0 and (always or is_tensor_result(r)):
                count[0] += 1
            return r
        return counted

    for mod in list(sys.modules.values()):
        try:
            items = list(vars(mod).items())
        except TypeError:
            continue
        for name, obj in items:
            if id(obj) in kernels and kernels[id(obj)] is obj:
                saved.append((mod, name, obj))
    for name, obj in vars(paddle.Tensor).items():
        if type(obj).__name__ == "method_descriptor" or name in ("__getitem__", "__setitem__"):
            saved.append((paddle.Tensor, name, obj))
    wrappers = {}
    try:
        for owner, name, obj in saved:
            w = wrappers.get(id(obj))
            if w is None:
                w = wrappers[id(obj)] = wrap(obj, always=name == "__setitem__")
            setattr(owner, name, w)
        model(*args, **kwargs)
    finally:
        for owner, name, obj in saved:
            setattr(owner, name, obj)
    return count[0]


def _c3(forward, site, other_args, reseed=None) -> dict:
    grads = _autodiff(forward)
    if reseed is not None:
        plain = grads
        grads = lambda loss, *a, **k: plain(loss, *a, _reseed=reseed, **k)  # noqa: E731
    return {"site": site, "forward": forward, "other_args": other_args, "other_kwargs": {},
            "loss": _square_sum, "backward": _backward, "grads": grads}


def zoo() -> dict[str, dict]:
    paddle.seed(7)
    x = _t(np.linspace(-1, 1, 12), (3, 4))
    other = _t(np.cos(np.arange(12)), (3, 4))
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    loop, constant, random, conv, attn = LoopNet(), ConstantNet(), RandomNet(), ConvNet(), AttentionBlock()
    # running statistics that are not the identity, so the eval-mode BatchNorm computes something
    conv.bn._mean.set_value(_t([0.1, -0.2, 0.3]))
    conv.bn._variance.set_value(_t([0.5, 1.5, 2.0]))
    for m in (mlp, loop, constant, random, conv, attn):
        m.eval()
    img = _t(np.sin(np.arange(2 * 2 * 5 * 5)), (2, 2, 5, 5))
    seq = _t(np.sin(np.arange(2 * 5 * 8) * 0.37), (2, 5, 8))

    def reseed():
        paddle.seed(1234)

    entries = {
        "mlp": {"model": mlp, "args": (x,), "kwargs": {}, "c3": _c3(_mlp_forward(mlp), "relu_1_2", (other,))},
        "conv": {"model": conv, "args": (img,), "kwargs": {}, "c3": _c3(_conv_forward(conv), "relu_1_5", (paddle.cos(img),))},
        "attention": {"model": attn, "args": (seq,), "kwargs": {},
                      "c3": _c3(_attention_forward(attn), "softmax_1_13", (paddle.cos(seq),))},
        "loop": {"model": loop, "args": (x,), "kwargs": {}, "c3": _c3(_loop_forward(loop), "tanh_1_3:2", (other,))},
        "constant": {"model": constant, "args": (x,), "kwargs": {},
                     "c3": _c3(_constant_forward(constant), "add_1_3", (other,))},
        "random": {"model": random, "args": (x,), "kwargs": {}, "reseed": reseed,
                   "c3": _c3(_random_forward(random), "linear_1_1", (other,), reseed)},
    }
    for entry in entries.values():
        entry["count_ops"] = count_framework_calls
    return entries
