"""The tinygrad backend's small models for tests and the conformance suite (roles `mlp`,
`conv`, `attention`, `loop`, `constant`, `random`), each with its tier-3 oracle: the model's
computation written by hand with tinygrad `Tensor` operations on the model's own weights,
calling `tap(label, value)` at each op output it reproduces (labels are the trace's), and
the gradient oracle: tinygrad's own autodiff (`Tensor.gradient`) of that hand forward.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from tinygrad import Tensor, nn


#: Why a plain forward is held to a tolerance: tinygrad evaluates it lazily as a few fused
#: kernels (clang contracts a multiply and an add of two ops into one fma), the capture
#: realizes every op as its own kernel; the capture's own replay is bit-exact.
FUSED = ("a plain tinygrad forward runs as a few fused kernels (multiply-adds across op boundaries contract into "
         "fma), the capture realizes each op as its own kernel")


def _square_sum(out):
    return (out ** 2).sum()


def _backward(trace, loss):
    return trace.backward(loss)  # the tinygrad backend takes the loss as a callable of the outputs


def _autodiff(forward):
    """The gradient oracle: tinygrad's autodiff of the loss with respect to a zero perturbation
    added at every tapped value of the hand forward (never the backend's own backward)."""
    def grads(loss, *args, **kwargs):
        seen = {}

        def perturb(label, v):  # one pass: a second one would draw different random numbers
            seen[label] = Tensor(np.zeros(tuple(v.shape), np.float32)).realize()
            return v + seen[label]

        value = loss(forward(perturb, *args, **kwargs))
        g = value.gradient(*seen.values())
        Tensor.realize(*g)
        return dict(zip(seen, g))
    return grads


def _t(values) -> Tensor:
    return Tensor(np.asarray(values, dtype=np.float32)).realize()


CONST = _t([0.5, -1.0, 2.0, 0.25])


class MLP:
    """Two `tinygrad.nn.Linear` layers with a ReLU between."""

    def __init__(self, d_in: int = 4, hidden: int = 8, d_out: int = 2) -> None:
        self.l1 = nn.Linear(d_in, hidden)
        self.l2 = nn.Linear(hidden, d_out)

    def __call__(self, x):
        return self.l2(self.l1(x).relu())


class ConstantNet:
    """Adds a closure constant (a tensor that is no input, parameter or op output)."""

    def __init__(self) -> None:
        self.fc = nn.Linear(4, 4)

    def __call__(self, x):
        return (self.fc(x) + CONST).relu()


class RandomNet:
    """Masks a linear layer's output with a draw from tinygrad's global stream
    (`Tensor.manual_seed` seeds it). Multiplying by a 0/1 mask is exact, so a plain fused
    forward and the op-by-op capture agree bit for bit (the conformance RNG cell compares
    them exactly)."""

    def __init__(self) -> None:
        self.fc = nn.Linear(4, 4)

    def __call__(self, x):
        return self.fc(x) * (Tensor.rand(*x.shape) < 0.5)


class LoopNet:
    """One layer applied three times."""

    def __init__(self, steps: int = 3) -> None:
        self.inp = nn.Linear(4, 4)
        self.cell = nn.Linear(4, 4)
        self.steps = steps

    def __call__(self, x):
        h = self.inp(x)
        for _ in range(self.steps):
            h = self.cell(h).tanh()
        return h


class ConvNet:
    """`nn.Conv2d`, `nn.BatchNorm` with its running statistics (eval), ReLU, pooling, `nn.Linear`."""

    def __init__(self) -> None:
        self.conv = nn.Conv2d(2, 3, kernel_size=3, padding=1)
        self.bn = nn.BatchNorm(3)
        self.bn.running_mean = _t([0.1, -0.2, 0.3])
        self.bn.running_var = _t([0.5, 1.5, 2.0])
        self.bn.weight = _t([1.1, 0.9, 1.3])
        self.bn.bias = _t([0.05, -0.1, 0.2])
        self.fc = nn.Linear(3, 2)

    def __call__(self, x):  # x: NCHW
        h = self.bn(self.conv(x)).relu()
        return self.fc(h.mean(axis=(2, 3)))


class Attention:
    """Pre-norm self-attention: `nn.LayerNorm`, one `qkv` projection split in three,
    `scaled_dot_product_attention`, an output projection and the residual."""

    def __init__(self, dims: int = 8, heads: int = 2) -> None:
        self.heads = heads
        self.norm = nn.LayerNorm(dims)
        self.qkv = nn.Linear(dims, 3 * dims)
        self.out = nn.Linear(dims, dims)

    def __call__(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        o = q.scaled_dot_product_attention(k, v)
        return x + self.out(o.transpose(1, 2).reshape(b, t, c))


class AttentionStack:
    """`depth` attention blocks in a list (the benchmark's model)."""

    def __init__(self, depth: int = 3, dims: int = 8, heads: int = 2) -> None:
        self.blocks = [Attention(dims, heads) for _ in range(depth)]

    def __call__(self, x):
        for blk in self.blocks:
            x = blk(x)
        return x


def _lin(layer, x):
    return x @ layer.weight.T + layer.bias


def _mlp_forward(m):
    def forward(tap, x):
        h = tap("linear_1_2", _lin(m.l1, x))
        h = tap("relu_1_3", h.maximum(0))
        return tap("linear_2_5", _lin(m.l2, h))
    return forward


def _loop_forward(m):
    def forward(tap, x):
        h = tap("linear_1_2", _lin(m.inp, x))
        for i in range(1, m.steps + 1):
            h = tap(f"tanh_1_5:{i}", tap(f"linear_2_4:{i}", _lin(m.cell, h)).tanh())
        return h
    return forward


def _constant_forward(m):
    def forward(tap, x):
        h = tap("add_1_4", tap("linear_1_2", _lin(m.fc, x)) + CONST)
        return tap("relu_1_5", h.maximum(0))
    return forward


def _random_forward(m):
    def forward(tap, x):
        h = tap("linear_1_2", _lin(m.fc, x))
        return tap("mul_1_5", h * (Tensor.rand(*x.shape) < 0.5))
    return forward


def _conv_forward(m):
    bn = m.bn

    def forward(tap, x):
        h = tap("conv2d_1_1", x.conv2d(m.conv.weight, m.conv.bias, padding=1))
        scale = (bn.weight * (bn.running_var + bn.eps).rsqrt()).reshape(1, -1, 1, 1)
        h = tap("batchnorm_1_5", (h - bn.running_mean.reshape(1, -1, 1, 1)) * scale + bn.bias.reshape(1, -1, 1, 1))
        h = tap("relu_1_6", h.maximum(0))
        h = tap("mean_1_7", h.sum(axis=(2, 3)) / (h.shape[2] * h.shape[3]))
        return tap("linear_1_9", _lin(m.fc, h))
    return forward


def _attention_forward(m):
    def forward(tap, x):
        b, t, c = x.shape
        mu = x.mean(axis=-1, keepdim=True)
        var = ((x - mu) ** 2).mean(axis=-1, keepdim=True)
        h = tap("add_1_3", (x - mu) / (var + m.norm.eps).sqrt() * m.norm.weight + m.norm.bias)
        qkv = tap("linear_1_5", _lin(m.qkv, h))
        hd = c // m.heads
        q, k, v = (qkv[..., i * c:(i + 1) * c].reshape(b, t, m.heads, hd).permute(0, 2, 1, 3) for i in range(3))
        w = (q @ k.permute(0, 1, 3, 2) / math.sqrt(hd))
        w = (w - w.max(axis=-1, keepdim=True)).exp()
        o = tap("scaleddotproductattention_1_9", (w / w.sum(axis=-1, keepdim=True)) @ v)
        o = o.permute(0, 2, 1, 3).reshape(b, t, c)
        return tap("add_2_14", x + tap("linear_2_13", _lin(m.out, o)))
    return forward


#: Object plumbing and calls whose body runs the model's own code (or only evaluates): the
#: counter's only exclusions. `sequential` calls the model's layers; `realize` evaluates.
_NOT_COUNTED = frozenset({"__init__", "__new__", "__del__", "__repr__", "__hash__", "__bool__", "__len__",
                          "__getattribute__", "__setattr__", "__class__", "__init_subclass__", "__subclasshook__",
                          "sequential", "realize"})


def count_framework_calls(model, *args, **kwargs) -> int:
    """The conformance no-silent-gap counter: how many `Tensor` calls a plain forward makes
    that produce tensors, counted without the capture machinery. It wraps every callable
    member of every class in `Tensor`'s MRO (functions, class-methods, static methods, the
    `T` property) on `Tensor` itself, counts the outermost calls whose result is (or holds)
    a `Tensor` (and item assignment, which writes one and returns None), and restores
    everything (deleting its shadows)."""
    count, depth, saved = [0], [0], []

    def is_tensor_result(r):
        return isinstance(r, Tensor) or (isinstance(r, (tuple, list)) and any(isinstance(v, Tensor) for v in r))

    def wrap(f, always=False):
        @functools.wraps(f)
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

    members = {}
    for cls in reversed(Tensor.__mro__[:-1]):
        members.update(vars(cls))
    for name, obj in members.items():
        if name in _NOT_COUNTED or (name.startswith("_") and not name.endswith("__")):
            continue
        if isinstance(obj, classmethod):
            new = classmethod(wrap(obj.__func__))
        elif isinstance(obj, staticmethod):
            new = staticmethod(wrap(obj.__func__))
        elif isinstance(obj, property):
            new = property(wrap(obj.fget)) if name == "T" else None
        elif callable(obj) and not isinstance(obj, type):
            new = wrap(obj, always=name in ("__setitem__", "__delitem__"))  # they write a tensor, return None
        else:
            new = None
        if new is not None:
            saved.append((name, Tensor.__dict__.get(name, _MISSING)))
            setattr(Tensor, name, new)
    try:
        model(*args, **kwargs)
    finally:
        for name, old in saved:
            if old is _MISSING:
                delattr(Tensor, name)
            else:
                setattr(Tensor, name, old)
    return count[0]


_MISSING = object()


def _c3(forward, site, other_args) -> dict:
    return {"site": site, "forward": forward, "other_args": other_args, "other_kwargs": {},
            "loss": _square_sum, "backward": _backward, "grads": _autodiff(forward)}


def _realized(*objs):
    from tinygrad.nn.state import get_parameters

    for o in objs:
        ps = get_parameters(o)
        if ps:
            Tensor.realize(*ps)


def zoo() -> dict[str, dict]:
    Tensor.manual_seed(7)
    x = _t(np.linspace(-1, 1, 12).reshape(3, 4))
    other = _t(np.cos(np.arange(12)).reshape(3, 4))
    mlp, loop, constant, random, conv, attn = MLP(), LoopNet(), ConstantNet(), RandomNet(), ConvNet(), Attention()
    _realized(mlp, loop, constant, random, conv, attn)
    img = _t(np.sin(np.arange(2 * 2 * 5 * 5)).reshape(2, 2, 5, 5))
    seq = _t(np.sin(np.arange(2 * 5 * 8) * 0.37).reshape(2, 5, 8))
    entries = {
        "mlp": {"model": mlp, "args": (x,), "kwargs": {}, "c3": _c3(_mlp_forward(mlp), "relu_1_3", (other,))},
        "conv": {"model": conv, "args": (img,), "kwargs": {},
                 "c3": _c3(_conv_forward(conv), "relu_1_6", (_t(np.cos(np.arange(100)).reshape(2, 2, 5, 5)),))},
        "attention": {"model": attn, "args": (seq,), "kwargs": {},
                      "c3": _c3(_attention_forward(attn), "scaleddotproductattention_1_9",
                                (_t(np.cos(np.arange(80) * 0.37).reshape(2, 5, 8)),))},
        "loop": {"model": loop, "args": (x,), "kwargs": {}, "c3": _c3(_loop_forward(loop), "tanh_1_5:2", (other,))},
        "constant": {"model": constant, "args": (x,), "kwargs": {},
                     "c3": _c3(_constant_forward(constant), "add_1_4", (other,))},
        "random": {"model": random, "args": (x,), "kwargs": {}, "reseed": lambda: Tensor.manual_seed(1234),
                   "c3": _c3(_random_forward(random), "linear_1_2", (other,))},
    }
    for name, entry in entries.items():
        entry["count_ops"] = count_framework_calls
        if name != "random":
            entry["compiled_reference"] = FUSED

    return entries
