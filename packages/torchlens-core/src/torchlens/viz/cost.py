"""Layout cost: warn before a Graphviz `dot` layout that is expected to take long.

Why: almost all the time of drawing a big real graph goes to `dot`. Its cost follows the
graph it really lays out: the drawn nodes plus one virtual node per rank an edge skips
(`dot` routes long edges through chains of them). Mask R-CNN (2,583 ops, 2-core machine):
`collapse="none"` took 29 s in `dot` (its detection head's per-mask loop draws edges that
span hundreds of ranks), `layout="rank"` (positions computed here, drawn with `neato -n2`)
0.5 s, while a 2,604-node chain of transformer blocks takes 3.4 s. So before running `dot`
we count layout units (nodes + skipped ranks, with longest-path ranks) and, when the
estimate exceeds `LAYOUT_WARN_SECONDS`, warn with a `DrawCostWarning` (code
`draw_layout_slow`) naming the estimate and the faster paths. The fit is to measurements on
the project's 2-core machine: indicative, never a promise, and it never changes the drawing.
"""

from __future__ import annotations

import warnings
from typing import Any, Iterable

from torchlens.errors import DrawCostWarning

#: Warn when the estimated `dot` layout time exceeds this many seconds.
LAYOUT_WARN_SECONDS = 10.0
#: Fit of `dot` wall time, seconds = _A * (nodes/1000)**2 + _B * (units/10000)**_P, to five
#: drawings timed on the 2-core machine: a 2,605-node block chain (4,805 units) 3.4 s; a
#: 2,428-node synthetic detection loop (14,028 units) 3.6 s; Mask R-CNN collapse="none"
#: 3,195 nodes (47,562 units) 48 s, rolled 707 nodes (9,040 units) 1.3 s, auto-collapsed
#: 1,687 nodes (2,358 units) 1.3 s.
_A = 0.45
_B = 0.31
_P = 3.17


def layout_units(nodes: Iterable[str], edges: Iterable[tuple[str, str]]) -> int:
    """Nodes plus the ranks each edge skips, with longest-path ranks over the nodes in
    their drawing (execution) order; an edge back to an earlier node counts its span too."""
    order = {n: i for i, n in enumerate(nodes)}
    preds: dict[str, list[str]] = {}
    pairs = [(s, d) for s, d in edges if s in order and d in order]
    for s, d in pairs:
        if order[s] < order[d]:
            preds.setdefault(d, []).append(s)
    rank: dict[str, int] = {}
    for n in order:
        ps = preds.get(n)
        rank[n] = max(rank[p] for p in ps) + 1 if ps else 0
    return len(order) + sum(max(abs(rank[d] - rank[s]) - 1, 0) for s, d in pairs)


def estimate_dot_seconds(num_nodes: int, units: int) -> float:
    """Expected `dot` layout time for `num_nodes` nodes and `units` layout units (indicative)."""
    return _A * (max(num_nodes, 0) / 1000) ** 2 + _B * (max(units, 0) / 10000) ** _P


def warn_if_slow(nodes: Iterable[str], edges: Iterable[tuple[str, str]], *, collapse: Any, rolled: bool,
                 stacklevel: int = 3) -> float:
    """Warn (`draw_layout_slow`) when the estimated `dot` time exceeds `LAYOUT_WARN_SECONDS`;
    returns the estimate in seconds."""
    nodes, edges = list(nodes), list(edges)
    units = layout_units(nodes, edges)
    est = estimate_dot_seconds(len(nodes), units)
    if est > LAYOUT_WARN_SECONDS:
        warnings.warn(DrawCostWarning(
            "draw_layout_slow",
            f"laying out {len(nodes)} nodes and {len(edges)} edges ({units} layout units) with Graphviz dot is "
            f"expected to take about {est:.0f} s (collapse={collapse!r}, rolled={rolled})",
            remedy="keep collapse='auto' (the default folds modules above 2000 nodes), fold with depth=N, "
                   "draw with layout='rank' (a fast layered layout, seconds), or write a .dot file and lay it "
                   "out later",
            num_nodes=len(nodes), num_edges=len(edges), layout_units=units, estimated_s=round(est, 1),
            collapse=str(collapse), rolled=rolled), stacklevel=stacklevel)
    return est


__all__ = ["LAYOUT_WARN_SECONDS", "layout_units", "estimate_dot_seconds", "warn_if_slow"]
