"""grad_fn records for `trace.autograd` (core: `torchlens.records.autograd`).

`record_grad_fns(trace, rec, output)` runs once at the end of a capture. It reads nothing
per op during the forward. After the forward it takes the outputs' grad_fns (the roots) and
maps each kept output tensor's grad_fn to the event that produced the tensor (`rec.keep` /
`rec.tags`): the seeds. The walk (`_Walk`) then follows `next_functions` from the seeds in
forward order (for labels that do not depend on what the output still reaches) and the roots,
keeps the nodes reachable from the roots, and stores plain rows (labels, type names, edges,
forward op labels, parameter addresses) in `trace.provenance.extra["grad_fns"]`, which is
saved with the trace.

The walk is deferred to the first read (`Provenance.settle_extra()`: a `trace.autograd`
read, a backward or combined drawing, a save or export, a pickle, `trace.cleanup()`)
when holding its roots and seeds keeps nothing alive that the trace does not hold already:
a `save="all"` capture whose payloads are not detached (`save_mode` "copy" or "reference")
holds every kept tensor, and so every seed's graph. The deferred walk holds the root and seed
nodes themselves (not the tensors: an output changed in place afterwards, or a backward run
before the first read, does not change the records; `next_functions` and
`AccumulateGrad.variable` stay readable after a backward). Every other capture walks at once,
as before: its seeds may be nodes of a branch the output does not reach (their saved
activations would otherwise outlive the capture), and a `backward_ready` capture hooks its
nodes before any backward can run.

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

import torch
from torch import Tensor

from torchlens_torch.values import iter_leaves

FORMAT = 1
EXTRA_KEY = "grad_fns"
CALLS_KEY = "grad_fn_calls"
#: where a deferred walk waits: `trace.provenance.__dict__[PENDING_KEY][EXTRA_KEY]`, run by core's
#: `Provenance.settle_extra()` (every reader of the records calls it first)
PENDING_KEY = "_deferred_extra"
_ERRORS = (RuntimeError, AttributeError, TypeError, KeyError)


def record_grad_fns(trace: Any, rec: Any, output: Any, *, defer: bool | None = None) -> None:
    """Store the output's grad_fn graph on `trace` (see the module docstring): at once, or on
    the first read where deferring keeps nothing alive the trace does not hold (`defer=None`:
    decided from `trace.options`; True/False force it, for tests and benchmarks). A graph
    this walk cannot read (a node type that raises on `next_functions`) leaves no records and
    says why in `trace.autograd.unavailable`, rather than failing the capture or the read."""
    prov = trace.provenance
    pending = prov.__dict__.get(PENDING_KEY)
    if pending:
        pending.pop(EXTRA_KEY, None)
    try:
        walk = _prepare(trace, rec, output)
    except _ERRORS as exc:
        _failed(trace, exc)
        return
    if walk is None:
        return
    if defer is None:
        defer = _holds_every_seed(trace.options, rec)
    if defer:
        prov.__dict__.setdefault(PENDING_KEY, {})[EXTRA_KEY] = walk
    else:
        walk()


def _holds_every_seed(options: Any, rec: Any) -> bool:
    """Whether the trace's own payloads keep every seed node alive (so a deferred walk holds
    nothing more): save="all" with payloads attached to the graph (a save="stats" capture runs
    as save="all" here but folds its payloads and keeps tensors weakly: `rec.keep` is then not
    a list), and no backward hooks to place."""
    return (type(rec.keep) is list and rec.save_payloads and options is not None
            and getattr(options, "save", None) == "all"
            and not getattr(options, "detach_saved_activations", True)
            and getattr(options, "save_mode", "view") in ("copy", "reference")
            and not getattr(options, "backward_ready", True) and not getattr(options, "save_grads", True))


def _failure(exc: BaseException) -> dict:
    return {"format": FORMAT, "rows": None,
            "why": f"walking the grad_fn graph failed ({type(exc).__name__}: {exc}); no grad_fn records were kept"}


def _failed(trace: Any, exc: BaseException) -> None:
    trace.provenance.extra[EXTRA_KEY] = _failure(exc)
    trace.provenance.extra.pop(CALLS_KEY, None)


def _prepare(trace: Any, rec: Any, output: Any) -> _Walk | None:
    """The roots and seeds, read now (what the tensors carry at the end of the forward); None,
    with the reason stored, when the output has no grad history."""
    roots: list[Any] = []
    for _, t in iter_leaves(output, "output"):
        if isinstance(t, Tensor):
            g = t.grad_fn
            if g is not None and all(g is not r for r in roots):
                roots.append(g)
    if not roots:
        why = ("the capture ran without autograd history (under torch.no_grad() or inference_only, or the output "
               "does not require grad), so there is no grad_fn graph")
        trace.provenance.extra[EXTRA_KEY] = {"format": FORMAT, "rows": None, "why": why}
        return None
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
    # Everything else the walk reads is taken now, so a deferred walk reads no state that can
    # change afterwards: the op labels of the events, the parameter addresses (a copy: the
    # model description is cached and reused) and the tags (this capture's own dict; it keys
    # the leaf tensors an AccumulateGrad node holds, which that node keeps alive).
    label_of_event = {op.event_id: op.label for op in trace._ops.values()}
    return _Walk(trace, roots, found, dict(rec.param_address), tags, label_of_event)


class _Walk:
    """The records from the roots and seeds: the DFS over the graph, labels and rows, stored
    in the trace's `provenance.extra`. Deferred, it holds the root and seed nodes (see the
    module docstring), the provenance weakly (forks share it) and no tensor; it runs once."""

    __slots__ = ("prov_ref", "trace_ref", "args")

    def __init__(self, trace: Any, *args: Any) -> None:
        self.prov_ref = weakref.ref(trace.provenance)
        self.trace_ref = weakref.ref(trace)  # for the backward hooks of an eager backward_ready walk only
        self.args: tuple | None = args

    def __call__(self) -> None:
        prov, args, self.args = self.prov_ref(), self.args, None
        if prov is None or args is None:
            return
        try:
            post, labels = _walk(prov.extra, *args)
        except _ERRORS as exc:
            prov.extra[EXTRA_KEY] = _failure(exc)
            prov.extra.pop(CALLS_KEY, None)
            return
        trace = self.trace_ref()
        options = None if trace is None else trace.options
        if options is not None and getattr(options, "backward_ready", False):
            _hook_calls(trace, post, labels)


def _walk(extra: dict, roots: list, found: list, param_address: dict, tags: dict,
          label_of_event: dict) -> tuple[list, dict]:
    # Nodes are keyed by the node objects themselves: autograd nodes hash and compare by
    # identity, and a node's Python object stays the same while one is held (the dicts hold
    # every node they key). `owners`: grad_fn -> producing events, its keys the seeds in
    # forward (recording) order.
    owners: dict[Any, list[int]] = {}
    for event, g in sorted(found, key=_first):  # forward order, so labels match a save="all" capture's
        lst = owners.get(g)
        if lst is None:
            owners[g] = [event]
        elif event not in lst:
            lst.append(event)
    # DFS post-order over the whole forward's graph, seeded in forward order, then the roots:
    # a node comes after every node it sends gradient to. Labels count along this order, so
    # a member whose output graph is pruned (an ablation cuts a branch off) still gives the
    # nodes it keeps the labels an unpruned run gives them.
    post: list[Any] = []
    nexts: dict[Any, tuple] = {}
    for r in (*owners, *roots):
        if r in nexts:
            continue
        nf = nexts[r] = r.next_functions
        stack = [(r, iter(nf))]
        while stack:
            node, it = stack[-1]
            for nxt, _ in it:
                if nxt is not None and nxt not in nexts:
                    nf = nexts[nxt] = nxt.next_functions
                    stack.append((nxt, iter(nf)))
                    break
            else:
                stack.pop()
                post.append(node)
    counts: dict[str, int] = {}
    labels: dict[Any, str] = {}
    names: dict[Any, str] = {}
    for node in post:
        name = names[node] = type(node).__name__
        n = counts[name] = counts.get(name, 0) + 1
        labels[node] = f"{name}_{n}"
    # what a backward from the outputs runs: the nodes reachable from the roots
    reach: set[Any] = set()
    todo = list(roots)
    while todo:
        node = todo.pop()
        if node in reach:
            continue
        reach.add(node)
        todo.extend(m for m, _ in nexts[node] if m is not None and m not in reach)
    post = [node for node in post if node in reach]
    rows = []
    for node in reversed(post):  # topological: roots first
        name = names[node]
        ops: list[str] = []
        param = None
        if name == "AccumulateGrad":
            var = getattr(node, "variable", None)
            if var is not None:
                param = param_address.get(id(var))
                tag = tags.get(id(var))  # a model input (or other source) that requires grad
                if param is None and tag is not None and tag[0] in label_of_event:
                    ops.append(label_of_event[tag[0]])
        for eid in owners.get(node, ()):
            lbl = label_of_event.get(eid)
            if lbl is not None and lbl not in ops:
                ops.append(lbl)
        nxt = [[None if m is None else labels[m], int(i)] for m, i in nexts[node]]
        rows.append([labels[node], name, nxt, ops, param])
    extra[EXTRA_KEY] = {"format": FORMAT, "roots": [labels[r] for r in roots], "rows": rows}
    return post, labels


def _first(pair: tuple) -> Any:
    return pair[0]


def _hook_calls(trace: Any, nodes: list, labels: dict[Any, str]) -> None:
    """A pre-hook per node that appends [label, backward pass] to grad_fn_calls.

    torch keeps one AccumulateGrad node per parameter while it is alive, so captures of the
    same model share those nodes, and a backward through another graph (another capture's,
    or a loss on the parameter itself) runs them too. An AccumulateGrad run is recorded only
    in a backward (graph task) that has already run one of this capture's other nodes: every
    path from a loss through this graph to a parameter passes one, and the engine runs a node
    only after all nodes that feed it."""
    calls: list = []
    trace.provenance.extra[CALLS_KEY] = calls
    ref = weakref.ref(trace)
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    ours: set = set()  # the graph tasks that ran one of this capture's non-AccumulateGrad nodes

    for node in nodes:
        label = labels[node]
        if type(node).__name__ != "AccumulateGrad" or task_id is None:
            def hook(grad_outputs: Any, label: str = label) -> None:
                t = ref()
                if t is not None:
                    if task_id is not None:
                        ours.add(task_id())
                    calls.append([label, int(t.__dict__.get("_backward_passes", 0)) + 1])
        else:
            def hook(grad_outputs: Any, label: str = label) -> None:
                t = ref()
                if t is not None and task_id() in ours:
                    calls.append([label, int(t.__dict__.get("_backward_passes", 0)) + 1])

        try:
            node.register_prehook(hook)
        except (AttributeError, RuntimeError):  # a node type that takes no hooks: its runs go unrecorded, named here
            trace.provenance.extra.setdefault("grad_fn_calls_unhooked", []).append(label)


__all__ = ["record_grad_fns"]
