"""causal_audit of an EDGE table, and the replayability check patching needs (issue 17).

`causal_audit(table, model, inputs, *, corrupted_input, metric)` grades an `edge_scores`
table the way the glossary's causal_audit entry defines it for EDGE tables: each named edge
is patched ALONE (one `patch_edges` call per edge, so one receiver) with the corrupted input
and metric it was scored with, and the measured change of the metric is set beside the
edge's score (its first-order claim). Every set is measured: `sets_not_measured` is empty,
or the audit refuses before it runs.

`require_replayable(trace, function)` is the check `patch_edges` needs: a trace captured
without `CaptureOptions(replayable=True)` refuses `mi_edge_patch_not_replayable`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from torchlens.errors import MechInterpError

__all__ = ["require_replayable", "causal_audit", "EdgeAudit", "EdgeAuditRow", "reduce_metric", "logits_of"]


def require_replayable(trace: Any, function: str = "patch_edges") -> None:
    """Refuse `mi_edge_patch_not_replayable` unless `trace` was captured with
    `capture=tl.options.CaptureOptions(replayable=True)` (read from `trace.options`, which a
    fork shares and a saved trace keeps)."""
    opts = getattr(trace, "options", None)
    if not bool(getattr(opts, "replayable", False)):
        raise MechInterpError("mi_edge_patch_not_replayable", f"{function}: the trace was not captured with "
                              "replayable=True", remedy="tl.trace(model, x, capture=tl.options.CaptureOptions("
                              "replayable=True), save='all')", function=function)


def logits_of(trace: Any, function: str) -> Any:
    """The unembedding output's saved value on `trace` (or a fork of it)."""
    from torchlens_mechinterp._common import head_facts

    return trace._ops[head_facts(trace, function).logits_label].out


def reduce_metric(metric: Callable[[Any], Any], logits: Any, reduction: str, code: str, function: str) -> float:
    """`metric(logits)` reduced to one float: a per-example [batch] result is averaged
    (`"mean"`) or added (`"sum"`); a 0-d result is taken as it is. Anything else, or a value
    that is not finite, refuses with `code`."""
    m = metric(logits)
    shape = tuple(getattr(m, "shape", ()) or ())
    batch = int(logits.shape[0])
    if not hasattr(m, "shape") or shape not in ((), (batch,)):
        raise MechInterpError(code, f"{function}: the metric returned {shape or type(m).__name__}, not one value "
                              f"per example ({batch},) or a scalar", remedy="return a [batch] tensor, e.g. "
                              "logits[:, -1, a] - logits[:, -1, b]", function=function)
    v = float(m.sum() if (shape and reduction == "sum") else m.mean() if shape else m)
    if not math.isfinite(v):
        raise MechInterpError(code, f"{function}: the metric is not finite ({v})", remedy="use a metric that is "
                              "finite on the clean and patched logits", function=function)
    return v


@dataclass(frozen=True)
class EdgeAuditRow:
    """One audited edge: `site` is the receiver (the residual read the patch writes, at op
    `site_label`), `component` the sender whose value was swapped for its corrupted one;
    `claimed` the table's score, `measured` the metric change patching that edge alone gave
    (patched minus clean, reduced over examples as the table was)."""

    edge: str
    site: str
    site_label: str
    component: str
    claimed: float
    measured: float

    @property
    def error(self) -> float:
        return self.measured - self.claimed


@dataclass(frozen=True)
class EdgeAudit:
    """`causal_audit` of an EDGE table: one row per audited edge, in the table's order."""

    rows: tuple[EdgeAuditRow, ...]
    metric_clean: float
    example_reduction: str
    method: str | None
    sets_not_measured: tuple[str, ...] = ()
    seconds: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, edge: str) -> EdgeAuditRow:
        for r in self.rows:
            if r.edge == edge:
                return r
        raise KeyError(edge)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def pearson(self) -> float | None:
        """Pearson correlation of claimed and measured over the rows (None when either is
        constant or there are fewer than 2 rows)."""
        xs = [r.claimed for r in self.rows]
        ys = [r.measured for r in self.rows]
        n = len(xs)
        if n < 2:
            return None
        mx, my = sum(xs) / n, sum(ys) / n
        sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
        sxx = sum((x - mx) ** 2 for x in xs)
        syy = sum((y - my) ** 2 for y in ys)
        if sxx == 0 or syy == 0:
            return None
        return sxy / math.sqrt(sxx * syy)

    @property
    def sign_agreement(self) -> float | None:
        """Fraction of rows with a nonzero measured effect whose claim has the same sign."""
        hit = [r for r in self.rows if r.measured != 0.0]
        if not hit:
            return None
        return sum(1 for r in hit if (r.claimed > 0) == (r.measured > 0)) / len(hit)

    @property
    def max_abs_error(self) -> float:
        return max((abs(r.error) for r in self.rows), default=0.0)

    def __repr__(self) -> str:
        p = self.pearson
        return (f"EdgeAudit({len(self.rows)} edges, pearson={'n/a' if p is None else f'{p:.3f}'}, "
                f"max_abs_error={self.max_abs_error:.3g}, sets_not_measured={list(self.sets_not_measured)})")


def _table_rows(table: Any, function: str) -> dict[str, float]:
    """edge name -> score of an EDGE table (`edge_scores`'s result or anything with the same
    `items()` layout: ((target, "EDGE", (edge name,)), row with .score))."""
    items = getattr(table, "items", None)
    if not callable(items):
        raise MechInterpError("mi_audit_table_invalid", f"{function}: a {type(table).__name__} is not an EDGE table",
                              remedy="pass the table torchlens.mechinterp.edge_scores returned", function=function)
    out: dict[str, float] = {}
    for key, row in items():
        ok = isinstance(key, tuple) and len(key) == 3 and key[1] == "EDGE" and isinstance(key[2], tuple) \
            and len(key[2]) == 1 and isinstance(key[2][0], str) and hasattr(row, "score")
        if not ok:
            raise MechInterpError("mi_audit_table_invalid", f"{function}: row {key!r} is not an EDGE row "
                                  "(target, 'EDGE', (edge name,))", remedy="pass the table "
                                  "torchlens.mechinterp.edge_scores returned", function=function)
        out[key[2][0]] = float(row.score)
    return out


def causal_audit(table: Any, model: Any, inputs: Any, *, corrupted_input: Any, metric: Callable[[Any], Any],
                 edges: Iterable[str] | None = None) -> EdgeAudit:
    """Grade an EDGE table from `edge_scores` by patching each of its edges alone.

    `inputs`, `corrupted_input` and `metric` are the ones the table was scored with (the table
    keeps neither tensors nor callables); `edges` names a subset of the table's edges (default:
    all). Each edge is one `patch_edges(clean, [edge], corrupted_graph=...)` call on a replayable
    capture of `model` on `inputs`; its measured effect is `metric(patched logits) -
    metric(clean logits)`, reduced over examples with the table's `example_reduction`
    (EAP's first-order estimate of exactly that quantity). Refusals, all before anything is
    patched: `mi_audit_table_invalid` (not an EDGE table, an edge not in it, a table edge
    that is not in this model's component graph), `mi_edge_scores_inputs_mismatched`,
    `mi_edge_scores_metric_invalid`."""
    import torch

    import torchlens as tl
    from torchlens_mechinterp.edges import patch_edges
    from torchlens_mechinterp.graph import component_graph

    function = "causal_audit"
    scores = _table_rows(table, function)
    meta = dict(getattr(table, "meta", {}) or {})
    reduction = meta.get("example_reduction", "mean")
    if edges is None:
        chosen = list(scores)
    else:
        if isinstance(edges, str):
            raise MechInterpError("mi_audit_table_invalid", f"{function}: edges= is one string, not a collection "
                                  "of edge names", remedy=f"edges=[{edges!r}]", function=function)
        chosen = [e.name if hasattr(e, "name") and hasattr(e, "sender") else e for e in edges]
        unknown = [e for e in chosen if e not in scores]
        if unknown:
            raise MechInterpError("mi_audit_table_invalid", f"{function}: {len(unknown)} edges are not rows of the "
                                  f"table: {unknown[:5]}", remedy="name edges the table holds", function=function,
                                  unknown=unknown)
        if len(set(chosen)) != len(chosen):
            raise MechInterpError("mi_audit_table_invalid", f"{function}: an edge is named twice in edges=",
                                  remedy="name each edge once", function=function)
    if not hasattr(inputs, "shape") or not hasattr(corrupted_input, "shape") \
            or tuple(inputs.shape) != tuple(corrupted_input.shape):
        raise MechInterpError("mi_edge_scores_inputs_mismatched", f"{function}: the corrupted input's shape "
                              f"{tuple(getattr(corrupted_input, 'shape', ()))} differs from the clean input's "
                              f"{tuple(getattr(inputs, 'shape', ()))}", remedy="pass the inputs the table was "
                              "scored with", function=function)
    if not callable(metric):
        raise MechInterpError("mi_edge_scores_metric_invalid", f"{function}: metric is not callable",
                              remedy="pass the metric the table was scored with", function=function)
    t0 = time.perf_counter()
    ready = tl.options.CaptureOptions(replayable=True)
    clean = tl.trace(model, inputs, capture=ready, save="all")
    corrupt = tl.trace(model, corrupted_input, capture=ready, save="all")
    try:
        graph = component_graph(clean)
        corrupt_graph = component_graph(corrupt)
        foreign = [e for e in chosen if e not in graph.edges]
        if foreign:
            raise MechInterpError("mi_audit_table_invalid", f"{function}: {len(foreign)} table edges are not in this "
                                  f"model's component graph: {foreign[:5]}", remedy="audit the table with the model "
                                  "and inputs it was scored with", function=function, unknown=foreign)
        with torch.no_grad():
            base = reduce_metric(metric, logits_of(clean, function).detach(), reduction,
                                 "mi_edge_scores_metric_invalid", function)
            rows = []
            for name in chosen:
                e = graph.edges[name]
                fork = patch_edges(clean, [e], corrupted_graph=corrupt_graph)
                after = reduce_metric(metric, logits_of(fork, function).detach(), reduction,
                                      "mi_edge_scores_metric_invalid", function)
                rows.append(EdgeAuditRow(name, e.receiver.name, e.site_label, e.sender.name, scores[name],
                                         after - base))
                fork.cleanup()
    finally:
        for t in (clean, corrupt):
            t.cleanup()
    return EdgeAudit(tuple(rows), base, reduction, meta.get("method"), (), time.perf_counter() - t0,
                     {"table": meta, "n_patch_calls": len(rows)})
