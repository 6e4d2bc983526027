"""Per-op FLOPs and MACs, computed from shapes only (no extra torch work).

`COST_FUNCS[name](args, kwargs, outs) -> (flops, macs)` for the callables that dominate a
forward (linear, matmul family, convolutions, attention) and cheap elementwise ops.
MACs count multiply-accumulates; FLOPs are 2 per MAC plus bias adds.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

Tensor = torch.Tensor


def _numel(shape: Any) -> int:
    return math.prod(shape)


def _linear(args, kwargs, outs):
    w = args[1] if len(args) > 1 else kwargs.get("weight")
    b = args[2] if len(args) > 2 else kwargs.get("bias")
    out = outs[0]
    k = w.shape[-1] if w.dim() >= 1 else 1
    macs = out.numel() * k
    return 2 * macs + (out.numel() if isinstance(b, Tensor) else 0), macs


def _matmul(args, kwargs, outs):
    a = args[0] if args else kwargs.get("input")
    if not isinstance(a, Tensor) or a.dim() == 0:
        return None
    k = a.shape[-1]
    macs = outs[0].numel() * k
    return 2 * macs, macs


def _addmm_like(args, kwargs, outs):
    # addmm(bias, a, b), baddbmm(bias, a, b), addbmm: a is the second tensor
    a = args[1] if len(args) > 1 else kwargs.get("batch1", kwargs.get("mat1"))
    if not isinstance(a, Tensor):
        return None
    macs = outs[0].numel() * a.shape[-1]
    return 2 * macs + outs[0].numel(), macs


def _conv(args, kwargs, outs):
    w = args[1] if len(args) > 1 else kwargs.get("weight")
    b = args[2] if len(args) > 2 else kwargs.get("bias")
    out = outs[0]
    # weight: (out_channels, in_channels / groups, *kernel)
    macs = out.numel() * _numel(w.shape[1:])
    return 2 * macs + (out.numel() if isinstance(b, Tensor) else 0), macs


def _sdpa(args, kwargs, outs):
    q = args[0] if args else kwargs.get("query")
    k = args[1] if len(args) > 1 else kwargs.get("key")
    v = args[2] if len(args) > 2 else kwargs.get("value")
    batch = _numel(q.shape[:-2])
    L, E = q.shape[-2], q.shape[-1]
    S, Ev = k.shape[-2], v.shape[-1]
    macs = batch * L * S * E + batch * L * S * Ev
    return 2 * macs + 3 * batch * L * S, macs  # softmax counted roughly as 3 flops per score


def _elementwise(args, kwargs, outs):
    o = outs[0]
    return (o.numel() if isinstance(o, Tensor) else 0), 0


def _norm(args, kwargs, outs):
    o = outs[0]
    return 5 * o.numel(), 0


COST_FUNCS: dict[str, Callable[..., Any]] = {
    "linear": _linear,
    "matmul": _matmul, "mm": _matmul, "bmm": _matmul, "__matmul__": _matmul, "__rmatmul__": None,
    "addmm": _addmm_like, "baddbmm": _addmm_like, "addbmm": _addmm_like,
    "conv1d": _conv, "conv2d": _conv, "conv3d": _conv,
    "scaled_dot_product_attention": _sdpa,
    "layer_norm": _norm, "batch_norm": _norm, "group_norm": _norm, "rms_norm": _norm,
}
for _name in ("add", "sub", "mul", "div", "relu", "gelu", "silu", "tanh", "sigmoid", "exp", "neg", "pow", "sqrt",
              "rsqrt", "softmax", "log_softmax", "__add__", "__radd__", "__iadd__", "__sub__", "__rsub__", "__isub__",
              "__mul__", "__rmul__", "__imul__", "__truediv__", "__rtruediv__", "__itruediv__", "add_", "mul_",
              "relu_", "sub_", "div_", "__neg__", "__pow__", "where", "clamp", "abs", "dropout"):
    COST_FUNCS[_name] = _elementwise
COST_FUNCS = {k: v for k, v in COST_FUNCS.items() if v is not None}


def op_cost(name: str, args: tuple, kwargs: dict, outs: tuple) -> tuple[int, int] | None:
    """(flops, macs) of one call, or None when this callable has no cost rule."""
    fn = COST_FUNCS.get(name)
    if fn is None:
        return None
    try:
        return fn(args, kwargs, outs)
    except (AttributeError, IndexError, TypeError):
        return None
