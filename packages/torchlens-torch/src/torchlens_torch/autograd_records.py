"""grad_fn records for `trace.autograd` (core: `torchlens.records.autograd`).

`record_grad_fns(trace, rec, output)` runs once at the end of a capture. It reads nothing
per op during the forward: after the forward it maps each kept output tensor's grad_fn to the
event that produced the tensor (`rec.keep` / `rec.tags`), walks the autograd graph along
`next_functions` (seeded by those grad_fns in forward order, for labels that do not depend on
what the output still reaches), keeps the nodes reachable from the outputs' grad_fns, and
stores plain rows (labels, type names,
edges, forward op labels, parameter addresses) in `trace.provenance.extra["grad_fns"]`, which
is saved with the trace. No autograd object is kept on the trace.

For a `backward_ready` capture it also puts a pre-hook on every recorded node, so each
backward pass through the captured graph appends [label, pass] rows to
`provenance.extra["grad_fn_calls"]` (`trace.autograd.grad_fn_calls`). The hooks hold the
trace through a weak reference and the label only; they live as long as the autograd graph
(a node that takes no hook is listed in `provenance.extra["grad_fn_calls_unhooked"]`).

Limits: nodes not reachable from the outputs (a discarded branch) are not recorded; an
in-place op's output tensor carries the grad_fn of its last writer, so only the last
in-place op on a tensor gets the link (the earlier version's node is recorded with no op).
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import Tensor

from torchlens_torch.values import iter_leaves

FORMAT = 1
EXTRA_KEY = "grad_fns"
CALLS_KEY = "grad_fn_calls"


def record_grad_fns(trace: Any, rec: Any, output: Any) -> None:
    """Store the output's grad_fn graph on `trace` (see the module docstring). A graph this
    walk cannot read (a node type that raises on `next_functions`) leaves no records and
    says why in `trace.autograd.unavailable`, rather than failing the capture."""
    try:
        _record(trace, rec, output)
    except (RuntimeError, AttributeError, TypeError, KeyError) as exc:
        trace.provenance.extra[EXTRA_KEY] = {
            "format": FORMAT, "rows": None,
            "why": f"walking the grad_fn graph failed ({type(exc).__name__}: {exc}); no grad_fn records were kept"}
        trace.provenance.extra.pop(CALLS_KEY, None)


def _record(trace: Any, rec: Any, output: Any) -> None:
    extra = trace.provenance.extra
    roots = []
    for _, t in iter_leaves(output, "output"):
        if isinstance(t, Tensor):
            g = t.grad_fn
            if g is not None and all(g is not r for r in roots):
                roots.append(g)
    if not roots:
        why = ("the capture ran without autograd history (under torch.no_grad() or inference_only, or the output "
               "does not require grad), so there is no grad_fn graph")
        extra[EXTRA_KEY] = {"format": FORMAT, "rows": None, "why": why}
        return
    # grad_fn (by identity; every wrapper is held in `hold` while ids are used) -> producing events;
    # `seeds`: the kept tensors' grad_fns in forward (recording) order
    hold: dict[int, Any] = {}
    owners: dict[int, list[int]] = {}
    seeds: list[Any] = []
    tags = rec.tags
    found: list[tuple[int, Any]] = []  # (event id, grad_fn)
    for t in rec.keep:
        if not isinstance(t, Tensor):
            continue
        g = t.grad_fn
        if g is None:
            continue
        tag = tags.get(id(t))
        if tag is None:
            continue
        found.append((tag[0], g))
    # save="stats" keeps no outs: those freed during the forward left their (grad_fn, tag) behind
    found.extend((tag[0], g) for g, tag in getattr(rec.keep, "dead_grad_owners", ()))
    found.sort(key=lambda pair: pair[0])  # forward order, so labels match a save="all" capture's
    for event, g in found:
        k = id(g)
        if k not in hold:
            hold[k] = g
            seeds.append(g)
        lst = owners.setdefault(k, [])
        if event not in lst:
            lst.append(event)
    label_of_event = {op.event_id: op.label for op in trace._ops.values()}
    param_address = rec.param_address
    # DFS post-order over the whole forward's graph, seeded in forward order, then the roots:
    # a node comes after every node it sends gradient to. Labels count along this order, so
    # a member whose output graph is pruned (an ablation cuts a branch off) still gives the
    # nodes it keeps the labels an unpruned run gives them.
    post: list[Any] = []
    nexts: dict[int, tuple] = {}
    for r in seeds + roots:
        if id(r) in nexts:
            continue
        hold[id(r)] = r
        nexts[id(r)] = r.next_functions
        stack = [(r, iter(nexts[id(r)]))]
        while stack:
            node, it = stack[-1]
            for nxt, _ in it:
                if nxt is not None and id(nxt) not in nexts:
                    hold[id(nxt)] = nxt
                    nf = nexts[id(nxt)] = nxt.next_functions
                    stack.append((nxt, iter(nf)))
                    break
            else:
                stack.pop()
                post.append(node)
    counts: dict[str, int] = {}
    labels: dict[int, str] = {}
    for node in post:
        name = type(node).__name__
        n = counts[name] = counts.get(name, 0) + 1
        labels[id(node)] = f"{name}_{n}"
    # what a backward from the outputs runs: the nodes reachable from the roots
    reach: set[int] = set()
    todo = list(roots)
    while todo:
        node = todo.pop()
        if id(node) in reach:
            continue
        reach.add(id(node))
        todo.extend(m for m, _ in nexts[id(node)] if m is not None and id(m) not in reach)
    post = [node for node in post if id(node) in reach]
    rows = []
    for node in reversed(post):  # topological: roots first
        var = getattr(node, "variable", None) if type(node).__name__ == "AccumulateGrad" else None
        param = None
        ops: list[str] = []
        if var is not None:
            param = param_address.get(id(var))
            tag = tags.get(id(var))  # a model input (or other source) that requires grad
            if param is None and tag is not None and tag[0] in label_of_event:
                ops.append(label_of_event[tag[0]])
        for eid in owners.get(id(node), ()):
            lbl = label_of_event.get(eid)
            if lbl is not None and lbl not in ops:
                ops.append(lbl)
        nxt = [[None if m is None else labels[id(m)], int(i)] for m, i in nexts[id(node)]]
        rows.append([labels[id(node)], type(node).__name__, nxt, ops, param])
    extra[EXTRA_KEY] = {"format": FORMAT, "roots": [labels[id(r)] for r in roots], "rows": rows}
    options = trace.options
    if options is not None and getattr(options, "backward_ready", False):
        _hook_calls(trace, post, labels)


def _hook_calls(trace: Any, nodes: list, labels: dict[int, str]) -> None:
    """A pre-hook per node that appends [label, backward pass] to grad_fn_calls."""
    calls: list = []
    trace.provenance.extra[CALLS_KEY] = calls
    ref = weakref.ref(trace)

    for node in nodes:
        label = labels[id(node)]

        def hook(grad_outputs: Any, label: str = label) -> None:
            t = ref()
            if t is not None:
                calls.append([label, int(t.__dict__.get("_backward_passes", 0)) + 1])

        try:
            node.register_prehook(hook)
        except (AttributeError, RuntimeError):  # a node type that takes no hooks: its runs go unrecorded, named here
            trace.provenance.extra.setdefault("grad_fn_calls_unhooked", []).append(label)


__all__ = ["record_grad_fns"]
