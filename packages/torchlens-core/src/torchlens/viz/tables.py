"""Tables and notebook HTML: `Trace.to_pandas()`, `<accessor>.to_pandas()`,
`Selection.to_dataframe()` and the `_repr_html_` of every record, collection and Selection
(styling and figures in `viz/notebook.py`).

pandas is optional and imported only here, inside the functions that need it. Values are
shown through the trace's backend (`host_copy`), never by importing a framework.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

from torchlens.errors import InvalidArgumentError
from torchlens.viz import notebook as N
from torchlens.viz.units import fmt_bytes, fmt_count, fmt_seconds, fmt_shape, fmt_shapes

if TYPE_CHECKING:  # pragma: no cover
    from torchlens.records.module import Module
    from torchlens.records.op import Layer, Op
    from torchlens.records.trace import Trace

OP_COLUMNS = ("label", "layer_label", "pass_number", "num_passes", "func_name", "kind", "module", "shape",
              "dtype", "numel", "nbytes", "parents", "children", "params", "flops", "macs", "duration_s", "saved")


def _pandas():
    try:
        import pandas
    except ImportError:
        raise InvalidArgumentError("table_render_unavailable", "pandas is not installed",
                                   remedy='pip install "torchlens-core[tables]" (or pip install pandas)') from None
    return pandas


def op_row(op: "Op") -> dict[str, Any]:
    return {
        "label": op.label, "layer_label": op.layer_label, "pass_number": op.pass_number,
        "num_passes": op.num_passes, "func_name": op.func_name, "kind": op.kind, "module": op.module,
        "shape": op.shape, "dtype": op.dtype, "numel": op.numel, "nbytes": op.nbytes,
        "parents": list(op.parents), "children": list(op.children), "params": list(op.params),
        "flops": op.meta.get("flops"), "macs": op.meta.get("macs"), "duration_s": op.meta.get("duration_s"),
        "saved": op.saved,
    }


def ops_dataframe(trace: "Trace", ops: Iterable["Op"] | None = None) -> Any:
    """One row per op (all of the trace's, or the given ones), in trace order."""
    pd = _pandas()
    rows = [op_row(op) for op in (trace if ops is None else ops)]
    df = pd.DataFrame(rows, columns=list(OP_COLUMNS))
    for col in ("flops", "macs"):
        df[col] = df[col].astype("Int64")
    return df


def _layer_row(layer: "Layer") -> dict[str, Any]:
    ops = layer.ops
    shapes = {o.shape for o in ops}
    flops = [o.meta.get("flops") for o in ops if o.meta.get("flops") is not None]
    return {"label": layer.label, "func_name": layer.func_name, "kind": layer.kind, "module": layer.module,
            "num_passes": len(ops), "shape": ops[0].shape if len(shapes) == 1 else None, "dtype": ops[0].dtype,
            "nbytes": sum(o.nbytes for o in ops), "parents": layer.parents, "children": layer.children,
            "params": list(layer.params), "flops": sum(flops) if flops else None}


def _module_row(m: "Module") -> dict[str, Any]:
    return {"address": m.address, "class_name": m.class_name, "parent": m.parent, "children": list(m.children),
            "depth": m.depth, "num_calls": m.num_calls, "num_layers": len(m.layer_labels),
            "num_params": m.num_params, "params": list(m.param_addresses), "buffers": list(m.buffer_addresses),
            "training": m.training}


def _call_row(c: Any) -> dict[str, Any]:
    return {"label": c.label, "address": c.address, "call": c.call, "num_ops": len(c.op_labels),
            "num_layers": c.num_layers, "inputs": list(c.input_labels), "outputs": list(c.output_labels)}


def _param_row(p: Any) -> dict[str, Any]:
    return {"address": p.address, "module": p.module, "name": p.name, "shape": p.shape, "dtype": p.dtype,
            "numel": p.numel, "nbytes": p.nbytes, "trainable": p.trainable, "num_calls": p.num_calls,
            "consumers": list(p.consumer_labels)}


def _buffer_row(b: Any) -> dict[str, Any]:
    return {"address": b.address, "module": b.module, "name": b.name, "shape": b.shape, "dtype": b.dtype,
            "numel": b.numel, "persistent": b.persistent, "versions": list(b.op_labels)}


_ROWS = {"layer": _layer_row, "module": _module_row, "module call": _call_row, "param": _param_row,
         "buffer": _buffer_row}


def collection_dataframe(collection: Any) -> Any:
    """One row per record of an accessor (`trace.layers`, `.modules`, `.params`, ...)."""
    if collection.kind == "op":
        return ops_dataframe(collection._trace, list(collection))
    row = _ROWS.get(collection.kind)
    if row is None:
        raise InvalidArgumentError("invalid_argument", f"no table for {collection.kind} records",
                                   remedy="use trace.to_pandas() for ops")
    pd = _pandas()
    return pd.DataFrame([row(r) for r in collection])


# notebook HTML --------------------------------------------------------------------------

def _esc(s: Any) -> str:
    return str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def host_values(trace: "Trace", value: Any) -> Any:
    """A NumPy copy of a payload through the trace's backend (None if it cannot be read)."""
    import numpy as np

    if value is None:
        return None
    if isinstance(value, np.ndarray) or np.isscalar(value):
        return np.asarray(value)
    backend = getattr(trace, "_backend", None)
    if backend is not None:  # host_copy is a required BackendProtocol member
        try:
            return np.asarray(backend.host_copy(value))
        except Exception:
            return None
    return None


def value_preview(trace: "Trace", value: Any, k: int = 6) -> str:
    """The first `k` values and, for numbers, min/max/mean/std/norm over the finite elements,
    with a NaN/Inf count flag when there are any: `[0.1, -0.3, ...] min -1.2 max 2 mean 0.01 std 0.9 norm 3.1`."""
    import numpy as np

    arr = host_values(trace, value)
    if arr is None:
        return ""
    flat = arr.reshape(-1)
    if flat.dtype.kind in "fc":
        head = ", ".join(f"{v:.4g}" for v in flat[:k])
    else:
        head = ", ".join(str(v) for v in flat[:k])
    text = f"[{head}{', ...' if flat.size > k else ''}]"
    if flat.size > 1 and flat.dtype.kind in "fiu":
        with np.errstate(all="ignore"):
            f64 = flat.astype(np.float64)
            finite = f64[np.isfinite(f64)]
            if finite.size:
                text += (f"  min {finite.min():.4g}  max {finite.max():.4g}  mean {finite.mean():.4g}"
                         f"  std {finite.std():.4g}  norm {np.sqrt(np.sum(finite * finite)):.4g}")
    if flat.dtype.kind in "fc":
        with np.errstate(all="ignore"):
            n_nan = int(np.isnan(flat).sum())
            n_inf = int(np.isinf(flat).sum())
        if n_nan:
            text += f"  NaN x{n_nan}"
        if n_inf:
            text += f"  Inf x{n_inf}"
    return text


def _op_values(op: "Op", arr: Any = None) -> str:
    """The value text of an op's first two outputs (`arr`: the first, already on the host)."""
    if not op.saved:
        return "(not saved)"
    try:
        outs = op._outputs
    except AttributeError:
        return ""
    texts = [value_preview(op._trace, arr if (i == 0 and arr is not None) else v) for i, v in enumerate(outs[:2])]
    return " | ".join(t for t in texts if t)


def _kv_table(title: str, rows: list[tuple[str, Any]], raw: dict[str, str] | None = None, sub: str = "") -> str:
    """A record card: a heading and a two-column table (`raw` cells are trusted HTML we built)."""
    raw = raw or {}
    body = "".join(f"<tr><th class='k'>{_esc(k)}</th><td class='v'>{raw[k] if k in raw else _esc(v)}</td></tr>"
                   for k, v in rows)
    sub_html = f"<div class='tlv-sub'>{_esc(sub)}</div>" if sub else ""
    return N.wrap(f"<h3>{_esc(title)}</h3>{sub_html}<table>{body}</table>")


def _list(labels: Iterable[str], limit: int = 8) -> str:
    labels = list(labels)
    text = ", ".join(labels[:limit])
    return text + (f", ... (+{len(labels) - limit})" if len(labels) > limit else "") if labels else "-"


def op_html(op: "Op") -> str:
    arr = N.op_arrays(op)
    rows = [("func", op.func_name), ("kind", op.kind), ("module", " > ".join(op.module_calls) or "-"),
            ("layer", f"{op.layer_label} (pass {op.pass_number} of {op.num_passes})"),
            ("shape", fmt_shapes(op.shapes, 4)), ("dtype", ", ".join(str(d) for d in op.dtypes) or "-"),
            ("bytes", fmt_bytes(op.nbytes)), ("parents", _list(op.parents)), ("children", _list(op.children))]
    if op.params:
        rows.append(("params", _list(op.params)))
    if op.meta.get("flops") is not None:
        rows.append(("FLOPs", fmt_count(op.meta["flops"])))
    if op.meta.get("duration_s") is not None:
        rows.append(("time", fmt_seconds(op.meta["duration_s"])))
    rows.append(("values", _op_values(op, arr)))
    raw = {}
    fig = N.op_figure(op, arr, compact=False) if arr is not None else ""
    if fig:
        rows.append(("attention" if N.is_attention_probs(op) else "histogram", ""))
        raw[rows[-1][0]] = fig
    return _kv_table(f"Op {op.label}", rows, raw)


def layer_html(layer: "Layer") -> str:
    rows = [("func", layer.func_name), ("kind", layer.kind), ("module", " > ".join(layer.modules) or "-"),
            ("passes", len(layer.ops)), ("parents", _list(layer.parents)), ("children", _list(layer.children))]
    if layer.params:
        rows.append(("params", _list(layer.params)))
    raw = {}
    for op in layer.ops[:6]:
        arr = N.op_arrays(op)
        key = f"pass {op.pass_number}"
        rows.append((key, ""))
        raw[key] = (_esc(f"{fmt_shapes(op.shapes, 2)} {op.dtype or ''}  {_op_values(op, arr)} ")
                    + N.op_figure(op, arr))
    if len(layer.ops) > 6:
        rows.append(("...", f"{len(layer.ops) - 6} more passes"))
    return _kv_table(f"Layer {layer.label}", rows, raw)


def module_html(module: "Module") -> str:
    rows = [("class", module.class_name), ("parent", module.parent or "-"), ("children", _list(module.children)),
            ("calls", _list(c.label for c in module.calls)), ("layers", len(module.layer_labels)),
            ("params", f"{fmt_count(module.num_params_total)} in {len(module.all_param_addresses)} tensors "
                       f"({fmt_count(module.num_params)} its own)")]
    raw = {}
    outs = [op for call in module.calls for op in call.output_ops]
    if outs:
        first = outs[0]
        arr = N.op_arrays(first)
        rows.append(("output", ""))
        raw["output"] = (_esc(f"{first.label}: {fmt_shapes(first.shapes, 2)} {first.dtype or ''}  {_op_values(first, arr)}"
                              + (f"  (+{len(outs) - 1} more output ops)" if len(outs) > 1 else "") + " ")
                         + N.op_figure(first, arr))
    else:
        rows.append(("output", "never called" if not module.calls else "-"))
    for p in module.params[:6]:
        rows.append((p.name, f"{fmt_shape(p.shape)} {p.dtype}{'' if p.trainable else ' (frozen)'}"))
    return _kv_table(f"Module {module.address}", rows, raw)


def call_html(call: Any) -> str:
    ops = call.ops
    head = (f"{len(ops)} ops in {call.num_layers} layers; inputs {_list(call.input_labels, 4)}; "
            f"outputs {_list(call.output_labels, 4)}")
    return N.wrap(f"<h3>ModuleCall {_esc(call.label)}</h3><div class='tlv-sub'>{_esc(head)}</div>"
                  + _ops_table(ops, 1000))


def param_html(p: Any) -> str:
    rows = [("module", p.module), ("shape", fmt_shape(p.shape)), ("dtype", p.dtype), ("numel", fmt_count(p.numel)),
            ("bytes", fmt_bytes(p.nbytes)), ("trainable", p.trainable), ("consumers", _list(p.consumer_labels))]
    arr = host_values(p._trace, p.value) if getattr(p, "value", None) is not None else None
    raw = {}
    if arr is not None:
        rows.append(("values", ""))
        raw["values"] = _esc(value_preview(None, arr) + " ") + N.histogram_svg(arr) + N.nonfinite_flags(arr)
    return _kv_table(f"Param {p.address}", rows, raw)


def buffer_html(b: Any) -> str:
    rows = [("module", b.module), ("shape", fmt_shape(b.shape)), ("dtype", b.dtype), ("numel", fmt_count(b.numel)),
            ("persistent", b.persistent), ("versions", _list(b.op_labels))]
    arr = host_values(b._trace, b.value) if getattr(b, "value", None) is not None else None
    raw = {}
    if arr is not None:
        rows.append(("values", ""))
        raw["values"] = _esc(value_preview(None, arr) + " ") + N.histogram_svg(arr) + N.nonfinite_flags(arr)
    return _kv_table(f"Buffer {b.address}", rows, raw)


_OP_COLS = ("label", "func", "module", "shape", "dtype", "parents", "values", "figure")
_OP_WIDTHS = (11, 7, 14, 7, 6, 12, 34, 9)  # percent; one layout, so the per-module tables line up


def _op_row_html(op: "Op") -> str:
    arr = N.op_arrays(op)
    cells = (op.label, op.func_name, op.module or "-", fmt_shapes(op.shapes, 2), op.dtype or "-",
             _list(op.parents, 3), _op_values(op, arr))
    classes = ("m", "", "", "m", "", "m", "v")
    return ("<tr>" + "".join(f"<td class='{c}'>{_esc(v)}</td>" if c else f"<td>{_esc(v)}</td>"
                             for c, v in zip(classes, cells))
            + f"<td>{N.op_figure(op, arr)}</td></tr>")


def _ops_table(ops: list["Op"], max_ops: int) -> str:
    cols = "<colgroup>" + "".join(f"<col style='width:{w}%'>" for w in _OP_WIDTHS) + "</colgroup>"
    head = cols + "<thead><tr>" + "".join(f"<th>{c}</th>" for c in _OP_COLS) + "</tr></thead>"
    body = [_op_row_html(op) for op in ops[:max_ops]]
    if len(ops) > max_ops:
        body.append(f"<tr><td colspan='{len(_OP_COLS)}'>... {len(ops) - max_ops} more ops "
                    "(trace.to_pandas() lists all)</td></tr>")
    return f"<table>{head}<tbody>{''.join(body)}</tbody></table>"


def _module_path(op: "Op") -> list[str]:
    return [c for c in (op.module_calls or ()) if not str(c).startswith("self:")]


def _grouped_ops(trace: "Trace", ops: list["Op"]) -> str:
    """Ops in trace order inside nested `<details>`, one per module call (collapsible), each
    run of ops with the same innermost call in one table."""
    from collections import Counter

    counts: Counter = Counter()
    for op in ops:
        for c in _module_path(op):
            counts[c] += 1
    out: list[str] = []
    stack: list[str] = []
    run: list["Op"] = []

    def flush() -> None:
        if run:
            out.append(_ops_table(run, len(run)))
            run.clear()

    for op in ops:
        path = _module_path(op)
        if path != stack:
            flush()
            common = 0
            while common < min(len(path), len(stack)) and path[common] == stack[common]:
                common += 1
            out.extend("</details>" for _ in stack[common:])
            for call in path[common:]:
                address = call.rpartition(":")[0]
                mod = trace._modules.get(address)
                cls = f" {mod.class_name}" if mod is not None else ""
                out.append(f"<details open class='mod'><summary>{_esc(call)}<span class='c'>{_esc(cls)} "
                           f"&middot; {counts[call]} ops</span></summary>")
            stack = path
        run.append(op)
    flush()
    out.extend("</details>" for _ in stack)
    return "".join(out)


def trace_html(trace: "Trace", max_ops: int = 1000) -> str:
    """A header of totals and the first `max_ops` ops, grouped by module call in collapsible
    sections, each op with its shape, value statistics, a histogram (an attention heatmap for
    attention probabilities) and NaN/Inf flags, in a scrolling box."""
    p = trace.provenance
    n_params = sum(q.numel for q in trace._params.values())
    head = (f"<h3>Trace of {_esc(p.model_class or trace.name)}</h3><div class='tlv-sub'>({_esc(p.backend)}) "
            f"{trace.num_ops} ops in {len(trace._layers)} layers, {len(trace._modules)} modules, "
            f"{fmt_count(n_params)} params, activations {fmt_bytes(trace.cost.total_activation_memory)}</div>")
    ops = list(trace)
    more = (f"<div class='tlv-sub'>... {len(ops) - max_ops} more ops (trace.to_pandas() lists all)</div>"
            if len(ops) > max_ops else "")
    return N.wrap(head + f"<div class='scroll'>{_grouped_ops(trace, ops[:max_ops])}</div>" + more)


def records_html(title: str, records: list[Any], kind: str, max_rows: int = 1000) -> str:
    """A collection or Selection: ops as the op table (with figures), other records one row each."""
    head = f"<h3>{_esc(title)}</h3>"
    if kind == "op":
        return N.wrap(head + f"<div class='scroll'>{_ops_table(records, max_rows)}</div>")
    row = _ROWS.get(kind)
    if row is None or not records:
        return N.wrap(head + f"<div class='tlv-sub'>{_esc(_list((getattr(r, 'label', r) for r in records), 50))}</div>")
    dicts = [row(r) for r in records[:max_rows]]
    cols = list(dicts[0])
    body = "".join("<tr>" + "".join(f"<td>{_esc(_cell(d[c]))}</td>" for c in cols) + "</tr>" for d in dicts)
    if len(records) > max_rows:
        body += f"<tr><td colspan='{len(cols)}'>... {len(records) - max_rows} more</td></tr>"
    table = "<table><thead><tr>" + "".join(f"<th>{_esc(c)}</th>" for c in cols) + f"</tr></thead><tbody>{body}</tbody></table>"
    return N.wrap(head + f"<div class='scroll'>{table}</div>")


def _cell(v: Any) -> str:
    if isinstance(v, (list, tuple)) and not (v and isinstance(v[0], int)):
        return _list(str(x) for x in v)
    if isinstance(v, tuple):
        return fmt_shape(v)
    return "-" if v is None else str(v)


def collection_html(collection: Any) -> str:
    return records_html(f"{len(collection)} {collection.kind}s", list(collection), collection.kind)


def selection_html(selection: Any) -> str:
    sel = getattr(selection, "selector", None)
    title = f"Selection: {len(selection)} ops" + (f" matched by {sel!r}" if sel is not None else "")
    return records_html(title, list(selection), "op")
