"""`Trace.draw`: render a Trace as a Graphviz picture and return a `Drawing`.

Modules draw as nested clusters; `depth=N` folds every module call at nesting depth N
(top-level submodules are depth 1) into one box; `rolled=True` draws a multi-pass layer
once; `collapse=` condenses module detail under a budget (see `torchlens.viz.collapse`).
The DOT source is built without graphviz; writing a picture needs the `dot` program.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchlens.errors import ArgumentConflictError, InvalidArgumentError
from torchlens.viz import collapse as _collapse
from torchlens.viz import containers as _containers
from torchlens.viz import repeats as _repeats
from torchlens.viz.cost import warn_if_slow
from torchlens.viz.dot import RANKDIR, DotOptions, emit_dot
from torchlens.viz.encoding import DEFAULT_SCALE, EncodingState, check_scale, node_values, stack_groups
from torchlens.viz.ir import RenderIR, build_ir, trace_units
from torchlens.viz.progress import bound
from torchlens.viz.themes import get_theme
from torchlens.viz.units import fmt_count

if TYPE_CHECKING:  # pragma: no cover
    from torchlens.records.trace import Trace

#: Output formats `draw` writes; "dot"/"gv" write the DOT text itself.
FORMATS = ("svg", "png", "pdf", "jpg", "jpeg", "gif", "ps", "eps", "dot", "gv")
_TEXT_FORMATS = ("dot", "gv")
_SAME = {"jpeg": "jpg", "gv": "dot"}
INSTALL_DOT = "apt-get install graphviz (Debian/Ubuntu), brew install graphviz (macOS) or conda install -c conda-forge graphviz"
LAYOUTS = ("auto", "dot", "rank")
SHOW_CONTAINERS = (False, "labels", "collapsed", "nodes")
CONTAINER_MAX_INLINE = 12
_REMOVED_CONTAINERS = {"auto": "collapsed", "cluster": "labels"}


class Drawing:
    """A rendered trace: `str(drawing)` is the DOT source, `drawing.path` the written file
    (None when nothing was written). Displays inline in Jupyter as SVG."""

    def __init__(self, source: str, *, path: str | None, file_format: str | None, ir: RenderIR,
                 engine: str = "dot", notes: list[tuple[str, str]] | None = None,
                 collapse: _collapse.CollapseResult | None = None,
                 encoding: dict[str, EncodingState] | None = None, schedule: Any = None) -> None:
        self.source = source
        self.path = path
        self.format = file_format
        self.engine = engine
        self.ir = ir
        self.notes = list(notes or [])
        self.encoding = dict(encoding or {})
        self._collapse = collapse
        self._schedule = schedule
        self._svg: str | None = None

    def __str__(self) -> str:
        return self.source

    def __repr__(self) -> str:
        where = f", written to {self.path}" if self.path else ""
        return f"<Drawing: {self.num_nodes} nodes, {self.num_clusters} module clusters, {self.num_edges} edges{where}>"

    @property
    def num_nodes(self) -> int:
        return len(self.ir.nodes)

    @property
    def num_edges(self) -> int:
        return len(self.ir.edges)

    @property
    def num_clusters(self) -> int:
        """Module frames drawn (the dotted tuple boxes of show_containers="nodes" excluded)."""
        return self.source.count("subgraph cluster_") - self.source.count("subgraph cluster_tuple_")

    @property
    def node_ids(self) -> dict[str, str]:
        """Op label -> DOT node id (ops folded into a module box map to the box)."""
        return dict(self.ir.node_of)

    @property
    def collapse_plan(self) -> tuple[str, ...]:
        """The module addresses the collapse request folded (empty when none)."""
        if self._collapse is None:
            return ()
        if self._collapse.plan is None:
            raise InvalidArgumentError("collapse_plan_unavailable",
                                       "collapsing was skipped for this pathologically large trace",
                                       remedy="draw with depth=N to fold modules explicitly")
        return self._collapse.plan

    @property
    def collapse_schedule(self) -> list[tuple[float, tuple[str, ...], int]]:
        """(level, folded modules, drawn nodes) for collapse levels 0 .. 1."""
        return self._schedule() if callable(self._schedule) else list(self._schedule or [])

    def pipe(self, file_format: str = "svg") -> bytes:
        """Render the source with graphviz and return the bytes (needs `dot`)."""
        return _run_graphviz(self.source, file_format, None, self.engine)

    def render(self, path: str | os.PathLike, file_format: str | None = None) -> str:
        """Write the drawing to `path` (extension picks the format); returns the path."""
        path, fmt = resolve_path(path, file_format)
        write(self.source, path, fmt, self.engine)
        self.path = path
        return path

    def _repr_svg_(self) -> str:
        if self._svg is None:
            self._svg = self.pipe("svg").decode("utf-8")
        return self._svg


def find_dot() -> str:
    exe = shutil.which("dot")
    if exe is None:
        raise InvalidArgumentError("graph_render_unavailable", "the graphviz 'dot' program is not on PATH",
                                   remedy=f"install it: {INSTALL_DOT}; or write DOT text with a .dot/.gv path")
    return exe


def _run_graphviz(source: str, fmt: str, path: str | None, engine: str) -> bytes:
    exe = find_dot()
    fmt = _SAME.get(fmt, fmt)
    cmd = [exe, f"-K{'neato' if engine == 'neato' else 'dot'}", f"-T{fmt}"]
    if engine == "neato":
        cmd.append("-n2")
    if fmt in ("png", "jpg", "gif"):
        cmd.append("-Gdpi=96")
    if path is not None:
        cmd += ["-o", path]
    proc = subprocess.run(cmd, input=source.encode("utf-8"), capture_output=True)
    if proc.returncode != 0:
        raise InvalidArgumentError("graph_render_failed", f"dot exited with {proc.returncode}: {proc.stderr.decode(errors='replace')[:500]}",
                                   remedy="report this with the DOT source (str(drawing)); a .dot path writes it without rendering")
    return proc.stdout


def write(source: str, path: str, fmt: str, engine: str = "dot") -> None:
    if fmt in _TEXT_FORMATS:
        Path(path).write_text(source, encoding="utf-8")
    else:
        _run_graphviz(source, fmt, path, engine)


def _norm_format(fmt: str) -> str:
    f = fmt.lower().lstrip(".")
    if f not in FORMATS:
        raise InvalidArgumentError("file_format_unsupported", f"file_format={fmt!r} is not a format draw() writes",
                                   remedy=f"use one of {', '.join(FORMATS)}", file_format=fmt)
    return f


def resolve_path(path: Any, file_format: str | None, default: str = "pdf") -> tuple[str, str]:
    """(final path, format): the extension picks the format; file_format applies only to a
    path without a known extension (appended), and must agree with one that has it."""
    text = os.fspath(path)
    ext = os.path.splitext(text)[1].lower().lstrip(".")
    fmt = _norm_format(file_format) if file_format is not None else None
    if ext in FORMATS:
        if fmt is not None and _SAME.get(fmt, fmt) != _SAME.get(ext, ext):
            raise ArgumentConflictError("draw_format_mismatch", f"file_format={file_format!r} disagrees with the path {text!r}",
                                        remedy=f"drop file_format, or write to a .{fmt} path", path=text, file_format=file_format)
        return text, ext
    fmt = fmt or default
    return f"{text}.{fmt}", fmt


def in_notebook() -> bool:
    """True inside a Jupyter (IPython kernel) session; never imports IPython."""
    mod = sys.modules.get("IPython")
    if mod is None:
        return False
    try:
        ip = mod.get_ipython()
    except Exception:
        return False
    return ip is not None and ("IPKernelApp" in getattr(ip, "config", {}) or type(ip).__name__ == "ZMQInteractiveShell")


def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "model"


def reserve_path(stem: str, fmt: str, directory: str = ".") -> str:
    """A new file `<stem>_<n>.<fmt>` in `directory`, created exclusively so two processes
    never write the same one."""
    n = 1
    while True:
        candidate = os.path.join(directory, f"{stem}_{n}.{fmt}")
        try:
            fd = os.open(candidate, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            n += 1
            continue
        os.close(fd)
        return candidate


def _open_viewer(path: str) -> None:
    try:
        import graphviz  # optional: its viewer helper knows each platform

        graphviz.view(path)
        return
    except ImportError:
        pass
    if sys.platform == "darwin":
        subprocess.Popen(["open", path])
    elif os.name == "nt":  # pragma: no cover
        os.startfile(path)  # type: ignore[attr-defined]
    else:
        subprocess.Popen(["xdg-open", path], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _check_options(depth: Any, direction: Any, layout: Any, show_containers: Any,
                   fold_repeats: Any = False, container_max_inline: Any = CONTAINER_MAX_INLINE) -> None:
    if not isinstance(fold_repeats, bool):
        raise InvalidArgumentError("draw_option_invalid", f"fold_repeats={fold_repeats!r} is not True or False",
                                   remedy="fold_repeats=True folds runs of identical sibling blocks into one with '+N more'",
                                   option="fold_repeats")
    if (not isinstance(container_max_inline, int) or isinstance(container_max_inline, bool)
            or container_max_inline < 1):
        raise InvalidArgumentError("draw_option_invalid", f"container_max_inline={container_max_inline!r} is not a positive int",
                                   remedy=f"use a positive int (default {CONTAINER_MAX_INLINE}); it is read under "
                                          "show_containers='collapsed' and 'nodes'", option="container_max_inline")
    if depth is not None and (not isinstance(depth, int) or isinstance(depth, bool) or depth < 1):
        raise InvalidArgumentError("draw_option_invalid", f"depth={depth!r} is not a positive int",
                                   remedy="depth=1 folds every top-level module into a box; None draws everything",
                                   option="depth")
    if direction not in RANKDIR:
        raise InvalidArgumentError("draw_option_invalid", f"direction={direction!r} is not a direction",
                                   remedy=f"use one of {', '.join(RANKDIR)}", option="direction")
    if layout not in LAYOUTS:
        raise InvalidArgumentError("draw_option_invalid", f"layout={layout!r} is not a layout",
                                   remedy=f"use one of {', '.join(LAYOUTS)}", option="layout")
    if isinstance(show_containers, str) and show_containers in _REMOVED_CONTAINERS:
        new = _REMOVED_CONTAINERS[show_containers]
        raise InvalidArgumentError("visualization_show_containers_invalid",
                                   f"show_containers={show_containers!r} was removed; use {new!r}",
                                   remedy=f"show_containers={new!r}", show_containers=show_containers, replacement=new)
    if show_containers not in SHOW_CONTAINERS:
        raise InvalidArgumentError("visualization_show_containers_invalid",
                                   f"show_containers={show_containers!r} is not supported by this release",
                                   remedy="use False, 'labels', 'collapsed' or 'nodes'", show_containers=repr(show_containers))


def _overrides(name: str, value: Any) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidArgumentError("draw_option_invalid", f"{name} must be a dict, not {type(value).__name__}",
                                   remedy=f"for example {name}={{'linear_1_1': {{'color': 'red'}}}}", option=name)
    return value


def draw_trace(
    trace: "Trace",
    path: Any = None,
    *,
    depth: int | None = None,
    collapse: Any = "auto",
    rolled: bool = False,
    direction: str = "TB",
    theme: str = "light",
    show_legend: bool | None = None,
    color_by: Any = None,
    size_by: Any = None,
    size_scale: str = DEFAULT_SCALE,
    stack_by: Any = None,
    layout: str = "auto",
    show_containers: Any = False,
    container_max_inline: int = CONTAINER_MAX_INLINE,
    fold_repeats: bool = False,
    file_format: str | None = None,
    open_viewer: bool = False,
    progress: bool | None = None,
    graph_overrides: dict | None = None,
    node_overrides: dict | None = None,
    edge_overrides: dict | None = None,
) -> Drawing:
    """Draw `trace`; see the module docstring and docs/guides/drawing.md."""
    th = get_theme(theme)
    _check_options(depth, direction, layout, show_containers, fold_repeats, container_max_inline)
    scale = check_scale(size_by, size_scale)
    channels = color_by is not None or size_by is not None or (stack_by is not None and stack_by is not False)
    if isinstance(show_containers, str) and layout == "rank":
        layout = "dot"  # spec: any string setting of show_containers forces the dot engine
    if layout == "rank" and channels:
        raise InvalidArgumentError("encoding_requires_dot_layout", "encoding channels need the Graphviz dot layout",
                                   remedy="drop layout='rank' (layout='auto' uses dot when a channel is active)")
    if show_legend not in (None, True, False):
        raise InvalidArgumentError("draw_option_invalid", f"show_legend={show_legend!r} is not None, True or False",
                                   remedy="use None (auto), True or False", option="show_legend")
    if stack_by is not None and stack_by is not False and rolled:
        raise InvalidArgumentError("stack_by_requires_unrolled", "stack_by needs an unrolled drawing",
                                   remedy="draw with rolled=False", stack_by=repr(stack_by))
    graph_overrides = _overrides("graph_overrides", graph_overrides)
    node_overrides = _overrides("node_overrides", node_overrides)
    edge_overrides = _overrides("edge_overrides", edge_overrides)
    # resolve the output before the work, so a bad path fails fast
    notebook = path is None and in_notebook()
    out_path: str | None = None
    fmt: str | None = None
    if path is not None:
        out_path, fmt = resolve_path(path, file_format)
    else:
        fmt = _norm_format(file_format) if file_format is not None else "svg"
    pbar = bound(progress)

    units = trace_units(trace, rolled)
    result = _collapse.plan_collapse(trace, units, collapse, depth)
    folded = frozenset(result.plan or ())
    runs = _repeats.find_runs(trace, units) if fold_repeats else None
    ir = build_ir(trace, units, depth=depth, folded=folded, rolled=rolled, progress=pbar, repeats=runs)
    container_notes: list[str] = []
    if show_containers in ("collapsed", "nodes"):
        for where, n in _containers.fold_leaves(trace, ir, container_max_inline):
            container_notes.append(f"{where}: {n} same-shape leaves folded")
    if show_containers == "nodes":
        _containers.container_nodes(trace, ir)

    encoding: dict[str, EncodingState] = {}
    captions: list[str] = []
    if color_by is not None:
        encoding["color"] = node_values(trace, ir, color_by, "color")
    if size_by is not None:
        encoding["size"] = node_values(trace, ir, size_by, "size")
        encoding["size"].scale = scale
    if stack_by is not None and stack_by is not False:
        ir.stack_rank_groups, cap = stack_groups(trace, ir, stack_by)
        captions.append(cap)

    p = trace.provenance
    n_params = sum(q.numel for q in trace._params.values())
    header = [f"{trace.num_ops} ops in {len(trace._layers)} layers, {len(trace._modules)} modules, "
              f"{fmt_count(n_params)} params ({p.backend})"]
    view = []
    if depth is not None:
        view.append(f"depth {depth}")
    if rolled:
        view.append("rolled")
    if folded:
        view.append(f"collapse {result.request}: {len(folded)} module(s) folded")
    for run in ir.repeat_runs:
        view.append(f"{run.addresses[0]} drawn, {run.span} folded ({run.title})")
    view += container_notes
    if view:
        header.append("; ".join(view) + f"; {len(ir.nodes)} nodes drawn")
    header += captions
    header += [msg for _, msg in result.notes]

    engine = "neato" if layout == "rank" else "dot"
    if engine == "dot" and (notebook or fmt not in _TEXT_FORMATS):  # a dot layout will run: say if it is slow
        warn_if_slow(ir.nodes, ir.edges, collapse=result.request, rolled=rolled, stacklevel=4)
    opts = DotOptions(
        theme=th, direction=direction, header=header, title=p.model_class or trace.name,
        show_legend=show_legend, color=encoding.get("color"), size=encoding.get("size"),
        layout="rank" if layout == "rank" else "dot", graph_overrides=graph_overrides,
        node_overrides=_map_node_overrides(ir, node_overrides),
        edge_overrides=_map_edge_overrides(ir, edge_overrides),
    )
    if show_containers:
        opts.edge_labels = _container_labels(trace, ir)
    for edge, role in _attention_labels(trace, ir).items():  # Q/K/V into attention ops
        opts.edge_labels[edge] = role if edge not in opts.edge_labels else f"{opts.edge_labels[edge]} {role}"
    source = emit_dot(ir, opts, progress=pbar)

    schedule = (lambda: _collapse.collapse_schedule(trace, units, depth))
    drawing = Drawing(source, path=None, file_format=fmt, ir=ir, engine=engine, notes=result.notes,
                      collapse=result, encoding=encoding, schedule=schedule)
    if notebook:
        return drawing
    if out_path is None:
        stem = f"trace_{_safe_name(p.model_class or trace.name)}"
        out_path = reserve_path(stem, fmt)
        try:
            write(source, out_path, fmt, engine)
        except BaseException:
            os.unlink(out_path)
            raise
        print(f"torchlens: drawing written to {out_path}")
    else:
        write(source, out_path, fmt, engine)
    drawing.path = out_path
    if open_viewer:
        _open_viewer(out_path)
    return drawing


def _map_node_overrides(ir: RenderIR, overrides: dict) -> dict[str, dict]:
    """Keys are op labels, layer labels (rolled) or module call labels (folded boxes)."""
    by_key = {k: nid for nid, k in ir.key_of.items()}
    out: dict[str, dict] = {}
    for key, attrs in overrides.items():
        nid = by_key.get(key) or ir.node_of.get(key)
        if nid is None:
            raise InvalidArgumentError("draw_option_invalid", f"node_overrides key {key!r} names no drawn node",
                                       remedy="key by an op label (a layer label when rolled, a module call for a folded box)",
                                       option="node_overrides", key=key)
        out.setdefault(nid, {}).update(attrs)
    return out


def _map_edge_overrides(ir: RenderIR, overrides: dict) -> dict[tuple[str, str], dict]:
    by_key = {k: nid for nid, k in ir.key_of.items()}
    out: dict[tuple[str, str], dict] = {}
    for key, attrs in overrides.items():
        if not (isinstance(key, tuple) and len(key) == 2):
            raise InvalidArgumentError("draw_option_invalid", f"edge_overrides key {key!r} is not a (source, target) pair",
                                       remedy="key by (parent label, child label)", option="edge_overrides")
        s = by_key.get(key[0]) or ir.node_of.get(key[0])
        d = by_key.get(key[1]) or ir.node_of.get(key[1])
        if (s, d) not in ir.edges:
            raise InvalidArgumentError("draw_option_invalid", f"edge_overrides key {key!r} names no drawn edge",
                                       remedy="key by (parent label, child label) of an edge in the drawing", option="edge_overrides")
        out.setdefault((s, d), {}).update(attrs)
    return out


def _container_labels(trace: "Trace", ir: RenderIR) -> dict[tuple[str, str], str]:
    """show_containers='labels' (and up): the output slot on each edge out of a multi-output
    op, and the container key on each edge into an output leaf (it wins where both apply)."""
    labels: dict[tuple[str, str], str] = {}
    by_event = {op.event_id: op for op in trace}
    for op in trace:
        dst = ir.node_of[op.label]
        for eid, slot in op.parent_slots:
            parent = by_event.get(eid)
            if parent is None or not parent.multi_output:
                continue
            src = ir.node_of[parent.label]
            if src != dst:
                labels[(src, dst)] = f"[{slot}]"
    for op in trace:  # the key or index on each edge into an output container leaf
        if op.kind != "output":
            continue
        keys = _containers.leaf_keys(op)[1]
        dst = ir.node_of.get(op.label)
        if not keys or dst is None or ir.nodes[dst].kind != "output":
            continue  # a plain output, or a leaf folded into a summary node
        for p in op.parents:
            src = ir.node_of.get(p)
            if src is not None and src != dst:
                labels[(src, dst)] = keys[-1]
    return labels


def _attention_labels(trace: "Trace", ir: RenderIR) -> dict[tuple[str, str], str]:
    """Q/K/V labels on the drawn edges into attention ops (see viz/attention.py)."""
    from torchlens.viz.attention import qkv_edges

    labels: dict[tuple[str, str], str] = {}
    for (parent, op), role in qkv_edges(trace).items():
        src, dst = ir.node_of.get(parent), ir.node_of.get(op)
        if src is not None and dst is not None and src != dst and (src, dst) in ir.edges:
            labels[(src, dst)] = role
    return labels
