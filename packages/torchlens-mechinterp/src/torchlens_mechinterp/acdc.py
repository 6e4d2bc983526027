"""ACDC as a recipe over `patch_edges` (issue 17; walked through in docs/field-guide/acdc_ioi.md).

Automatic circuit discovery (Conmy et al., 2023) in the component-graph vocabulary: start from
the full model (nothing patched), walk the receivers from the output back to the input (logits,
then the last MLP, the last layer's q/k/v receivers, ...), and for each incoming edge test
patching it on top of everything pruned so far, as one `patch_edges` call (the MIB multi-
receiver convention). When the metric moves by less than `threshold` the edge is pruned (it
stays patched); otherwise it is kept and the patch is withdrawn. Every decision is a ledger row.

Two decisions need no test, and the ledger says so:
- a bias edge (`b{L} -> ...`) is pruned untested: a bias is the same on both inputs, so
  patching it changes nothing (`verdict="pruned_bias"`);
- once every outgoing edge of a head or MLP is pruned, no receiver reads that node's own value
  any more, so its incoming edges are pruned untested (`verdict="pruned_unreachable"`).

This is a recipe, not an engine: each test is a full `patch_edges` call, so its cost grows with
the number of stages the pruned set touches (benchmarks/acdc.py measures it).
"""

from __future__ import annotations

import math
import numbers
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from torchlens.errors import MechInterpError

from torchlens_mechinterp.audit import logits_of, reduce_metric, require_replayable

__all__ = ["acdc", "AcdcResult", "AcdcDecision"]

FUNCTION = "acdc"


@dataclass(frozen=True)
class AcdcDecision:
    """One ledger row. `metric_before` is the metric of the circuit before this decision,
    `metric_after` with the edge patched too (equal to before for untested verdicts);
    `verdict` is "pruned", "kept", "pruned_bias" or "pruned_unreachable"; `test` numbers the
    patch_edges tests (None when untested); `patched_edges` and `stages` size that test."""

    edge: str
    receiver: str
    sender: str
    metric_before: float
    metric_after: float
    verdict: str
    test: int | None = None
    seconds: float = 0.0
    patched_edges: int = 0
    stages: int = 0

    @property
    def delta(self) -> float:
        return self.metric_after - self.metric_before

    @property
    def pruned(self) -> bool:
        return self.verdict != "kept"


@dataclass(frozen=True)
class AcdcResult:
    """The kept circuit (`kept`: edge names), what was pruned, the ledger in decision order,
    and the metric of the full model (`metric_clean`) and of the circuit (`metric_final`,
    one patch_edges call of every pruned edge). `untested` lists edges left when `max_tests`
    stopped the walk (they stay in the circuit; `complete` is then False)."""

    kept: tuple[str, ...]
    pruned: tuple[str, ...]
    ledger: tuple[AcdcDecision, ...]
    metric_clean: float
    metric_final: float
    threshold: float
    tests: int
    untested: tuple[str, ...] = ()
    seconds: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return not self.untested

    def __repr__(self) -> str:
        return (f"AcdcResult(kept {len(self.kept)} of {len(self.kept) + len(self.pruned)} edges, {self.tests} tests, "
                f"metric {self.metric_clean:.4g} -> {self.metric_final:.4g}, complete={self.complete})")


def _setting(why: str, **fields: Any) -> MechInterpError:
    return MechInterpError("mi_acdc_setting_invalid", f"{FUNCTION}: {why}", remedy="acdc(trace, corrupted_graph, "
                           "metric, threshold) with a replayable trace, a callable metric returning one value per "
                           "example, a finite threshold >= 0, edges from the trace's component graph, max_tests a "
                           "positive int or None", function=FUNCTION, **fields)


def acdc(trace: Any, corrupted_graph: Any, metric: Callable[[Any], Any], threshold: float, *,
         edges: Iterable[Any] | None = None, max_tests: int | None = None,
         example_reduction: str = "mean") -> AcdcResult:
    """Prune the component graph of `trace` edge by edge (see the module doc).

    `trace`: a capture with `CaptureOptions(replayable=True)` and `save="all"`;
    `corrupted_graph`: `component_graph` of the corrupted input's capture; `metric(logits)`:
    one value per example (reduced with `example_reduction`) or a scalar; an edge is pruned
    when `|metric(with it patched) - metric(before)| < threshold`. `edges` restricts the walk
    to those edges (the others stay in the circuit untouched); `max_tests` stops after that
    many patch_edges tests. Refusals (before anything runs): `mi_edge_patch_not_replayable`,
    `mi_acdc_setting_invalid`, and patch_edges' own (`mi_edge_corrupted_graph_invalid`,
    `mi_edge_scores_inputs_mismatched`, `mi_edge_scores_shared_norm`)."""
    import torch

    from torchlens_mechinterp.edges import patch_edges
    from torchlens_mechinterp.graph import component_graph

    require_replayable(trace, FUNCTION)
    if not callable(metric):
        raise _setting("metric is not callable")
    if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real) or not math.isfinite(float(threshold)) \
            or threshold < 0:
        raise _setting(f"threshold={threshold!r}", threshold=repr(threshold))
    if max_tests is not None and (isinstance(max_tests, bool) or not isinstance(max_tests, int) or max_tests < 1):
        raise _setting(f"max_tests={max_tests!r}", max_tests=repr(max_tests))
    if example_reduction not in ("mean", "sum"):
        raise _setting(f"example_reduction={example_reduction!r}", example_reduction=repr(example_reduction))
    t_start = time.perf_counter()
    graph = component_graph(trace)
    if edges is None:
        walk = set(graph.edges)
    else:
        if isinstance(edges, str):
            raise _setting("edges= is one string, not a collection of edges")
        names = [e.name if hasattr(e, "name") and hasattr(e, "sender") else e for e in edges]
        unknown = sorted(str(n) for n in names if n not in graph.edges)
        if unknown:
            raise _setting(f"{len(unknown)} edges are not in the trace's component graph: {unknown[:5]}",
                           unknown=unknown)
        if len(set(names)) != len(names):
            raise _setting("an edge is named twice in edges=")
        walk = set(names)
    patch_edges(trace, [], corrupted_graph=corrupted_graph).cleanup()  # patch_edges' own checks, nothing patched

    def measure(patched: list[str]) -> tuple[float, float]:
        t0 = time.perf_counter()
        fork = patch_edges(trace, [graph.edges[n] for n in patched], corrupted_graph=corrupted_graph)
        try:
            with torch.no_grad():
                v = reduce_metric(metric, logits_of(fork, FUNCTION).detach(), example_reduction,
                                  "mi_acdc_setting_invalid", FUNCTION)
        finally:
            fork.cleanup()
        return v, time.perf_counter() - t0

    with torch.no_grad():
        m_clean = reduce_metric(metric, logits_of(trace, FUNCTION).detach(), example_reduction,
                                "mi_acdc_setting_invalid", FUNCTION)
    outgoing: dict[str, list[str]] = {}
    for name, e in graph.edges.items():
        outgoing.setdefault(e.sender.name, []).append(name)
    stage_of = {r.name: r.stage for r in graph.receivers.values()}
    node_of = {r.name: (r.name.split("<", 1)[0] if r.kind in ("q", "k", "v") else r.name)
               for r in graph.receivers.values()}
    receivers = sorted(graph.receivers.values(), key=lambda r: (r.stage, r.name), reverse=True)
    patched: list[str] = []
    patched_set: set[str] = set()
    ledger: list[AcdcDecision] = []
    untested: list[str] = []
    current = m_clean
    tests = 0
    for r in receivers:
        incoming = [f"{s.name}->{r.name}" for s in reversed(r.senders)]
        node = node_of[r.name]
        unreachable = node in outgoing and all(n in patched_set for n in outgoing[node])
        for name in incoming:
            if name not in walk:
                continue
            e = graph.edges[name]
            if max_tests is not None and tests >= max_tests:
                untested.append(name)
                continue
            verdict = "pruned_bias" if e.sender.kind == "bias" else "pruned_unreachable" if unreachable else None
            if verdict is not None:
                patched.append(name)
                patched_set.add(name)
                ledger.append(AcdcDecision(name, r.name, e.sender.name, current, current, verdict,
                                           patched_edges=len(patched)))
                continue
            trial = patched + [name]
            value, seconds = measure(trial)
            tests += 1
            n_stages = len({stage_of[graph.edges[n].receiver.name] for n in trial})
            if abs(value - current) < threshold:
                ledger.append(AcdcDecision(name, r.name, e.sender.name, current, value, "pruned", tests, seconds,
                                           len(trial), n_stages))
                patched, current = trial, value
                patched_set.add(name)
            else:
                ledger.append(AcdcDecision(name, r.name, e.sender.name, current, value, "kept", tests, seconds,
                                           len(trial), n_stages))
    final = measure(patched)[0] if patched else m_clean
    kept = tuple(n for n in graph.edges if n not in patched_set)
    return AcdcResult(kept, tuple(patched), tuple(ledger), m_clean, final, float(threshold), tests, tuple(untested),
                      time.perf_counter() - t_start,
                      {"n_edges": len(graph.edges), "walked": len(walk), "example_reduction": example_reduction})
