"""Reading a module call's captured dataflow: which ops a module ran itself, which child
module fed a tensor, and the structural path (split, head reshape, slice) between them.

The built-in recipes find attention, residual and MLP structure from these facts alone:
the op names torch recorded, the module each op ran in, the output slots and shapes. They
never search module names.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torchlens
from torchlens.backends.sdk import ArgRef

#: ops that pass a value through unchanged (eval dropout, dtype casts, contiguous copies)
IDENTITY = frozenset({"contiguous", "clone", "dropout", "to", "type", "float", "detach"})
MATMULS = frozenset({"matmul", "bmm", "einsum", "__matmul__", "baddbmm"})
SCORE_ELEMENTWISE = frozenset({"mul", "div", "truediv", "__truediv__", "add", "__add__", "__mul__", "where",
                               "masked_fill", "to", "type", "float", "add_", "iadd", "__iadd__", "sub"})


def is_inside(address: str, op_module: str | None) -> bool:
    """True when an op's innermost module is `address` or one of its descendants."""
    if op_module is None:
        return False
    return address == "self" or op_module == address or op_module.startswith(address + ".")


def direct_child(address: str, op_module: str) -> str:
    """The direct child of `address` an op of `op_module` (a strict descendant) ran in."""
    rest = op_module if address == "self" else op_module[len(address) + 1:]
    head = rest.split(".")[0]
    return head if address == "self" else f"{address}.{head}"


def own_ops(call: Any) -> list[Any]:
    """The ops a module call ran in its own code (not inside a child module)."""
    return [op for op in call.ops if op.module == call.address]


def arg_value(trace: Any, op: Any, ref: Any) -> Any:
    """The value an argument template's ArgRef stands for (a parent's output or a parameter)."""
    if not isinstance(ref, ArgRef):
        return ref
    if ref.address is not None:
        rec = trace._params.get(ref.address) or trace._buffers.get(ref.address)
        return None if rec is None else rec.value
    label = op.parents[ref.index]
    slot = op.parent_slots[ref.index][1] if op.parent_slots else 0
    return trace._ops[label].outs[slot]


def parent_slot(op: Any, parent_label: str) -> int:
    for i, p in enumerate(op.parents):
        if p == parent_label:
            return op.parent_slots[i][1] if op.parent_slots else 0
    return 0


def child_call_of(trace: Any, call: Any, op: Any) -> Any:
    """The call of `call`'s direct child module that ran `op`."""
    address = direct_child(call.address, op.module)
    child = trace._modules[address]
    for c in child.calls:
        if op.label in c.op_labels:
            return c
    return None


def find_source(trace: Any, call: Any, start: Any) -> tuple[Any, list[Any]] | None:
    """Walk back from `start` inside `call` to the nearest op that ran in a child module or
    read a parameter (a projection). Returns (that op, the path from it to `start`)."""
    inside = set(call.op_labels)
    ops = trace._ops
    came_from: dict[str, str | None] = {start.label: None}
    queue = deque([start.label])
    found = None
    while queue:
        label = queue.popleft()
        op = ops[label]
        if op.module != call.address or op.params:
            found = op
            break
        for p in op.parents:
            if p in inside and p not in came_from:
                came_from[p] = label
                queue.append(p)
    if found is None:
        return None
    path = [found]
    nxt = came_from[found.label]
    while nxt is not None:
        path.append(ops[nxt])
        nxt = came_from[nxt]
    return found, path


def _basic_key(key: Any) -> bool:
    items = key if isinstance(key, tuple) else (key,)
    return all(k is Ellipsis or k is None or isinstance(k, (int, slice)) for k in items)


def path_spec(spec: Any, path: list[Any], home_shape: tuple[int, ...],
              d_head: int | None = None) -> tuple[Any, tuple[int, ...], bool]:
    """Translate the structural prefix of `path` (ops after its first) into FacetSpec
    primitives: a split / chunk section, a basic slice, a `(..., n_heads, d_head)` view, and
    the transposes between them (undone at the end, so the facet keeps the projection's
    `(..., pos, heads, d_head)` layout). A cut must keep whole heads (a multiple of
    `d_head`): a RoPE half-slice ends the path. Stops at the first other op (RoPE
    arithmetic, a cat, the attention core). Returns (spec, shape reached, whether a head
    view was applied)."""
    shape = tuple(home_shape)
    headed = False
    pending: list[tuple[int, int]] = []  # transposes seen but not yet needed
    applied: list[tuple[int, int]] = []  # transposes written into the chain (undone at the end)

    def whole_heads(width: int) -> bool:
        return d_head is None or (width > 0 and width % d_head == 0)

    def flush() -> None:
        nonlocal spec
        for d0, d1 in pending:
            spec = spec.transpose(d0, d1)
            applied.append((d0, d1))
        pending.clear()

    for i, op in enumerate(path[1:], start=1):
        f = op.func_name
        # the output slot of `op` the next op on the path read (a split's section)
        slot = parent_slot(path[i + 1], op.label) if i + 1 < len(path) else 0
        if f in IDENTITY and op.shapes and tuple(op.shapes[0]) == shape:
            continue
        if f in ("transpose", "swapaxes") and op.args_template and len(op.args_template) >= 3:
            d0, d1 = (int(d) for d in op.args_template[1:3])
            n = len(shape)
            d0, d1 = (d0 if d0 < 0 else d0 - n), (d1 if d1 < 0 else d1 - n)
            if -1 in (d0, d1):
                break
            pending.append((d0, d1))
            shape = tuple(op.shapes[0])
            continue
        if f in ("split", "chunk", "tensor_split", "split_with_sizes") and op.shapes and len(op.shapes) > 1:
            outs = [tuple(s) for s in op.shapes]
            dims = [d for d in range(len(shape)) if outs[0][d] != shape[d]] if len(outs[0]) == len(shape) else []
            if len(dims) != 1:
                break
            d = dims[0]
            sizes = tuple(o[d] for o in outs)
            if sum(sizes) != shape[d] or (d == len(shape) - 1 and not whole_heads(sizes[slot])):
                break
            flush()
            spec = spec.split(list(sizes), dim=d - len(shape))[slot]
            shape = outs[slot]
            continue
        if f == "__getitem__" and op.args_template and len(op.args_template) > 1 and _basic_key(op.args_template[1]):
            out = tuple(op.shapes[0])
            if len(out) != len(shape) or not whole_heads(out[-1]):
                break
            flush()
            spec = spec[op.args_template[1]]
            shape = out
            continue
        if f in ("view", "reshape", "unflatten") and op.shapes and not pending:
            out = tuple(op.shapes[0])
            if len(out) == len(shape) + 1 and out[:-2] == shape[:-1] and out[-2] * out[-1] == shape[-1]:
                spec = spec.heads(out[-2], out[-1])
                shape, headed = out, True
                continue
            if out == shape:
                continue
        break
    for d0, d1 in reversed(applied):
        spec = spec.transpose(d0, d1)
    if applied:
        shape = tuple(spec.read(_ShapeOnly(home_shape)).shape)
    return spec, shape, headed


class _ShapeOnly:
    """A stand-in value to compute a chain's output shape without a payload."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        import numpy as np

        self._a = np.broadcast_to(np.zeros((), dtype=np.int8), tuple(shape))
        self.shape = self._a.shape

    def __getitem__(self, key: Any) -> "_ShapeOnly":
        return _ShapeOnly(self._a[key].shape)

    def reshape(self, shape: Any) -> "_ShapeOnly":
        return _ShapeOnly(self._a.reshape(shape).shape)

    def swapaxes(self, a: int, b: int) -> "_ShapeOnly":
        return _ShapeOnly(self._a.swapaxes(a, b).shape)


def projection_spec(trace: Any, call: Any, start: Any, n_heads: int, d_head: int, recipe_id: str) -> Any:
    """The facet spec of the projection feeding `start` (a tensor in `(..., heads, pos,
    d_head)` attention layout): anchored on the projection's output, cut to this tensor's
    columns, viewed as `(..., pos, heads, d_head)`. None when no projection is found."""
    found = find_source(trace, call, start)
    if found is None:
        return None
    src, path = found
    if src.label == start.label:
        return None
    if src.module != call.address:
        child = child_call_of(trace, call, src)
        kind = "module_output" if child is not None and src.label in child.output_labels else "op"
        address = child.address if child is not None else src.module
    else:
        kind, address = "op", src.module
    slot = parent_slot(path[1], src.label) if len(path) > 1 else 0
    spec = torchlens.facets.FacetSpec(home_kind=kind, home=src.label, slot=slot if src.multi_output else None,
                                      recipe_id=recipe_id, address=address)
    home_shape = tuple(src.shapes[slot]) if src.shapes else ()
    spec, shape, headed = path_spec(spec, path, home_shape, d_head)
    if not headed:
        if not shape or shape[-1] % d_head:
            return None
        spec = spec.heads(shape[-1] // d_head, d_head)
    return spec


def forward_to_projection(trace: Any, call: Any, start: Any) -> Any:
    """From `start`, follow children inside `call` through structural ops to the first op
    in a child module or reading a parameter (an output projection); None if ambiguous."""
    inside = set(call.op_labels)
    ops = trace._ops
    cur = start
    for _ in range(12):
        nxt = [ops[c] for c in cur.children if c in inside]
        proj = [o for o in nxt if o.module != call.address or o.params]
        if len(proj) == 1:
            return proj[0]
        structural = [o for o in nxt if o.func_name in IDENTITY | {"transpose", "reshape", "view", "permute",
                                                                   "flatten"}]
        if not structural:
            return None
        # a contiguous() whose result is unused next to the real reshape: follow the one with children
        structural.sort(key=lambda o: -len([c for c in o.children if c in inside]))
        cur = structural[0]
    return None


__all__ = ["own_ops", "arg_value", "find_source", "path_spec", "projection_spec", "forward_to_projection",
           "child_call_of", "is_inside", "direct_child", "IDENTITY", "MATMULS", "SCORE_ELEMENTWISE"]
