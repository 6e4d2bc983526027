"""The built-in residual-block and MLP recipes.

A residual block is a module containing an attention module whose call returns an add (in
its own code or a wrapper child's), reached from one of its inputs through a chain of adds:
`resid_pre` is that input, `resid_post` the returned add, and `resid_mid` the first add of
the chain that reads `resid_pre` directly (the post-attention residual add). A parallel
block (GPT-NeoX, GPT-J: `x + attn(x) + mlp(x)`) has no such add, so resid_mid is absent,
not guessed. Reshapes of the stream are looked through (OPT flattens it around its MLP).
A post-norm block (BERT: `norm(x + sublayer(x))` per sublayer) returns a norm of the last
add; its resid_mid is the first sublayer's normalized sum, the stream the second sublayer
reads and adds to (TransformerLens's BERT `hook_resid_mid`).

An MLP is a non-attention child of a residual block (or of an attention-free residual
wrapper inside one, T5's `T5LayerFF`) whose output comes from a parameter projection:
`out` is its output, `post` the tensor the output projection read, and `pre` the
projection output that reaches `post` through the activation (a gated MLP's other
projection is `pre_linear`).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torchlens

from torchlens_torch.recipes.attention import is_attention
from torchlens_torch.recipes.dataflow import IDENTITY, child_call_of, direct_child, parent_slot

BLOCK_ID = "torchlens_torch.residual_block"
MLP_ID = "torchlens_torch.mlp"
ADDS = frozenset({"add", "__add__", "__radd__", "add_", "__iadd__"})
NORMS = frozenset({"layer_norm", "rms_norm", "group_norm"})
VIEWS = frozenset({"view", "reshape", "flatten", "unflatten"})


def _descendants(module: Any) -> list[Any]:
    trace = module._trace
    prefix = "" if module.address == "self" else module.address + "."
    return [m for a, m in trace._modules.items() if a != module.address and a.startswith(prefix)]


def contains_attention(module: Any) -> bool:
    return any(is_attention(m) for m in _descendants(module) if m.calls)


def _unview(trace: Any, op: Any, inside: set[str]) -> Any:
    """`op`, or the op it is a reshape of (OPT flattens the stream to `(batch * pos, d)`
    around its MLP and views it back at the end)."""
    for _ in range(4):
        if op.func_name not in VIEWS or op.label not in inside or len(op.parents) != 1:
            break
        op = trace._ops[op.parents[0]]
    return op


def block_anchors(trace: Any, call: Any) -> tuple[Any, Any, Any] | None:
    """(resid_pre op, resid_mid op or None, resid_post op) of a residual block call. The
    adds may sit in the block's own code or in a wrapper child (T5's `T5LayerSelfAttention`
    / `T5LayerFF` each end in their residual add). Reshapes of the stream are looked
    through. A post-norm block (BERT: `norm(x + sublayer(x))`) may end each sublayer in a
    norm of its add: then resid_mid is the first sublayer's normalized sum, the stream the
    second sublayer reads and adds to (TransformerLens's BERT hook_resid_mid)."""
    slots = call.output_slots
    if not slots:
        return None
    inside = set(call.op_labels)
    post = trace._ops[slots[0][0]]
    if post.label not in inside or post.shape is None:
        return None
    size = _numel(post.shape)
    first = _unview(trace, post, inside)
    if first.func_name not in ADDS | NORMS:
        return None
    inputs = set(call.input_labels)
    chain = [first]
    pre = None
    cur = first
    for _ in range(8):
        parents = [trace._ops[p] for p in cur.parents]
        direct = [p for p in parents if p.label in inputs and p.shape is not None and _numel(p.shape) == size]
        if direct and cur.func_name in ADDS:
            pre = direct[0]
            break
        if cur.func_name in NORMS:  # a post-norm: its (single) tensor input is the add it normalizes
            nxt = [p for p in (_unview(trace, q, inside) for q in parents) if p.label in inside
                   and p.func_name in ADDS]
        else:  # an add: follow the one add among its inputs, else the one norm (a post-norm block)
            same = [p for p in (_unview(trace, q, inside) for q in parents) if p.label in inside
                    and p.shape is not None and _numel(p.shape) == size]
            nxt = [p for p in same if p.func_name in ADDS] or [p for p in same if p.func_name in NORMS]
        if len(nxt) != 1:
            return None
        cur = nxt[0]
        chain.append(cur)
    if pre is None:
        return None
    top = next(j for j, a in enumerate(chain) if a.func_name in ADDS)  # the add resid_post comes from
    i = next((j for j, a in enumerate(chain) if j > top and a.func_name in ADDS and pre.label in a.parents), None)
    if i is None:
        return pre, None, post
    mid = chain[i - 1] if chain[i - 1].func_name in NORMS and i - 1 > top else chain[i]
    return pre, mid, post


def _numel(shape: Any) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _block_like(module: Any) -> bool:
    trace = module._trace
    return any(block_anchors(trace, c) is not None for c in module.calls) and contains_attention(module)


def _is_stack(module: Any) -> bool:
    """A stack of blocks (a ViT/CLIP encoder returning its last layer's residual add): its
    call returns what a block-like descendant's call returned. A short stack's chain of adds
    otherwise looks like one block's."""
    for call in module.calls:
        slots = call.output_slots
        if not slots:
            continue
        out = slots[0][0]  # the hidden state (a T5 block also returns its position bias)
        for d in _descendants(module):
            if any(c.output_slots and c.output_slots[0][0] == out for c in d.calls) and _block_like(d):
                return True
    return False


def is_block(module: Any) -> bool:
    """A residual block, and not a residual wrapper inside one (T5's per-sublayer wrappers
    are parts of their T5Block) nor a stack of blocks."""
    if not _block_like(module) or _is_stack(module):
        return False
    parent = called_ancestor(module)
    return not (parent is not None and _block_like(parent) and not _is_stack(parent))


def called_ancestor(module: Any) -> Any:
    """The nearest enclosing module that was called (containers such as ModuleList are not)."""
    trace = module._trace
    address = module.address
    while address not in ("self", ""):
        address = address.rsplit(".", 1)[0] if "." in address else "self"
        m = trace._modules.get(address)
        if m is not None and m.calls:
            return m
    return None


@torchlens.facets.recipe(predicate=is_block, facets=("resid_pre", "resid_mid", "resid_post"), recipe_id=BLOCK_ID,
                         builtin=True)
def residual_block(module: Any) -> dict[str, Any]:
    trace = module._trace
    call = torchlens.facets.current_call(module)
    anchors = block_anchors(trace, call)
    if anchors is None:
        return {}
    pre, mid, post = anchors
    spec = lambda op: torchlens.facets.FacetSpec(home_kind="op", home=op.label, recipe_id=BLOCK_ID,  # noqa: E731
                                                 address=op.module)
    return {"resid_pre": spec(pre), "resid_mid": spec(mid) if mid is not None else None, "resid_post": spec(post)}


def _param_calls(trace: Any, call: Any) -> dict[str, Any]:
    """Direct children of `call` that ran a parameter-reading op: address -> their call."""
    out = {}
    for op in call.ops:
        if op.params and op.module != call.address:
            child = child_call_of(trace, call, op)
            if child is not None:
                out.setdefault(child.address, child)
    return out


def mlp_anchors(trace: Any, call: Any) -> tuple[Any, Any, Any, Any] | None:
    """(pre, pre_linear or None, post, out) ops of an MLP call."""
    slots = call.output_slots
    if len(slots) != 1:
        return None
    out = trace._ops[slots[0][0]]
    projections = _param_calls(trace, call)
    if len(projections) < 2:
        return None
    cur = out
    for _ in range(4):  # through eval-mode dropout and casts to the output projection
        if cur.module != call.address and direct_child(call.address, cur.module) in projections:
            break
        if cur.func_name not in IDENTITY or not cur.parents:
            return None
        cur = trace._ops[cur.parents[0]]
    else:
        return None
    if cur.func_name in NORMS:  # a residual-and-norm tail (BERT's BertOutput), not an output projection
        return None
    out_proj = projections[direct_child(call.address, cur.module)]
    if not out_proj.input_labels:
        return None
    post = trace._ops[out_proj.input_labels[0]]
    inside = set(call.op_labels)
    dist = {post.label: 0}
    queue = deque([post])
    found: list[tuple[int, Any]] = []
    while queue:
        op = queue.popleft()
        child = direct_child(call.address, op.module) if op.module != call.address else None
        if child in projections and child != out_proj.address:
            pc = projections[child]
            if op.label in pc.output_labels:
                found.append((dist[op.label], op))
                continue
        for p in op.parents:
            if p in inside and p not in dist:
                dist[p] = dist[op.label] + 1
                queue.append(trace._ops[p])
    if not found or post.label in {op.label for _, op in found}:
        return None
    found.sort(key=lambda t: -t[0])
    pre = found[0][1]
    pre_linear = found[1][1] if len(found) > 1 else None
    return pre, pre_linear, post, out


def fused_gate(trace: Any, call: Any, pre: Any, post: Any) -> tuple[list[int], int, int, int] | None:
    """A gated MLP with one fused gate/up projection (Phi-3's `gate_up_proj`): the projection
    output is split in two, one half goes through the activation and the other multiplies it
    directly. Returns (section sizes, split dim, gate slot, up slot), else None."""
    inside = set(call.op_labels)
    splits = [trace._ops[c] for c in pre.children if c in inside]
    splits = [o for o in splits if o.func_name in ("chunk", "split", "split_with_sizes", "tensor_split")
              and o.shapes and len(o.shapes) == 2]
    if len(splits) != 1 or not pre.shapes or splits[0].label not in post.parents:
        return None
    sp = splits[0]
    shape, outs = tuple(pre.shapes[0]), [tuple(o) for o in sp.shapes]
    dims = [d for d in range(len(shape)) if len(outs[0]) == len(shape) and outs[0][d] != shape[d]]
    if len(dims) != 1 or post.parents.count(sp.label) != 1:
        return None
    d = dims[0]
    up = parent_slot(post, sp.label)
    return [o[d] for o in outs], d - len(shape), 1 - up, up


def is_mlp(module: Any) -> bool:
    trace = module._trace
    if module.parent is None or not module.calls:
        return False
    parent = called_ancestor(module)
    if parent is None or is_attention(module) or contains_attention(module):
        return False
    if not is_block(parent):
        # a residual wrapper inside a block (T5's `T5LayerFF` around `DenseReluDense`): the
        # wrapper's enclosing block counts, when the wrapper holds no attention itself
        outer = called_ancestor(parent)
        if outer is None or contains_attention(parent) or not is_block(outer):
            return False
    return any(mlp_anchors(trace, c) is not None for c in module.calls)


@torchlens.facets.recipe(predicate=is_mlp, facets=("pre", "pre_linear", "post", "out"), recipe_id=MLP_ID, builtin=True)
def mlp(module: Any) -> dict[str, Any]:
    trace = module._trace
    call = torchlens.facets.current_call(module)
    anchors = mlp_anchors(trace, call)
    if anchors is None:
        return {}
    pre, pre_linear, post, out = anchors
    spec = lambda op: torchlens.facets.FacetSpec(home_kind="op", home=op.label, recipe_id=MLP_ID,  # noqa: E731
                                                 address=op.module)
    fused = fused_gate(trace, call, pre, post) if pre_linear is None else None
    if fused is not None:  # pre is the gate half of the fused projection, pre_linear the up half
        sizes, dim, gate, up = fused
        halves = spec(pre).split(sizes, dim=dim)
        return {"pre": halves[gate], "pre_linear": halves[up], "post": spec(post), "out": spec(out)}
    return {"pre": spec(pre), "pre_linear": spec(pre_linear) if pre_linear is not None else None, "post": spec(post),
            "out": spec(out)}


__all__ = ["residual_block", "mlp", "block_anchors", "mlp_anchors", "is_block", "is_mlp"]
