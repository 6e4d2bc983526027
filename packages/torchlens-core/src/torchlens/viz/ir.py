"""RenderIR: the drawable graph of a Trace (nodes, edges, nested module clusters).

Building it is where depth folding, collapse plans and rolling happen; emitting DOT from
it (`torchlens.viz.dot`) is a separate, mechanical step. Nothing here changes the Trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

from torchlens.viz.units import fmt_count, fmt_shape, fmt_shapes

if TYPE_CHECKING:  # pragma: no cover
    from torchlens.records.op import Op
    from torchlens.records.trace import Trace


@dataclass(slots=True)
class Unit:
    """One thing that draws as a node when nothing folds it: an Op, or a Layer when rolled.

    `keys` are its cluster keys outermost first, root excluded (module call labels such as
    `"encoder:2"`, or module addresses when rolled); `addresses` the matching addresses.
    """

    key: str
    ops: list["Op"]
    keys: tuple[str, ...]
    addresses: tuple[str, ...]


def trace_units(trace: "Trace", rolled: bool) -> list[Unit]:
    units: list[Unit] = []
    if rolled:
        for layer in trace.layers:
            addrs = tuple(a for a in layer.modules if a != "self")
            units.append(Unit(layer.label, list(layer.ops), addrs, addrs))
    else:
        for op in trace:
            pairs = [(c, a) for c, a in zip(op.module_calls, op.modules) if a != "self"]
            units.append(Unit(op.label, [op], tuple(c for c, _ in pairs), tuple(a for _, a in pairs)))
    return units


def fold_index(unit: Unit, depth: int | None, folded: frozenset[str] | set[str]) -> int | None:
    """Index into `unit.keys` of the module that swallows this unit, or None."""
    f = depth - 1 if depth is not None and len(unit.keys) >= depth else None
    if folded:
        for i, a in enumerate(unit.addresses):
            if a in folded:
                if f is None or i < f:
                    f = i
                break
    return f


def drawn_size(units: Iterable[Unit], depth: int | None, folded: frozenset[str] | set[str]) -> int:
    """How many nodes the drawing has under this depth and set of folded modules."""
    seen: set[Any] = set()
    for u in units:
        f = fold_index(u, depth, folded)
        seen.add(u.key if f is None else ("box", u.keys[f]))
    return len(seen)


@dataclass(slots=True)
class RNode:
    id: str
    kind: str  # one of themes.NODE_KINDS
    title: str
    lines: list[str]
    cluster: str | None
    record: Any  # Op, Layer, ModuleCall or Module
    ops: list["Op"] = field(default_factory=list)
    passes: int = 1
    label_html: str | None = None  # a ready-made label (container record nodes)


@dataclass(slots=True)
class RCluster:
    key: str
    parent: str | None
    title: str
    subtitle: str
    level: int
    record: Any


@dataclass
class RenderIR:
    nodes: dict[str, RNode] = field(default_factory=dict)
    edges: dict[tuple[str, str], int] = field(default_factory=dict)
    clusters: dict[str, RCluster] = field(default_factory=dict)
    node_of: dict[str, str] = field(default_factory=dict)  # op label -> node id
    key_of: dict[str, str] = field(default_factory=dict)  # node id -> unit/box key
    stack_rank_groups: list[list[str]] = field(default_factory=list)
    rolled: bool = False
    repeat_runs: list[Any] = field(default_factory=list)  # RepeatRuns drawn as `+N more` nodes
    extra_edges: list[tuple[str, str, dict]] = field(default_factory=list)  # container ties (not data flow)


def op_kind(op: "Op") -> str:
    if op.kind in ("input", "output", "buffer", "constant"):
        return op.kind
    return "param" if op.params else "compute"


def _param_line(trace: "Trace", params: tuple[str, ...]) -> str | None:
    if not params:
        return None
    shapes = []
    for a in params[:3]:
        p = trace._params.get(a)
        shapes.append(fmt_shape(p.shape) if p is not None else a.rsplit(".", 1)[-1])
    more = f", +{len(params) - 3}" if len(params) > 3 else ""
    return "params " + ", ".join(shapes) + more


def _unit_lines(trace: "Trace", unit: Unit, rolled: bool) -> tuple[str, list[str]]:
    op = unit.ops[0]
    title = unit.key
    passes = len(unit.ops)
    if rolled and passes > 1:
        title += f" (x{passes})"
    lines: list[str] = []
    if op.kind in ("input", "output", "buffer"):
        if op.path:
            lines.append(str(op.path))
    else:
        lines.append(op.func_name)
    shapes = {tuple(map(tuple, (s for s in o.shapes if s is not None))) for o in unit.ops}
    if any(s is not None for s in op.shapes):
        lines.append(fmt_shapes(op.shapes) if len(shapes) <= 1 else "shape varies by pass")
    pl = _param_line(trace, op.params)
    if pl:
        lines.append(pl)
    return title, lines


def _module_box(modules: dict, calls: dict, addr: str, call_key: str, rolled: bool) -> tuple[str, str, Any]:
    """(class name, title, record) of a module drawn as a frame or a folded box: rolled, the
    module with its call count; unrolled, the call (`addr:N` titles when it was called again)."""
    mod = modules.get(addr)
    cls = mod.class_name if mod is not None else ""
    if rolled:
        n = mod.num_calls if mod is not None else 1
        return cls, addr + (f" (x{n})" if n > 1 else ""), mod
    many = mod is not None and mod.num_calls > 1
    return cls, call_key if many else addr, calls.get(call_key)


def build_ir(trace: "Trace", units: list[Unit], *, depth: int | None, folded: frozenset[str],
             rolled: bool, progress: Any = None, repeats: list[Any] | None = None) -> RenderIR:
    """Map units to nodes (folding where depth/collapse/fold_repeats say) and ops' edges to
    node edges."""
    ir = RenderIR(rolled=rolled)
    runs = list(repeats or ())
    hidden: dict[str, int] = {}
    for n, run in enumerate(runs):
        for key in run.members[1:]:
            hidden[key] = n
    more_nodes: dict[int, RNode] = {}
    node_by_key: dict[Any, RNode] = {}
    modules = trace._modules
    calls = trace._module_calls
    it = units if progress is None else progress(units, total=len(units), desc="draw: nodes")
    for u in it:
        f = fold_index(u, depth, folded)
        rep = None
        if hidden:
            for level, ck in enumerate(u.keys):
                if ck in hidden:
                    if f is None or level <= f:
                        rep = (level, hidden[ck])
                    break
        if rep is not None:
            ckeys = u.keys[:rep[0]]
        else:
            ckeys = u.keys if f is None else u.keys[:f]
        parent = None
        for level, ck in enumerate(ckeys):
            if ck not in ir.clusters:
                cls, title, rec = _module_box(modules, calls, u.addresses[level], ck, rolled)
                ir.clusters[ck] = RCluster(ck, parent, title, cls, level, rec)
            parent = ck
        cluster = parent
        if rep is not None:
            node = more_nodes.get(rep[1])
            if node is None:
                run = runs[rep[1]]
                node = RNode(f"n{len(ir.nodes)}", "repeat", run.title,
                             [f"{run.span}: {run.class_name}" if run.class_name else run.span,
                              f"{run.num_more} x {fmt_count(run.num_ops)} op{'s' if run.num_ops != 1 else ''}"],
                             cluster, run, [], 1)
                more_nodes[rep[1]] = node
                ir.nodes[node.id] = node
                ir.key_of[node.id] = run.members[1] + "+more"
                ir.repeat_runs.append(run)
            node.ops.extend(u.ops)
        elif f is None:
            node = RNode(f"n{len(ir.nodes)}", op_kind(u.ops[0]), "", [], cluster,
                         u.ops[0] if not rolled else trace._layers[u.key], list(u.ops), len(u.ops))
            node.title, node.lines = _unit_lines(trace, u, rolled)
            ir.nodes[node.id] = node
            ir.key_of[node.id] = u.key
        else:
            bkey = u.keys[f]
            node = node_by_key.get(bkey)
            if node is None:
                cls, title, rec = _module_box(modules, calls, u.addresses[f], bkey, rolled)
                node = RNode(f"n{len(ir.nodes)}", "module", title, [cls], cluster, rec, [], 1)
                node_by_key[bkey] = node
                ir.nodes[node.id] = node
                ir.key_of[node.id] = bkey
            node.ops.extend(u.ops)
        for op in u.ops:
            ir.node_of[op.label] = node.id
    for node in node_by_key.values():
        n_ops = len(node.ops)
        node.lines.append(f"{fmt_count(n_ops)} op{'s' if n_ops != 1 else ''}")
    _elide_single_node_clusters(ir)
    node_of = ir.node_of
    edges = ir.edges
    ops = trace._ops
    for op in trace:
        dst = node_of[op.label]
        for p in op.parents:
            src = node_of.get(p)
            if src is None:
                continue
            if src == dst and (ir.nodes[dst].kind == "repeat" or not (rolled and _recurrent(ir.nodes[dst], ops[p], op))):
                continue  # an edge inside one node (a folded module's internals)
            edges[(src, dst)] = edges.get((src, dst), 0) + 1
    return ir


def _recurrent(node: RNode, parent: "Op", child: "Op") -> bool:
    """On a rolled drawing, whether an edge from `parent` to `child` that lands on one node
    is a recurrence (one pass feeding the next) rather than a folded module's internals."""
    if node.kind != "module":
        return parent.label != child.label
    address = node.record.address if node.record is not None else None

    def call(op: "Op") -> str | None:
        for c, a in zip(op.module_calls, op.modules):
            if a == address:
                return c
        return None

    return call(parent) != call(child)


def _elide_single_node_clusters(ir: RenderIR) -> None:
    """A module frame around a single node is noise: drop it and name the module on the
    node instead (a frame is drawn only around two or more nodes)."""
    count: dict[str, int] = {}
    for node in ir.nodes.values():
        key = node.cluster
        while key is not None:
            count[key] = count.get(key, 0) + 1
            key = ir.clusters[key].parent
    gone = {k for k in ir.clusters if count.get(k, 0) < 2}
    if not gone:
        return
    for node in ir.nodes.values():
        key = node.cluster
        if key in gone:
            c = ir.clusters[key]
            node.lines.append(f"{c.title}: {c.subtitle}" if c.subtitle else c.title)
            while key in gone:
                key = ir.clusters[key].parent
            node.cluster = key
    for k in gone:
        del ir.clusters[k]
