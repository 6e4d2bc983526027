"""tl.viz.contact_sheet: a grid of small heatmaps, one per site (and per member of a Bundle).

Each cell shows one site's saved output as a heatmap, so many sites (or the same sites across
runs) can be scanned at a glance. The picture is SVG written here directly (no Graphviz, no
plotting library); every number behind it is kept on the returned `ContactSheet`.

How a value becomes a 2-D grid (stated, never guessed per site):
- leading dimensions of size 1 are dropped; a 0-d value is a 1x1 grid; a 1-D value one row;
- more than two dimensions: every dimension but the last is flattened into rows
  (a (heads, positions, dim) value draws heads*positions rows of dim columns);
- a grid larger than `max_pixels` on a side is block-averaged down (a block is
  ceil(rows / max_pixels) by ceil(cols / max_pixels) elements; edge blocks average what they hold).

Colour: a cell whose values take both signs uses a diverging blue-white-red ramp symmetric
around 0 (white = 0, full colour = the largest |value|); otherwise the viridis ramp from min to
max. For a Bundle every column (site) shares one scale across members, so equal colours mean
equal values. A site with no saved array refuses (`activation_not_saved`), never draws blank.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from torchlens.errors import InvalidArgumentError, PayloadUnavailableError
from torchlens.records import Layer, Op
from torchlens.viz.ramp import Ramp, default_ramp

DIVERGING = ("#2166ac", "#67a9cf", "#d1e5f0", "#f7f7f7", "#fddbc7", "#ef8a62", "#b2182b")
_DIV: Ramp | None = None
MAX_CELLS = 256


def diverging_ramp() -> Ramp:
    global _DIV
    if _DIV is None:
        _DIV = Ramp(DIVERGING)
    return _DIV


@dataclass
class Cell:
    """One heatmap: `grid` is the 2-D array drawn (after reduction), `scale` its (lo, hi)."""

    row: str
    site: str
    shape: tuple[int, ...]
    grid: np.ndarray
    scale: tuple[float, float]
    diverging: bool


@dataclass
class ContactSheet:
    """The SVG text (`str(sheet)`), where it was written (`path`), and every cell drawn."""

    source: str
    path: str | None
    cells: list[Cell] = field(default_factory=list)

    def __str__(self) -> str:
        return self.source

    def _repr_svg_(self) -> str:
        return self.source


def to_grid(arr: np.ndarray, max_pixels: int) -> np.ndarray:
    """The 2-D float64 grid a value draws as (see the module docstring)."""
    a = np.asarray(arr)
    if np.iscomplexobj(a):
        a = np.abs(a)
    a = a.astype(np.float64, copy=False)
    shape = list(a.shape)
    while len(shape) > 1 and shape[0] == 1:
        shape.pop(0)
    a = a.reshape(shape) if shape else a.reshape(1, 1)
    if a.ndim == 1:
        a = a.reshape(1, -1)
    elif a.ndim > 2:
        a = a.reshape(-1, a.shape[-1])
    rows, cols = a.shape
    br, bc = max(1, math.ceil(rows / max_pixels)), max(1, math.ceil(cols / max_pixels))
    if br == 1 and bc == 1:
        return a
    out = np.empty((math.ceil(rows / br), math.ceil(cols / bc)))
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            out[i, j] = a[i * br:(i + 1) * br, j * bc:(j + 1) * bc].mean()
    return out


def cell_color(v: float, lo: float, hi: float, diverging: bool) -> str:
    """The fill of one grid element on its cell's scale."""
    if not math.isfinite(v):
        return "#000000"  # NaN / Inf are black, never a colour on the scale
    if diverging:
        m = max(abs(lo), abs(hi))
        return diverging_ramp()(0.5 if m == 0 else 0.5 + 0.5 * v / m)
    return default_ramp()(0.0 if hi == lo else (v - lo) / (hi - lo))


def _host(trace: Any, op: Any, on: str) -> np.ndarray:
    """The op's output (or gradient) as one host array, through the trace's backend host copy
    (several output slots are flattened and joined in slot order)."""
    slots = (op._outputs if op.saved else None) if on == "out" else op.grads
    backend = trace._backend
    arrays = []
    for v in slots or ():
        if isinstance(v, np.ndarray):
            arrays.append(v)
        elif backend is not None and backend.is_tensor(v):
            arrays.append(np.asarray(backend.host_copy(v)))
        else:
            arrays = []
            break
    if not arrays:
        raise PayloadUnavailableError("activation_not_saved" if on == "out" else "grad_not_saved",
                                      f"op {op.label!r} has no saved {on} array to draw",
                                      remedy="capture with the site saved, or leave it out of sites=", label=op.label)
    return arrays[0] if len(arrays) == 1 else np.concatenate([np.asarray(a).reshape(-1) for a in arrays])


def _sites(trace: Any, sites: Any) -> list[str]:
    if sites is None:
        return [o.label for o in trace._ops.values() if o.saved and o.kind not in ("input", "output")]
    if isinstance(sites, str):
        sites = [sites]
    if isinstance(sites, (list, tuple)):
        out = []
        for s in sites:
            if isinstance(s, str):
                rec = trace._ops.get(s) or trace[s]
                if isinstance(rec, Layer):
                    out.extend(o.label for o in rec.ops)
                elif isinstance(rec, Op):
                    out.append(rec.label)
                else:
                    raise InvalidArgumentError("draw_option_invalid", f"site {s!r} names a {type(rec).__name__}, "
                                               "not an op or layer", remedy="pass op or layer labels", option="sites")
            else:
                out.extend(trace.find_sites(s).labels)
        return out
    return list(trace.find_sites(sites).labels)


def contact_sheet(source: Any, sites: Any = None, *, path: Any = None, columns: int | None = None, on: str = "out",
                  cell_px: int = 96, max_pixels: int = 64, max_cells: int = MAX_CELLS) -> ContactSheet:
    """A grid of heatmaps of `sites` (labels, a selector, or None: every saved op) of a Trace,
    or of every member of a Bundle (one row per member, one shared scale per site)."""
    from torchlens.records.trace import Trace

    for name, v, low in (("cell_px", cell_px, 8), ("max_pixels", max_pixels, 1), ("max_cells", max_cells, 1)):
        if type(v) is not int or v < low:
            raise InvalidArgumentError("draw_option_invalid", f"{name}={v!r} is not an int >= {low}",
                                       remedy=f"pass {name} as an int >= {low}", option=name)
    if on not in ("out", "grad"):
        raise InvalidArgumentError("draw_option_invalid", f"on={on!r} is not 'out' or 'grad'", remedy="on='out'",
                                   option="on")
    if isinstance(source, Trace):
        rows = {source.name: source}
        labels = _sites(source, sites)
    elif hasattr(source, "members") and hasattr(source, "names"):
        rows = dict(source.members)
        if not rows:
            raise InvalidArgumentError("draw_option_invalid", "the bundle has no members", remedy="add members first",
                                       option="source")
        labels = _sites(next(iter(rows.values())), sites)
    else:
        raise InvalidArgumentError("draw_option_invalid", f"contact_sheet draws a Trace or a Bundle, not "
                                   f"{type(source).__name__}", remedy="pass a tl.Trace or a tl.Bundle", option="source")
    if not labels:
        raise InvalidArgumentError("draw_option_invalid", "no sites to draw", remedy="pass sites=", option="sites")
    n_cells = len(labels) * len(rows)
    if n_cells > max_cells:
        raise InvalidArgumentError("draw_option_invalid", f"{n_cells} cells exceed max_cells={max_cells}",
                                   remedy="pass fewer sites= (or raise max_cells=)", option="max_cells")
    cells: list[Cell] = []
    for label in labels:
        col = []
        for rname, t in rows.items():
            if label not in t._ops:
                raise InvalidArgumentError("draw_option_invalid", f"member {rname!r} has no op {label!r}",
                                           remedy="draw sites every member holds", option="sites")
            arr = _host(t, t._ops[label], on)
            col.append(Cell(rname, label, tuple(np.shape(arr)), to_grid(arr, max_pixels), (0.0, 0.0), False))
        finite = [g[np.isfinite(g)] for g in (c.grid for c in col)]
        vals = np.concatenate([f.reshape(-1) for f in finite]) if finite else np.zeros(0)
        lo, hi = (float(vals.min()), float(vals.max())) if vals.size else (0.0, 0.0)
        div = lo < 0 < hi
        for c in col:
            c.scale, c.diverging = (lo, hi), div
        cells.extend(col)
    svg = _svg(cells, list(rows), labels, columns, cell_px, len(rows) > 1 or not isinstance(source, Trace))
    out_path = None
    if path is not None:
        out_path = os.fspath(path)
        if os.path.splitext(out_path)[1].lower() != ".svg":
            raise InvalidArgumentError("file_format_unsupported", f"contact_sheet writes SVG; {out_path!r} is not .svg",
                                       remedy="give a path ending in .svg", file_format=os.path.splitext(out_path)[1])
        with open(out_path, "w", encoding="utf-8") as f:
            f.write(svg)
    return ContactSheet(svg, out_path, cells)


def _esc(s: Any) -> str:
    return str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def _svg(cells: list[Cell], row_names: list[str], labels: list[str], columns: int | None, px: int,
         by_member: bool) -> str:
    pad, title_h, foot_h, row_label_w = 8, 14, 12, (90 if by_member else 0)
    if by_member:
        ncols, nrows = len(labels), len(row_names)
    else:
        ncols = columns or min(len(labels), 6)
        nrows = math.ceil(len(labels) / ncols)
    cw, ch = px + pad, px + title_h + foot_h + pad
    width, height = row_label_w + ncols * cw + pad, nrows * ch + pad
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="Helvetica" font-size="9">',
           f'<rect width="{width}" height="{height}" fill="white"/>']
    for k, c in enumerate(cells):
        if by_member:
            ci, ri = labels.index(c.site), row_names.index(c.row)
        else:
            ci, ri = k % ncols, k // ncols
        x0, y0 = row_label_w + pad + ci * cw, pad + ri * ch
        if by_member and ci == 0:
            out.append(f'<text x="{pad}" y="{y0 + title_h + px / 2}">{_esc(c.row)}</text>')
        out.append(f'<text x="{x0}" y="{y0 + 10}">{_esc(c.site)}</text>')
        g = c.grid
        rows, cols = g.shape
        sx, sy = px / cols, px / rows
        out.append(f'<g class="cell" data-site="{_esc(c.site)}" data-row="{_esc(c.row)}" '
                   f'transform="translate({x0},{y0 + title_h})">')
        lo, hi = c.scale
        for i in range(rows):
            for j in range(cols):
                out.append(f'<rect x="{j * sx:.3f}" y="{i * sy:.3f}" width="{sx:.3f}" height="{sy:.3f}" '
                           f'fill="{cell_color(float(g[i, j]), lo, hi, c.diverging)}"/>')
        out.append("</g>")
        shape = "x".join(str(d) for d in c.shape) or "scalar"
        out.append(f'<text x="{x0}" y="{y0 + title_h + px + 10}" fill="#555">{shape}  [{lo:.3g}, {hi:.3g}]</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


__all__ = ["contact_sheet", "ContactSheet", "Cell", "to_grid", "cell_color"]
