"""Container structure on a drawing: `Trace.draw(show_containers="collapsed" | "nodes")`.

A model's inputs and outputs arrive as containers (dicts, lists, tuples) whose tensor leaves
are separate `input_N` / `output_N` ops; `op.path` says where each leaf sits
(`args[1][0]`, `output['o'][3]`). Rendering only: nothing here changes the Trace.

- "collapsed": leaves of one container that share their shape and dtype, more than
  `container_max_inline` of them, fold into one dashed summary node.
- "nodes": "collapsed" plus one dashed record node per container (one field per key),
  grey keyed edges from an input container to its leaves (sources) and from output leaves
  to their container (sinks), nested containers tied the same way, and for a module call
  that returned a tuple mid-graph, a record node with dashed member-of ties from the node
  that made each leaf.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from torchlens.viz.dot import LINE_PT, TITLE_PT, TUPLE_BOX, esc
from torchlens.viz.ir import RCluster, RenderIR, RNode
from torchlens.viz.units import fmt_shapes

if TYPE_CHECKING:  # pragma: no cover
    from torchlens.records.trace import Trace

_KEY = re.compile(r"\[(?:'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|[^\[\]]*)\]")
LEAF_KINDS = ("input", "output")
TIE_COLOR = "#8c959f"


def split_path(path: str) -> tuple[str, tuple[str, ...]]:
    """`"output['o'][3]"` -> `("output", ("['o']", "[3]"))`."""
    keys = tuple(m.group(0) for m in _KEY.finditer(path))
    root = path[: len(path) - len("".join(keys))] if keys and path.endswith("".join(keys)) else path
    if not keys or root + "".join(keys) != path:
        return path, ()
    return root, keys


def leaf_keys(op: Any) -> tuple[str, tuple[str, ...]]:
    """(outermost container, keys below it) of a leaf: the positional/keyword argument
    list of the call is not a container the user built, so `args[1][0]` sits in `args[1]`."""
    root, keys = split_path(str(op.path or ""))
    if op.kind == "input" and root in ("args", "kwargs") and keys:
        root, keys = root + keys[0], keys[1:]
    return root, keys


def _leaves(trace: "Trace") -> list[Any]:
    return [op for op in trace if op.kind in LEAF_KINDS and op.path and leaf_keys(op)[1]]


def fold_leaves(trace: "Trace", ir: RenderIR, max_inline: int) -> list[tuple[str, int]]:
    """Fold each same-shape group of more than `max_inline` leaves of one container into a
    summary node; returns (container path, leaves folded) per fold."""
    groups: dict[tuple, list[Any]] = {}
    for op in _leaves(trace):
        root, keys = leaf_keys(op)
        groups.setdefault((op.kind, root + "".join(keys[:-1]), tuple(op.shapes), tuple(op.dtypes)), []).append(op)
    folds: dict[str, RNode] = {}  # old node id -> summary node
    done: list[tuple[str, int]] = []
    for (kind, container, shapes, _), ops in groups.items():
        if len(ops) <= max_inline:
            continue
        ids = [ir.node_of[op.label] for op in ops]
        if len(set(ids)) != len(ids) or any(ir.nodes[i].kind != kind for i in ids):
            continue  # already folded some other way
        first, last = leaf_keys(ops[0])[1][-1], leaf_keys(ops[-1])[1][-1]
        node = RNode(f"k{len(done)}", "container", f"{container} x{len(ops)}",
                     [f"{kind} leaves {first} .. {last}", fmt_shapes(list(shapes)) if shapes else ""],
                     None, ("folded leaves", first, last), list(ops), 1)
        node.lines = [line for line in node.lines if line]
        for i in ids:
            folds[i] = node
        done.append((container, len(ops)))
    if folds:
        _merge(ir, folds)
    return done


def _merge(ir: RenderIR, folds: dict[str, RNode]) -> None:
    nodes: dict[str, RNode] = {}
    for nid, node in ir.nodes.items():
        new = folds.get(nid)
        if new is None:
            nodes[nid] = node
        elif new.id not in nodes:
            nodes[new.id] = new
            ir.key_of[new.id] = new.title
    for nid in folds:
        ir.key_of.pop(nid, None)
    ir.nodes = nodes
    for label, nid in list(ir.node_of.items()):
        if nid in folds:
            ir.node_of[label] = folds[nid].id
    edges: dict[tuple[str, str], int] = {}
    for (s, d), n in ir.edges.items():
        s2 = folds[s].id if s in folds else s
        d2 = folds[d].id if d in folds else d
        if s2 != d2:
            edges[(s2, d2)] = edges.get((s2, d2), 0) + n
    ir.edges = edges


def _record_label(title: str, keys: list[str]) -> str:
    sep = ' BORDER="1" SIDES="L"'  # a rule between fields, none before the first
    cells = "".join(f'<TD{sep if i else ""} PORT="k{i}"><FONT POINT-SIZE="{LINE_PT}">{esc(k)}</FONT></TD>'
                    for i, k in enumerate(keys))
    return (f'<<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="0" CELLPADDING="3">'
            f'<TR><TD COLSPAN="{max(len(keys), 1)}"><FONT POINT-SIZE="{TITLE_PT}"><B>{esc(title)}</B></FONT></TD></TR>'
            f'<TR>{cells}</TR></TABLE>>')


def container_nodes(trace: "Trace", ir: RenderIR) -> int:
    """Add the record nodes and their ties (show_containers="nodes"); returns how many."""
    tree: dict[tuple[str, str], list[str]] = {}  # (kind, container path) -> its keys in order
    leaf_of: dict[tuple[str, str, str], list[str]] = {}  # (kind, container, key) -> node ids
    for op in _leaves(trace):
        root, keys = leaf_keys(op)
        nid = ir.node_of.get(op.label)
        rec = ir.nodes[nid].record if nid is not None else None
        if isinstance(rec, tuple) and rec and rec[0] == "folded leaves":  # one field for the folded range
            keys = keys[:-1] + (f"{rec[1]} .. {rec[2]}",)
        for depth in range(len(keys)):
            path = root + "".join(keys[:depth])
            ks = tree.setdefault((op.kind, path), [])
            if keys[depth] not in ks:
                ks.append(keys[depth])
        if nid is not None:
            ids = leaf_of.setdefault((op.kind, root + "".join(keys[:-1]), keys[-1]), [])
            if nid not in ids:
                ids.append(nid)
    ids: dict[tuple[str, str], str] = {}
    for i, key in enumerate(tree):
        ids[key] = f"r{i}"
    nodes: dict[str, RNode] = {}
    # sources first, sinks last, so Graphviz ranks them at the two ends
    for (kind, path), nid in ids.items():
        if kind == "input":
            nodes[nid] = _mk(nid, path, tree[(kind, path)])
    nodes.update(ir.nodes)
    for (kind, path), nid in ids.items():
        if kind == "output":
            nodes[nid] = _mk(nid, path, tree[(kind, path)])
    ir.nodes = nodes
    for nid in ids.values():
        ir.key_of[nid] = ir.nodes[nid].title
    grey = {"color": TIE_COLOR, "fontcolor": TIE_COLOR}
    for (kind, path), keys in tree.items():
        me = ids[(kind, path)]
        for i, key in enumerate(keys):
            port = f"{me}:k{i}"
            targets = list(leaf_of.get((kind, path, key), ()))
            child = ids.get((kind, path + key))
            if child is not None:
                targets.append(child)
            for t in targets:
                if kind == "input":
                    ir.extra_edges.append((port, t, dict(grey, label=key)))
                else:
                    ir.extra_edges.append((t, port, dict(grey, label=key)))
    n = len(ids)
    n += _returned_tuples(trace, ir)
    n += _tuple_boxes(trace, ir)
    return n


def _tuple_boxes(trace: "Trace", ir: RenderIR) -> int:
    """A dotted box around each op drawn on its own that returned a tuple of two or more
    tensors (its leaves come from that one op, so they share its module); the slot labels on
    its out-edges name the leaves."""
    count = 0
    for op in trace:
        if not op.multi_output or len(op.shapes) < 2:
            continue
        nid = ir.node_of.get(op.label)
        node = ir.nodes.get(nid) if nid is not None else None
        if node is None or node.kind in ("module", "repeat", "container") or len(node.ops) != 1:
            continue
        key = f"tuple:{op.label}"
        parent = node.cluster
        level = ir.clusters[parent].level + 1 if parent is not None else 0
        ir.clusters[key] = RCluster(key, parent, f"{len(op.shapes)} outputs", "", level, TUPLE_BOX)
        node.cluster = key
        count += 1
    return count


def _mk(nid: str, path: str, keys: list[str]) -> RNode:
    node = RNode(nid, "container", path, [], None, None, [], 1)
    node.label_html = _record_label(path, keys)
    return node


def _returned_tuples(trace: "Trace", ir: RenderIR) -> int:
    """A record node per module call that returned two or more tensors mid-graph, tied by
    dashed member-of edges to the nodes that made the leaves."""
    count = 0
    for call in trace._module_calls.values():
        if call.address == "self":
            continue
        slots = call.output_slots
        if len(slots) < 2:
            continue
        makers = [ir.node_of.get(label) for label, _ in slots]
        if any(m is None for m in makers) or ir.nodes[makers[0]].kind == "module" and len(set(makers)) == 1:
            continue  # the call is folded into one box: its tuple is inside it
        nid = f"t{count}"
        keys = [f"[{i}]" for i in range(len(slots))]
        node = _mk(nid, f"{call.label} returned", keys)
        node.cluster = ir.nodes[makers[0]].cluster
        ir.nodes[nid] = node
        ir.key_of[nid] = node.title
        for i, m in enumerate(makers):
            ir.extra_edges.append((m, f"{nid}:k{i}", {"style": "dashed", "arrowhead": "none", "color": TIE_COLOR}))
        count += 1
    return count
