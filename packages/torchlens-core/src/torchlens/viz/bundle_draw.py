"""Bundle.draw: one picture of a Bundle (union op graph, member graph, or the two-member diff).

- graph="forward" (nodes="ops"): the union of the members' op graphs; a node or arrow that
  not every member runs lists the members that do.
- nodes="members": one node per member, one arrow per relation row from the earlier member
  to the later one, labelled with the kind (dashed: no row carries checked token spans yet).
- graph="diff": two members side by side, one node per op (each pass its own node), filled
  by the metric distance on `on` from `Bundle.compare` (white: exactly zero; a light-to-dark
  red ramp, normalised to the largest distance shown, otherwise). Ops with no distance (a
  payload not saved) are grey and dashed, never coloured as zero.

- graph="diff", depth=N (the folded diff): the compared member drawn exactly as
  Trace.draw(depth=N) folds it, every op and folded box filled by its distance from the
  baseline (a box takes its most changed op; no top-k cap).

- rolled=True (union graph only): one node per layer, `(xN)` for a layer run N times.

- graph="backward": the union of the members' captured grad_fn graphs
  (`trace.autograd.grad_fns`), one node per grad_fn label, one arrow per next_functions edge
  (drawn from a node to the node it sends gradient to); a node or arrow not every member
  has lists the members that do. Each node names the forward op whose output carries it
  (`<- op`) or the parameter an AccumulateGrad node accumulates into.
- graph="combined": the forward union graph and the backward union graph in one picture,
  with a dotted link from each forward op to its grad_fn.
  A member with no grad_fn records (captured under torch.no_grad(), by a backend that builds
  no autograd graph, or loaded from an artifact saved before grad_fn records existed) refuses
  with BundleError `bundle_draw_grad_fns_missing` naming the member, before anything is written.
"""

from __future__ import annotations

from typing import Any

from torchlens.errors import ArgumentTypeError, InvalidArgumentError
from torchlens.viz.dot import RANKDIR, _attrs
from torchlens.viz.draw import Drawing, _norm_format, _open_viewer, _overrides, in_notebook, reserve_path, resolve_path, write
from torchlens.viz.ramp import Ramp, is_dark
from torchlens.viz.themes import get_theme

GRAPHS = ("forward", "backward", "combined", "diff")
NODES = ("ops", "members")
SUPPORTED = ("path", "graph", "nodes", "rolled", "direction", "theme", "show_legend", "file_format", "open_viewer",
             "graph_overrides", "node_overrides", "edge_overrides", "members", "metric", "on", "depth",
             "fold_repeats", "show_containers", "container_max_inline")
#: Trace.draw keywords the folded diff (graph="diff", depth=N) passes through; elsewhere they refuse.
FOLDED_ONLY = ("fold_repeats", "show_containers", "container_max_inline")
#: zero distance draws white; anything above zero starts visibly coloured on this ramp
DIFF_RAMP = ("#fee5d9", "#fcae91", "#fb6a4a", "#de2d26", "#a50f15")
ZERO_FILL = "#ffffff"
MISSING_FILL = "#d9d9d9"
_RAMP: Ramp | None = None
#: Above this many nodes, Graphviz's network-simplex passes are capped (`nslimit`) and the
#: crossing minimisation shortened (`mclimit`): on the 3-member 12-layer GPT-2 union graph
#: (605 nodes) this takes `dot` from ~14 s to ~3 s with the same ranks (see
#: benchmarks/bundle_draw.py). graph_overrides={"nslimit": None, ...} cannot unset them, but
#: larger values (graph_overrides={"nslimit": 100}) restore the full search.
LAYOUT_LIMIT_NODES = 300
LAYOUT_LIMITS = {"nslimit": 2, "mclimit": 0.5}


def diff_ramp() -> Ramp:
    global _RAMP
    if _RAMP is None:
        _RAMP = Ramp(DIFF_RAMP)
    return _RAMP


def diff_fill(distance: float | None, top: float) -> str:
    """The fill of one diff node: white for exactly zero, the ramp at distance/top otherwise."""
    if distance is None:
        return MISSING_FILL
    if distance == 0.0 or top <= 0.0:
        return ZERO_FILL
    if distance != distance:  # NaN: the darkest colour, never white
        return DIFF_RAMP[-1]
    return diff_ramp()(distance / top)


class BundleDrawing(Drawing):
    """A rendered bundle: `str(d)` is the DOT source, `d.path` the written file. `d.distances`
    holds the diff drawing's op label -> distance (None where there is none)."""

    def __init__(self, source: str, *, path: str | None, file_format: str | None, nodes: dict[str, str],
                 num_edges: int, distances: dict[str, float | None] | None = None,
                 members: tuple[str, ...] = ()) -> None:
        super().__init__(source, path=path, file_format=file_format, ir=None)  # type: ignore[arg-type]
        self._nodes = nodes
        self._num_edges = num_edges
        self.distances = dict(distances or {})
        self.members = members

    @property
    def num_nodes(self) -> int:
        return len(self._nodes)

    @property
    def num_edges(self) -> int:
        return self._num_edges

    @property
    def node_ids(self) -> dict[str, str]:
        return dict(self._nodes)

    def __repr__(self) -> str:
        where = f", written to {self.path}" if self.path else ""
        return f"<BundleDrawing: {self.num_nodes} nodes, {self.num_edges} edges{where}>"


def _unsupported(keyword: str, why: str) -> ArgumentTypeError:
    return ArgumentTypeError("bundle_draw_keyword_unsupported", f"Bundle.draw: {keyword}= {why}",
                             remedy=f"drop {keyword}=; Bundle.draw takes {', '.join(SUPPORTED)}", keyword=keyword,
                             supported=list(SUPPORTED))


def draw_bundle(bundle: Any, path: Any = None, *, graph: str = "forward", nodes: str = "ops", rolled: bool = False,
                direction: str | None = None, theme: str | None = None, show_legend: bool | None = None,
                file_format: str | None = None, open_viewer: bool = False, graph_overrides: dict | None = None,
                node_overrides: dict | None = None, edge_overrides: dict | None = None, members: Any = None,
                metric: Any = "relative_l2", on: str = "out", depth: int | None = None, **other: Any) -> BundleDrawing:
    passthrough = {k: other.pop(k) for k in FOLDED_ONLY if k in other}
    if other:
        raise _unsupported(sorted(other)[0], "is not supported by the bundle renderer yet")
    if passthrough and not (graph == "diff" and depth is not None):
        raise _unsupported(sorted(passthrough)[0], "applies to the folded diff only (graph='diff', depth=N), "
                                                   "which draws the compared member with Trace.draw")
    if graph not in GRAPHS:
        raise InvalidArgumentError("bundle_draw_option_invalid", f"graph={graph!r} is not one of {GRAPHS}",
                                   remedy=f"use one of {GRAPHS}", option="graph")
    if nodes not in NODES:
        raise InvalidArgumentError("bundle_draw_option_invalid", f"nodes={nodes!r} is not one of {NODES}",
                                   remedy=f"use one of {NODES}", option="nodes")
    if direction is not None and direction not in RANKDIR:
        raise InvalidArgumentError("bundle_draw_option_invalid", f"direction={direction!r} is not one of {sorted(RANKDIR)}",
                                   remedy=f"use one of {sorted(RANKDIR)}", option="direction")
    if show_legend not in (None, True, False):
        raise InvalidArgumentError("bundle_draw_option_invalid", f"show_legend={show_legend!r} is not None, True or False",
                                   remedy="use None, True or False", option="show_legend")
    graph_overrides = _overrides("graph_overrides", graph_overrides)
    node_overrides = _overrides("node_overrides", node_overrides)
    edge_overrides = _overrides("edge_overrides", edge_overrides)
    if rolled and (graph == "diff" or nodes == "members"):
        raise _unsupported("rolled", "has no meaning for a diff" if graph == "diff" else "has no meaning with nodes='members'")
    if rolled and graph in ("backward", "combined"):
        raise _unsupported("rolled", f"has no meaning with graph={graph!r} (grad_fn nodes are per pass, not per layer)")
    if nodes == "members" and graph not in ("forward", "diff"):
        raise _unsupported("nodes", f"='members' draws the member graph, which has no {graph!r} pass; "
                                    "use graph='forward'")
    if graph == "diff":
        if nodes == "members":
            raise _unsupported("nodes", "='members' has no meaning for a diff")
        if depth is not None:
            if node_overrides or edge_overrides:
                raise _unsupported("node_overrides" if node_overrides else "edge_overrides",
                                   "keys ops and has no meaning for the folded diff (depth=)")
            return _folded_diff(bundle, path, members, metric, on, depth, direction, theme, show_legend, file_format,
                                open_viewer, graph_overrides, passthrough)
    else:
        if depth is not None:
            raise _unsupported("depth", f"has no meaning with graph={graph!r} (the union graph has no module folding)")
        if members is not None:
            raise _unsupported("members", "applies to graph='diff' only")
    grads = _member_grad_fns(bundle) if graph in ("backward", "combined") else None
    th = get_theme(theme if theme is not None else ("paper" if graph == "diff" else "torchlens"))
    stem = "bundle_diff" if graph == "diff" else "bundle_modelgraph"
    notebook = path is None and in_notebook()
    if path is not None:
        out_path, fmt = resolve_path(path, file_format, default="svg" if graph == "diff" else "pdf")
    else:
        out_path = None
        fmt = _norm_format(file_format) if file_format is not None else ("svg" if graph == "diff" else "pdf")
    if graph == "diff":
        source, ids, n_edges, dist, pair = _diff_source(bundle, members, metric, on, direction, th, show_legend,
                                                        graph_overrides, node_overrides, edge_overrides)
    elif grads is not None:
        source, ids, n_edges = _grad_source(bundle, grads, graph == "combined", direction, th, graph_overrides,
                                            node_overrides, edge_overrides)
        dist, pair = {}, tuple(bundle.names)
    elif nodes == "members":
        source, ids, n_edges = _members_source(bundle, direction, th, graph_overrides, node_overrides, edge_overrides)
        dist, pair = {}, tuple(bundle.names)
    else:
        source, ids, n_edges = _union_source(bundle, direction, th, graph_overrides, node_overrides, edge_overrides,
                                             rolled)
        dist, pair = {}, tuple(bundle.names)
    if out_path is None and not notebook:
        out_path = reserve_path(stem, fmt)
        print(out_path)
    if out_path is not None:
        write(source, out_path, fmt)
        if open_viewer:
            _open_viewer(out_path)
    return BundleDrawing(source, path=out_path, file_format=fmt if out_path else None, nodes=ids, num_edges=n_edges,
                         distances=dist, members=pair)


def _folded_diff(bundle: Any, path: Any, members: Any, metric: Any, on: str, depth: int, direction: str | None,
                 theme: str | None, show_legend: bool | None, file_format: str | None, open_viewer: bool,
                 graph_overrides: dict, passthrough: dict | None = None) -> Drawing:
    """The compared member drawn as Trace.draw(depth=N) folds it, every op and box filled by
    its distance from the baseline (a box: its most changed op)."""
    import os
    import re
    import tempfile

    left, right = _pair(bundle, members)
    rows = bundle.compare(left, right, metric=metric, on=on)
    dist: dict[str, float | None] = dict(rows)
    for label in rows.skipped:
        dist[label] = None
    kwargs: dict[str, Any] = {"depth": depth, "theme": theme or "torchlens", "graph_overrides": graph_overrides}
    kwargs.update(passthrough or {})  # fold_repeats / show_containers: checked by Trace.draw
    if direction is not None:
        kwargs["direction"] = direction
    if show_legend is not None:
        kwargs["show_legend"] = show_legend
    notebook = path is None and in_notebook()
    if path is not None:
        out_path, fmt = resolve_path(path, file_format, default="svg")
    else:
        out_path, fmt = None, (_norm_format(file_format) if file_format is not None else "svg")
    with tempfile.TemporaryDirectory() as tmp:
        drawing = bundle[right].draw(os.path.join(tmp, "folded.dot"), **kwargs)
    per_node: dict[str, list[float | None]] = {}
    for label, nid in drawing.node_ids.items():
        per_node.setdefault(nid, []).append(dist.get(label))
    values: dict[str, float | None] = {}
    for nid, vals in per_node.items():
        known = [v for v in vals if v is not None]
        values[nid] = max(known) if known else None
    finite = [v for v in values.values() if v is not None and v == v]
    top = max(finite) if finite else 0.0
    source = drawing.source
    for nid, v in values.items():
        fill = diff_fill(v, top)
        extra = _attrs({"fillcolor": fill, "fontcolor": "white" if is_dark(fill) else "black",
                        "tooltip": f"{right} vs {left}: {'no distance' if v is None else repr(v)}"})
        source = re.sub(rf"^(\s*{re.escape(nid)} \[.*)\];$", lambda m: f"{m.group(1)}, {extra}];", source, count=1,
                        flags=re.M)
    if show_legend is not False:
        key = (f"{right} vs {left}: {rows.metric or 'metric'} on {on}; white = 0, darkest red = {top:.4g}; "
               "grey = no distance")
        source = source.rstrip().removesuffix("}") + f"  diff_key [{_attrs({'shape': 'plaintext', 'label': key})}];\n}}\n"
    drawing.source = source
    drawing.distances = values  # node id -> distance (a box: its most changed op)
    drawing.members = (left, right)
    if out_path is None and not notebook:
        out_path = reserve_path("bundle_diff", fmt)
        print(out_path)
    drawing.path = out_path
    drawing.format = fmt if out_path else None
    if out_path is not None:
        write(source, out_path, fmt)
        if open_viewer:
            _open_viewer(out_path)
    return drawing


def _pair(bundle: Any, members: Any) -> tuple[str, str]:
    if members is None:
        return bundle._pair_default(None, None)
    if not (isinstance(members, (list, tuple)) and len(members) == 2 and all(type(m) is str for m in members)):
        raise InvalidArgumentError("bundle_draw_option_invalid", "members= takes two member names (left, right)",
                                   remedy="members=('clean', 'ablated')", option="members")
    bundle[members[0]], bundle[members[1]]
    return members[0], members[1]


def _head(name: str, rankdir: str, th: Any, graph_overrides: dict, label: str | None, n_nodes: int) -> list[str]:
    gattrs = {"rankdir": rankdir, "bgcolor": th.background, "fontname": th.fontname, "fontcolor": th.font,
              "label": label, "labelloc": "b" if label else None, "newrank": "true"}
    if n_nodes > LAYOUT_LIMIT_NODES:
        gattrs.update(LAYOUT_LIMITS)  # graph_overrides below can lift them
    gattrs.update(graph_overrides)
    return [f"digraph {name} {{", f"  graph [{_attrs(gattrs)}];",
            f"  node [{_attrs({'shape': 'box', 'fontname': th.fontname, 'fontsize': 10, 'color': th.node('compute').border})}];",
            f"  edge [{_attrs({'color': th.edge})}];"]


def _diff_source(bundle: Any, members: Any, metric: Any, on: str, direction: str | None, th: Any,
                 show_legend: bool | None, graph_overrides: dict, node_overrides: dict,
                 edge_overrides: dict) -> tuple[str, dict[str, str], int, dict[str, float | None], tuple[str, str]]:
    left, right = _pair(bundle, members)
    rows = bundle.compare(left, right, metric=metric, on=on)  # the comparison gate runs on this pair only
    dist: dict[str, float | None] = dict(rows)
    for label in rows.skipped:
        dist[label] = None
    finite = [d for d in dist.values() if d is not None and d == d]
    top = max(finite) if finite else 0.0
    label = None
    if show_legend is not False:
        mname = rows.metric or "metric"
        label = f"{left} vs {right}: {mname} on {on}; white = 0, darkest red = {top:.4g}; grey = no distance"
    lines = _head("bundle_diff", RANKDIR[direction] if direction else "TB", th, graph_overrides, label,
                  len(bundle[left]._ops) + len(bundle[right]._ops))
    ids: dict[str, str] = {}
    n_edges = 0
    for side, name in (("L", left), ("R", right)):
        t = bundle[name]
        lines.append(f"  subgraph cluster_{side} {{")
        lines.append(f"    graph [{_attrs({'label': name, 'style': 'rounded', 'color': th.cluster_border})}];")
        local: dict[str, str] = {}
        for i, (op_label, op) in enumerate(t._ops.items()):
            nid = f"{side}{i}"
            local[op_label] = nid
            ids[f"{name}:{op_label}"] = nid
            d = dist.get(op_label) if op_label in dist else None
            fill = diff_fill(d, top)
            text = f"{op_label}\n{'no distance' if d is None else f'{d:.3g}'}"
            attrs = {"label": text, "style": "filled,rounded" if d is not None else "filled,rounded,dashed",
                     "fillcolor": fill, "fontcolor": "white" if is_dark(fill) else th.font,
                     "tooltip": f"{op_label}: {'no distance' if d is None else repr(d)}"}
            attrs.update(node_overrides.get(op_label, {}))
            lines.append(f"    {nid} [{_attrs(attrs)}];")
        for src, dst in t.graph_edges:
            if src in local and dst in local:
                eattrs = dict(edge_overrides.get((src, dst), {}))
                lines.append(f"    {local[src]} -> {local[dst]}" + (f" [{_attrs(eattrs)}]" if eattrs else "") + ";")
                n_edges += 1
        lines.append("  }")
    lines.append("}")
    return "\n".join(lines) + "\n", ids, n_edges, dist, (left, right)


def _union_source(bundle: Any, direction: str | None, th: Any, graph_overrides: dict, node_overrides: dict,
                  edge_overrides: dict, rolled: bool = False) -> tuple[str, dict[str, str], int]:
    """The union op graph; rolled=True draws one node per layer (its passes folded, `xN`)."""
    names = list(bundle.names)
    nodes: dict[str, list[str]] = {}
    kinds: dict[str, str] = {}
    passes: dict[str, int] = {}
    edges: dict[tuple[str, str], list[str]] = {}
    for n in names:
        t = bundle[n]
        key = (lambda lbl: t._ops[lbl].layer_label) if rolled else (lambda lbl: lbl)
        for label, op in t._ops.items():
            k = key(label)
            if n not in nodes.setdefault(k, []):
                nodes[k].append(n)
            kinds.setdefault(k, op.kind)
            passes[k] = max(passes.get(k, 1), op.num_passes or 1)
        for src, dst in t.graph_edges:
            e = (key(src), key(dst))
            if n not in edges.setdefault(e, []):
                edges[e].append(n)
    lines = _head("bundle_graph", RANKDIR[direction or "bottomup"], th, graph_overrides, None, len(nodes))
    ids = {}
    for i, (label, who) in enumerate(nodes.items()):
        nid = f"n{i}"
        ids[label] = nid
        style = th.node(kinds[label] if kinds[label] in ("input", "output") else "compute")
        title = f"{label} (x{passes[label]})" if rolled and passes[label] > 1 else label
        text = title if len(who) == len(names) else f"{title}\nin: {', '.join(who)}"
        attrs = {"label": text, "style": style.style, "fillcolor": style.fill, "color": style.border}
        attrs.update(node_overrides.get(label, {}))
        lines.append(f"  {nid} [{_attrs(attrs)}];")
    for (src, dst), who in edges.items():
        eattrs: dict[str, Any] = {} if len(who) == len(names) else {"label": ", ".join(who), "style": "dashed"}
        eattrs.update(edge_overrides.get((src, dst), {}))
        lines.append(f"  {ids[src]} -> {ids[dst]}" + (f" [{_attrs(eattrs)}]" if eattrs else "") + ";")
    lines.append("}")
    return "\n".join(lines) + "\n", ids, len(edges)


def _member_grad_fns(bundle: Any) -> dict[str, Any]:
    """Each member's GradFnCollection; a member without one refuses (before any output)."""
    from torchlens.errors import BundleError
    from torchlens.records.autograd import grad_fns_of

    out = {}
    for n in bundle.names:
        coll, why = grad_fns_of(bundle[n])
        if coll is None:
            raise BundleError("bundle_draw_grad_fns_missing", f"member {n!r} has no grad_fn records to draw: {why}",
                              remedy=f"capture {n!r} again with gradients enabled (outside torch.no_grad(), with "
                                     "inputs or parameters that require grad) on a build that records grad_fns, or "
                                     "draw graph='forward'", member=n, reason=why)
        out[n] = coll
    return out


def _grad_source(bundle: Any, grads: dict[str, Any], combined: bool, direction: str | None, th: Any,
                 graph_overrides: dict, node_overrides: dict,
                 edge_overrides: dict) -> tuple[str, dict[str, str], int]:
    """graph="backward" (grad_fn union) or "combined" (forward union + grad_fn union + links).
    A backward arrow (g, n) is written `n -> g [dir=back]`, so it points from g to n while
    ranking like the forward graph (a grad_fn lines up with its forward op)."""
    names = list(bundle.names)
    everyone = len(names)
    gnodes: dict[str, list[str]] = {}
    grec: dict[str, Any] = {}
    gop: dict[str, list[str]] = {}
    gedges: dict[tuple[str, str], list[str]] = {}
    links: dict[tuple[str, str], list[str]] = {}
    fnodes: dict[str, list[str]] = {}
    fkinds: dict[str, str] = {}
    fedges: dict[tuple[str, str], list[str]] = {}
    for n in names:
        for g in grads[n]:
            who = gnodes.setdefault(g.label, [])
            if n not in who:
                who.append(n)
            grec.setdefault(g.label, g)
            gops = gop.setdefault(g.label, [])
            gops.extend(o for o in g.ops if o not in gops)  # members may link the node to different op labels
            for nxt in g.next_labels:
                w = gedges.setdefault((g.label, nxt), [])
                if n not in w:
                    w.append(n)
            if combined:
                for op in g.ops:
                    w = links.setdefault((op, g.label), [])
                    if n not in w:
                        w.append(n)
        if combined:
            t = bundle[n]
            for label, op in t._ops.items():
                who = fnodes.setdefault(label, [])
                if n not in who:
                    who.append(n)
                fkinds.setdefault(label, op.kind)
            for e in t.graph_edges:
                w = fedges.setdefault(tuple(e), [])
                if n not in w:
                    w.append(n)
    name = "bundle_combined" if combined else "bundle_backward"
    lines = _head(name, RANKDIR[direction or "bottomup"], th, graph_overrides, None, len(gnodes) + len(fnodes))
    ids: dict[str, str] = {}

    def member_note(text: str, who: list[str]) -> str:
        return text if len(who) == everyone else f"{text}\nin: {', '.join(who)}"

    for i, (label, who) in enumerate(fnodes.items()):
        nid = ids[label] = f"n{i}"
        style = th.node(fkinds[label] if fkinds[label] in ("input", "output") else "compute")
        attrs = {"label": member_note(label, who), "style": style.style, "fillcolor": style.fill, "color": style.border}
        attrs.update(node_overrides.get(label, {}))
        lines.append(f"  {nid} [{_attrs(attrs)}];")
    for i, (label, who) in enumerate(gnodes.items()):
        gid = ids[label] = f"g{i}"
        g = grec[label]
        sub = f"param {g.param}" if g.param else (f"<- {', '.join(gop[label])}" if gop[label] else "")
        style = th.node("param" if g.is_accumulate_grad else "module")
        attrs = {"label": member_note(label + (f"\n{sub}" if sub else ""), who), "shape": "ellipse",
                 "style": "filled", "fillcolor": style.fill, "color": style.border}
        attrs.update(node_overrides.get(label, {}))
        lines.append(f"  {gid} [{_attrs(attrs)}];")
    for (src, dst), who in fedges.items():
        eattrs: dict[str, Any] = {} if len(who) == everyone else {"label": ", ".join(who), "style": "dashed"}
        eattrs.update(edge_overrides.get((src, dst), {}))
        lines.append(f"  {ids[src]} -> {ids[dst]}" + (f" [{_attrs(eattrs)}]" if eattrs else "") + ";")
    grad_colour = th.node("module").border
    for (src, dst), who in gedges.items():
        eattrs = {"dir": "back", "color": grad_colour}
        if len(who) != everyone:
            eattrs.update({"label": ", ".join(who), "style": "dashed"})
        eattrs.update(edge_overrides.get((src, dst), {}))
        lines.append(f"  {ids[dst]} -> {ids[src]} [{_attrs(eattrs)}];")
    for (op, g), who in links.items():
        if op not in ids:  # a linked op the forward union lacks cannot happen; skip rather than invent a node
            continue
        eattrs = {"style": "dotted", "arrowhead": "none", "constraint": "false", "color": th.cluster_border}
        if len(who) != everyone:
            eattrs["label"] = ", ".join(who)
        eattrs.update(edge_overrides.get((op, g), {}))
        lines.append(f"  {ids[op]} -> {ids[g]} [{_attrs(eattrs)}];")
    lines.append("}")
    return "\n".join(lines) + "\n", ids, len(fedges) + len(gedges) + len(links)


def _members_source(bundle: Any, direction: str | None, th: Any, graph_overrides: dict, node_overrides: dict,
                    edge_overrides: dict) -> tuple[str, dict[str, str], int]:
    lines = _head("bundle_members", RANKDIR[direction or "TB"], th, graph_overrides, None, len(bundle))
    ids = {}
    for i, n in enumerate(bundle.names):
        ids[n] = f"m{i}"
        attrs = {"label": n, "style": "filled,rounded", "fillcolor": th.node("compute").fill}
        attrs.update(node_overrides.get(n, {}))
        lines.append(f"  m{i} [{_attrs(attrs)}];")
    count = 0
    for row in bundle.relations:
        if len(row.members) != 2:
            continue
        later, earlier = row.members
        parts = [row.kind]
        if "label" in row.params:
            parts.append(str(row.params["label"]))
        if row.kind == "fed_by":
            parts.append(f"basis={row.params.get('basis', 'declared')}")
            if "coverage" in row.params:
                parts.append(f"coverage={row.params['coverage']:g}")
        if row.kind == "selected_by" and "chosen" in row.params:
            parts.append(f"chosen={row.params['chosen']!r}")
        eattrs = {"label": "\n".join(parts), "style": "dashed"}  # no row carries checked spans yet: all dashed
        eattrs.update(edge_overrides.get((earlier, later), {}))
        lines.append(f"  {ids[earlier]} -> {ids[later]} [{_attrs(eattrs)}];")
        count += 1
    lines.append("}")
    return "\n".join(lines) + "\n", ids, count


__all__ = ["draw_bundle", "BundleDrawing", "diff_fill", "DIFF_RAMP", "ZERO_FILL", "MISSING_FILL"]
