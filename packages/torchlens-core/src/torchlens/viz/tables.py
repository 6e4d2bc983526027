"""Tables and notebook HTML: `Trace.to_pandas()`, `<accessor>.to_pandas()`,
`Selection.to_dataframe()` and the `_repr_html_` of Trace, Op, Layer and Module.

pandas is optional and imported only here, inside the functions that need it. Values are
shown through the trace's backend (`host_copy`), never by importing a framework.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

from torchlens.errors import InvalidArgumentError
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


def _op_values(op: "Op") -> str:
    if not op.saved:
        return "(not saved)"
    try:
        outs = op._outputs
    except AttributeError:
        return ""
    texts = [value_preview(op._trace, v) for v in outs[:2]]
    return " | ".join(t for t in texts if t)


def _kv_table(title: str, rows: list[tuple[str, Any]]) -> str:
    body = "".join(f"<tr><th style='text-align:left;padding-right:1em'>{_esc(k)}</th>"
                   f"<td style='text-align:left;font-family:monospace'>{_esc(v)}</td></tr>" for k, v in rows)
    return f"<div><b>{_esc(title)}</b><table>{body}</table></div>"


def _list(labels: Iterable[str], limit: int = 8) -> str:
    labels = list(labels)
    text = ", ".join(labels[:limit])
    return text + (f", ... (+{len(labels) - limit})" if len(labels) > limit else "") if labels else "-"


def op_html(op: "Op") -> str:
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
    rows.append(("values", _op_values(op)))
    return _kv_table(f"Op {op.label}", rows)


def layer_html(layer: "Layer") -> str:
    rows = [("func", layer.func_name), ("kind", layer.kind), ("module", " > ".join(layer.modules) or "-"),
            ("passes", len(layer.ops)), ("parents", _list(layer.parents)), ("children", _list(layer.children))]
    if layer.params:
        rows.append(("params", _list(layer.params)))
    for op in layer.ops[:6]:
        rows.append((f"pass {op.pass_number}", f"{fmt_shapes(op.shapes, 2)} {op.dtype or ''}  {_op_values(op)}"))
    if len(layer.ops) > 6:
        rows.append(("...", f"{len(layer.ops) - 6} more passes"))
    return _kv_table(f"Layer {layer.label}", rows)


def module_html(module: "Module") -> str:
    rows = [("class", module.class_name), ("parent", module.parent or "-"), ("children", _list(module.children)),
            ("calls", _list(c.label for c in module.calls)), ("layers", len(module.layer_labels)),
            ("params", f"{fmt_count(module.num_params_total)} in {len(module.all_param_addresses)} tensors "
                       f"({fmt_count(module.num_params)} its own)")]
    outs = [op for call in module.calls for op in call.output_ops]
    if outs:
        first = outs[0]
        rows.append(("output", f"{first.label}: {fmt_shapes(first.shapes, 2)} {first.dtype or ''}  {_op_values(first)}"
                               + (f"  (+{len(outs) - 1} more output ops)" if len(outs) > 1 else "")))
    else:
        rows.append(("output", "never called" if not module.calls else "-"))
    for p in module.params[:6]:
        rows.append((p.name, f"{fmt_shape(p.shape)} {p.dtype}{'' if p.trainable else ' (frozen)'}"))
    return _kv_table(f"Module {module.address}", rows)


def trace_html(trace: "Trace", max_ops: int = 1000) -> str:
    """A header of totals and the first `max_ops` ops with shapes and a few values, in a
    scrolling box (a GPT-2 block is ~50 ops, so a short cut-off hid the attention ops)."""
    p = trace.provenance
    n_params = sum(q.numel for q in trace._params.values())
    head = (f"<div><b>Trace of {_esc(p.model_class or trace.name)}</b> ({_esc(p.backend)}): "
            f"{trace.num_ops} ops in {len(trace._layers)} layers, {len(trace._modules)} modules, "
            f"{fmt_count(n_params)} params, activations {fmt_bytes(trace.cost.total_activation_memory)}</div>")
    cols = ("label", "func", "module", "shape", "dtype", "parents", "values")
    body = []
    ops = list(trace)
    for op in ops[:max_ops]:
        cells = (op.label, op.func_name, op.module or "-", fmt_shapes(op.shapes, 2), op.dtype or "-",
                 _list(op.parents, 3), _op_values(op))
        body.append("<tr>" + "".join(f"<td style='text-align:left'>{_esc(c)}</td>" for c in cells) + "</tr>")
    if len(ops) > max_ops:
        body.append(f"<tr><td colspan='{len(cols)}'>... {len(ops) - max_ops} more ops (trace.to_pandas() lists all)</td></tr>")
    table = ("<div style='max-height:40em;overflow:auto'><table><thead><tr>" +
             "".join(f"<th style='text-align:left'>{c}</th>" for c in cols) +
             "</tr></thead><tbody>" + "".join(body) + "</tbody></table></div>")
    return head + table
