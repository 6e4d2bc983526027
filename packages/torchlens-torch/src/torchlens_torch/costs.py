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


class SavedTensorTally:
    """Counts the tensors autograd saves for backward while a capture's forward runs
    (`torch.autograd.graph.saved_tensors_hooks`; the pack hook returns the tensor itself, so
    nothing about the graph changes). Each saved tensor is charged to the op whose call saved
    it: the recorder's next event id at pack time (the call's event is recorded after the
    call returns). Entered only when the capture records gradients (backward_ready/save_grads)."""

    def __init__(self, rec: Any, param_storages: set[int]) -> None:
        self.rec = rec
        self.param_storages = param_storages
        self.saved: list[tuple[int, int, int, bool]] = []  # (event id, storage key, bytes, is a Parameter's)
        self._ctx: Any = None

    def _pack(self, t: Any) -> Any:
        try:
            key = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # a tensor without storage (sparse, functional wrapper)
            key = id(t)
        self.saved.append((self.rec.next_id, key, t.numel() * t.element_size(), key in self.param_storages))
        return t

    @staticmethod
    def _unpack(t: Any) -> Any:
        return t

    def __enter__(self) -> "SavedTensorTally":
        import torch

        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._ctx.__exit__(*exc)

    def per_event(self, op_events: list[int]) -> dict[int, list[tuple[int, int, bool]]]:
        """event id -> [(storage key, bytes, is a Parameter's), ...], each storage once per op
        (the first saved view of a storage counts, in full). A pack at position p belongs to
        the first op event (sorted `op_events`) with id >= p: source events (a buffer or
        constant first seen as an argument) get their ids before the call's own event."""
        import bisect

        out: dict[int, dict[int, tuple[int, int, bool]]] = {}
        for pos, key, nbytes, is_param in self.saved:
            i = bisect.bisect_left(op_events, pos)
            if i == len(op_events):
                continue  # saved by code after the last recorded call: no op to charge
            out.setdefault(op_events[i], {}).setdefault(key, (key, nbytes, is_param))
        return {eid: list(d.values()) for eid, d in out.items()}


def stamp_autograd_memory(trace: Any, tally: SavedTensorTally, attached: bool) -> None:
    """Write each op's `meta["autograd_memory"]` / `meta["num_autograd_tensors"]` and the
    trace's pinned bytes (kept off the saved file: `trace.cost.__dict__["_pinned"]`)."""
    by_event = tally.per_event(sorted(op.event_id for op in trace._ops.values()
                                      if op.kind == "op" and getattr(op, "event_id", None) is not None))
    by_label: dict[str, list[tuple[int, int, bool]]] = {}
    for op in trace._ops.values():
        rows = by_event.get(getattr(op, "event_id", None), [])
        op.meta["autograd_memory"] = sum(n for _, n, _ in rows)
        op.meta["num_autograd_tensors"] = len(rows)
        by_label[op.label] = rows
    pinned = 0
    if attached:  # payloads that keep their graph pin every op upstream of them (and themselves)
        seen_ops: set[str] = set()
        stack = [op.label for op in trace._ops.values() if op.saved and op.kind not in ("input", "output")]
        while stack:
            label = stack.pop()
            if label in seen_ops or label not in trace._ops:
                continue
            seen_ops.add(label)
            stack.extend(trace._ops[label].parents)
        storages: dict[int, int] = {}
        for label in seen_ops:
            for key, nbytes, is_param in by_label.get(label, ()):
                if not is_param:
                    storages.setdefault(key, nbytes)
        pinned = sum(storages.values())
    trace.cost.__dict__["_pinned"] = pinned
