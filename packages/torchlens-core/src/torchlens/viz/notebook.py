"""Notebook HTML pieces: the scoped stylesheet, per-op value figures and NaN/Inf badges.

Everything is self-contained HTML: one `<style>` block scoped to `.tlv` (so a notebook's own
styles are untouched), inline SVG for the value histogram and the attention heatmap, and
`<details>` for collapsing; no script and nothing fetched from anywhere (a saved notebook
renders the same offline). Values are read through the trace's backend (`host_values`), so
core still imports no framework.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from torchlens.records.op import Op

CSS = """<style>
.tlv{font-family:system-ui,-apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;font-size:13px;color:#1f2328;
     line-height:1.35;max-width:100%}
.tlv h3{font-size:15px;margin:4px 0 6px 0;font-weight:600}
.tlv .tlv-sub{color:#57606a;margin-bottom:6px}
.tlv table{border-collapse:collapse;margin:2px 0 6px 0;border:1px solid #d0d7de}
.tlv th,.tlv td{border:1px solid #d0d7de;padding:2px 6px;text-align:left;vertical-align:middle}
.tlv thead th{background:#f6f8fa;position:sticky;top:0;z-index:1}
.tlv tbody tr:nth-child(even){background:#fbfcfd}
.tlv td.v,.tlv td.m{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12px}
.tlv th.k{background:#f6f8fa;font-weight:600;white-space:nowrap}
.tlv details{margin:2px 0 2px 10px;border-left:2px solid #d0d7de;padding-left:6px}
.tlv summary{cursor:pointer;font-weight:600;padding:1px 0}
.tlv summary .c{color:#57606a;font-weight:400}
.tlv .scroll{max-height:40em;overflow:auto}
.tlv .scroll table{width:100%;table-layout:fixed}
.tlv .scroll td{overflow-wrap:anywhere}
.tlv .flag{background:#cf222e;color:#fff;border-radius:3px;padding:0 4px;margin-left:4px;font-size:11px;font-weight:600}
.tlv svg{vertical-align:middle}
</style>"""

#: Functions whose output, with at least three axes ([batch, (heads,) q, k]), is drawn as an attention map.
ATTENTION_PROB_FUNCS = frozenset({"softmax", "_softmax", "safe_softmax", "_safe_softmax"})


def esc(s: Any) -> str:
    return (str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
            .replace('"', "&quot;").replace("'", "&#39;"))


def wrap(inner: str) -> str:
    """One styled view: the scoped stylesheet and the content."""
    return f"<div class='tlv'>{CSS}{inner}</div>"


def nonfinite_flags(arr: Any) -> str:
    """`NaN xN` / `Inf xN` badges for a float array (empty for a finite or non-float one)."""
    if arr is None or np.asarray(arr).dtype.kind not in "fc":
        return ""
    with np.errstate(all="ignore"):
        n_nan = int(np.isnan(arr).sum())
        n_inf = int(np.isinf(arr).sum())
    return (f"<span class='flag' title='NaN elements'>NaN x{n_nan}</span>" if n_nan else "") + \
           (f"<span class='flag' title='Inf elements'>Inf x{n_inf}</span>" if n_inf else "")


def histogram_svg(arr: Any, bins: int = 16, width: int = 72, height: int = 18) -> str:
    """A compact histogram of the finite values (one bar per bin, height ~ count)."""
    if arr is None:
        return ""
    flat = np.asarray(arr).reshape(-1)
    if flat.dtype.kind not in "fiub" or flat.size < 2:
        return ""
    with np.errstate(all="ignore"):
        f64 = flat.astype(np.float64)
        finite = f64[np.isfinite(f64)]
    if finite.size < 2:
        return ""
    lo, hi = float(finite.min()), float(finite.max())
    counts, _ = np.histogram(finite, bins=bins, range=(lo, hi) if hi > lo else (lo - 0.5, hi + 0.5))
    top = max(int(counts.max()), 1)
    bw = width / bins
    bars = "".join(
        f"<rect x='{i * bw:.1f}' y='{height - max(1.0, c / top * height):.1f}' width='{bw - 0.5:.1f}' "
        f"height='{max(1.0, c / top * height):.1f}' fill='#0969da'/>" for i, c in enumerate(counts) if c)
    return (f"<svg class='hist' width='{width}' height='{height}' viewBox='0 0 {width} {height}' role='img'>"
            f"<title>histogram of {finite.size} finite values in [{lo:.4g}, {hi:.4g}]</title>"
            f"<rect width='{width}' height='{height}' fill='#f6f8fa'/>{bars}</svg>")


def is_attention_probs(op: "Op") -> bool:
    """A softmax whose output has shape [..., q, k] with at least three axes (batch, heads)."""
    shape = op.shape
    return op.func_name in ATTENTION_PROB_FUNCS and shape is not None and len(shape) >= 3


def heatmap_svg(arr: Any, head: int = 0, cell: float = 0.0, size: int = 72, max_side: int = 64) -> str:
    """The q x k map of one head of an attention-probability array ([..., q, k]; the leading
    axes flattened, `head` picks the row), darker where the probability is higher."""
    if arr is None:
        return ""
    a = np.asarray(arr)
    if a.ndim < 2 or a.dtype.kind not in "fiu":
        return ""
    maps = a.reshape((-1,) + a.shape[-2:])
    if not 0 <= head < maps.shape[0]:
        return ""
    m = maps[head].astype(np.float64)[:max_side, :max_side]
    q, k = m.shape
    if cell <= 0:
        cell = size / max(q, k)
    with np.errstate(all="ignore"):
        finite = m[np.isfinite(m)]
        top = float(finite.max()) if finite.size and finite.max() > 0 else 1.0
    rects = []
    for i in range(q):
        for j in range(k):
            v = m[i, j]
            fill = "#cf222e" if not np.isfinite(v) else "#0969da"
            op_ = 1.0 if not np.isfinite(v) else max(0.0, min(1.0, v / top))
            if op_ > 0.02:
                rects.append(f"<rect x='{j * cell:.2f}' y='{i * cell:.2f}' width='{cell:.2f}' height='{cell:.2f}' "
                             f"fill='{fill}' fill-opacity='{op_:.2f}'/>")
    w, h = k * cell, q * cell
    return (f"<svg class='attn' width='{w:.0f}' height='{h:.0f}' viewBox='0 0 {w:.2f} {h:.2f}' role='img'>"
            f"<title>attention map, head {head}: {q} queries x {k} keys (max {top:.3g})</title>"
            f"<rect width='{w:.2f}' height='{h:.2f}' fill='#ffffff' stroke='#d0d7de'/>{''.join(rects)}</svg>")


def op_arrays(op: "Op") -> Any:
    """The op's first output as a host array (None when not saved or not readable)."""
    from torchlens.viz.tables import host_values

    if not op.saved:
        return None
    try:
        outs = op._outputs
    except AttributeError:
        return None
    if not outs:
        return None
    return host_values(op._trace, outs[0])


def op_figure(op: "Op", arr: Any = None, compact: bool = True) -> str:
    """The op's value figure: an attention heatmap for attention probabilities, else a histogram;
    with NaN/Inf badges."""
    arr = op_arrays(op) if arr is None else arr
    if arr is None:
        return ""
    if is_attention_probs(op):
        if compact:
            fig = heatmap_svg(arr, 0, size=48)
        else:
            n = int(np.prod(np.asarray(arr).shape[:-2])) if np.asarray(arr).ndim > 2 else 1
            fig = " ".join(heatmap_svg(arr, h, size=120) for h in range(min(n, 8)))
            if n > 8:
                fig += f" <span class='c'>(first 8 of {n} heads)</span>"
    else:
        fig = histogram_svg(arr)
    return fig + nonfinite_flags(arr)
