"""Structural alignment of Bundle members: graph-shape hashes, the parameter floor, input
equality, and which op labels line up between two traces.

An op's structural signature is what a run on other input values of the same shapes keeps:
its label, callable name, kind, parent labels, output shapes and dtypes, and the parameter
addresses it reads. The graph-shape hash is the sha256 of every op's signature in execution
order, so equal hashes mean every label names the same computation in both members. The
parameter floor (`same_param_shapes`) compares parameter addresses, shapes and dtypes only,
never values. Payload values reach NumPy only through the member's backend `host_copy`.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np


def host_array(trace: Any, value: Any) -> np.ndarray | None:
    """A NumPy copy of one payload through the trace's backend; None for a value that is not
    an array (None, a string, a placeholder)."""
    if isinstance(value, np.ndarray):
        return value
    backend = getattr(trace, "_backend", None)
    if backend is not None:
        try:
            if backend.is_tensor(value):
                return np.asarray(backend.host_copy(value))
        except Exception:  # a backend that cannot judge a foreign value: not an array
            return None
    if isinstance(value, (bool, int, float, complex, np.generic)):
        return np.asarray(value)
    return None


def payload_arrays(trace: Any, op: Any, on: str) -> list[np.ndarray] | None:
    """The op's output (on="out") or gradient (on="grad") slots as host arrays, or None when
    it was not saved or a slot is not an array."""
    if on == "out":
        if not op.saved:
            return None
        slots = op._outputs or ()
    else:
        if op.grads is None:
            return None
        slots = op.grads
    arrays = [host_array(trace, v) for v in slots]
    if not arrays or any(a is None for a in arrays):
        return None
    return arrays


def joined(arrays: list[np.ndarray]) -> np.ndarray:
    """Several slots (or passes) as one flat vector, in order."""
    if len(arrays) == 1:
        return arrays[0]
    return np.concatenate([np.asarray(a).reshape(-1) if not np.iscomplexobj(a) else
                           np.stack([a.real, a.imag], -1).reshape(-1) for a in arrays])


def op_signature(op: Any) -> list[Any]:
    return [op.label, op.func_name, op.kind, list(op.parents), [list(s) if s is not None else None for s in op.shapes or ()],
            list(op.dtypes or ()), list(op.params or ())]


def graph_shape_hash(trace: Any) -> str:
    """sha256 over every op's structural signature, in execution order."""
    h = hashlib.sha256()
    for op in trace._ops.values():
        h.update(json.dumps(op_signature(op), separators=(",", ":"), default=str).encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()


def param_shapes(trace: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    return {a: (tuple(p.shape), str(p.dtype)) for a, p in trace._params.items()}


def inputs_equal(ta: Any, tb: Any) -> bool | None:
    """True when both members' model inputs hold the same values (dtype, shape and every
    element); False when they provably differ; None when a payload was not saved."""
    ia, ib = ta.input_ops, tb.input_ops
    if [o.label for o in ia] != [o.label for o in ib]:
        return False
    for oa, ob in zip(ia, ib):
        xa, xb = payload_arrays(ta, oa, "out"), payload_arrays(tb, ob, "out")
        if xa is None or xb is None:
            return None
        if len(xa) != len(xb):
            return False
        for u, v in zip(xa, xb):
            if u.dtype != v.dtype or u.shape != v.shape or not np.array_equal(u, v):
                return False
    return True


def _local(op: Any) -> tuple:
    return (op.func_name, op.kind, tuple(tuple(s) if s is not None else None for s in op.shapes or ()),
            tuple(op.dtypes or ()))


def aligned_labels(ta: Any, tb: Any, same_graph: bool) -> list[str]:
    """Op labels that line up, in `ta`'s execution order: every label when the graph-shape
    hashes are equal, else the labels both hold with the same callable, kind, shapes and dtypes."""
    if same_graph:
        return list(ta._ops)
    out = []
    for label, op in ta._ops.items():
        other = tb._ops.get(label)
        if other is not None and _local(op) == _local(other):
            out.append(label)
    return out


def input_token_stream(trace: Any) -> np.ndarray | None:
    """The derived input-stream binding of a batch-of-one capture: the token ids of its first
    integer-dtype input, shaped (1, T) and saved; None when there is no such stream."""
    for op in trace.input_ops:
        arrays = payload_arrays(trace, op, "out")
        if arrays is None or len(arrays) != 1:
            continue
        ids = arrays[0]
        if ids.dtype.kind in "iu" and ids.ndim == 2 and ids.shape[0] == 1:
            return ids[0]
    return None


def descendants(trace: Any, label: str) -> set[str]:
    """Every op label reachable from `label` along the recorded dataflow edges."""
    seen: set[str] = set()
    stack = [label]
    while stack:
        cur = stack.pop()
        for child in trace._ops[cur].children:
            if child not in seen:
                seen.add(child)
                stack.append(child)
    return seen


__all__ = ["host_array", "payload_arrays", "joined", "graph_shape_hash", "param_shapes", "inputs_equal",
           "aligned_labels", "descendants", "op_signature", "input_token_stream"]
