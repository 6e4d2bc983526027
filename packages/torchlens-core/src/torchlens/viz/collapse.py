"""Collapse: a rendering-only condensation of module detail (spec: Collapse).

`collapse="none"` draws every unit; `"max"` folds every module worth folding; a float c in
[0, 1] aims for a drawn size c of the way from the full graph to the max plan; `"auto"`
draws everything while the graph is within `COLLAPSE_OPTIMIZER_MAX_OPS` and otherwise takes
the compact fallback. Requests over budget degrade to a deterministic fallback plan (note
`collapse_budget_fallback`), never an uncollapsed wall; pathologically large traces skip
collapsing (note `collapse_pathological_skip`) and have no plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torchlens.errors import InvalidArgumentError
from torchlens.viz.ir import Unit, drawn_size

if TYPE_CHECKING:  # pragma: no cover
    from torchlens.records.module import Module
    from torchlens.records.trace import Trace

COLLAPSE_OPTIMIZER_MAX_OPS = 2000
#: Raw op counts above this factor times the limit skip collapsing entirely.
PATHOLOGICAL_FACTOR = 20
#: The optimizer's work estimate (candidates x units) it may spend before falling back.
COLLAPSE_WORK_BUDGET = 4_000_000


def collapse_scores(trace: "Trace") -> dict[str, float]:
    """Every module's smart-collapse priority (spec: Module.collapse_score).

    The module's hidden ops (distinct subtree ops minus one) over the largest non-root
    module's, rounded to 6 places; 0.0 for the root, for a module of at most one Layer, and
    for the only child of a non-root module that hides the same ops (the parent ranks).
    """
    n_ops: dict[str, int] = {}
    layers: dict[str, set[str]] = {}
    for op in trace:
        for a in set(op.modules):
            n_ops[a] = n_ops.get(a, 0) + 1
            layers.setdefault(a, set()).add(op.layer_label)
    modules = trace._modules
    hidden = {a: max(n_ops.get(a, 0) - 1, 0) for a in modules}
    largest = max((h for a, h in hidden.items() if a != "self"), default=0)
    scores: dict[str, float] = {}
    for a, mod in modules.items():
        if a == "self" or len(layers.get(a, ())) <= 1 or largest == 0:
            scores[a] = 0.0
            continue
        parent = mod.parent
        if parent is not None and parent != "self" and parent in modules:
            live = [c for c in modules[parent].children if n_ops.get(c, 0)]
            if live == [a] and hidden[parent] == hidden[a]:
                scores[a] = 0.0
                continue
        scores[a] = round(hidden[a] / largest, 6)
    return scores


def collapse_score(module: "Module") -> float:
    """`Module.collapse_score`: this module's priority (computed when read, never saved)."""
    return collapse_scores(module._trace).get(module.address, 0.0)


def module_collapse_order(trace: "Trace") -> list[tuple[str, float]]:
    """`Trace.module_collapse_order`: every module's priority, highest first (ties in
    trace order)."""
    scores = collapse_scores(trace)
    order = {a: i for i, a in enumerate(trace._modules)}
    return sorted(scores.items(), key=lambda kv: (-kv[1], order[kv[0]]))


@dataclass
class CollapseResult:
    """What collapse decided: the folded module addresses and why."""

    request: Any
    plan: tuple[str, ...] | None  # None: no plan (pathological skip)
    size: int
    full_size: int
    notes: list[tuple[str, str]] = field(default_factory=list)


def validate_collapse(value: Any) -> Any:
    if isinstance(value, str) and value in ("none", "auto", "max"):
        return value
    if value is None or value is False:
        return "none"
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= float(value) <= 1.0:
        return float(value)
    raise InvalidArgumentError("collapse_value_invalid", f"collapse={value!r} is not valid",
                               remedy="use 'none', 'auto', 'max' or a float in [0, 1]", collapse=repr(value))


def _candidates(trace: "Trace", units: list[Unit], depth: int | None) -> list[str]:
    """Modules worth folding, highest priority first, excluding ones depth already hides."""
    visible: set[str] = set()
    for u in units:
        lim = len(u.addresses) if depth is None else min(len(u.addresses), depth - 1)
        visible.update(u.addresses[:lim])
    return [a for a, s in module_collapse_order(trace) if s > 0 and a in visible]


def _max_plan(trace: "Trace", units: list[Unit], candidates: list[str]) -> tuple[str, ...]:
    chosen: list[str] = []
    taken: set[str] = set()
    modules = trace._modules
    for a in candidates:
        p = modules[a].parent
        hidden_by_ancestor = False
        while p is not None:
            if p in taken:
                hidden_by_ancestor = True
                break
            # an uncalled ancestor (a ModuleList) has no record: step up by address
            p = modules[p].parent if p in modules else (None if p == "self" else p.rpartition(".")[0] or "self")
        if not hidden_by_ancestor:
            chosen.append(a)
            taken.add(a)
    return tuple(chosen)


def _fallback_plan(trace: "Trace", units: list[Unit], depth: int | None) -> tuple[str, ...]:
    """Fold every module at the deepest nesting level that fits the limit (else level 1)."""
    by_level: dict[int, set[str]] = {}
    for u in units:
        for i, a in enumerate(u.addresses):
            by_level.setdefault(i, set()).add(a)
    best: tuple[str, ...] = tuple(sorted(by_level.get(0, ())))
    for level in sorted(by_level):
        plan = frozenset(by_level[level])
        if drawn_size(units, depth, plan) <= COLLAPSE_OPTIMIZER_MAX_OPS:
            best = tuple(sorted(plan))
        else:
            break
    return best


def plan_collapse(trace: "Trace", units: list[Unit], collapse: Any, depth: int | None) -> CollapseResult:
    """Decide the folded modules for a `collapse=` request."""
    request = validate_collapse(collapse)
    full = drawn_size(units, depth, frozenset())
    if request == "none":
        return CollapseResult(request, (), full, full)
    if trace.num_ops > PATHOLOGICAL_FACTOR * COLLAPSE_OPTIMIZER_MAX_OPS:
        note = ("collapse_pathological_skip",
                f"{trace.num_ops} ops exceed {PATHOLOGICAL_FACTOR}x the collapse limit; collapsing skipped")
        return CollapseResult(request, None, full, full, [note])
    if request == "auto" and full <= COLLAPSE_OPTIMIZER_MAX_OPS:
        return CollapseResult(request, (), full, full)
    candidates = _candidates(trace, units, depth)
    if request == "max":
        plan = _max_plan(trace, units, candidates)
        return CollapseResult(request, plan, drawn_size(units, depth, frozenset(plan)), full)
    work = len(candidates) * len(units)
    if request == "auto" or full > COLLAPSE_OPTIMIZER_MAX_OPS or work > COLLAPSE_WORK_BUDGET:
        plan = _fallback_plan(trace, units, depth)
        note = ("collapse_budget_fallback",
                f"{full} drawn nodes (work estimate {work}) exceed the collapse budget "
                f"({COLLAPSE_OPTIMIZER_MAX_OPS} nodes); used the compact fallback plan")
        return CollapseResult(request, plan, drawn_size(units, depth, frozenset(plan)), full, [note])
    if request == 0.0 or not candidates:
        return CollapseResult(request, (), full, full)
    max_plan = _max_plan(trace, units, candidates)
    smallest = drawn_size(units, depth, frozenset(max_plan))
    target = math.ceil(smallest + (1.0 - request) * (full - smallest))
    chosen: list[str] = []
    size = full
    for a in candidates:
        if size <= target:
            break
        trial = frozenset(chosen + [a])
        s = drawn_size(units, depth, trial)
        if s < size and s >= target:
            chosen.append(a)
            size = s
    if size > target:  # nothing fine-grained fits: take the candidates that overshoot least
        for a in candidates:
            if size <= target:
                break
            trial = frozenset(chosen + [a])
            s = drawn_size(units, depth, trial)
            if s < size:
                chosen.append(a)
                size = s
    return CollapseResult(request, tuple(chosen), size, full)


def collapse_schedule(trace: "Trace", units: list[Unit], depth: int | None,
                      levels: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)) -> list[tuple[float, tuple[str, ...], int]]:
    """The plans for a ladder of collapse levels: (level, folded modules, drawn size).
    A pathologically large trace degrades to its single full-graph step."""
    full = drawn_size(units, depth, frozenset())
    if trace.num_ops > PATHOLOGICAL_FACTOR * COLLAPSE_OPTIMIZER_MAX_OPS:
        return [(0.0, (), full)]
    out = []
    for level in levels:
        r = plan_collapse(trace, units, level if level < 1.0 else "max", depth)
        out.append((level, r.plan or (), r.size))
    return out
