"""Emit DOT text from a RenderIR: nodes, nested module clusters, edges, the header and key.

Pure string building: no graphviz import and no `dot` binary needed.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torchlens.viz.encoding import EncodingState, color_of, size_factor
from torchlens.viz.ramp import is_dark
from torchlens.viz.themes import KIND_LEGEND, NODE_KINDS, Theme

if TYPE_CHECKING:  # pragma: no cover
    from torchlens.viz.ir import RenderIR, RNode

RANKDIR = {"TB": "TB", "BT": "BT", "LR": "LR", "RL": "RL", "topdown": "TB", "bottomup": "BT",
           "leftright": "LR", "rightleft": "RL"}
TITLE_PT = 11
#: RCluster.record of a dotted box drawn around an op-returned tuple (not a module frame).
TUPLE_BOX = "op-returned tuple"
LINE_PT = 9
#: Node label margin (inches, x,y). The y margin is wider than Graphviz's tight default so an
#: underscore, drawn below the baseline of a node's last line, is not clipped by the border at
#: small sizes (labels such as `linear_1_2` and `q_proj`).
NODE_MARGIN = "0.1,0.07"


def quote(s: str) -> str:
    return '"' + str(s).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def esc(s: Any) -> str:
    return (str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
            .replace('"', "&quot;"))


def _attrs(d: dict[str, Any]) -> str:
    parts = []
    for k, v in d.items():
        if v is None:
            continue
        if isinstance(v, str) and v.startswith("<") and v.endswith(">"):
            parts.append(f"{k}={v}")
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            parts.append(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}")
        else:
            parts.append(f"{k}={quote(str(v))}")
    return ", ".join(parts)


#: points of space under a node's title: an underscore sits on the title's baseline and, at
#: small sizes, merges into the next line (`linear_1_1` reads as `linear 1 1`) without it.
TITLE_GAP_PT = 3


def node_label(node: "RNode") -> str:
    """The node's HTML-like label: the bold title in its own cell, padded below so its
    underscores stay visible at small sizes, then the detail lines."""
    html = getattr(node, "label_html", None)  # a ready-made label (container record nodes)
    if html is not None:
        return html
    title = f'<TR><TD CELLPADDING="0" HEIGHT="{TITLE_PT + TITLE_GAP_PT}" VALIGN="TOP"><B>{esc(node.title)}</B></TD></TR>'
    if not node.lines:
        return f'<<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="0" CELLPADDING="0">{title}</TABLE>>'
    body = "<BR/>".join(f'<FONT POINT-SIZE="{LINE_PT}">{esc(line)}</FONT>' for line in node.lines)
    return (f'<<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="0" CELLPADDING="0">{title}'
            f'<TR><TD CELLPADDING="0">{body}</TD></TR></TABLE>>')


def label_size(node: "RNode") -> tuple[float, float]:
    """Estimated inches a node's label needs (width, height), margins included."""
    chars = max([len(node.title)] + [len(l) * LINE_PT / TITLE_PT for l in node.lines])
    w = chars * TITLE_PT * 0.6 / 72 + 0.2
    h = (TITLE_PT + LINE_PT * len(node.lines)) * 1.25 / 72 + TITLE_GAP_PT / 72 + 0.16
    return w, h


@dataclass
class DotOptions:
    theme: Theme
    direction: str = "TB"
    header: list[str] = field(default_factory=list)
    title: str = ""
    show_legend: bool | None = None
    color: EncodingState | None = None
    size: EncodingState | None = None
    layout: str = "dot"
    show_container_labels: bool = False
    graph_overrides: dict[str, Any] = field(default_factory=dict)
    node_overrides: dict[str, dict[str, Any]] = field(default_factory=dict)  # node id -> attrs
    edge_overrides: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    edge_labels: dict[tuple[str, str], str] = field(default_factory=dict)


def _swatch(theme: Theme, kind: str) -> str:
    st = theme.node(kind)
    style = "rounded" if "rounded" in st.style else ("dashed" if "dashed" in st.style else
                                                     "dotted" if "dotted" in st.style else "")
    style_attr = f' STYLE="{style}"' if style else ""
    border = 2 if st.peripheries > 1 else 1
    return (f'<TD BGCOLOR="{st.fill}" COLOR="{st.border}" BORDER="{border}"{style_attr} '
            f'WIDTH="26" HEIGHT="12" FIXEDSIZE="TRUE"></TD>')


def _text(s: str, width: int = 0) -> str:
    w = f' WIDTH="{width}"' if width else ""
    return f'<TD ALIGN="LEFT"{w}><FONT POINT-SIZE="{LINE_PT}">{esc(s)}</FONT></TD>'


def _legend_table(ir: "RenderIR", opts: DotOptions) -> str | None:
    """One compact row per drawn mark, each with its real fill, border and corner style."""
    theme = opts.theme
    present = {n.kind for n in ir.nodes.values()}
    # a nested table is stretched to its cell's width: size the text column to take the slack
    widest = max([len(opts.title) * TITLE_PT * 0.62] + [len(l) * LINE_PT * 0.56 for l in opts.header])
    w = max(int(widest) - 36, 0)
    rows = [f"<TR>{_swatch(theme, kind)}{_text(KIND_LEGEND[kind], w)}</TR>" for kind in NODE_KINDS if kind in present]
    if ir.clusters:
        rows.append(f'<TR><TD BGCOLOR="{theme.cluster_fills[0]}" COLOR="{theme.cluster_border}" BORDER="1" '
                    f'STYLE="rounded" WIDTH="26" HEIGHT="12" FIXEDSIZE="TRUE"></TD>{_text("module call (frame)", w)}</TR>')
    if not rows:
        return None
    return '<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="3" CELLPADDING="0">' + "".join(rows) + "</TABLE>"


def _channel_rows(opts: DotOptions) -> list[str]:
    rows = []
    c = opts.color
    if c is not None and c.vmin is not None:
        cells = "".join(f'<TD BGCOLOR="{color_of(c, c.vmin + (c.vmax - c.vmin) * i / 11, opts.theme)}" '
                        f'WIDTH="10" HEIGHT="10" FIXEDSIZE="TRUE"></TD>' for i in range(12))
        bar = (f'<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="0" CELLPADDING="0"><TR>'
               f'<TD><FONT POINT-SIZE="{LINE_PT}">{esc(c.label)}: {esc(c.fmt(c.vmin))}&nbsp;</FONT></TD>{cells}'
               f'<TD><FONT POINT-SIZE="{LINE_PT}">&nbsp;{esc(c.fmt(c.vmax))}</FONT></TD></TR></TABLE>')
        rows.append(f'<TR><TD ALIGN="LEFT">{bar}</TD></TR>')
    s = opts.size
    if s is not None and s.vmin is not None:
        rows.append(f'<TR><TD ALIGN="LEFT"><FONT POINT-SIZE="{LINE_PT}">size: {esc(s.label)}, '
                    f"{esc(s.fmt(s.vmin))} ... {esc(s.fmt(s.vmax))}</FONT></TD></TR>")
    return rows


def graph_label(ir: "RenderIR", opts: DotOptions) -> str:
    """The top-left block: title, header lines, then the key (legend and channel keys)."""
    rows = [f'<TR><TD ALIGN="LEFT"><B>{esc(opts.title)}</B></TD></TR>']
    for line in opts.header:
        rows.append(f'<TR><TD ALIGN="LEFT"><FONT POINT-SIZE="{LINE_PT}">{esc(line)}</FONT></TD></TR>')
    channels = opts.color is not None or opts.size is not None
    if opts.show_legend is True:
        table = _legend_table(ir, opts)
        if table:
            rows.append(f'<TR><TD ALIGN="LEFT">{table}</TD></TR>')
    if opts.show_legend is True or (opts.show_legend is None and channels):
        rows += _channel_rows(opts)
    return ('<<TABLE BORDER="0" CELLBORDER="0" CELLSPACING="2" CELLPADDING="1">' + "".join(rows) + "</TABLE>>")


def _rank_positions(ir: "RenderIR", rankdir: str) -> dict[str, tuple[float, float]]:
    """The 'rank' layout: longest-path levels, order of first appearance within a level."""
    level: dict[str, int] = {nid: 0 for nid in ir.nodes}
    preds: dict[str, list[str]] = {}
    for (s, d) in ir.edges:
        preds.setdefault(d, []).append(s)
    for nid in ir.nodes:  # nodes are in execution order, so parents come first
        ps = preds.get(nid)
        if ps:
            level[nid] = max(level[p] for p in ps) + 1
    slot: dict[int, int] = {}
    pos = {}
    for nid in ir.nodes:
        lv = level[nid]
        i = slot.get(lv, 0)
        slot[lv] = i + 1
        across, along = i * 170.0, lv * 80.0
        if rankdir == "TB":
            pos[nid] = (across, -along)
        elif rankdir == "BT":
            pos[nid] = (across, along)
        elif rankdir == "LR":
            pos[nid] = (along * 2.2, -across / 2.5)
        else:
            pos[nid] = (-along * 2.2, -across / 2.5)
    return pos


def emit_dot(ir: "RenderIR", opts: DotOptions, progress: Any = None) -> str:
    theme = opts.theme
    rankdir = RANKDIR[opts.direction]
    out: list[str] = ["digraph trace {"]
    gattrs: dict[str, Any] = {
        "rankdir": rankdir, "bgcolor": theme.background, "fontname": theme.fontname, "fontcolor": theme.font,
        "fontsize": 12, "nodesep": 0.25, "ranksep": 0.35, "pad": 0.2, "labelloc": "t", "labeljust": "l",
        "label": graph_label(ir, opts),
    }
    if ir.stack_rank_groups:
        gattrs["newrank"] = "true"
    if opts.layout == "rank":
        gattrs["splines"] = "line"
    gattrs.update(opts.graph_overrides)
    out.append(f"  graph [{_attrs(gattrs)}];")
    out.append(f"  node [{_attrs({'shape': 'box', 'fontname': theme.fontname, 'fontsize': TITLE_PT, 'fontcolor': theme.font, 'margin': NODE_MARGIN, 'height': 0.3, 'penwidth': 1.2})}];")
    out.append(f"  edge [{_attrs({'color': theme.edge, 'arrowsize': 0.6, 'penwidth': 1.0, 'fontname': theme.fontname, 'fontsize': LINE_PT, 'fontcolor': theme.font})}];")

    typical = None
    if opts.size is not None and opts.size.values:
        sizes = [label_size(n) for n in ir.nodes.values()]
        typical = (statistics.median(w for w, _ in sizes), statistics.median(h for _, h in sizes))
    positions = _rank_positions(ir, rankdir) if opts.layout == "rank" else None

    def node_line(node: "RNode", indent: str) -> str:
        st = theme.node(node.kind)
        a: dict[str, Any] = {"label": node_label(node), "style": st.style, "fillcolor": st.fill, "color": st.border}
        if st.font:
            a["fontcolor"] = st.font
        if st.peripheries > 1:
            a["peripheries"] = st.peripheries
        if opts.color is not None and node.id in opts.color.values:
            fill = color_of(opts.color, opts.color.values[node.id], theme)
            a["fillcolor"] = fill
            a["fontcolor"] = "white" if is_dark(fill) else "black"
        if typical is not None and node.id in opts.size.values:
            f = size_factor(opts.size, opts.size.values[node.id]) ** 0.5
            a["width"] = round(typical[0] * f, 3)
            a["height"] = round(typical[1] * f, 3)
        if positions is not None:
            x, y = positions[node.id]
            a["pos"] = f"{x:g},{y:g}!"
        a.update(opts.node_overrides.get(node.id, {}))
        return f"{indent}{node.id} [{_attrs(a)}];"

    # items per cluster, in order of first appearance
    items: dict[str | None, list[tuple[str, str]]] = {None: []}
    placed: set[str] = set()
    clusters = ir.clusters if opts.layout != "rank" else {}
    nodes = ir.nodes.values()
    if progress is not None:
        nodes = progress(nodes, total=len(ir.nodes), desc="draw: layout")
    for node in nodes:
        key = node.cluster if clusters else None
        chain = []
        while key is not None and key not in placed:
            chain.append(key)
            key = clusters[key].parent
        for ck in reversed(chain):
            placed.add(ck)
            items.setdefault(clusters[ck].parent, []).append(("c", ck))
            items.setdefault(ck, [])
        items.setdefault(node.cluster if clusters else None, []).append(("n", node.id))

    counter = [0]

    def emit(key: str | None, depth: int) -> None:
        indent = "  " * (depth + 1)
        for kind, x in items.get(key, ()):
            if kind == "n":
                out.append(node_line(ir.nodes[x], indent))
                continue
            c = clusters[x]
            idx = counter[0]
            counter[0] += 1
            label = f'<<B>{esc(c.title)}</B>' + (f'<BR/><FONT POINT-SIZE="{LINE_PT}">{esc(c.subtitle)}</FONT>' if c.subtitle else "") + ">"
            cattrs = {"label": label, "style": "rounded,filled", "fillcolor": theme.cluster_fills[c.level % len(theme.cluster_fills)],
                      "color": theme.cluster_border, "fontcolor": theme.cluster_font, "fontsize": 10,
                      "labeljust": "l", "labelloc": "t", "penwidth": 1.0, "margin": 8}
            if c.record == TUPLE_BOX:  # show_containers="nodes": the tuple an op returned
                cattrs.update(style="dotted", fillcolor=None, margin=4)
                out.append(f"{indent}subgraph cluster_tuple_{idx} {{")
            else:
                out.append(f"{indent}subgraph cluster_{idx} {{")
            out.append(f"{indent}  graph [{_attrs(cattrs)}];")
            emit(x, depth + 1)
            out.append(f"{indent}}}")

    emit(None, 0)
    for (s, d), n in ir.edges.items():
        ea: dict[str, Any] = {}
        if ir.rolled and n > 1:
            ea["label"] = f"x{n}"
        if (s, d) in opts.edge_labels:
            ea["label"] = opts.edge_labels[(s, d)]
        ea.update(opts.edge_overrides.get((s, d), {}))
        out.append(f"  {s} -> {d}" + (f" [{_attrs(ea)}];" if ea else ";"))
    for s, d, ea in ir.extra_edges:  # container ties: drawn, but not data flow
        out.append(f"  {s} -> {d} [{_attrs(ea)}];")
    for group in ir.stack_rank_groups:
        out.append("  { rank=same; " + "; ".join(group) + "; }")
    out.append("}")
    return "\n".join(out) + "\n"
